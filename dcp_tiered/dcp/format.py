"""On-disk format version 1: the per-item record kept in ``Metadata.storage_data``.

Records hold plain builtins only (str, int, tuple, dict) so that ``.metadata`` stays
loadable by the allow-list unpickler without importing anything from this package.
"""

from __future__ import annotations

from typing import Any

import torch

from dcp_tiered.codecs import FILTERS, parse_codec
from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError

FORMAT_VERSION = 1
METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
KIND_TENSOR = "tensor"
KIND_BYTES = "bytes"
_REQUIRED = ("fmt", "kind", "file", "offset", "length", "raw", "codec", "filter", "itemsize", "frame", "frames", "sums")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "checkpoint metadata") -> torch.dtype:
    """Inverse of :func:`dtype_name`, refusing anything that is not a torch dtype."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise UnsupportedFormatError(f"unknown dtype {name!r} in {where}")
    return value


def is_native_record(record: Any) -> bool:
    """Whether a ``storage_data`` value was written by this package (a dict with ``fmt``)."""
    return isinstance(record, dict) and "fmt" in record


# Largest frame header: one byte plus five per plane, eight planes at most.
_FRAME_OVERHEAD = 1 + 5 * 8
#: Default cap on the decoded size of one non-tensor item (its size is not in DCP's metadata).
MAX_OBJECT_BYTES = 256 << 20


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_record(record: dict, key: str, checkpoint: str, max_object_bytes: int = MAX_OBJECT_BYTES) -> dict:
    """Validate one native record so that no size in it can be trusted blindly; raise naming the key."""
    where = f"record of {key!r} in {checkpoint}"
    if record.get("fmt") != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"tensor {key!r} in {checkpoint} uses dcp_tiered format version {record.get('fmt')!r}; "
            f"this version reads {FORMAT_VERSION}: upgrade dcp_tiered"
        )
    missing = [f for f in _REQUIRED if f not in record]
    if missing:
        raise CorruptCheckpointError(f"{where} lacks fields {missing}")
    if record["kind"] not in (KIND_TENSOR, KIND_BYTES) or record["filter"] not in FILTERS:
        raise UnsupportedFormatError(f"{where} has kind {record['kind']!r} / filter {record['filter']!r}")
    try:
        parse_codec(record["codec"])
    except ValueError as exc:
        raise UnsupportedFormatError(f"{where} uses codec {record['codec']!r}, which this version cannot read") from exc
    if not all(_is_uint(record[f]) for f in ("offset", "length", "raw", "itemsize", "frame")) or not isinstance(record["file"], str):
        raise CorruptCheckpointError(f"{where} has invalid sizes")
    if record["frame"] <= 0 or record["itemsize"] not in (1, 2, 4, 8, 16):
        raise CorruptCheckpointError(f"{where} has an invalid frame or item size")
    frames, sums = record["frames"], record["sums"]
    if not isinstance(frames, tuple) or not isinstance(sums, tuple) or len(frames) != len(sums):
        raise CorruptCheckpointError(f"{where} has an invalid frame table")
    if not all(_is_uint(n) for n in frames) or not all(_is_uint(n) for n in sums):
        raise CorruptCheckpointError(f"{where} has a frame table with non-integer entries")
    if sum(frames) != record["length"]:
        raise CorruptCheckpointError(f"frame table of {key!r} in {checkpoint} does not add up to its stored length")
    step = record["frame"] - record["frame"] % record["itemsize"] or record["itemsize"]
    if len(frames) != -(-record["raw"] // step):
        raise CorruptCheckpointError(f"{where} has {len(frames)} frames for {record['raw']} raw bytes")
    if any(n > min(step, record["raw"] - i * step) + _FRAME_OVERHEAD for i, n in enumerate(frames)):
        raise CorruptCheckpointError(f"{where} has a frame larger than its raw size allows")
    if record["kind"] == KIND_BYTES and record["raw"] > max_object_bytes:
        raise CorruptCheckpointError(
            f"{where}: non-tensor item claims {record['raw']} bytes, above the {max_object_bytes}-byte limit "
            "(raise max_object_bytes if this checkpoint is trusted)"
        )
    if record["kind"] == KIND_TENSOR:
        stored = dtype_from_name(record.get("dtype", ""), where)
        if "orig_dtype" in record:
            dtype_from_name(record["orig_dtype"], where)
        if stored.itemsize != record["itemsize"]:
            raise CorruptCheckpointError(f"{where}: dtype {stored} does not match item size")
        shape = record.get("shape")
        if not isinstance(shape, tuple) or not all(_is_uint(d) for d in shape):
            raise CorruptCheckpointError(f"{where} has an invalid shape")
        numel = 1
        for d in shape:
            numel *= d
        if numel * record["itemsize"] != record["raw"]:
            raise CorruptCheckpointError(f"{where}: shape {shape} does not match {record['raw']} raw bytes")
    return record


def chunk_sizes(state_dict_metadata: dict) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """``(fqn, chunk offsets) -> chunk sizes`` for every tensor chunk DCP's metadata lists."""
    out: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for fqn, md in state_dict_metadata.items():
        for chunk in getattr(md, "chunks", ()) or ():
            out[(fqn, tuple(chunk.offsets))] = tuple(chunk.sizes)
    return out


def check_against_chunks(record: dict, index: Any, sizes: dict, checkpoint: str) -> None:
    """A tensor record's shape must be the chunk DCP's metadata says it is."""
    if record["kind"] != KIND_TENSOR:
        return
    key = (index.fqn, tuple(index.offset or ()))
    expected = sizes.get(key)
    if expected is None or tuple(expected) != record["shape"]:
        raise CorruptCheckpointError(
            f"record of {index.fqn!r} in {checkpoint} has shape {record['shape']}, but the checkpoint's "
            f"tensor table says {expected}: the metadata is inconsistent"
        )
