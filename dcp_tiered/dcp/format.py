"""On-disk format version 1: the per-item record kept in ``Metadata.storage_data``.

Records hold plain builtins only (str, int, tuple, dict) so that ``.metadata`` stays
loadable by the allow-list unpickler without importing anything from this package.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcp_tiered.codecs import FILTERS
from dcp_tiered.codecs.frames import MAX_FRAME_SIZE, MAX_FRAMES_PER_RECORD, MIN_FRAME_SIZE, stored_frame_bounds
from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError

FORMAT_VERSION = 1
METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
KIND_TENSOR = "tensor"
KIND_BYTES = "bytes"
_REQUIRED = ("fmt", "kind", "file", "offset", "length", "raw", "codec", "filter", "itemsize", "frame", "frames", "sums")


_DTYPES = {n: v for n in dir(torch) if isinstance(v := getattr(torch, n, None), torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "checkpoint metadata") -> torch.dtype:
    """Inverse of :func:`dtype_name`, refusing anything that is not a torch dtype."""
    # A fixed table, not getattr(torch, name): that could import one of torch's lazy submodules.
    value = _DTYPES.get(name) if type(name) is str else None
    if value is None:
        raise UnsupportedFormatError(f"unknown dtype {name!r} in {where}")
    return value


def is_native_record(record: Any) -> bool:
    """Whether a ``storage_data`` value was written by this package (a dict with ``fmt``)."""
    return isinstance(record, dict) and "fmt" in record


#: Default cap on the decoded size of one non-tensor item (its size is not in DCP's metadata).
MAX_OBJECT_BYTES = 256 << 20
#: Largest ``.metadata`` read; its size is checked before reading it.
MAX_METADATA_BYTES = 256 << 20
_MAX_DIMS = 64
_U64 = 1 << 64
_OPTIONAL = {"checksum": str, "dtype": str, "orig_dtype": str, "shape": tuple}


def _is_uint(v: object) -> bool:
    return type(v) is int and v >= 0


def _uints(values: tuple, limit: int = _U64) -> bool:
    """All exact ints in ``[0, limit)`` (C-speed checks: frame tables can be long)."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0 and max(values) < limit)


def check_record(record: dict, key: str, checkpoint: str, max_object_bytes: "int | None" = MAX_OBJECT_BYTES) -> dict:
    """Validate one native record (types and ranges) so that no size in it can be trusted blindly.

    Raises :class:`CorruptCheckpointError` (or :class:`UnsupportedFormatError` for a newer
    format) naming the key and the checkpoint.  ``max_object_bytes=None`` skips the
    non-tensor size cap (the caller applies its own).
    """
    where = f"record of {key!r} in {checkpoint}"
    fmt = record.get("fmt")
    if type(fmt) is not int or fmt != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"tensor {key!r} in {checkpoint} uses dcp_tiered format version {fmt!r}; "
            f"this version reads {FORMAT_VERSION}: upgrade dcp_tiered"
        )
    missing = [f for f in _REQUIRED if f not in record]
    if missing:
        raise CorruptCheckpointError(f"{where} lacks fields {missing}")
    for name, typ in (("kind", str), ("filter", str), ("codec", str), ("file", str), ("frames", tuple), ("sums", tuple),
                      *_OPTIONAL.items()):
        if name in record and type(record[name]) is not typ:
            raise CorruptCheckpointError(f"{where}: field {name!r} is a {type(record[name]).__name__}, not a {typ.__name__}")
    if record["kind"] not in (KIND_TENSOR, KIND_BYTES) or record["filter"] not in FILTERS:
        raise UnsupportedFormatError(f"{where} has kind {record['kind']!r} / filter {record['filter']!r}")
    try:
        stored_frame_bounds(record["codec"], record["filter"], 1, 0)  # validates the codec (cached)
    except ValueError as exc:
        raise UnsupportedFormatError(f"{where} uses codec {record['codec']!r}, which this version cannot read") from exc
    if not all(_is_uint(record[f]) for f in ("offset", "length", "raw", "itemsize", "frame")):
        raise CorruptCheckpointError(f"{where} has invalid sizes (not non-negative integers)")
    if max(record["offset"], record["length"], record["raw"]) >= 1 << 62:
        raise CorruptCheckpointError(f"{where} has impossible sizes")
    itemsize, frame, raw = record["itemsize"], record["frame"], record["raw"]
    if not MIN_FRAME_SIZE <= frame <= MAX_FRAME_SIZE:
        raise CorruptCheckpointError(f"{where} has frame size {frame}, outside {MIN_FRAME_SIZE}..{MAX_FRAME_SIZE}")
    if itemsize not in (1, 2, 4, 8, 16) or (record["filter"] != FILTERS[0] and itemsize not in (2, 4, 8)):
        raise CorruptCheckpointError(f"{where} has an invalid item size {itemsize} for filter {record['filter']!r}")
    if raw % itemsize:
        raise CorruptCheckpointError(f"{where}: {raw} raw bytes is not a whole number of {itemsize}-byte items")
    frames, sums = record["frames"], record["sums"]
    if len(frames) != len(sums):
        raise CorruptCheckpointError(f"{where} has {len(frames)} frame sizes but {len(sums)} checksums")
    if len(frames) > MAX_FRAMES_PER_RECORD:
        raise CorruptCheckpointError(f"{where} has {len(frames)} frames, above the limit of {MAX_FRAMES_PER_RECORD}")
    if not _uints(frames, 1 << 62) or not _uints(sums):
        raise CorruptCheckpointError(f"{where} has a frame table with entries that are not 64-bit unsigned integers")
    if sum(frames) != record["length"]:
        raise CorruptCheckpointError(f"frame table of {key!r} in {checkpoint} does not add up to its stored length")
    step = frame - frame % itemsize
    if len(frames) != -(-raw // step):
        raise CorruptCheckpointError(f"{where} has {len(frames)} frames for {raw} raw bytes in frames of {step}")
    if frames:
        bounds = lambda n: stored_frame_bounds(record["codec"], record["filter"], itemsize, n)  # noqa: E731
        full, last = frames[:-1], frames[-1]
        lo, hi = bounds(step)
        lo_last, hi_last = bounds(raw - (len(frames) - 1) * step)
        if (full and (min(full) < lo or max(full) > hi)) or not lo_last <= last <= hi_last:
            raise CorruptCheckpointError(
                f"{where} has a frame whose stored size is impossible for its raw size and codec "
                f"{record['codec']} (the sizes are damaged or crafted)"
            )
    if record["kind"] == KIND_BYTES:
        if max_object_bytes is not None and raw > max_object_bytes:
            raise CorruptCheckpointError(
                f"{where}: non-tensor item claims {raw} bytes, above the {max_object_bytes}-byte limit "
                "(raise max_object_bytes if this checkpoint is trusted)"
            )
        return record
    stored = dtype_from_name(record.get("dtype", ""), where)
    if "orig_dtype" in record:
        dtype_from_name(record["orig_dtype"], where)
    if stored.itemsize != itemsize:
        raise CorruptCheckpointError(f"{where}: dtype {stored} does not match item size {itemsize}")
    shape = record.get("shape")
    if type(shape) is not tuple or len(shape) > _MAX_DIMS or not _uints(shape, 1 << 62):
        raise CorruptCheckpointError(f"{where} has an invalid shape {shape!r}"[:300])
    numel = 1
    for d in shape:
        numel *= d
    if numel * itemsize != raw:
        raise CorruptCheckpointError(f"{where}: shape {shape} does not match {raw} raw bytes")
    return record


def chunk_sizes(state_dict_metadata: dict) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """``(fqn, chunk offsets) -> chunk sizes`` for every tensor chunk DCP's metadata lists."""
    out: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for fqn, md in state_dict_metadata.items():
        if type(md) is not TensorStorageMetadata:
            continue
        for chunk in md.chunks:
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
