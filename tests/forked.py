"""Fresh child processes forked from one forkserver per test process, which imported torch, DCP
and dcp_tiered once.

A spawned interpreter imports them again, 2-3 CPU seconds each on the CI machine; the suite
starts hundreds of children (gloo ranks, CLI runs), so that alone was minutes of its time.  A
child forked from the server starts in milliseconds, from a clean state: nothing of the test
process but what its arguments carry, the caller's environment and working directory as a
spawned one would have them, and no threads.

:func:`run_cli` and :func:`start_cli` run ``dcp-tiered`` this way: the console script's own
``main()``, with ``sys.argv`` set, its exit code and its stdout/stderr captured at the file
descriptors; :func:`start_code` runs code as ``python -c`` would (tests/isolated.py).  A child
given an environment variable read only as a process starts (:data:`AT_START`) is a new
interpreter instead.  What a fork does not exercise: the imports themselves (their time, their
warnings, their failures) and the installed script; tests of those (tests/test_no_torch.py,
test_integrations.py's import test, the plugin tests' first look-ups, the tty tests, SIGTERM while it runs) start it
with :mod:`subprocess`.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from typing import Any

from speed import scaled

# imported once in the forkserver; every child forks from it.  torch._dynamo: an optimizer's step and
# DTensor.from_local import it on their first call (about 1 CPU second in every child that trains or
# builds a DTensor: `dcp-tiered train`, gloo ranks)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo", "dcp_tiered", "dcp_tiered.tiers",
           "dcp_tiered.cli.__main__", "forked", "gloo_ranks"]
SCRIPT = "dcp-tiered"


def context() -> Any:
    """The forkserver context every child of the tests starts from (torch and dcp_tiered preloaded)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _enter(env: dict, cwd: str, out: str, err: str, memory: int | None, new_session: bool) -> None:
    """In the child: its output to the files, its session, memory limit, environment, directory and
    warning filters, and ``PYTHONPATH`` on ``sys.path``, as a new interpreter would have them."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    if new_session:
        os.setsid()
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    # the server's filters are a new interpreter's; PYTHONWARNINGS goes on top, as it would at a start
    warnings._processoptions([w for w in env.get("PYTHONWARNINGS", "").split(",") if w])  # type: ignore[attr-defined]


def _run_main(fn: Any) -> None:
    try:
        code: Any = fn()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # type: ignore[attr-defined]  # as the interpreter does at exit
    sys.exit(code)  # the child's bootstrap maps it as the interpreter would, after joining threads


def _cli_child(argv: list[str], *enter: Any) -> None:
    _enter(*enter)
    sys.argv = [SCRIPT, *argv]
    from dcp_tiered.cli.__main__ import main

    _run_main(main)


def _code_child(code: str, *enter: Any) -> None:
    _enter(*enter)
    sys.argv = ["-c"]
    _run_main(lambda: exec(compile(code, "<string>", "exec"), {"__name__": "__main__"}))


#: Prefixes of environment variables that take effect only as a process starts (glibc's allocator, the
#: loader, the interpreter's options, locale, OpenMP and torch's import-time settings): a child whose
#: environment sets one otherwise than this process is a new interpreter, not a fork.
AT_START = ("MALLOC_", "GLIBC_", "LD_", "PYTHONMALLOC", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONDEVMODE",
            "PYTHONIOENCODING", "PYTHONUTF8", "LC_", "LANG", "OMP_", "MKL_", "TORCH_")


def needs_new_interpreter(env: dict) -> bool:
    """Whether ``env`` sets a variable of :data:`AT_START` otherwise than this process's environment."""
    keys = {k for k in (*env, *os.environ) if k.startswith(AT_START)}
    return any(env.get(k) != os.environ.get(k) for k in keys)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not in its session yet, or gone
        pass


class Spawned:
    """A new interpreter running ``command``, with :class:`Child`'s ``communicate`` and ``kill``."""

    def __init__(self, command: list[str], env: dict, cwd: "str | os.PathLike[str] | None",
                 memory: int | None, new_session: bool) -> None:
        self.args = command
        self.new_session = new_session
        limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory))) if memory else None
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=cwd, start_new_session=new_session, preexec_fn=limit)

    def communicate(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            raise subprocess.TimeoutExpired(self.args, timeout, out, err) from None
        return subprocess.CompletedProcess(self.args, self.proc.returncode, out, err)

    def kill(self) -> None:
        if self.new_session:
            _kill_session(self.proc.pid)
        self.proc.kill()
        self.proc.wait(scaled(10))


class Child:
    """One child forked from the tests' forkserver, its stdout and stderr captured at the file descriptors."""

    def __init__(self, target: Any, first: Any, args: list[str], env: dict | None = None,
                 cwd: "str | os.PathLike[str] | None" = None, memory: int | None = None,
                 new_session: bool = False) -> None:
        self.args = args
        self.new_session = new_session
        fd_out, self._out = tempfile.mkstemp(prefix="child-out-")
        fd_err, self._err = tempfile.mkstemp(prefix="child-err-")
        os.close(fd_out)
        os.close(fd_err)
        self.proc = context().Process(
            target=target, args=(first, dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()),
                                 self._out, self._err, memory, new_session))
        self.proc.start()

    def communicate(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait at most ``timeout`` seconds (as given: scale it first); ``subprocess.TimeoutExpired`` after killing it."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
            raise subprocess.TimeoutExpired(self.args, timeout, self._read(self._out), self._read(self._err))
        return subprocess.CompletedProcess(self.args, self.proc.exitcode, self._read(self._out), self._read(self._err))

    def kill(self) -> None:
        """SIGKILL the child (and its session's processes, in a session of its own) and reap it."""
        if self.new_session:
            _kill_session(self.proc.pid)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(scaled(10))

    @staticmethod
    def _read(path: str) -> str:
        try:
            with open(path, encoding="utf-8", errors="backslashreplace") as f:
                return f.read()
        finally:
            os.unlink(path)


def _start(target: Any, first: Any, args: list[str], command: list[str], env: dict | None,
           cwd: "str | os.PathLike[str] | None", memory: int | None, new_session: bool) -> "Child | Spawned":
    """A forked child running ``target(first, ...)``, or a new interpreter running ``command`` (:data:`AT_START`)."""
    env = dict(os.environ if env is None else env)
    if needs_new_interpreter(env):
        return Spawned(command, env, cwd, memory, new_session)
    return Child(target, first, args, env, cwd, memory, new_session)


def start_code(code: str, *, env: dict | None = None, cwd: "str | os.PathLike[str] | None" = None,
               memory: int | None = None, new_session: bool = False) -> "Child | Spawned":
    """Run ``code`` as ``python -c`` would (``__main__``, ``sys.argv == ["-c"]``) in a forked child."""
    command = [sys.executable, "-c", code]
    return _start(_code_child, code, command, command, env, cwd, memory, new_session)


def start_cli(*argv: object, env: dict | None = None, cwd: "str | os.PathLike[str] | None" = None,
              memory: int | None = None, new_session: bool = False) -> "Child | Spawned":
    """Start ``dcp-tiered ARGV`` in a forked child with ``env`` (default: this process's) in ``cwd``;
    ``memory``: its address-space limit in bytes; ``new_session``: in a session of its own."""
    args = [str(a) for a in argv]
    return _start(_cli_child, args, [SCRIPT, *args], [sys.executable, "-m", "dcp_tiered.cli", *args], env, cwd,
                  memory, new_session)


def run_cli(*argv: object, env: dict | None = None, cwd: "str | os.PathLike[str] | None" = None,
            timeout: float = 180.0, memory: int | None = None, new_session: bool = False) -> subprocess.CompletedProcess:
    """Run ``dcp-tiered ARGV`` to its end (``timeout``: quiet-machine seconds, :func:`speed.scaled` here),
    as ``subprocess.run(..., capture_output=True, text=True)`` would."""
    return start_cli(*argv, env=env, cwd=cwd, memory=memory, new_session=new_session).communicate(scaled(timeout))
