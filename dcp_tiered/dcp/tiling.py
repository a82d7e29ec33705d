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

import bisect
import itertools
import math
from collections.abc import Sequence

#: Cells of the boundary grid allowed per chunk (and at least :data:`MIN_CELLS` in all) before a layout
#: counts as too irregular to check: the work and the memory stay linear in the chunks.
CELLS_PER_CHUNK = 64
MIN_CELLS = 1 << 16

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


def tiling_problem(size: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` (offsets, sizes; each inside ``size``) do not tile a tensor of ``size`` exactly, or None."""
    total = math.prod(size)
    volume = sum(math.prod(n) for _, n in boxes)
    if volume != total:
        return f"the chunks cover {volume} of its {total} elements"
    full = [(tuple(o), tuple(n)) for o, n in boxes if math.prod(n)]
    if len(full) <= 1 or not size:
        return None  # one chunk of the full volume inside the tensor is the tensor
    cuts = [sorted({0, d, *(o[k] for o, _ in full), *(o[k] + n[k] for o, n in full)}) for k, d in enumerate(size)]
    shape = [len(c) - 1 for c in cuts]
    cells = math.prod(shape)
    limit = max(CELLS_PER_CHUNK * len(full), MIN_CELLS)
    if cells > limit:
        return (f"the chunk layout is too irregular to check: {len(full)} chunks cut it into {cells} cells, over "
                f"{limit}; DCP writes grid layouts")
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    covered = bytearray(cells)
    for off, n in full:
        spans = [range(bisect.bisect_left(c, o), bisect.bisect_left(c, o + m)) for c, o, m in zip(cuts, off, n)]
        for cell in itertools.product(*spans):
            flat = sum(i * s for i, s in zip(cell, strides))
            if covered[flat]:
                return f"chunks overlap (the one at {off} covers elements another chunk covers)"
            covered[flat] = 1
    return None
