"""Run a piece of Python in a child process with a timeout and a memory limit.

Every test that drives a crash, a hang or a memory blow-up (hostile checkpoints, SIGKILLs)
goes through :func:`run_isolated`, so a segfault, an endless loop or a runaway allocation
fails that one test instead of killing or stalling pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from speed import scaled

_ROOT = Path(__file__).resolve().parent.parent

# The child prints one line starting with this marker followed by a JSON value: its result.
RESULT_MARK = "@@RESULT@@"

_PRELUDE = f"""
import json, resource, sys
def _limit(nbytes):
    resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
def emit(value):
    print({RESULT_MARK!r} + json.dumps(value), flush=True)
"""


@dataclass
class Isolated:
    """What the child did: exit code (negative: killed by that signal), output, and its emitted result."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    result: object = None

    @property
    def crashed(self) -> bool:
        """Killed by a signal (SIGSEGV, SIGABRT, ...) other than our own timeout kill."""
        return self.returncode < 0 and not self.timed_out

    def describe(self) -> str:
        how = "timed out" if self.timed_out else f"exited with {self.returncode}"
        if self.returncode < 0 and not self.timed_out:
            how = f"died of {signal.Signals(-self.returncode).name}"
        return f"child {how}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def run_isolated(code: str, *, timeout: float = 60.0, memory_mb: int = 4096, env: dict | None = None,
                 cwd: "str | os.PathLike[str] | None" = None) -> Isolated:
    """Run ``code`` (dedented) with ``python -c`` under ``RLIMIT_AS = memory_mb`` and a wall-clock ``timeout``
    (quiet-machine seconds, :func:`speed.scaled` here; the child inherits the factor through the environment).

    The code may call ``emit(value)`` to hand a JSON value back (``Isolated.result``). The
    memory limit is set inside the child before ``code`` runs, after the imports of the prelude.
    """
    src = _PRELUDE + f"\n_limit({int(memory_mb)} << 20)\n" + textwrap.dedent(code)
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    child_env.update(env or {})
    proc = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env, cwd=cwd, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
    return Isolated(proc.returncode, out, err, timed_out, result)
