"""Reading frames of the ``none`` codec straight into a destination: no read buffer, no decode copy.

A frame of one raw plane is a 6-byte header followed by the raw bytes themselves, so its payload
can be read from a local file directly into the destination tensor's bytes.  The checksum is
verified over the header and the destination together: the same bytes the writer hashed.
"""

from __future__ import annotations

import struct

import numpy as np

from dcp_tiered.codecs.checksum import checksum
from dcp_tiered.codecs.frames import MODE_RAW
from dcp_tiered.errors import CorruptCheckpointError

# Plane count, then the plane's mode and stored length.
RAW_HEAD = struct.Struct("<BBI")
_RESTORE = "restore from another tier or an older step"


def read_raw_frames(storage, record, frames: range, buf: np.ndarray, key: str, verify: bool = True) -> None:
    """Fill ``buf`` (uint8, the raw bytes of ``frames`` of ``record``) from ``storage``, frame by frame."""
    head = bytearray(RAW_HEAD.size)
    base = frames.start * record.frame_step if len(frames) else 0
    for i, at, stored_len, start, end in record.frame_slices(frames):
        where = f"frame {i} of {key!r} in {storage.url_of(record.file)}"
        dest = buf[start - base : end - base]
        got = storage.read_range_into(record.file, at, head)
        planes, mode, length = RAW_HEAD.unpack(head) if got == len(head) else (0, -1, -1)
        if planes != 1 or mode != MODE_RAW or length != end - start or stored_len != len(head) + length:
            raise CorruptCheckpointError(f"{where} is not a raw frame of {end - start} bytes: the file is corrupted; {_RESTORE}")
        if storage.read_range_into(record.file, at + len(head), dest) != length:
            raise CorruptCheckpointError(f"data file {storage.url_of(record.file)} is truncated in {where}; {_RESTORE}")
        if verify and checksum((head, dest)) != record.frame_sums[i]:
            raise CorruptCheckpointError(f"checksum mismatch in {where}: the file is corrupted; {_RESTORE}")
