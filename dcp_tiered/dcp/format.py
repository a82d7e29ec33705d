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


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`, refusing anything that is not a torch dtype."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise UnsupportedFormatError(f"unknown dtype {name!r} in checkpoint metadata")
    return value


def is_native_record(record: Any) -> bool:
    """Whether a ``storage_data`` value was written by this package (a dict with ``fmt``)."""
    return isinstance(record, dict) and "fmt" in record


def check_record(record: dict, key: str, checkpoint: str) -> dict:
    """Validate one native record; raise naming the tensor key and the checkpoint."""
    if record.get("fmt") != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"tensor {key!r} in {checkpoint} uses dcp_tiered format version {record.get('fmt')!r}; "
            f"this version reads {FORMAT_VERSION}: upgrade dcp_tiered"
        )
    missing = [f for f in _REQUIRED if f not in record]
    if missing:
        raise CorruptCheckpointError(f"record of {key!r} in {checkpoint} lacks fields {missing}")
    if record["kind"] not in (KIND_TENSOR, KIND_BYTES) or record["filter"] not in FILTERS:
        raise UnsupportedFormatError(f"record of {key!r} in {checkpoint} has kind {record['kind']!r} / filter {record['filter']!r}")
    parse_codec(record["codec"])
    ints = [record[f] for f in ("offset", "length", "raw", "itemsize", "frame")]
    if not all(isinstance(v, int) and v >= 0 for v in ints) or record["frame"] <= 0 or record["itemsize"] <= 0:
        raise CorruptCheckpointError(f"record of {key!r} in {checkpoint} has invalid sizes")
    frames, sums = record["frames"], record["sums"]
    if not isinstance(frames, tuple) or not isinstance(sums, tuple) or len(frames) != len(sums):
        raise CorruptCheckpointError(f"record of {key!r} in {checkpoint} has an invalid frame table")
    if sum(frames) != record["length"] or any(not isinstance(n, int) or n < 0 for n in frames):
        raise CorruptCheckpointError(f"frame table of {key!r} in {checkpoint} does not add up to its stored length")
    expected_frames = -(-record["raw"] // (record["frame"] - record["frame"] % record["itemsize"] or record["itemsize"]))
    if len(frames) != expected_frames:
        raise CorruptCheckpointError(f"record of {key!r} in {checkpoint} has {len(frames)} frames for {record['raw']} raw bytes")
    if record["kind"] == KIND_TENSOR:
        stored = dtype_from_name(record.get("dtype", ""))
        if stored.itemsize != record["itemsize"]:
            raise CorruptCheckpointError(f"record of {key!r} in {checkpoint}: dtype {stored} does not match item size")
        shape = record.get("shape")
        if not isinstance(shape, tuple) or any(not isinstance(d, int) or d < 0 for d in shape):
            raise CorruptCheckpointError(f"record of {key!r} in {checkpoint} has an invalid shape")
        numel = 1
        for d in shape:
            numel *= d
        if numel * record["itemsize"] != record["raw"]:
            raise CorruptCheckpointError(f"record of {key!r} in {checkpoint}: shape {shape} does not match {record['raw']} raw bytes")
    return record
