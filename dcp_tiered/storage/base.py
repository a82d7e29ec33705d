"""``Storage``: one directory on any fsspec filesystem, derived from a few primitives per backend.

``Storage(url, storage_options)`` returns the backend that serves the URL's filesystem, as
``pathlib.Path`` does: :class:`~dcp_tiered.storage.local.LocalStorage` for local paths,
:class:`~dcp_tiered.storage.object_store.ObjectStoreStorage` for S3, GCS, Azure, ... and
:class:`~dcp_tiered.storage.generic.FsspecStorage` for any other fsspec filesystem.  A URL whose
protocol no registered backend declares in :attr:`Storage.protocols` is first looked up among the
installed plugins (entry point group ``dcp_tiered.storage``, named by the protocol;
:mod:`dcp_tiered.plugins`), before its filesystem is opened, so a plugin may bring its filesystem.

A backend implements the primitives ``_open_write`` (write, durable on clean exit),
``_commit`` (publish a small file atomically), ``_size``, ``_read_range``, ``_read_all`` and
``_list`` (every file with its size and modification time).  This class derives the rest
(bounded whole-file reads, reads into buffers, sizes and ages, temp cleanup, children), offers a
default ``_commit_file`` (publish a finished local file) that backends override where one upload
is atomic or a rename is enough, and maps every error to :class:`StorageError` or :class:`MissingFileError` naming the URL.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, ClassVar

import fsspec

from dcp_tiered.errors import ConfigError, CorruptCheckpointError, DcpTieredError, MissingFileError, StorageError
from dcp_tiered.plugins import STORAGE_GROUP, load_plugin
from dcp_tiered.storage.lock import FileLock
from dcp_tiered.storage.paths import location, safe_relative_name
from dcp_tiered.storage.retry import RetryPolicy, retrying

_TEMP_FILE = re.compile(r".+\.[0-9a-f]{8}\.tmp")


def temp_name(final: str) -> str:
    """The temp file a commit of ``final`` writes before renaming it (:meth:`Storage.remove_temps` finds it)."""
    return f"{final}.{uuid.uuid4().hex[:8]}.tmp"


def protocols_of(fs: fsspec.AbstractFileSystem) -> set[str]:
    """The protocol names of an fsspec filesystem, as a set."""
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


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


def write_pieces(f: BinaryIO, pieces: "list[object] | tuple[object, ...]") -> None:
    """Write buffers, in order, to a file opened by :meth:`Storage.open_write`.

    A backend's file may offer the optional primitive ``writev(pieces)`` (local files:
    ``os.writev``, which releases the GIL and joins nothing); other files (object stores,
    which stream their parts) get one ``write`` per piece.
    """
    writev = getattr(f, "writev", None)
    if writev is not None:
        writev(pieces)
        return
    for piece in pieces:
        f.write(piece)  # type: ignore[arg-type]


_BACKENDS: list[type["Storage"]] = []


def register_backend(cls: type["Storage"]) -> type["Storage"]:
    """Class decorator: ``Storage(url)`` asks ``cls.handles(fs)`` before the backends registered earlier
    (a storage plugin needs no registration: its entry point names it)."""
    _BACKENDS.append(cls)
    return cls


def _protocol(url: str) -> str | None:
    """The protocol of ``url`` (the outermost of a chained URL), None for a plain path."""
    protocol = fsspec.core.split_protocol(url)[0]
    return protocol.split("::")[0] if protocol else None


def _plugin_backend(url: str) -> "tuple[type[Storage], str] | None":
    """The backend an installed plugin declares for ``url``'s protocol, with the plugin's description;
    None when a registered backend declares the protocol or no plugin does."""
    protocol = _protocol(url)
    served = set().union(*(b.protocols for b in _BACKENDS))
    if protocol is None or protocol in served:
        return None
    plugin = load_plugin(STORAGE_GROUP, protocol, ConfigError, served, f"the storage backend of {protocol}:// URLs")
    if plugin is None:
        return None
    if not (isinstance(plugin.obj, type) and issubclass(plugin.obj, Storage)):
        raise ConfigError(f"{plugin.where} names {plugin.obj!r}, which is not a Storage subclass: the entry point must "
                          "name the backend class; report it to the plugin's authors, or uninstall it")
    return plugin.obj, plugin.where


def _open_fs(url: str, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    with storage_errors(url, "open filesystem"):
        try:
            return fsspec.core.url_to_fs(url, **storage_options)
        except ValueError:
            for protocol in (fsspec.core.split_protocol(url)[0] or "").split("::"):
                try:
                    fsspec.get_filesystem_class(protocol)
                except ValueError as exc:  # fsspec's "Protocol not known"
                    raise ConfigError(f"no filesystem serves {url}: its protocol {protocol!r} is known neither to "
                                      "fsspec nor to an installed plugin. Install the package that provides it: a "
                                      f"dcp-tiered storage plugin (entry point group {STORAGE_GROUP!r}) or an "
                                      "fsspec filesystem (group 'fsspec.specs')") from exc
            raise


class Storage:
    """One directory on any fsspec filesystem; ``Storage(url)`` returns the backend for the URL."""

    #: The root is a directory of the local machine, reached with plain ``os`` calls.
    is_local: ClassVar[bool] = False
    #: No directories, no locks, no rename; a single PUT is atomic.
    is_object_store: ClassVar[bool] = False
    #: URL protocols this backend serves, once registered, whatever plugins are installed: a storage
    #: plugin is looked up only for a protocol that no registered backend declares.
    protocols: ClassVar[frozenset[str]] = frozenset()

    def __new__(cls, url: "str | os.PathLike[str]" = "", storage_options: dict[str, Any] | None = None) -> "Storage":
        if cls is not Storage:  # a backend named directly, or unpickling
            return super().__new__(cls)
        plugin = _plugin_backend(os.fspath(url))
        fs, root = _open_fs(os.fspath(url), dict(storage_options or {}))
        if plugin is not None:
            backend, where = plugin
            if not backend.handles(fs):
                raise ConfigError(f"{where} names {backend.__name__}, which does not serve {os.fspath(url)} "
                                  f"({type(fs).__name__}); report it to the plugin's authors")
        else:
            backend = next((b for b in reversed(_BACKENDS) if b.handles(fs)), None)
        if backend is None:
            raise ConfigError(f"no storage backend serves {os.fspath(url)} ({type(fs).__name__})")
        self = super().__new__(backend)
        self._opened = (fs, root)  # __init__ takes it instead of opening the filesystem again
        return self

    def __init__(self, url: "str | os.PathLike[str]", storage_options: dict[str, Any] | None = None) -> None:
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        fs, root = self.__dict__.pop("_opened", None) or _open_fs(self.url, self.storage_options)
        if not self.handles(fs):
            raise ConfigError(f"{type(self).__name__} cannot serve {self.url} ({type(fs).__name__}); use Storage(url)")
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") or root

    @classmethod
    def handles(cls, fs: fsspec.AbstractFileSystem) -> bool:
        """Whether this backend serves the fsspec filesystem ``fs``."""
        return False

    def __getstate__(self) -> dict:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def child(self, name: str) -> "Storage":
        """A storage of the same backend for the subdirectory ``name`` (contained)."""
        sub = safe_relative_name(name, self.url)
        child = super().__new__(type(self))
        # on this storage's filesystem object where it serves every thread (an async one, whose calls run
        # on fsspec's own loop, or the local one): opening the URL again can make a new one (a new S3
        # client and session, about half a second of CPU, where the options skip fsspec's cache); a
        # filesystem of one connection (sftp, ftp) is opened again, as fsspec caches it per thread
        if getattr(self.fs, "async_impl", False) or self.is_local:
            child._opened = (self.fs, posixpath.join(self.root, sub))
        child.__init__(self.url.rstrip("/") + "/" + sub, self.storage_options)
        return child

    def same_place(self, other: "Storage") -> bool:
        """Whether ``other`` is this directory: the same :func:`~dcp_tiered.storage.paths.location`
        (filesystem, endpoint, path; links resolved, trailing slashes ignored)."""
        return location(self.url, self.storage_options) == location(other.url, other.storage_options)

    def path(self, name: str) -> str:
        """The filesystem path of ``name`` inside the root (containment checked)."""
        return posixpath.join(self.root, safe_relative_name(name, self.url))

    def url_of(self, name: str) -> str:
        return self.url.rstrip("/") + "/" + name

    def _refresh(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path)

    # -- primitives: each backend implements these ------------------------------------

    def _open_write(self, name: str, durable: bool) -> "contextlib.AbstractContextManager[BinaryIO]":
        """Open ``name`` for writing; on clean exit the bytes are durable (as the backend allows) and closed.

        The file may also offer ``writev(pieces)`` (see :func:`write_pieces`): every byte of
        the buffers written in order, or an error.
        """
        raise NotImplementedError

    def _commit(self, name: str, data: bytes, exclusive: bool) -> bool:
        """Make ``name`` hold ``data`` atomically; with ``exclusive``, False (nothing changed) if it exists."""
        raise NotImplementedError

    def _commit_file(self, name: str, local_path: str) -> None:
        """Make ``name`` hold the bytes of the local file ``local_path`` atomically (it may be moved away).

        This default uploads to a temp name and moves it into place; a backend overrides it where
        one upload is atomic or a rename is enough."""
        path = self.path(name)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self._via_temp(path, lambda tmp: self.fs.put_file(local_path, tmp))

    def _via_temp(self, path: str, put: "Callable[[str], object]") -> None:
        """``put(tmp)`` writes a temp name next to ``path``, then it moves into place; no temp is left."""
        tmp = temp_name(path)
        try:
            put(tmp)
            self.fs.mv(tmp, path)
        finally:
            with contextlib.suppress(Exception):
                if self.fs.exists(tmp):
                    self.fs.rm_file(tmp)

    def _size(self, name: str) -> int:
        raise NotImplementedError

    def _read_range(self, name: str, start: int, end: int) -> bytes:
        raise NotImplementedError

    def _read_all(self, name: str) -> bytes:
        raise NotImplementedError

    def _list(self) -> dict[str, tuple[int, float | None]]:
        """Every file under the root by relative name: ``(size, mtime)`` (mtime None when unknown)."""
        raise NotImplementedError

    def _read_into(self, name: str, start: int, view: memoryview) -> int:
        data = self._read_range(name, start, start + len(view))
        view[: len(data)] = data
        return len(data)

    # -- derived ------------------------------------------------------------------------

    def check_reachable(self) -> None:
        """Raise a clear error now if the root cannot be reached (object stores: the bucket is missing)."""

    def makedirs(self) -> None:
        """Create the root directory (a no-op on object stores) and check it is reachable."""
        self.check_reachable()
        with storage_errors(self.url, "create directory"):
            self.fs.makedirs(self.root, exist_ok=True)

    def exists(self, name: str = "") -> bool:
        path = self.path(name) if name else self.root
        with storage_errors(self.url_of(name), "check existence"):
            self._refresh(path)
            return bool(self.fs.exists(path))

    def is_link(self, name: str = "") -> bool:
        """Whether ``name`` (``""``: the root itself) is a symbolic link; always False off local filesystems."""
        return False

    def size(self, name: str) -> int:
        """Size of the regular file ``name`` (links and special files are refused locally)."""
        with storage_errors(self.url_of(name), "stat"):
            return self._size(name)

    def listdir(self) -> list[str]:
        """Names directly inside the root (files and directories); empty if the root is missing."""
        with storage_errors(self.url, "list"):
            self._refresh(self.root)
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries} - {""})

    def _listed(self) -> dict[str, tuple[int, float | None]]:
        with storage_errors(self.url, "list"):
            return self._list()

    def file_stats(self) -> dict[str, tuple[int, float | None]]:
        """Every file under the root, by relative name: ``(size, mtime)`` (mtime None when unknown).

        One listing: on an object store one paginated list, a request per 1000 objects."""
        return self._listed()

    def file_sizes(self) -> dict[str, int]:
        """Every file under the root, by relative name, with its size."""
        return {rel: size for rel, (size, _mtime) in self._listed().items()}

    def file_ages(self, now: float) -> dict[str, float]:
        """Seconds since each file under the root was last modified (files whose time is unknown are left out)."""
        return {rel: now - mtime for rel, (_size, mtime) in self._listed().items() if mtime is not None}

    @contextlib.contextmanager
    def open_write(self, name: str, durable: bool = True) -> Iterator[BinaryIO]:
        """Open ``name`` for writing; on clean exit the bytes are flushed, fsynced (local) and closed."""
        with storage_errors(self.url_of(name), "write"), self._open_write(name, durable) as f:
            yield f

    def commit_bytes(self, name: str, data: bytes, exclusive: bool = False) -> bool:
        """Make ``name`` hold ``data`` atomically: temp file + fsync + rename locally, one PUT on object stores.

        With ``exclusive`` the commit only happens if ``name`` does not exist, atomically under a
        race where the backend allows it (``link(2)`` locally, ``If-None-Match: *`` on S3);
        returns False (and changes nothing) when ``name`` already holds other bytes.  A refusal is
        read back: when ``name`` holds exactly ``data``, it is this commit's own earlier attempt (a
        request applied whose response was lost, so the client's retry was refused) and the commit
        succeeded.  A commit that fails is read back too: a lost response reported as an error (a
        closed connection, a 5xx) to a request that applied is a success, not a failure.  Callers
        make ``data`` unique to the commit (a save id in it) for that to hold.
        """
        with storage_errors(self.url_of(name), "commit"):
            try:
                committed = self._commit(name, data, exclusive)
            except Exception:
                with contextlib.suppress(Exception):  # the commit's own error is the one to report
                    if self._holds(name, data):
                        return True
                raise
            return committed or self._holds(name, data)

    def commit_file(self, name: str, local_path: "str | os.PathLike[str]", retry: RetryPolicy = RetryPolicy()) -> None:
        """Publish the finished local file ``local_path`` as ``name`` atomically, and remove ``local_path``:
        a reader sees the old ``name`` or all of the new one, also after a crash.

        Locally: fsync + rename (a copy through a temp file from another filesystem) + directory
        fsync, no link followed, the mode a new file gets in the directory; object stores: one
        upload; other filesystems: upload to a temp name + move.  Off local disks a failure is
        retried under ``retry``.  For files too big for :meth:`commit_bytes` (a safetensors shard).
        """
        url, path = self.url_of(name), os.fspath(local_path)

        def once() -> None:
            with storage_errors(url, "commit"):
                self._commit_file(name, path)

        try:
            retrying(once, RetryPolicy(attempts=1) if self.is_local else retry, f"commit of {url}")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def _holds(self, name: str, data: bytes) -> bool:
        """Whether ``name`` holds exactly ``data`` now (False when it does not exist)."""
        try:
            return self._size(name) == len(data) and self._read_all(name) == data
        except FileNotFoundError:
            return False

    def try_lock(self, name: str) -> FileLock | None:
        """Take an exclusive lock on the file ``name`` without waiting; None when another writer holds it.

        Filesystems without locks (object stores, ``memory://``) get a lock that holds nothing:
        they rely on :meth:`commit_bytes` with ``exclusive`` instead.
        """
        return FileLock()

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``; fewer bytes mean the file is short."""
        with storage_errors(self.url_of(name), "read"):
            return self._read_range(name, start, end)

    def read_range_into(self, name: str, start: int, buf: "bytearray | memoryview") -> int:
        """Fill ``buf`` from offset ``start`` of ``name``; return the bytes read (short at EOF).

        Local files read straight into the caller's (reused) buffer; other filesystems copy.
        """
        view = memoryview(buf).cast("B")
        with storage_errors(self.url_of(name), "read"):
            return self._read_into(name, start, view)

    def read_bytes(self, name: str, max_bytes: int | None = None) -> bytes:
        """The whole file ``name``; with ``max_bytes``, its size is checked before anything is read.

        A file larger than ``max_bytes`` raises :class:`CorruptCheckpointError`, also when it
        grows while being read; locally only a regular file reached without links is read (a
        FIFO does not block, ``/dev/zero`` is never opened).
        """
        url = self.url_of(name)

        def too_big(size: "int | str") -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{url} has {size} bytes, more than the {max_bytes} allowed; refusing to read it")

        with storage_errors(url, "read"):
            if max_bytes is None:
                return self._read_all(name)
            size = self._size(name)
            if size > max_bytes:
                raise too_big(size)
            data = self._read_range(name, 0, max_bytes + 1) if size else b""  # +1: growth is caught
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

    def remove_temps(self, name: str, older_than: float, now: float | None = None) -> None:
        """Delete the temp files a killed :meth:`commit_bytes` of ``name`` left behind.

        Only those unchanged for ``older_than`` seconds: a younger one may belong to a commit
        in progress in another process.  Files whose age is unknown are kept.
        """
        ages = self.file_ages(time.time() if now is None else now)
        for entry, age in ages.items():
            if age >= older_than and _TEMP_FILE.fullmatch(entry) and entry.rsplit(".", 2)[0] == name:
                self.remove(entry)

    def remove_tree(self) -> None:
        """Delete the root and everything under it; a missing root is not an error."""
        with storage_errors(self.url, "delete"):
            try:
                self.fs.rm(self.root, recursive=True)
            except FileNotFoundError:
                pass
            self._refresh(self.root)
