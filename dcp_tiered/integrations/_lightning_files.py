"""Local checkpoint names of the Lightning plugin: an atomic swap of a committed directory into a name.

A checkpoint is written to a hidden sibling ``.NAME.<hex>.partial`` and committed there, then
swapped in.  On Linux the swap is ``renameat2(RENAME_EXCHANGE)``: ``NAME`` names the old
checkpoint or the new one at every instant, so a SIGKILL never leaves Lightning without
``last.ckpt``.  Where the exchange is unsupported the old one is moved aside (``.NAME.<hex>.old``)
and the new one renamed in; a kill between the two is repaired by :func:`recover` (the next
save of ``NAME``) and read through by :func:`resolve` (loads).  Standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import glob
import os
import shutil
import uuid
from typing import Any

from dcp_tiered.names import METADATA_FILE


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def exchange(a: str, b: str) -> bool:
    """Swap two existing paths atomically; False where the OS or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hidden(path: str, kind: str) -> str:
    """A fresh hidden sibling of ``path``: ``.NAME.<hex>.<kind>``."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{uuid.uuid4().hex[:12]}.{kind}")


def siblings(path: str) -> list[str]:
    """The hidden ``.NAME.*.partial`` / ``.old`` entries of ``path`` left by saves and swaps."""
    parent, name = os.path.split(os.path.abspath(path))
    pattern = os.path.join(glob.escape(parent), f".{glob.escape(name)}.*")
    return [p for p in glob.glob(pattern) if p.endswith((".partial", ".old", ".removed"))]


def _committed_mtime(path: str) -> int | None:
    try:
        return os.stat(os.path.join(path, METADATA_FILE)).st_mtime_ns if os.path.isdir(path) else None
    except OSError:
        return None


def _mtime(path: str) -> int:
    real = os.path.realpath(path)
    return _committed_mtime(real) or os.stat(real).st_mtime_ns


def newest_committed(path: str) -> str | None:
    """The newest committed hidden sibling of ``path`` (a save or swap killed before it finished)."""
    found = [(t, p) for p in siblings(path) if not p.endswith(".removed") and (t := _committed_mtime(p)) is not None]
    return max(found)[1] if found else None


def swap_in(new: str, path: str) -> None:
    """Put ``new`` (a committed directory or a file) at ``path``; what was there is deleted."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        os.rename(new, path)
        fsync_dir(parent)
        return
    if exchange(new, path):
        fsync_dir(parent)
        delete(new)  # now the previous checkpoint
        return
    old = hidden(path, "old")  # no atomic exchange here: recover() repairs a kill between the two renames
    os.rename(path, old)
    os.rename(new, path)
    fsync_dir(parent)
    delete(old)


def recover(path: str) -> None:
    """Repair what a killed save or swap left beside ``path``, then delete the leftovers.

    A committed sibling newer than ``path`` (or ``path`` missing) was a finished save whose swap
    was cut short: it becomes ``path``.  Uncommitted siblings and older ones are deleted.
    """
    best = newest_committed(path)
    if best is not None:
        if not os.path.exists(path) or _committed_mtime(best) > _mtime(path):
            swap_in(best, path)
    for leftover in siblings(path):
        delete(leftover)


def resolve(path: str) -> str:
    """``path``, or its newest committed sibling when ``path`` is missing (a swap killed half-way)."""
    if os.path.exists(path):
        return path
    return newest_committed(path) or path


def delete(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def remove(path: str) -> None:
    """Take ``path`` from its name at once (a directory is moved aside first), then delete it and its leftovers."""
    if os.path.isdir(path) and not os.path.islink(path):
        old = hidden(path, "removed")  # never taken back by recover()
        os.rename(path, old)
        delete(old)
    else:
        delete(path)
    for leftover in siblings(path):
        delete(leftover)
