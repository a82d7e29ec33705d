"""fsspec access for one directory (local path, ``file://``, ``memory://``, ``s3://``, ...).

:class:`Storage` owns a root directory and offers exactly what checkpoints need: write a
file and make it durable, commit a small file atomically, read byte ranges, list and
delete.  Errors come out as :class:`StorageError` or :class:`MissingFileError` naming the URL.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dcp_tiered.errors import DcpTieredError, StorageError
from dcp_tiered.storage.paths import safe_relative_name
from dcp_tiered.storage.writeback import WritebackFile

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2", "oss"}


class MissingFileError(StorageError, FileNotFoundError):
    """A file that should exist in storage does not."""


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

    def __getstate__(self) -> dict:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def child(self, name: str) -> "Storage":
        """A Storage for a subdirectory ``name`` (contained)."""
        sub = safe_relative_name(name, self.url)
        return Storage(self.url.rstrip("/") + "/" + sub, self.storage_options)

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

    def size(self, name: str) -> int:
        with storage_errors(self.url_of(name), "stat"):
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
        """fsspec ``find`` details of every file under the root, by relative name."""
        with storage_errors(self.url, "list"):
            self._refresh(self.root)
            try:
                found = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                return {}
        root = self.root.replace(os.sep, "/")
        return {posixpath.relpath(str(p).replace(os.sep, "/"), root): info for p, info in found.items()}

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
                with open(path, "wb") as raw:
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

    def commit_bytes(self, name: str, data: bytes) -> None:
        """Make ``name`` hold ``data`` atomically: temp file + fsync + rename locally, one PUT remotely."""
        url = self.url_of(name)
        with storage_errors(url, "commit"):
            if self.is_local:
                final = self.path(name)
                tmp = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
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
                self.fs.pipe_file(self.path(name), data)  # one PUT: atomic on object stores
                self._refresh(self.path(name))
            else:
                self._parent_dirs(name)
                tmp = f"{self.path(name)}.{uuid.uuid4().hex[:8]}.tmp"
                try:
                    self.fs.pipe_file(tmp, data)
                    self.fs.mv(tmp, self.path(name))
                finally:
                    with contextlib.suppress(Exception):
                        if self.fs.exists(tmp):
                            self.fs.rm_file(tmp)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``; fewer bytes mean the file is short."""
        with storage_errors(self.url_of(name), "read"):
            if self.is_local:
                with open(self.path(name), "rb") as f:
                    f.seek(start)
                    return f.read(end - start)
            return self.fs.cat_file(self.path(name), start=start, end=end)

    def read_range_into(self, name: str, start: int, buf: "bytearray | memoryview") -> int:
        """Fill ``buf`` from offset ``start`` of ``name``; return the bytes read (short at EOF).

        Local files read straight into the caller's (reused) buffer; other filesystems copy.
        """
        view = memoryview(buf).cast("B")
        with storage_errors(self.url_of(name), "read"):
            if self.is_local:
                with open(self.path(name), "rb", buffering=0) as f:
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

    def read_bytes(self, name: str) -> bytes:
        with storage_errors(self.url_of(name), "read"):
            if self.is_local:
                with open(self.path(name), "rb") as f:
                    return f.read()
            return self.fs.cat_file(self.path(name))

    def remove(self, name: str) -> None:
        """Delete one file; a missing file is not an error."""
        with storage_errors(self.url_of(name), "delete"):
            try:
                self.fs.rm_file(self.path(name))
            except FileNotFoundError:
                pass
            self._refresh(self.path(name))

    def remove_tree(self) -> None:
        """Delete the root and everything under it; a missing root is not an error."""
        with storage_errors(self.url, "delete"):
            try:
                self.fs.rm(self.root, recursive=True)
            except FileNotFoundError:
                pass
            self._refresh(self.root)
