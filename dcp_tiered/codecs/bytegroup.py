"""The byte-group filter: regroup element bytes into planes (all byte 0s, all byte 1s, ...).

In floating-point data only the exponent plane carries redundancy; grouping lets the
codec see it as one low-entropy stream while mantissa planes can be stored raw.  For
16-bit floats the sign bit is first rotated to the bottom so that the high byte holds
the exponent alone (worth about 2 points of ratio on bf16).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

_scratch = threading.local()


def _scratch_buffer(nbytes: int) -> np.ndarray:
    # Strided writes into freshly allocated pages run at a fraction of the speed of writes
    # into touched memory, so planes are interleaved in a reused per-thread buffer and the
    # result is copied out sequentially.
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _scratch.buf = np.zeros(nbytes, dtype=np.uint8)
    return buf[:nbytes]

FILTER_NONE = "none"
FILTER_BYTEGROUP = "bytegroup"
FILTER_BYTEGROUP_SIGNROT = "bytegroup-signrot"
FILTERS = (FILTER_NONE, FILTER_BYTEGROUP, FILTER_BYTEGROUP_SIGNROT)


def filter_for(is_float: bool, itemsize: int, enabled: bool = True) -> str:
    """Pick the filter for an element type: byte-group floats, rotate the sign of 16-bit ones."""
    if not enabled or not is_float or itemsize < 2:
        return FILTER_NONE
    return FILTER_BYTEGROUP_SIGNROT if itemsize == 2 else FILTER_BYTEGROUP


def plane_count(filter_name: str, itemsize: int) -> int:
    """Number of planes a frame splits into under ``filter_name``."""
    return 1 if filter_name == FILTER_NONE else itemsize


def split_planes(raw: np.ndarray, filter_name: str, itemsize: int) -> list[np.ndarray]:
    """Split a uint8 frame into contiguous planes (the frame itself when unfiltered)."""
    if filter_name == FILTER_NONE:
        return [raw]
    if filter_name == FILTER_BYTEGROUP_SIGNROT:
        u = raw.view(np.uint16)
        raw = ((u << np.uint16(1)) | (u >> np.uint16(15))).view(np.uint8)
    planes = np.empty((itemsize, raw.size // itemsize), dtype=np.uint8)
    # One transposing copy is ~5x faster than a strided copy per plane in numpy; the
    # reverse direction is fastest per plane (see merge_planes).
    np.copyto(planes, raw.reshape(-1, itemsize).T)
    return list(planes)


def merge_planes(planes: Sequence[object], filter_name: str, itemsize: int, out: np.ndarray) -> None:
    """Interleave decoded planes back into ``out`` (uint8, the frame's raw length)."""
    if filter_name == FILTER_NONE:
        out[:] = np.frombuffer(planes[0], dtype=np.uint8)
        return
    work = _scratch_buffer(out.nbytes)
    grid = work.reshape(-1, itemsize)
    for k in range(itemsize):
        grid[:, k] = np.frombuffer(planes[k], dtype=np.uint8)
    if filter_name == FILTER_BYTEGROUP_SIGNROT:
        u = work.view(np.uint16)
        np.bitwise_or(u >> np.uint16(1), u << np.uint16(15), out=out.view(np.uint16))
    else:
        out[:] = work
