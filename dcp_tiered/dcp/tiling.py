"""Whether the chunks of a tensor tile it exactly: every element in exactly one chunk.

A ``.metadata`` is untrusted input.  Its chunk table tells ``dcp.load`` which parts of each tensor
exist; chunks that overlap while the total volume still matches leave part of the tensor unwritten
(old values, or uninitialized memory under ``torch.empty``), and no checksum sees it.

Exact at any chunk count, in work linear in the chunks for the layouts DCP writes: the distinct
chunk boundaries of each dimension cut the tensor into a grid of cells, and each chunk must cover
its own cells, none covered twice (with the total volume equal to the tensor's, that is an exact
tiling).  A sharded tensor's chunks are a grid (FSDP, TP and their products), so the cells number
about the chunks; a layout whose boundaries cut far more cells than there are chunks cannot come
from DCP and is refused rather than walked (:data:`CELLS_PER_CHUNK`).  Torch-free: plain tuples.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

#: Cells of the boundary grid allowed per chunk (and at least :data:`MIN_CELLS` in all) before a layout
#: counts as too irregular to check: the work and the memory stay linear in the chunks.
CELLS_PER_CHUNK = 64
MIN_CELLS = 1 << 22

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


def tiling_problem(size: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` (offsets, sizes; each inside ``size``) do not tile a tensor of ``size`` exactly, or None."""
    dims = len(size)
    if not boxes:
        return array_tiling_problem(size, np.zeros((0, dims), dtype=np.int64), np.zeros((0, dims), dtype=np.int64))
    try:
        offsets = np.array([tuple(o) for o, _ in boxes], dtype=np.int64).reshape(len(boxes), dims)
        sizes = np.array([tuple(n) for _, n in boxes], dtype=np.int64).reshape(len(boxes), dims)
    except OverflowError:  # a dimension past int64: counted exactly in Python
        offsets = sizes = None
    if offsets is None:
        total, volume = math.prod(size), sum(math.prod(n) for _, n in boxes)
        if volume != total:
            return f"the chunks cover {volume} of its {total} elements"
        return "the chunk layout is too large to check: a dimension exceeds 2**63"
    return array_tiling_problem(size, offsets, sizes)


#: Tensors of fewer elements have their chunks' volumes summed in int64 without overflow (at most
#: :data:`~dcp_tiered.dcp.format.MAX_METADATA_RECORDS` chunks of at most the tensor's volume each).
_EXACT = 1 << 40


def array_tiling_problem(size: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> str | None:
    """:func:`tiling_problem` over the chunks' offsets and sizes as ``(chunks, dims)`` int64 arrays, each
    chunk inside ``size``."""
    total = math.prod(size)
    if total < _EXACT:
        volumes = np.prod(sizes, axis=1)
        volume = int(volumes.sum(dtype=np.int64))
    else:  # exact in Python ints (only tensors of 2**40 elements or more)
        volumes = np.array([math.prod(n) != 0 for n in sizes.tolist()], dtype=bool)
        volume = sum(math.prod(n) for n in sizes.tolist())
    if volume != total:
        return f"the chunks cover {volume} of its {total} elements"
    keep = volumes != 0
    offsets, sizes = offsets[keep], sizes[keep]
    if len(offsets) <= 1 or not size:
        return None  # one chunk of the full volume inside the tensor is the tensor
    ends = offsets + sizes
    cuts = [np.unique(np.concatenate(([0, d], offsets[:, k], ends[:, k]))) for k, d in enumerate(size)]
    shape = [len(c) - 1 for c in cuts]
    cells = math.prod(shape)
    limit = max(CELLS_PER_CHUNK * len(offsets), MIN_CELLS)
    if cells > limit:
        return (f"the chunk layout is too irregular to check: {len(offsets)} chunks cut it into {cells} cells, over "
                f"{limit}; DCP writes grid layouts")
    first = np.stack([np.searchsorted(c, offsets[:, k]) for k, c in enumerate(cuts)], axis=1)
    last = np.stack([np.searchsorted(c, ends[:, k]) for k, c in enumerate(cuts)], axis=1)
    counts = _coverage(first, last, shape) if len(shape) <= MAX_CORNER_DIMS else _coverage_by_cell(first, last, shape)
    if counts is None or counts.max(initial=0) > 1:
        where = f" at {_corner(int(np.argmax(counts > 1)), shape, cuts)}" if counts is not None else ""
        return f"chunks overlap (two cover the elements{where})"
    return None


#: Up to this many dimensions, coverage is counted with a difference array (2^dims corners per chunk).
MAX_CORNER_DIMS = 8


def _coverage(first: np.ndarray, last: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """How many chunks cover each grid cell: +1/-1 at each chunk's corners, summed along every axis
    (vectorized: 2^dims scatter-adds over the chunks, then one pass over the cells)."""
    dims, outer = len(shape), [n + 1 for n in shape]
    strides = np.array([math.prod(outer[k + 1:]) for k in range(dims)], dtype=np.int64)
    diff = np.zeros(math.prod(outer), dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=dims):
        flat = np.where(np.array(corner, dtype=bool), last, first) @ strides
        counts = np.bincount(flat, minlength=diff.size)
        diff += -counts if sum(corner) % 2 else counts
    diff = diff.reshape(outer)
    for k in range(dims):
        np.cumsum(diff, axis=k, out=diff)
    return diff[tuple(slice(0, n) for n in shape)].ravel()


def _coverage_by_cell(first: np.ndarray, last: np.ndarray, shape: Sequence[int]) -> "np.ndarray | None":
    """:func:`_coverage` for tensors of many dimensions: each chunk's cells marked in turn; None at the
    first cell covered twice."""
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    covered = np.zeros(math.prod(shape), dtype=np.uint8)
    for a, b in zip(first.tolist(), last.tolist()):
        for cell in itertools.product(*(range(i, j) for i, j in zip(a, b))):
            at = sum(c * st for c, st in zip(cell, strides))
            if covered[at]:
                return None
            covered[at] = 1
    return covered


def _corner(flat: int, shape: Sequence[int], cuts: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The element offsets where grid cell ``flat`` starts."""
    out = []
    for k in reversed(range(len(shape))):
        flat, i = divmod(flat, shape[k])
        out.append(int(cuts[k][i]))
    return tuple(reversed(out))
