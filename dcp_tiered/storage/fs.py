"""fsspec access for one directory (local path, ``file://``, ``memory://``, ``s3://``, ...).

:class:`Storage` owns a root directory and offers exactly what checkpoints need: write a
file and make it durable, commit a small file atomically, read byte ranges, list and
delete.  Errors come out as :class:`StorageError` or :class:`MissingFileError` naming the URL.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import posixpath
import re
import stat
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError, StorageError, UnsafeCheckpointError
from dcp_tiered.storage.paths import safe_relative_name
from dcp_tiered.storage.writeback import WritebackFile

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2", "oss"}


class MissingFileError(StorageError, FileNotFoundError):
    """A file that should exist in storage does not."""


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_TEMP_FILE = re.compile(r".+\.[0-9a-f]{8}\.tmp")


def _temp_name(final: str) -> str:
    """The temp file :meth:`Storage.commit_bytes` writes before renaming it to ``final``."""
    return f"{final}.{uuid.uuid4().hex[:8]}.tmp"


class FileLock:
    """An exclusive advisory lock (``flock``) on a local file, held until :meth:`release`.

    The kernel drops it when the process dies, so a crashed save never leaves a stale lock.
    A pickled copy is released (a lock belongs to the process that took it).
    """

    def __init__(self, fd: int | None = None, path: str = "") -> None:
        self._fd = fd
        self.path = path

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self._fd, self.path = None, state["path"]

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, unlink: bool = False) -> None:
        """Give the lock up; ``unlink`` first removes the lock file (after a commit: nothing to guard)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if unlink:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
        finally:
            os.close(fd)

    def __del__(self) -> None:  # the lock must not outlive a writer dropped after a failed save
        with contextlib.suppress(Exception):
            self.release()


def _map_error(exc: BaseException, url: str, action: str) -> DcpTieredError:
    if isinstance(exc, DcpTieredError):
        return exc
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return MissingFileError(errno.ENOENT, f"{action}: {url} does not exist")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StorageError(errno.ENOSPC, f"{action}: no space left writing {url}; free space or point the tier elsewhere")
    if isinstance(exc, PermissionError):
        return StorageError(errno.EACCES, f"{action}: permission denied on {url}")
    return StorageError(f"{action} failed on {url}: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def storage_errors(url: str, action: str) -> Iterator[None]:
    """Translate fsspec/OS/botocore exceptions inside the block into this package's errors."""
    try:
        yield
    except DcpTieredError:
        raise
    except Exception as exc:  # fsspec backends raise anything; map it once here
        raise _map_error(exc, url, action) from exc


class Storage:
    """One directory on any fsspec filesystem."""

    def __init__(self, url: "str | os.PathLike[str]", storage_options: dict[str, Any] | None = None) -> None:
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        with storage_errors(self.url, "open filesystem"):
            fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") or root
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        # A subclass of the local filesystem with its own protocol (e.g. a fault injector)
        # is treated as remote, so that every access goes through it.
        self.is_local = isinstance(fs, LocalFileSystem) and bool(protocols & {"file", "local"})
        self.is_object_store = bool(protocols & _OBJECT_STORES)
        # Local reads walk from ``_anchor`` (trusted: the directory the caller named) through
        # ``_inside`` (directories reached through checkpoint contents) without following links.
        self._anchor: str = self.root
        self._inside: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        return {"url": self.url, "storage_options": self.storage_options, "anchor": self._anchor, "inside": self._inside}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]
        self._anchor, self._inside = state.get("anchor", self.root), tuple(state.get("inside", ()))

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def child(self, name: str) -> "Storage":
        """A Storage for a subdirectory ``name`` (contained)."""
        sub = safe_relative_name(name, self.url)
        child = Storage(self.url.rstrip("/") + "/" + sub, self.storage_options)
        # The child is reached through this directory: a link on the way is not followed.
        child._anchor, child._inside = self._anchor, self._inside + tuple(sub.split("/"))
        return child

    def path(self, name: str) -> str:
        """The filesystem path of ``name`` inside the root (containment checked)."""
        return posixpath.join(self.root, safe_relative_name(name, self.url)) if not self.is_local else os.path.join(
            self.root, safe_relative_name(name, self.url)
        )

    def url_of(self, name: str) -> str:
        return self.url.rstrip("/") + "/" + name

    def _refresh(self, path: str | None = None) -> None:
        if not self.is_local:
            self.fs.invalidate_cache(path)

    # -- local files: regular files only, never through a link -------------------------

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
        fd = os.open(self._anchor, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
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

    def check_reachable(self) -> None:
        """Raise a clear error now if the bucket (object stores) of the root does not exist."""
        if not self.is_object_store:
            return
        bucket = self.root.split("/", 1)[0]
        with storage_errors(self.url, "reach storage"):
            self._refresh()
            try:
                # info() raises on connection errors, where exists() would answer False
                self.fs.info(bucket)
            except FileNotFoundError:
                raise MissingFileError(
                    errno.ENOENT, f"bucket or container {bucket!r} of {self.url} does not exist; create it first"
                ) from None

    def _parent_dirs(self, name: str) -> None:
        # Object stores have no directories; other filesystems need the parent to exist.
        if not self.is_object_store:
            self.fs.makedirs(posixpath.dirname(self.path(name)), exist_ok=True)

    def makedirs(self) -> None:
        """Create the root directory (a no-op on object stores) and check it is reachable."""
        self.check_reachable()
        if not self.is_object_store:
            with storage_errors(self.url, "create directory"):
                self.fs.makedirs(self.root, exist_ok=True)

    def exists(self, name: str = "") -> bool:
        path = self.path(name) if name else self.root
        with storage_errors(self.url_of(name), "check existence"):
            self._refresh(path)
            return bool(self.fs.exists(path))

    def is_link(self, name: str = "") -> bool:
        """Whether ``name`` (``""``: the root itself) is a symbolic link; always False off local filesystems."""
        return self.is_local and os.path.islink(self.path(name) if name else self.root)

    def size(self, name: str) -> int:
        """Size of the regular file ``name`` (links and special files are refused locally)."""
        with storage_errors(self.url_of(name), "stat"):
            if self.is_local:
                fd = self._open_local(name)
                try:
                    return os.fstat(fd).st_size
                finally:
                    os.close(fd)
            self._refresh(self.path(name))
            return int(self.fs.size(self.path(name)))

    def listdir(self) -> list[str]:
        """Names directly inside the root (files and directories); empty if the root is missing."""
        with storage_errors(self.url, "list"):
            self._refresh(self.root)
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries} - {""})

    def _find(self) -> dict[str, dict]:
        """fsspec ``find`` details of every file under the root, by relative name.

        Locally only regular files count and links are not followed (a link to ``/`` inside a
        checkpoint must not make a listing walk the whole machine).
        """
        if self.is_local:
            return self._find_local()
        with storage_errors(self.url, "list"):
            self._refresh(self.root)
            try:
                found = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                return {}
        root = self.root.replace(os.sep, "/")
        return {posixpath.relpath(str(p).replace(os.sep, "/"), root): info for p, info in found.items()}

    def _find_local(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        with storage_errors(self.url, "list"):
            try:
                top = self._open_local("", directory=True)
            except (FileNotFoundError, NotADirectoryError, UnsafeCheckpointError):
                return {}
            try:
                for dirpath, _dirs, files, dfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                    for f in files:
                        try:
                            st = os.stat(f, dir_fd=dfd, follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            rel = posixpath.normpath(posixpath.join(dirpath, f))
                            out[rel] = {"size": st.st_size, "mtime": st.st_mtime}
            finally:
                os.close(top)
        return out

    def file_sizes(self) -> dict[str, int]:
        """Every file under the root, by relative name, with its size."""
        return {rel: int(info.get("size") or 0) for rel, info in self._find().items()}

    def file_ages(self, now: float) -> dict[str, float]:
        """Seconds since each file under the root was last modified (files whose time is unknown are left out)."""
        out = {}
        for rel, info in self._find().items():
            mtime = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            if isinstance(mtime, (int, float)):
                out[rel] = now - float(mtime)
        return out

    @contextlib.contextmanager
    def open_write(self, name: str, durable: bool = True) -> Iterator[BinaryIO]:
        """Open ``name`` for writing; on clean exit the bytes are flushed, fsynced (local) and closed."""
        url = self.url_of(name)
        with storage_errors(url, "write"):
            if self.is_local:
                path = self.path(name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                # O_NOFOLLOW: a link planted where a data file goes must not redirect the write
                fd = self._open_local(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
                with os.fdopen(fd, "wb") as raw:
                    if not durable:
                        yield raw
                        raw.flush()
                        return
                    f = WritebackFile(raw)
                    try:
                        yield f  # type: ignore[misc]
                        f.sync()
                    finally:
                        f.join()
            else:
                self._parent_dirs(name)
                f = self.fs.open(self.path(name), "wb")
                try:
                    yield f
                except BaseException:
                    with contextlib.suppress(Exception):
                        f.discard() if hasattr(f, "discard") else None
                    raise
                f.flush()
                f.close()

    def commit_bytes(self, name: str, data: bytes, exclusive: bool = False) -> bool:
        """Make ``name`` hold ``data`` atomically: temp file + fsync + rename locally, one PUT remotely.

        With ``exclusive`` the commit only happens if ``name`` does not exist, atomically under a
        race where the backend allows it (``link(2)`` locally, ``If-None-Match: *`` on S3);
        returns False (and changes nothing) when ``name`` already exists.
        """
        url = self.url_of(name)
        with storage_errors(url, "commit"):
            if self.is_local:
                final = self.path(name)
                tmp = _temp_name(final)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
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
                fd = os.open(os.path.dirname(final), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            elif self.is_object_store:
                path = self.path(name)
                if exclusive:
                    try:
                        self.fs.pipe_file(path, data, mode="create")  # conditional PUT: If-None-Match: *
                    except FileExistsError:
                        return False
                    except TypeError:  # a backend without exclusive writes: best effort
                        self._refresh(path)
                        if self.fs.exists(path):
                            return False
                        self.fs.pipe_file(path, data)
                else:
                    self.fs.pipe_file(path, data)  # one PUT: atomic on object stores
                self._refresh(path)
            else:
                self._parent_dirs(name)
                if exclusive and self.fs.exists(self.path(name)):  # no atomic primitive here: best effort
                    return False
                tmp = _temp_name(self.path(name))
                try:
                    self.fs.pipe_file(tmp, data)
                    self.fs.mv(tmp, self.path(name))
                finally:
                    with contextlib.suppress(Exception):
                        if self.fs.exists(tmp):
                            self.fs.rm_file(tmp)
        return True

    def try_lock(self, name: str) -> FileLock | None:
        """Take an exclusive lock on the local file ``name`` (created if missing) without waiting.

        Returns None when another writer holds it.  Filesystems without locks (object stores,
        ``memory://``) get a lock that holds nothing: they rely on :meth:`commit_bytes` with
        ``exclusive`` instead.
        """
        if not self.is_local:
            return FileLock()
        path = self.path(name)
        with storage_errors(self.url_of(name), "lock"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
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

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``; fewer bytes mean the file is short."""
        with storage_errors(self.url_of(name), "read"):
            if self.is_local:
                fd = self._open_local(name)
                try:
                    return os.pread(fd, max(0, end - start), start)
                finally:
                    os.close(fd)
            return self.fs.cat_file(self.path(name), start=start, end=end)

    def read_range_into(self, name: str, start: int, buf: "bytearray | memoryview") -> int:
        """Fill ``buf`` from offset ``start`` of ``name``; return the bytes read (short at EOF).

        Local files read straight into the caller's (reused) buffer; other filesystems copy.
        """
        view = memoryview(buf).cast("B")
        with storage_errors(self.url_of(name), "read"):
            if self.is_local:
                with self._local_file(name) as f:
                    f.seek(start)
                    got = 0
                    while got < len(view):
                        n = f.readinto(view[got:])
                        if not n:
                            break
                        got += n
                    return got
            data = self.fs.cat_file(self.path(name), start=start, end=start + len(view))
        view[: len(data)] = data
        return len(data)

    def read_bytes(self, name: str, max_bytes: int | None = None) -> bytes:
        """The whole file ``name``; with ``max_bytes``, its size is checked before anything is read.

        A file larger than ``max_bytes`` raises :class:`CorruptCheckpointError`; locally only a
        regular file reached without links is read (a FIFO does not block, ``/dev/zero`` is
        never opened).
        """
        url = self.url_of(name)

        def too_big(size: "int | str") -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{url} has {size} bytes, more than the {max_bytes} allowed; refusing to read it")

        with storage_errors(url, "read"):
            if self.is_local:
                with self._local_file(name) as f:
                    if max_bytes is None:
                        return f.read()
                    if os.fstat(f.fileno()).st_size > max_bytes:
                        raise too_big(os.fstat(f.fileno()).st_size)
                    data = f.read(max_bytes + 1)  # +1: a file growing while read is still caught
            else:
                path = self.path(name)
                if max_bytes is None:
                    return self.fs.cat_file(path)
                self._refresh(path)
                size = int(self.fs.size(path))
                if size > max_bytes:
                    raise too_big(size)
                data = self.fs.cat_file(path, start=0, end=max_bytes + 1) if size else self.fs.cat_file(path)
            if len(data) > max_bytes:
                raise too_big(f"more than {max_bytes}")
            return data

    def remove(self, name: str) -> None:
        """Delete one file; a missing file is not an error."""
        with storage_errors(self.url_of(name), "delete"):
            try:
                self.fs.rm_file(self.path(name))
            except FileNotFoundError:
                pass
            self._refresh(self.path(name))

    def remove_temps(self, name: str) -> None:
        """Delete the temp files a killed :meth:`commit_bytes` of ``name`` left behind."""
        for entry in self.listdir():
            if _TEMP_FILE.fullmatch(entry) and entry.rsplit(".", 2)[0] == name:
                self.remove(entry)

    def remove_tree(self) -> None:
        """Delete the root and everything under it; a missing root is not an error."""
        with storage_errors(self.url, "delete"):
            try:
                self.fs.rm(self.root, recursive=True)
            except FileNotFoundError:
                pass
            self._refresh(self.root)


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
