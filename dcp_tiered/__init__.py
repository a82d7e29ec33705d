"""dcp_tiered: smaller, faster, cheaper PyTorch Distributed Checkpoint saves.

Public names load lazily so that ``import dcp_tiered`` stays light: torch and the codec
libraries are imported only when a writer, reader or planner is first used.
"""

from __future__ import annotations

from dcp_tiered.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CodecError,
    ConfigError,
    CorruptCheckpointError,
    DcpTieredError,
    PromotionError,
    SaveError,
    SaveMemoryError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    UnsafeObjectError,
    RestoreError,
    PromotionIOError,
    LeaderLoadError,
    MissingFileError,
    MemoryBudgetError,
    ReplicationError,
    MetadataTooLargeError,
)
from dcp_tiered.lazy import lazy_attributes

__version__ = "0.1.0"

_LAZY = {
    "CompressedWriter": "dcp_tiered.dcp.writer",
    "CompressedReader": "dcp_tiered.dcp.reader",
    "CheckpointerOptions": "dcp_tiered.tiers.config",
    "Codec": "dcp_tiered.codecs",
    "register_codec": "dcp_tiered.codecs",
    "get_codec": "dcp_tiered.codecs",
    "DowncastSavePlanner": "dcp_tiered.dcp.planners",
    "DowncastReport": "dcp_tiered.dcp.planners",
    "SaveStats": "dcp_tiered.dcp.save_stats",
    "Tier": "dcp_tiered.tiers.config",
    "TieredCheckpointer": "dcp_tiered.tiers.checkpointer",
    "TieredWriter": "dcp_tiered.tiers.save.writer",
    "SaveReport": "dcp_tiered.tiers.events",
    "CheckpointInfo": "dcp_tiered.tiers.catalog",
    "load_and_broadcast": "dcp_tiered.dcp.broadcast",
    "numpy_safe_globals": "dcp_tiered.dcp.objects",
}

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CodecError",
    "CompressedReader",
    "CompressedWriter",
    "ConfigError",
    "CorruptCheckpointError",
    "DowncastReport",
    "DowncastSavePlanner",
    "LeaderLoadError",
    "MissingFileError",
    "load_and_broadcast",
    "PromotionError",
    "SaveError",
    "SaveMemoryError",
    "SaveReport",
    "SaveStats",
    "CheckpointInfo",
    "Tier",
    "TieredCheckpointer",
    "TieredWriter",
    "DcpTieredError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "__version__",
    "UnsafeObjectError",
    "numpy_safe_globals",
    "RestoreError",
    "PromotionIOError",
    "CheckpointerOptions",
    "Codec",
    "register_codec",
    "get_codec",
    "MemoryBudgetError",
    "ReplicationError",
    "MetadataTooLargeError",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals(), __all__)
