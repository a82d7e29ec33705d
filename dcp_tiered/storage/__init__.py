"""fsspec access: open/read ranges/write/commit/list/delete with error mapping and containment.

``Storage(url)`` returns the backend for the URL: :class:`LocalStorage`,
:class:`ObjectStoreStorage` or :class:`FsspecStorage` (any other fsspec filesystem).
This layer knows nothing of torch or DCP.
"""

from dcp_tiered.errors import MissingFileError
from dcp_tiered.storage.base import Storage, register_backend, storage_errors

# Registration order: a backend registered later is asked first; the generic one is the fallback.
from dcp_tiered.storage.generic import FsspecStorage  # isort: skip
from dcp_tiered.storage.object_store import ObjectStoreStorage  # isort: skip
from dcp_tiered.storage.local import LocalStorage  # isort: skip
from dcp_tiered.storage.lock import FileLock
from dcp_tiered.storage.paths import safe_relative_name

__all__ = [
    "FileLock",
    "FsspecStorage",
    "LocalStorage",
    "MissingFileError",
    "ObjectStoreStorage",
    "Storage",
    "register_backend",
    "safe_relative_name",
    "storage_errors",
]
