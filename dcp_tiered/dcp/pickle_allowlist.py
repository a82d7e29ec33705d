"""What a DCP ``.metadata`` pickle may reference, and in which shapes.

The tables the allow-list unpickler of :mod:`dcp_tiered.dcp.safe_pickle` enforces: the
globals it may name, the dataclasses it may create with NEWOBJ and fill with BUILD, the
constructors it may call with REDUCE (each with a check of its arguments), and the limits
on depth, sizes and counts.  Pure tables and checks: nothing here unpickles.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.serialization import _get_layout

from dcp_tiered.dcp.format import MAX_DIMS  # noqa: F401 - the allow-list's limit, re-exported

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
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
TORCH_DTYPE_NAMES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
TORCH_MISC_NAMES = frozenset({"strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"})

#: Deepest nesting of built objects accepted (DCP metadata nests about 10 deep).
MAX_DEPTH = 64
#: Most items in one container (a frame table of the largest record fits).
MAX_CONTAINER_ITEMS = 1 << 22
#: Most items in all containers of one pickle together.
MAX_TOTAL_ITEMS = 1 << 26
#: Most dict keys sharing one hash value (colliding keys make dict insertion quadratic).
MAX_SAME_HASH = 16
# Largest integer (bytes of LONG4 / digits of LONG) accepted; DCP's are 64-bit.
MAX_INT_BYTES = 16
MAX_PATH_PARTS = 4096

# Dataclasses DCP pickles as NEWOBJ + BUILD.
BUILDABLE = frozenset(
    {
        _md.Metadata,
        _md.MetadataIndex,
        _md.TensorStorageMetadata,
        _md.BytesStorageMetadata,
        _md.ChunkStorageMetadata,
        _md.TensorProperties,
        _md.StorageMeta,
        _StorageInfo,
    }
)
MEM_FORMATS = frozenset(_md._MEM_FORMAT_ENCODING)
BUILD_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in BUILDABLE}


def tensor_properties_state_ok(state: Any) -> bool:
    """``TensorProperties`` state: (dtype, layout, requires_grad, memory format, pin_memory)."""
    return (
        type(state) is tuple
        and len(state) == 5
        and isinstance(state[0], torch.dtype)
        and isinstance(state[1], torch.layout)
        and type(state[2]) is bool
        and state[3] in MEM_FORMATS
        and type(state[4]) is bool
    )


def field_state_ok(cls: type, state: Any) -> bool:
    """BUILD state of the other dataclasses: a dict of field names (or any plain names: fields
    of other torch versions)."""
    return type(state) is dict and (
        state.keys() <= BUILD_FIELDS[cls]  # fast path
        or all(type(k) is str and k.isidentifier() and not k.startswith("__") for k in state)
    )


def index_key_ok(key: Any) -> bool:
    """A ``MetadataIndex`` used as a dict key has a str fqn, a small ``torch.Size`` offset or
    None, and an int index or None."""
    fqn, offset, index = (getattr(key, f, None) for f in ("fqn", "offset", "index"))
    return (
        type(fqn) is str
        and (offset is None or (type(offset) is torch.Size and len(offset) <= MAX_DIMS))
        and (index is None or type(index) is int)
    )


# REDUCE: the constructors DCP's pickles call, each with a check of its arguments. A check
# gets the unpickler (to count items and check set members) and the argument tuple.
def _seq(args: tuple, item_types: tuple[type, ...] | None = None, limit: int = MAX_CONTAINER_ITEMS) -> bool:
    """``()`` or ``(list_or_tuple,)`` whose items have the given types."""
    if not args:
        return True
    if len(args) != 1 or type(args[0]) not in (list, tuple) or len(args[0]) > limit:
        return False
    return item_types is None or set(map(type, args[0])) <= set(item_types)


def _set_args(u: Any, args: tuple) -> bool:
    if not _seq(args):
        return False
    if args:
        u._count(len(args[0]))
        u._check_keys(args[0], "set member")
    return True


def _list_args(u: Any, args: tuple) -> bool:
    if not _seq(args):
        return False
    if args:
        u._count(len(args[0]))
    return True


REDUCE_RULES: dict[int, tuple[Any, Any]] = {
    id(f): (f, check)
    for f, check in [
        (torch.Size, lambda u, a: len(a) == 1 and type(a[0]) in (tuple, list) and len(a[0]) <= MAX_DIMS),
        (_get_layout, lambda u, a: len(a) == 1 and type(a[0]) is str and len(a[0]) <= 64),
        (_md._MEM_FORMAT_ENCODING, lambda u, a: len(a) == 1 and type(a[0]) is int),
        (pathlib.PosixPath, lambda u, a: len(a) <= MAX_PATH_PARTS and all(type(x) is str for x in a)),
        (pathlib.PurePosixPath, lambda u, a: len(a) <= MAX_PATH_PARTS and all(type(x) is str for x in a)),
        (pathlib.PureWindowsPath, lambda u, a: len(a) <= MAX_PATH_PARTS and all(type(x) is str for x in a)),
        (OrderedDict, lambda u, a: a == ()),
        (dict, lambda u, a: a == ()),
        (set, _set_args),
        (frozenset, _set_args),
        (list, _list_args),
        (tuple, _list_args),
        (slice, lambda u, a: len(a) <= 3 and all(type(x) in (int, type(None)) for x in a)),
        (complex, lambda u, a: len(a) <= 2 and all(type(x) in (int, float) for x in a)),
    ]
}

