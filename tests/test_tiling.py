"""The chunks of a tensor must tile it exactly, at every chunk count, in time linear in the chunks.

Issue: above 512 chunks only the total volume was compared, so a ``.metadata`` listing chunk 0
twice and leaving chunk 1 out passed every check and loaded, leaving part of the tensor unwritten.
Below 512 the check was pairwise: a crafted 251 KB ``.metadata`` took over a minute to refuse.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from isolated import run_isolated
from dcp_tiered import CompressedReader, CompressedWriter, CorruptCheckpointError
from dcp_tiered.dcp.metadata_io import unpack_metadata
from dcp_tiered.dcp.tiling import tiling_problem


def brute_force(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether ``boxes`` tile ``size`` exactly: every element covered once."""
    grid = np.zeros(size, dtype=np.int64)
    for off, n in boxes:
        grid[tuple(slice(o, o + k) for o, k in zip(off, n))] += 1
    return bool((grid == 1).all())


@st.composite
def layouts(draw):
    """A tensor size and boxes inside it: a real grid tiling, maybe damaged (a box dropped, duplicated, moved)."""
    dims = draw(st.integers(1, 3))
    size = tuple(draw(st.integers(1, 6)) for _ in range(dims))
    cuts = [sorted(set(draw(st.lists(st.integers(1, s - 1), max_size=3))) if s > 1 else []) for s in size]
    spans = [list(zip([0, *c], [*c, s])) for c, s in zip(cuts, size)]
    boxes = [(tuple(a for a, _ in cell), tuple(b - a for a, b in cell)) for cell in itertools.product(*spans)]
    change = draw(st.sampled_from(["none", "drop", "dup", "move", "swap_dup", "empty"]))
    if change == "drop" and len(boxes) > 1:
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    elif change == "dup":
        boxes.append(boxes[draw(st.integers(0, len(boxes) - 1))])
    elif change == "swap_dup" and len(boxes) > 1:  # same volume: one box twice, another gone
        i, j = draw(st.permutations(range(len(boxes))))[:2]
        boxes[j] = boxes[i]
    elif change == "move":
        i = draw(st.integers(0, len(boxes) - 1))
        off, n = boxes[i]
        k = draw(st.integers(0, dims - 1))
        new = list(off)
        new[k] = draw(st.integers(0, size[k] - n[k]))
        boxes[i] = (tuple(new), n)
    elif change == "empty":
        boxes.append((tuple(0 for _ in size), tuple(0 for _ in size)))
    return size, boxes


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_tiling_problem_agrees_with_brute_force(layout):
    size, boxes = layout
    problem = tiling_problem(size, boxes)
    assert (problem is None) == brute_force(size, boxes), (size, boxes, problem)


def test_many_chunks_each_once_pass_and_a_duplicate_in_place_of_another_is_refused():
    boxes = [((i, 0), (1, 8)) for i in range(4096)]
    assert tiling_problem((4096, 8), boxes) is None
    boxes[1] = boxes[0]
    assert "overlap" in tiling_problem((4096, 8), boxes)


def test_a_2d_grid_of_many_chunks_is_checked_in_linear_work():
    rows, cols = 512, 512
    boxes = [((r, c), (1, 1)) for r in range(rows) for c in range(cols)]
    assert tiling_problem((rows, cols), boxes) is None


def test_a_layout_too_irregular_to_check_is_refused_not_walked():
    # staircase: n boxes whose boundaries make n^2 grid cells
    n = 3000
    boxes = [((i, 0), (1, i + 1)) for i in range(n)] + [((i, i + 1), (1, n - i - 1)) for i in range(n - 1)]
    problem = tiling_problem((n, n), boxes)
    assert problem is not None and "too irregular" in problem


def _metadata_with_chunks(path, n: int, damage: bool):
    """A real committed checkpoint of one tensor saved as ``n`` row chunks; ``damage``: chunk 0 listed
    twice in the metadata and chunk 1 left out (records left as they were)."""
    import pickle

    t = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
    dcp.save({"w": t}, storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    md = unpack_metadata((path / ".metadata").read_bytes())
    tmd = md.state_dict_metadata["w"]
    tmd.chunks = [ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 4])) for i in range(n)]
    if damage:
        tmd.chunks[1] = tmd.chunks[0]
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return t


@pytest.mark.parametrize("n", [8, 600])
def test_a_duplicated_chunk_in_place_of_another_is_refused_at_any_count(tmp_path, n):
    _metadata_with_chunks(tmp_path / "ckpt", n, damage=True)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        CompressedReader(tmp_path / "ckpt")


def test_crafted_metadata_with_many_chunks_is_refused_quickly(tmp_path):
    """Thousands of chunks per tensor: the check is linear, so refusing (or passing) takes seconds."""
    path = tmp_path / "ckpt"
    _metadata_with_chunks(path, 4, damage=False)
    res = run_isolated(f"""
        import pickle, time, torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from dcp_tiered.dcp.metadata_io import decode_metadata, unpack_metadata
        from dcp_tiered.errors import CorruptCheckpointError
        md = unpack_metadata(open({str(path / '.metadata')!r}, 'rb').read())
        n = 20000
        tmd = md.state_dict_metadata['w']
        tmd.size = torch.Size([n, 4])
        tmd.chunks = [ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 4])) for i in range(n)]
        tmd.chunks[7] = tmd.chunks[3]
        try:
            decode_metadata(pickle.dumps(md), 'crafted')
            emit('loaded')
        except CorruptCheckpointError as e:
            emit('refused: ' + str(e))
    """, timeout=120)
    assert res.returncode == 0 and not res.timed_out, res.describe()
    assert res.result.startswith("refused") and ("overlap" in res.result or "cover" in res.result), res.result
