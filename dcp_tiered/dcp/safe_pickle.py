"""Load DCP ``.metadata`` pickles through an allow-list, so a crafted checkpoint runs no code.

Only the exact classes DCP metadata is made of may be referenced: the metadata
dataclasses, torch dtypes, ``torch.Size``, layouts and memory formats, path classes, and
the stock ``_StorageInfo`` record (to read checkpoints written by stock DCP writers).
Anything else raises :class:`UnsafeCheckpointError` before it is called.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from dcp_tiered.errors import CorruptCheckpointError, UnsafeCheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "slice", "complex"}),
}
_TORCH_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
_TORCH_MISC = frozenset({"strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"})


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name in _TORCH_DTYPES or name in _TORCH_MISC):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._source} references {module}.{name}, which is not allowed in checkpoint metadata; "
            "the file may be malicious: do not load it with plain pickle"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source} uses persistent ids, which checkpoint metadata never does")



def safe_loads(data: bytes, source: str = ".metadata") -> Any:
    """Unpickle ``data`` allowing only DCP metadata classes; raise a clear error otherwise."""
    try:
        return _AllowListUnpickler(data, source).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, ImportError,
            MemoryError, RecursionError, OverflowError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{source} is not a readable DCP metadata pickle: {type(exc).__name__}: {exc}") from exc
