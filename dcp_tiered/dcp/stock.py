"""Decoding items written by stock DCP writers (``FileSystemWriter``, ``FsspecWriter``).

Stock items are ``torch.save`` payloads, optionally passed through DCP's experimental
``stream.zstd`` transform.  Decompression is bounded by the size the metadata implies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import zstandard
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_tiered.dcp.format import MAX_OBJECT_BYTES
from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError

# torch.save wraps tensor bytes in a zip with a small pickle; this covers that overhead.
_TORCH_SAVE_SLACK = 1 << 20
_READ_STEP = 4 << 20


def stock_raw_bound(
    req: ReadItem,
    chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    stored_len: int,
    max_object_bytes: int = MAX_OBJECT_BYTES,
) -> int:
    """Largest decoded size a stock item may legitimately have.

    A tensor chunk: its size in DCP's metadata (plus ``torch.save`` overhead).  A non-tensor
    item, whose size DCP's metadata does not record: ``max_object_bytes``.
    """
    fqn = req.storage_index.fqn
    sizes = chunk_sizes.get((fqn, tuple(req.storage_index.offset or ())))
    if req.type == LoadItemType.BYTE_IO or fqn not in dtypes or sizes is None:
        return max_object_bytes
    numel = 1
    for s in sizes:
        numel *= s
    return numel * dtypes[fqn].itemsize + _TORCH_SAVE_SLACK


def decode_stock_item(data: bytes, descriptors: Sequence[str], bound: int, where: str) -> bytes:
    """Undo the stream transforms named by ``descriptors`` (outermost last), never producing more than ``bound`` bytes."""
    out = data
    for descriptor in reversed(list(descriptors)):
        name, _, version = str(descriptor).partition("/")
        if name != "stream.zstd" or version.partition(".")[0] != "1":
            raise UnsupportedFormatError(f"item {where} uses stream transform {descriptor!r}, which this reader does not know")
        parts, total = [], 0
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(out)
            while True:
                part = reader.read(min(_READ_STEP, bound + 1 - total))
                if not part:
                    break
                parts.append(part)
                total += len(part)
                if total > bound:
                    break
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"item {where} does not decompress: {exc}") from exc
        out = b"".join(parts)
    if len(out) > bound:
        raise CorruptCheckpointError(
            f"item {where} decodes past its size bound of {bound} bytes (for a non-tensor item: raise "
            "max_object_bytes if this checkpoint is trusted)"
        )
    return out
