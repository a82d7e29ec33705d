"""The chunk checks of a format-2 item table: ``check_table_chunks`` checks every tensor's chunks over the
table's columns (inside the tensor, tiling it exactly) instead of one tensor at a time, so a crafted
table is refused as a format-1 pickle of the same chunks is."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from dcp_tiered import CompressedReader, CompressedWriter, CorruptCheckpointError
from dcp_tiered.codecs import checksum
from dcp_tiered.dcp.item_table import check_table_chunks, pack_items, unpack_items
from dcp_tiered.dcp.tiling import tiling_problem
from test_tiling import layouts

_MAGIC = b"\x00dcp_tiered.md1"


def _tensor(size, boxes):
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes])


@pytest.mark.parametrize("boxes, ok", [
    ([((0, 0), (4, 3)), ((4, 0), (4, 3))], True),                      # a split along dim 0
    ([((4, 0), (4, 3)), ((0, 0), (4, 3))], True),                      # in any order
    ([((0, 0), (8, 1)), ((0, 1), (8, 2))], True),                      # a split along dim 1: the exact check
    ([((0, 0), (4, 2)), ((0, 2), (4, 1)), ((4, 0), (4, 3))], True),    # a grid of another shape
    ([((0, 0), (4, 3)), ((0, 0), (4, 3))], False),                     # one chunk twice, the rows 4..8 never
    ([((0, 0), (4, 3)), ((3, 0), (4, 3)), ((7, 0), (1, 3))], False),   # overlapping rows, the volume right
    ([((0, 0), (4, 3)), ((4, 0), (3, 3))], False),                     # a gap
    ([((0, 0), (4, 3)), ((4, 0), (4, 3)), ((2, 0), (0, 3))], True),    # an empty chunk changes nothing
])
def test_item_table_chunks_are_checked_as_format_1_checks_them(boxes, ok):
    sdm = {"a": _tensor((5,), [((0,), (5,))]), "w": _tensor((8, 3), boxes), "s": _tensor((), [((), ())])}
    items = pack_items(sdm)
    assert unpack_items(items, "x") == sdm
    if ok:
        check_table_chunks(items, "x")
    else:
        with pytest.raises(CorruptCheckpointError, match="'w'"):
            check_table_chunks(items, "x")


def test_a_chunk_outside_its_tensor_in_the_item_table_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4, 3), "v": torch.zeros(2)}, storage_writer=CompressedWriter(path, sync_files=False),
             no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes()[:-len(_MAGIC) - 8])
    items = next(iter(md.storage_data.values()))["item_table"]
    width = len(items["offsets"]) // 3
    offsets = np.frombuffer(items["offsets"], dtype=f"<u{width}").astype(np.uint64)
    offsets[0] = 3  # w's chunk starts at row 3, 4 rows long: past the end of its 4 rows
    items["offsets"] = offsets.astype(f"<u{width}").tobytes()
    body = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    (path / ".metadata").write_bytes(body + _MAGIC + checksum((body,)).to_bytes(8, "little"))
    with pytest.raises(CorruptCheckpointError, match="outside its size"):
        CompressedReader(path)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_the_item_table_check_agrees_with_the_exact_one(layout):
    size, boxes = layout
    items = pack_items({"w": _tensor(size, boxes), "v": _tensor((3,), [((0,), (3,))])})
    try:
        unpack_items(items, "x")
        check_table_chunks(items, "x")
        refused = False
    except CorruptCheckpointError:
        refused = True
    assert refused == (tiling_problem(size, boxes) is not None), (size, boxes)


@pytest.mark.parametrize("offsets, sizes", [((-1,), (4,)), ((0,), (-4,))])
def test_a_negative_chunk_offset_or_size_is_refused_at_finish_naming_the_tensor(tmp_path, offsets, sizes):
    """A planner's chunk that starts before its tensor (or has a negative size) does not fit the table: the
    save fails before its commit with this package's error naming the tensor, not an ``OverflowError``."""
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_tiered import DcpTieredError

    assert pack_items({"w": _tensor((4,), [(offsets, sizes)])}) is None
    from torch.distributed.checkpoint.planner import SavePlan

    writer = CompressedWriter(tmp_path / "ck")
    writer.set_up_storage_writer(True)
    writer.prepare_global_plan([SavePlan([])])
    with pytest.raises(DcpTieredError, match="'w'"):
        writer.finish(Metadata({"w": _tensor((4,), [(offsets, sizes)])}), [])
    assert not (tmp_path / "ck" / ".metadata").exists()


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 3), st.integers(-3, 3))
def test_a_save_commits_only_chunk_layouts_its_readers_accept(layout, shifted, by):
    """Any chunk layout a planner may hand ``finish`` (grids, damaged ones, a chunk shifted, even before the
    tensor or past it): the save refuses it before its commit, or its readers accept its layout.  (No rank
    wrote here, so a committed layout's chunks have no records, which readers refuse next.)"""
    import tempfile

    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    from dcp_tiered import DcpTieredError

    size, boxes = layout
    if boxes and by:
        i = shifted % len(boxes)
        offsets, sizes = boxes[i]
        boxes = [*boxes[:i], ((offsets[0] + by, *offsets[1:]), sizes), *boxes[i + 1:]]
    with tempfile.TemporaryDirectory() as root:
        writer = CompressedWriter(root)
        writer.set_up_storage_writer(True)
        writer.prepare_global_plan([SavePlan([])])
        try:
            writer.finish(Metadata({"w": _tensor(size, boxes)}), [])
        except DcpTieredError:
            return
        with pytest.raises(CorruptCheckpointError, match="has no storage record"):
            CompressedReader(root).read_metadata()


class _DroppingWriter(CompressedWriter):
    """A writer whose gathered results lost one item's records (a rank's, say): what finish must not commit."""

    def finish(self, metadata, results):
        return super().finish(metadata, [[wr for wr in rs if wr.index.fqn != "b"] for rs in results])


def test_a_save_missing_an_items_records_is_refused_before_its_commit(tmp_path):
    """Readers refuse a ``.metadata`` with a chunk that no record holds; finish refuses it first, naming it."""
    from dcp_tiered import DcpTieredError
    from failures import failure_of

    state = {"a": torch.ones(4), "b": torch.zeros(2, 3)}
    exc = failure_of(lambda: dcp.save(state, storage_writer=_DroppingWriter(tmp_path / "ck"), no_dist=True))
    assert isinstance(exc, DcpTieredError) and "chunk (0, 0) of tensor 'b' has no storage record" in str(exc), exc
    assert not (tmp_path / "ck" / ".metadata").exists()
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ok"), no_dist=True)  # the same save, whole
    CompressedReader(tmp_path / "ok").read_metadata()
