"""``LocalStorage``: a directory of the local machine, with plain ``os`` calls.

Only regular files are used and no link is ever followed: every open walks from the directory
the caller named with ``O_NOFOLLOW``.  Data files are fsynced as they are written (writeback
overlaps the writing), a commit is temp file + fsync + ``rename`` (``link`` when exclusive) +
directory fsync, and saves lock their checkpoint with ``flock``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import posixpath
import shutil
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dcp_tiered.errors import StorageError, UnsafeCheckpointError
from dcp_tiered.storage.base import Storage, protocols_of, register_backend, storage_errors, temp_name
from dcp_tiered.storage.lock import FileLock
from dcp_tiered.storage.paths import safe_relative_name
from dcp_tiered.storage.writeback import RawFile, WritebackFile

log = logging.getLogger(__name__)

#: Directories deeper than this below a listed root are not walked (a checkpoint is at most 2 deep).
MAX_LIST_DEPTH = 16

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | _CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | _CLOEXEC


@register_backend
class LocalStorage(Storage):
    """A local directory: regular files only, never through a link; fsync + rename commits; ``flock``."""

    is_local = True
    protocols = frozenset({"file", "local"})

    @classmethod
    def handles(cls, fs: fsspec.AbstractFileSystem) -> bool:
        # A subclass of the local filesystem with its own protocol (e.g. a fault injector) is
        # served by the generic backend, so that every access goes through it.
        return isinstance(fs, LocalFileSystem) and bool(protocols_of(fs) & cls.protocols)

    def __init__(self, url: "str | os.PathLike[str]", storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        # Reads walk from ``_anchor`` (trusted: the directory the caller named) through
        # ``_inside`` (directories reached through checkpoint contents) without following links.
        self._anchor: str = self.root
        self._inside: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "anchor": self._anchor, "inside": self._inside}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._anchor, self._inside = state.get("anchor", self.root), tuple(state.get("inside", ()))

    def child(self, name: str) -> "LocalStorage":
        child = super().child(name)
        assert isinstance(child, LocalStorage)
        # The child is reached through this directory: a link on the way is not followed.
        child._anchor, child._inside = self._anchor, self._inside + tuple(safe_relative_name(name, self.url).split("/"))
        return child

    def _refresh(self, path: str | None = None) -> None:
        pass  # nothing is cached

    def _open_local(self, name: str, flags: int = _READ_FLAGS, directory: bool = False) -> int:
        """Open ``name`` (``""``: the root) by walking from the anchor with ``O_NOFOLLOW`` at every step.

        Path containment is then physical, not only lexical: a file or a directory of the
        checkpoint that is a symbolic link (to ``/dev/zero``, to another checkpoint, ...) is
        refused with :class:`UnsafeCheckpointError` instead of being followed, and anything
        but a regular file (``directory``: a directory) is refused after opening it without
        blocking (a FIFO never stalls the reader).
        """
        inner = tuple(safe_relative_name(name, self.url).split("/")) if name else ()
        parts = [p for p in self._inside + inner if p not in ("", ".")]
        url = self.url_of(name) if name else self.url
        fd = os.open(self._anchor, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                try:
                    nxt = os.open(part, flags | os.O_NOFOLLOW if last and not directory else _DIR_FLAGS, 0o666, dir_fd=fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(part, fd)):
                        raise UnsafeCheckpointError(
                            f"{url}: {'/'.join(parts[: i + 1])} is a symbolic link; files of a checkpoint are "
                            "never read through links (copy the files instead of linking them)"
                        ) from None
                    raise
                os.close(fd)
                fd = nxt
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
                what = "a directory" if directory else "a regular file"
                raise UnsafeCheckpointError(f"{url} is not {what} (a FIFO, device, link or directory?); refusing to use it")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _local_file(self, name: str) -> BinaryIO:
        return os.fdopen(self._open_local(name), "rb", buffering=0)

    def is_link(self, name: str = "") -> bool:
        return os.path.islink(self.path(name) if name else self.root)

    def _size(self, name: str) -> int:
        fd = self._open_local(name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _read_range(self, name: str, start: int, end: int) -> bytes:
        fd = self._open_local(name)
        try:
            return os.pread(fd, max(0, end - start), start)
        finally:
            os.close(fd)

    def _read_into(self, name: str, start: int, view: memoryview) -> int:
        with self._local_file(name) as f:
            f.seek(start)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            return got

    def _read_all(self, name: str) -> bytes:
        with self._local_file(name) as f:
            return f.read()

    def _list(self) -> dict[str, tuple[int, float | None]]:
        """Regular files only, and links are not followed (a link to ``/`` inside a checkpoint
        must not make a listing walk the whole machine).  Directories nested deeper than
        :data:`MAX_LIST_DEPTH` below the root hold nothing a checkpoint writes: they are skipped
        (and logged), never walked, so one planted deep tree cannot make the listing fail."""
        out: dict[str, tuple[int, float | None]] = {}
        try:
            top = self._open_local("", directory=True)
        except (FileNotFoundError, NotADirectoryError, UnsafeCheckpointError):
            return {}
        try:
            for dirpath, dirs, files, dfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                if dirs and dirpath.count("/") >= MAX_LIST_DEPTH:
                    log.warning("listing %s: not walking %d directories nested deeper than %d below it (%s/...)",
                                self.url, len(dirs), MAX_LIST_DEPTH, posixpath.normpath(dirpath)[:200])
                    dirs[:] = []
                for f in files:
                    try:
                        st = os.stat(f, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        out[posixpath.normpath(posixpath.join(dirpath, f))] = (st.st_size, st.st_mtime)
        finally:
            os.close(top)
        return out

    def remove_tree(self) -> None:
        """Delete the root and everything under it, links never followed; a missing root is not an error.

        Iterative and with one directory open at a time, so a tree nested thousands deep (which a
        recursive delete fails on) goes like any other."""
        with storage_errors(self.url, "delete"):
            if os.path.islink(self.root):
                raise UnsafeCheckpointError(f"{self.url} is a symbolic link; a delete never goes through links "
                                            "(remove the link itself)")
            try:
                fd = self._open_local("", directory=True)
            except FileNotFoundError:
                return
            _remove_below(fd)  # closes fd
            try:
                os.rmdir(self.root)
            except FileNotFoundError:
                pass
            self._refresh(self.root)

    @contextlib.contextmanager
    def _open_write(self, name: str, durable: bool) -> Iterator[BinaryIO]:
        os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
        # O_NOFOLLOW: a link planted where a data file goes must not redirect the write.
        # Unbuffered, with writev: encoded pieces go to the kernel without a copy in Python.
        with RawFile(self._open_local(name, _WRITE_FLAGS)) as raw:
            if not durable:
                yield raw  # type: ignore[misc]
                return
            f = WritebackFile(raw)  # type: ignore[arg-type]
            try:
                yield f  # type: ignore[misc]
                f.sync()
            finally:
                f.join()

    def _commit(self, name: str, data: bytes, exclusive: bool) -> bool:
        final = self.path(name)
        tmp = temp_name(final)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                if not _link_exclusive(tmp, final):
                    return False
            else:
                os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(os.path.dirname(final))
        return True

    def _commit_file(self, name: str, local_path: str) -> None:
        final = self.path(name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = temp_name(final)
        # Created as any new file here (umask, default ACLs): its mode is the one to publish with.
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o666)
        try:
            try:
                src = os.open(local_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafeCheckpointError(f"{local_path} is a symbolic link; refusing to publish it as "
                                                f"{self.url_of(name)}") from None
                raise
            with os.fdopen(src, "rb") as f:
                st, mode = os.fstat(src), stat.S_IMODE(os.fstat(out).st_mode)
                if not stat.S_ISREG(st.st_mode):
                    raise UnsafeCheckpointError(f"{local_path} is not a regular file; refusing to publish it")
                if st.st_dev == os.fstat(out).st_dev:  # same filesystem: the file itself is moved in
                    os.fchmod(src, mode)
                    os.fsync(src)
                    os.replace(local_path, final)  # replaces a link at ``final``, never follows it
                else:
                    with os.fdopen(os.dup(out), "wb") as g:
                        shutil.copyfileobj(f, g, 16 << 20)
                        g.flush()
                        os.fsync(g.fileno())
                    os.replace(tmp, final)
        finally:
            os.close(out)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(os.path.dirname(final))

    def try_lock(self, name: str) -> FileLock | None:
        """Take an exclusive ``flock`` on the file ``name`` (created if missing) without waiting.

        Returns None when another writer holds it.  The kernel drops the lock when the process dies.
        """
        path = self.path(name)
        with storage_errors(self.url_of(name), "lock"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _CLOEXEC, 0o666)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafeCheckpointError(f"{self.url_of(name)} is a symbolic link; refusing to use it as a lock") from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
        return FileLock(fd, path)


def fsync_dir(path: str) -> None:
    """Make a rename in the directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _link_exclusive(src: str, dst: str) -> bool:
    """Publish ``src`` as ``dst`` only if ``dst`` does not exist (atomic: ``link(2)``); False if it does."""
    try:
        os.link(src, dst, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    # A filesystem without hard links: fall back to check-then-rename (writers also hold a lock).
    if os.path.lexists(dst):
        return False
    os.replace(src, dst)
    return True


def _remove_below(fd: int) -> None:
    """Delete everything inside the directory open as ``fd`` (closed on return), depth first, holding one
    directory open at a time: it descends by name (``O_NOFOLLOW``) and comes back up through ``..``,
    checking that ``..`` is the directory it came from (a directory moved meanwhile stops the delete
    with :class:`StorageError` instead of deleting in another place)."""
    pending: list[list[str]] = []  # per level: the subdirectories of that level still to delete
    ids: list[tuple[int, int]] = []  # per level: (st_dev, st_ino) of that level's directory
    try:
        while True:
            st = os.fstat(fd)
            ids.append((st.st_dev, st.st_ino))
            subdirs = []
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.name, dir_fd=fd)
            pending.append(subdirs)
            while pending and not pending[-1]:
                pending.pop()
                ids.pop()
                if not pending:
                    return
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != ids[-1]:
                    raise StorageError("a directory was moved while it was being deleted; stopped the delete")
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(pending[-1].pop(), dir_fd=fd)
            child = os.open(pending[-1][-1], _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
