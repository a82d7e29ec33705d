"""The old import path of the storage layer, kept until ``dcp/writer.py`` imports
``FileLock`` from :mod:`dcp_tiered.storage`; new code imports from there."""

from dcp_tiered.errors import MissingFileError
from dcp_tiered.storage.base import Storage, storage_errors
from dcp_tiered.storage.lock import FileLock

__all__ = ["FileLock", "MissingFileError", "Storage", "storage_errors"]
