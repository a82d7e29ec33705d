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


def split_tilings(size: np.ndarray, ndim: np.ndarray, nchunks: np.ndarray, offsets: np.ndarray,
                  sizes: np.ndarray) -> np.ndarray:
    """Per tensor, whether its chunks provably tile it as a split along dim 0, over the flat columns of
    many tensors at once (work linear in the chunks, a few array passes in all, not a few per tensor).

    ``size``: every tensor's dimensions, one after another; ``ndim`` and ``nchunks`` per tensor;
    ``offsets`` and ``sizes``: every chunk's, ``ndim`` entries each, tensor after tensor; all int64,
    each chunk inside its tensor.  Proven: every dimension but the first whole in each chunk, and the
    chunks' row ranges, in order, start at 0, each where the one before ends, and end at the tensor's
    rows; or a scalar with one chunk.  False means only "not proven": check that tensor with
    :func:`array_tiling_problem`."""
    tensors = len(ndim)
    ndim, nchunks = ndim.astype(np.int64), nchunks.astype(np.int64)
    ok = ((ndim >= 1) & (nchunks >= 1)) | ((ndim == 0) & (nchunks == 1))  # a scalar's one chunk is all of it
    dim_tensor = np.repeat(np.arange(tensors), ndim)
    ok &= np.bincount(dim_tensor[size == 0], minlength=tensors) == 0  # empty tensors: left to the exact check
    chunk_tensor = np.repeat(np.arange(tensors), nchunks)
    chunk_dims = ndim[chunk_tensor]
    entry_chunk = np.repeat(np.arange(len(chunk_tensor)), chunk_dims)
    first_entry = np.cumsum(chunk_dims) - chunk_dims
    k = np.arange(len(entry_chunk)) - first_entry[entry_chunk]
    tensor_dim = size[(np.cumsum(ndim) - ndim)[chunk_tensor[entry_chunk]] + k]
    partial = (k > 0) & ((offsets != 0) | (sizes != tensor_dim))
    ok &= np.bincount(chunk_tensor[entry_chunk[partial]], minlength=tensors) == 0
    rows = first_entry[chunk_dims > 0]
    o, n, t = offsets[rows], sizes[rows], chunk_tensor[chunk_dims > 0]
    order = np.lexsort((o, t))
    o, n, t = o[order], n[order], t[order]
    starts = np.r_[True, t[1:] != t[:-1]]
    ends = np.r_[t[1:] != t[:-1], True]
    bad = (n == 0) | (starts & (o != 0)) | (~starts & (o != np.r_[0, o[:-1] + n[:-1]]))
    bad |= ends & (o + n != size[(np.cumsum(ndim) - ndim)[t]])
    ok[t[bad]] = False
    return ok
