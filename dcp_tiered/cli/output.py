"""What the CLI returns and prints: exit codes, error lines, tables, JSON, progress bars (tqdm)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import contextlib
import functools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from dcp_tiered.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpTieredError,
    PromotionError,
    SaveError,
    StorageError,
    UnsupportedFormatError,
)

# Exit codes scripts can rely on (also in docs/cli.md and `dcp-tiered --help`).
EXIT_OK = 0
EXIT_PROBLEMS = 1  # the command ran and found problems (verify), or a save/promotion/training failed
EXIT_USAGE = 2  # bad arguments or configuration
EXIT_NOT_FOUND = 3  # no checkpoint / file / bucket where one was named
EXIT_CORRUPT = 4  # corrupt, unsafe or unsupported checkpoint
EXIT_STORAGE = 5  # storage unreachable or an I/O error
EXIT_NO_MEMORY = 6  # out of memory
EXIT_INTERNAL = 70  # an unexpected error: a bug, or input the library failed to reject (sysexits EX_SOFTWARE)
EXIT_INTERRUPTED = 130

#: Environment variable that, set to a non-empty value other than 0, shows tracebacks like ``--debug``.
DEBUG_ENV = "DCP_TIERED_DEBUG"

EXIT_CODES_HELP = f"""\
exit codes:
  0  success
  1  problems found (verify), a failed save/promotion, or a demo check that failed
  2  usage or configuration error
  3  not found (no committed checkpoint, missing file or bucket)
  4  corrupt, unsafe or unsupported checkpoint
  5  storage error (unreachable endpoint, permission, I/O)
  6  out of memory
  70 internal error (a bug; --debug or {DEBUG_ENV}=1 shows the traceback)
  130 interrupted"""


class CliError(Exception):
    """A one-line error for the user, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def unwrap_error(exc: BaseException) -> BaseException:
    """The error worth reporting: DCP wraps errors raised inside dcp.save/dcp.load in a CheckpointException."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return inner
    return exc


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code of an error (``EXIT_INTERNAL`` for anything unexpected)."""
    if isinstance(exc, CliError):
        return exc.code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, MemoryError):
        return EXIT_NO_MEMORY
    if isinstance(exc, DcpTieredError):
        if isinstance(exc, CheckpointNotFoundError):
            return EXIT_NOT_FOUND
        if isinstance(exc, (CorruptCheckpointError, UnsupportedFormatError)):
            return EXIT_CORRUPT
        if isinstance(exc, (ConfigError, CheckpointExistsError)):
            return EXIT_USAGE
        if isinstance(exc, (PromotionError, SaveError)):
            return EXIT_PROBLEMS
        if isinstance(exc, FileNotFoundError):  # StorageError's MissingFileError, a missing bucket
            return EXIT_NOT_FOUND
        if isinstance(exc, (StorageError, OSError)):
            return EXIT_STORAGE
        return EXIT_PROBLEMS  # any other error of this package: the operation failed, said why
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return EXIT_NOT_FOUND
    if isinstance(exc, OSError):  # permission, a directory where a file was expected, I/O, a full disk
        return EXIT_STORAGE
    return EXIT_INTERNAL


def one_line(exc: BaseException, limit: int = 600) -> str:
    """``exc``'s message on one line, shortened to ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_line(command: str, exc: BaseException, path: str | None = None) -> str:
    """The one line the user sees for ``exc``: command, kind, the path when the message lacks it, what to do."""
    code = exit_code_for(exc)
    where = f"{path}: " if path and path not in str(exc) else ""
    if code == EXIT_INTERNAL:
        return (f"dcp-tiered {command}: internal error: {where}{type(exc).__name__}: {one_line(exc, 300)} "
                f"(a bug in dcp-tiered, or input it failed to reject; rerun with --debug or {DEBUG_ENV}=1 "
                "for the traceback and report it)")
    kind = "" if isinstance(exc, CliError) else f"{type(exc).__name__}: "
    hint = " (the checkpoint or the state is too large for this machine's memory)" if code == EXIT_NO_MEMORY else ""
    return f"dcp-tiered {command}: error: {where}{kind}{one_line(exc)}{hint}"


def debug_enabled(args: argparse.Namespace | None = None) -> bool:
    """Tracebacks wanted: ``--debug``, ``-vv``, or ``DCP_TIERED_DEBUG`` set."""
    env = os.environ.get(DEBUG_ENV, "")
    if env and env != "0":
        return True
    return bool(args is not None and (getattr(args, "debug", False) or getattr(args, "verbose", 0) >= 2))


def human_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def kept_line(kept: dict[str, str], shown: int = 5) -> str:
    """The line a safe downcast prints for the tensors it kept in their own dtype (``export``/``convert --dtype``)."""
    return f"kept in their own dtype ({len(kept)}): " + "; ".join(f"{k}: {v}" for k, v in list(kept.items())[:shown])


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], right: Iterable[int] = ()) -> str:
    """Aligned plain-text table; columns in ``right`` are right-aligned."""
    right = set(right)
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()


def progress(total: float, desc: str = "", unit: str = "", enabled: bool | None = None) -> Any:
    """A tqdm bar on stderr with rate and ETA, drawn only when stderr is a terminal (``enabled`` overrides).

    Also the :data:`dcp_tiered.inspect.ProgressFactory` the CLI passes to the library: ``update(n)``, a
    context manager.  ``unit="B"`` counts bytes (scaled: KB/s, MB/s); anything else counts items.
    """
    from tqdm import tqdm

    on = sys.stderr.isatty() if enabled is None else enabled
    count = max(total, 0)
    count = int(count) if float(count).is_integer() else float(count)  # "0/206", not "0/206.0"
    return tqdm(total=count, desc=desc, unit=unit or "it", unit_scale=unit == "B",
                unit_divisor=1024 if unit == "B" else 1000, disable=not on, file=sys.stderr,
                leave=False, mininterval=0.2)


@contextlib.contextmanager
def ticking(bar: Any, every: float = 0.5) -> Any:
    """Redraw ``bar`` every ``every`` seconds, so elapsed time and rate move while one long step runs."""
    if getattr(bar, "disable", True):
        yield bar
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            bar.refresh()

    t = threading.Thread(target=tick, name="dcp-tiered-progress", daemon=True)
    t.start()
    try:
        yield bar
    finally:
        stop.set()
        t.join()


def progress_for(args: argparse.Namespace) -> Any:
    """The progress factory of a command: none with ``--json`` (a machine reads that output)."""
    if getattr(args, "json", False):
        return functools.partial(progress, enabled=False)
    return progress
