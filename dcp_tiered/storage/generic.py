"""``FsspecStorage``: any fsspec filesystem (``memory://``, ``ftp://``, a wrapped filesystem, ...).

Everything goes through fsspec calls; a commit writes a temporary name and moves it into place.
It is the fallback backend: :class:`Storage` uses it when no other backend serves the URL.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec

from dcp_tiered.storage.base import Storage, register_backend


def _mtime(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec ``info`` dict, as the backends name it (None if absent)."""
    mtime = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return float(mtime) if isinstance(mtime, (int, float)) else None


@register_backend
class FsspecStorage(Storage):
    """A directory on a generic fsspec filesystem: write through ``fs.open``, commit by temp + ``mv``."""

    @classmethod
    def handles(cls, fs: fsspec.AbstractFileSystem) -> bool:
        return True

    def _parent_dirs(self, name: str) -> None:
        self.fs.makedirs(posixpath.dirname(self.path(name)), exist_ok=True)

    @contextlib.contextmanager
    def _open_write(self, name: str, durable: bool) -> Iterator[BinaryIO]:
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

    def _commit(self, name: str, data: bytes, exclusive: bool) -> bool:
        self._parent_dirs(name)
        path = self.path(name)
        if exclusive and self.fs.exists(path):  # no atomic primitive here: best effort
            return False
        self._via_temp(path, lambda tmp: self.fs.pipe_file(tmp, data))
        return True

    def _size(self, name: str) -> int:
        path = self.path(name)
        self._refresh(path)
        return int(self.fs.size(path))

    def _read_range(self, name: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path(name), start=start, end=end)

    def _read_all(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

    def _list(self) -> dict[str, tuple[int, float | None]]:
        self._refresh(self.root)
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return {}
        root = self.root.replace(os.sep, "/")
        return {
            posixpath.relpath(str(p).replace(os.sep, "/"), root): (int(info.get("size") or 0), _mtime(info))
            for p, info in found.items()
        }
