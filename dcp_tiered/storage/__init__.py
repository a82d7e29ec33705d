"""fsspec access: open/read ranges/write/commit/list/delete with error mapping and containment.

This layer knows nothing of torch or DCP.
"""

from dcp_tiered.storage.fs import MissingFileError, Storage, storage_errors
from dcp_tiered.storage.paths import safe_relative_name

__all__ = ["MissingFileError", "Storage", "safe_relative_name", "storage_errors"]
