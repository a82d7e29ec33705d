"""Local checkpoint names of the Lightning plugin: an atomic swap of a committed directory into a name.

A checkpoint is written to a hidden sibling ``.NAME.<hex>.partial`` and committed there, then
swapped in.  On Linux the swap is ``renameat2(RENAME_EXCHANGE)``: ``NAME`` names the old
checkpoint or the new one at every instant, so a SIGKILL never leaves Lightning without
``last.ckpt``.  Where the exchange is unsupported the old one is moved aside (``.NAME.<hex>.old``)
and the new one renamed in; a kill between the two is repaired by :func:`recover` (the next
save of ``NAME``) and read through by :func:`resolve` (loads).  Standard library only.

Directories in use are never deleted.  A save holds an exclusive ``flock`` on its partial directory
until it is swapped in (:func:`writing`); a load holds a shared one while it links the files of the
directory it opened into a hidden ``.NAME.<hex>.reading`` snapshot and reads from there
(:func:`reading`), so a save swapping ``NAME`` meanwhile changes nothing under it.  Cleanup
(:func:`discard`) skips a directory whose lock it cannot take: the next save's :func:`recover` deletes
it.  (Lightning's ``AsyncCheckpointIO`` saves in a thread while ``ModelCheckpoint`` removes and saves
the same names; a second process may read ``last.ckpt`` while it is saved again.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import glob
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import Any

from dcp_tiered.names import METADATA_FILE
from dcp_tiered.storage.local import fsync_dir


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


def hidden(path: str, kind: str) -> str:
    """A fresh hidden sibling of ``path``: ``.NAME.<hex>.<kind>``."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{uuid.uuid4().hex[:12]}.{kind}")


def siblings(path: str) -> list[str]:
    """The hidden ``.NAME.*.partial`` / ``.old`` / ``.removed`` / ``.reading`` entries of ``path`` left by
    saves, swaps, removals and loads."""
    parent, name = os.path.split(os.path.abspath(path))
    pattern = os.path.join(glob.escape(parent), f".{glob.escape(name)}.*")
    return [p for p in glob.glob(pattern) if p.endswith((".partial", ".old", ".removed", ".reading"))]


def _locked(path: str, exclusive: bool, wait: bool = False) -> "int | None":
    """An open descriptor of directory ``path`` holding a ``flock`` on it, or None where another process or
    thread holds a conflicting one (or the directory is gone).  On a file system without ``flock`` the
    descriptor holds nothing, and directories in use are as unprotected as before."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        pass
    return fd


def discard(path: str) -> None:
    """Delete ``path`` unless it is a directory that a save is writing or a load is reading (locked)."""
    if os.path.isdir(path) and not os.path.islink(path):
        fd = _locked(path, exclusive=True)
        if fd is None:
            return  # in use: the next save's recover() deletes it
        try:
            delete(path)
        finally:
            os.close(fd)
    else:
        delete(path)


@contextlib.contextmanager
def writing(path: str) -> Iterator[str]:
    """A fresh hidden partial directory for a save of ``path``, locked against every cleanup until the
    save has swapped it in (or failed)."""
    tmp = hidden(path, "partial")
    os.mkdir(tmp)
    fd = _locked(tmp, exclusive=True)
    try:
        yield tmp
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def reading(path: str) -> Iterator[str]:
    """The committed directory ``path`` under a name that stays as it is for the whole load: hard links of
    its files in a hidden ``.reading`` snapshot, made under a shared lock (no swap deletes a file before it
    is linked), deleted afterwards.  Where links cannot be made there, ``path`` itself."""
    fd = _locked(path, exclusive=False, wait=True)
    if fd is None:
        yield path
        return
    snap = hidden(path, "reading")
    snap_fd = None
    try:
        os.mkdir(snap)
        snap_fd = _locked(snap, exclusive=False)  # keeps the snapshot from recover() while the load runs
        for name in os.listdir(fd):
            if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                os.link(name, os.path.join(snap, name), src_dir_fd=fd, follow_symlinks=False)
    except OSError:  # e.g. a read-only parent directory: read in place, as before
        if snap_fd is not None:
            os.close(snap_fd)
        delete(snap)
        snap = None
    finally:
        os.close(fd)
    if snap is None:
        yield path
        return
    try:
        yield snap
    finally:
        if snap_fd is not None:
            os.close(snap_fd)
        delete(snap)


def _committed_mtime(path: str) -> int | None:
    try:
        return os.stat(os.path.join(path, METADATA_FILE)).st_mtime_ns if os.path.isdir(path) else None
    except OSError:
        return None


def _mtime(path: str) -> int:
    real = os.path.realpath(path)
    return _committed_mtime(real) or os.stat(real).st_mtime_ns


def newest_committed(path: str) -> str | None:
    """The newest committed hidden sibling of ``path`` (a save or swap killed before it finished; not one a
    live save still holds: it swaps itself in)."""
    found = [(t, p) for p in siblings(path) if p.endswith((".partial", ".old"))
             and (t := _committed_mtime(p)) is not None and _free(p)]
    return max(found)[1] if found else None


def _free(path: str) -> bool:
    """Whether no save or load holds directory ``path``."""
    fd = _locked(path, exclusive=True)
    if fd is None:
        return not os.path.isdir(path)
    os.close(fd)
    return True


def swap_in(new: str, path: str, *, keep_old: bool = False) -> "str | None":
    """Put ``new`` (a committed directory or a file) at ``path``; what was there is deleted, or with
    ``keep_old`` left under a hidden name that is returned (None if nothing was there), for the caller
    to :func:`discard` once it no longer holds ``new`` locked (a load waiting on it goes on first)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        os.rename(new, path)
        fsync_dir(parent)
        return None
    if exchange(new, path):
        old = new  # now the previous checkpoint
    else:
        old = hidden(path, "old")  # no atomic exchange here: recover() repairs a kill between the two renames
        os.rename(path, old)
        os.rename(new, path)
    fsync_dir(parent)
    if keep_old:
        return old
    discard(old)
    return None


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
        discard(leftover)


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
        discard(old)
    else:
        delete(path)
    for leftover in siblings(path):
        discard(leftover)
