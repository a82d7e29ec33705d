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
import textwrap
from dataclasses import dataclass
from pathlib import Path

from forked import start_code
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
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM, the peak resident set, starts again from here
    return status("VmRSS")
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
    """Run ``code`` (dedented) as ``python -c`` would, under ``RLIMIT_AS = memory_mb`` and a wall-clock ``timeout``
    (quiet-machine seconds, :func:`speed.scaled` here; the child inherits the factor through the environment),
    in a child forked from the tests' forkserver (:func:`forked.start_code`: torch is imported already), in a
    session of its own that a timeout kills whole (a new interpreter where ``env`` sets a variable read
    only as a process starts: :data:`forked.AT_START`).

    The code may call ``emit(value)`` to hand a JSON value back (``Isolated.result``), ``status(field)``
    for a ``/proc/self/status`` size in bytes and ``reset_peak()`` to start ``VmHWM`` again (it returns
    ``VmRSS``). The memory limit is set inside the child before ``code`` runs, after the imports of
    the prelude.
    """
    src = _PRELUDE + f"\n_limit({int(memory_mb)} << 20)\n" + textwrap.dedent(code)
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    child_env.update(env or {})
    child = start_code(src, env=child_env, cwd=cwd, new_session=True)
    timed_out = False
    try:
        done = child.communicate(scaled(timeout))
        returncode, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        timed_out = True
        returncode, out, err = -signal.SIGKILL, exc.output or "", exc.stderr or ""
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
    return Isolated(returncode, out, err, timed_out, result)
