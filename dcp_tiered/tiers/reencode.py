"""Copying one data file between tiers: byte for byte, or re-encoded when codecs differ."""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from dcp_tiered.storage.base import write_pieces
from dcp_tiered.codecs import FrameCodec, get_codec, verify_frame
from dcp_tiered.codecs.bytegroup import FILTER_NONE
from dcp_tiered.dcp.format import record_view
from dcp_tiered.errors import CorruptCheckpointError
from dcp_tiered.storage import Storage

COPY_CHUNK = 8 << 20


def copy_file(src: Storage, dst: Storage, name: str) -> int:
    """Stream ``name`` from ``src`` to ``dst`` in bounded chunks; return the bytes copied."""
    size = src.size(name)
    buf = bytearray(min(COPY_CHUNK, max(size, 1)))
    done = 0
    with dst.open_write(name) as f:
        while done < size:
            n = src.read_range_into(name, done, memoryview(buf)[: min(len(buf), size - done)])
            if n == 0:
                raise CorruptCheckpointError(f"{src.url_of(name)} shrank while being copied ({done} of {size} bytes)")
            f.write(memoryview(buf)[:n])
            done += n
    return done


def reencode_file(src: Storage, dst: Storage, name: str, records: list[tuple[object, dict]], codec: str,
                  cpu: "threading.Semaphore | None" = None) -> tuple[int, list[tuple[object, dict]]]:
    """Decode every item of ``name`` (verifying checksums) and write it re-encoded with ``codec``.

    ``cpu`` (the background CPU budget) is held around each frame's decode and encode only, so
    that re-encodes for several tiers never run more coders at once than it allows, while reads
    and writes of a stalled tier hold no slot.

    ``records`` are validated native records (plain builtins) of ``name``.  Returns the bytes
    written and the new records (same keys, new offsets/lengths/frames), as plain builtins.
    """
    out_records = []
    offset = 0
    target = get_codec(codec)
    with dst.open_write(name) as f:
        for key, rec in sorted(((k, record_view(r)) for k, r in records), key=lambda kr: kr[1].offset):
            old = FrameCodec(rec.codec, rec.filter_name, rec.itemsize)
            new_filter = rec.filter_name if target.compresses else FILTER_NONE
            new = FrameCodec(target, new_filter, rec.itemsize)
            frames, sums = [], []
            for i, at, stored_len, s, e in rec.frame_slices():
                stored = src.read_range(rec.file, at, at + stored_len)
                if len(stored) != stored_len or not verify_frame(stored, rec.frame_sums[i]):
                    raise CorruptCheckpointError(f"frame {i} of {key!r} in {src.url_of(name)} fails its checksum; not promoting it")
                raw = np.empty(e - s, dtype=np.uint8)
                with cpu or contextlib.nullcontext():
                    old.decode(stored, raw)
                    enc = new.encode(raw)
                write_pieces(f, enc.pieces)
                frames.append(enc.stored_len)
                sums.append(enc.digest)
            moved = rec.reencoded(target.spec, new_filter, offset, frames, sums)
            out_records.append((key, moved.to_builtin()))
            offset += moved.length
    return offset, out_records
