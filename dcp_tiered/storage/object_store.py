"""``ObjectStoreStorage``: S3, GCS, Azure and other object stores.

Object stores have no directories, no locks and no rename, but a single PUT is atomic: a commit
is one PUT, and an exclusive commit a conditional PUT (``If-None-Match: *``).
"""

from __future__ import annotations

import errno

import fsspec

from dcp_tiered.errors import MissingFileError
from dcp_tiered.storage.base import protocols_of, register_backend, storage_errors
from dcp_tiered.storage.generic import FsspecStorage

#: Protocols on which one PUT is atomic and there is no atomic rename.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2", "oss"})


@register_backend
class ObjectStoreStorage(FsspecStorage):
    """A prefix in an object store bucket: commit by one PUT, exclusive commit by a conditional PUT."""

    is_object_store = True
    protocols = OBJECT_STORES

    @classmethod
    def handles(cls, fs: fsspec.AbstractFileSystem) -> bool:
        return bool(protocols_of(fs) & OBJECT_STORES)

    def check_reachable(self) -> None:
        """Raise a clear error now if the bucket (or container) of the root does not exist."""
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

    def makedirs(self) -> None:
        """Check that the bucket exists (object stores have no directories to create)."""
        self.check_reachable()

    def _parent_dirs(self, name: str) -> None:
        pass  # no directories

    def _commit(self, name: str, data: bytes, exclusive: bool) -> bool:
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
        return True

    def _commit_file(self, name: str, local_path: str) -> None:
        path = self.path(name)
        self.fs.put_file(local_path, path)  # one upload (a multipart one is also published whole)
        self._refresh(path)
