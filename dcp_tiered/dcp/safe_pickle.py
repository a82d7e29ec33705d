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

from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError, UnsafeCheckpointError

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
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "slice", "complex"}),
}
_TORCH_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
_TORCH_MISC = frozenset({"strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"})


# The pure-Python unpickler keeps its memo in a dict; the C one preallocates a memo array
# as large as any index a PUT opcode names, so 9 crafted bytes could make it zero-fill GBs.
class _AllowListUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    def __init__(self, data: bytes, source: str) -> None:
        self._source_stream = io.BytesIO(data)
        super().__init__(self._source_stream)
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



def safe_loads(data: bytes, source: str = ".metadata", exact: bool = True) -> Any:
    """Unpickle ``data`` allowing only DCP metadata classes; raise a clear error otherwise.

    With ``exact``, bytes left over after the pickle's end mean the file was damaged.
    """
    try:
        unpickler = _AllowListUnpickler(data, source)
        value = unpickler.load()
    except DcpTieredError:
        raise
    except Exception as exc:  # any failure to decode hostile or damaged bytes is "not readable"
        raise CorruptCheckpointError(f"{source} is not a readable DCP metadata pickle: {type(exc).__name__}: {exc}") from exc
    if exact and unpickler._source_stream.tell() != len(data):
        raise CorruptCheckpointError(f"{source} has {len(data) - unpickler._source_stream.tell()} stray bytes after its end: it is damaged")
    return value
