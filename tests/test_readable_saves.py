"""A save commits only what its readers accept: a state dict that would give a ``.metadata`` or a record the
readers refuse is refused by the save, before its commit, naming the item and what to do (found by a hostile
review: each of these committed, and every reader then refused the checkpoint as damaged)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_tiered import CompressedReader, CompressedWriter, DcpTieredError
from failures import failure_of


class _ReshapingPlanner(DefaultSavePlanner):
    """Resolves each tensor to a flat view: bytes of the right length, in a shape other than its chunk's."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data.reshape(-1) if isinstance(data, torch.Tensor) else data


@pytest.mark.parametrize("state, planner, says", [
    ({"a": torch.zeros([1] * 65)}, None, r"'a' has 65 dimensions"),
    ({"a": torch.empty(0, 2**62)}, None, r"'a' has a dimension of 4611686018427387904"),
    ({"b": b"\x01" * ((256 << 20) + 1)}, None, r"non-tensor item 'b' is \d+ bytes"),
    ({"a": torch.ones(3, 2)}, _ReshapingPlanner(), r"'a' to a tensor of shape \(6,\) for its chunk of shape \(3, 2\)"),
], ids=["65-dims", "huge-empty-dim", "object-over-256-MiB", "planner-reshapes"])
def test_a_state_its_readers_would_refuse_is_refused_by_the_save(tmp_path, state, planner, says):
    import re

    exc = failure_of(lambda: dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), planner=planner,
                                      no_dist=True))
    assert isinstance(exc, DcpTieredError) and re.search(says, str(exc)), exc
    assert "nothing was committed" in str(exc)
    assert not (tmp_path / "ck" / ".metadata").exists()


def test_the_largest_states_readers_accept_save_and_load(tmp_path):
    """The limits themselves save and load back: 64 dimensions, an object of just under the limit."""
    state = {"a": torch.arange(2.0).reshape([2] + [1] * 63), "b": b"\x02" * (1 << 20)}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    back = {"a": torch.zeros_like(state["a"]), "b": b""}
    dcp.load(back, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(back["a"], state["a"]) and back["b"] == state["b"]


class _MetadataPlanner(DefaultSavePlanner):
    """Changes the global metadata as a custom planner may: ``change(metadata)``."""

    def __init__(self, change) -> None:
        super().__init__()
        self.change = change

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        self.change(metadata)
        return plans, metadata


def _size_as_list(metadata) -> None:
    metadata.state_dict_metadata["a"].size = [3, 2]


def _declared_bfloat16(metadata) -> None:
    from torch.distributed.checkpoint.metadata import TensorProperties

    metadata.state_dict_metadata["a"].properties = TensorProperties(dtype=torch.bfloat16)


def _reshaped_same_numel(metadata) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    entry = metadata.state_dict_metadata["a"]
    entry.size, entry.chunks = torch.Size([2, 3]), [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))]


@pytest.mark.parametrize("change, says", [
    (lambda md: setattr(md, "version", 7), "version is not a string"),
    (_size_as_list, r"tensor 'a' has an invalid size \[3, 2\]"),
    (_declared_bfloat16, r"'a' in .* holds float32 values, but the checkpoint's tensor table says bfloat16"),
    (_reshaped_same_numel, r"'a' in .* has shape \(3, 2\), but the checkpoint's tensor table says \(2, 3\)"),
], ids=["version-int", "size-list", "dtype-changed", "shape-changed-same-numel"])
def test_metadata_a_planner_broke_is_refused_before_the_commit(tmp_path, change, says):
    import re

    exc = failure_of(lambda: dcp.save({"a": torch.ones(3, 2)}, storage_writer=CompressedWriter(tmp_path / "ck"),
                                      planner=_MetadataPlanner(change), no_dist=True))
    assert isinstance(exc, DcpTieredError) and re.search(says, str(exc)) and "nothing was committed" in str(exc), exc
    assert not (tmp_path / "ck" / ".metadata").exists()


class _SecondChunkWriter(CompressedWriter):
    """A writer handed a tensor table with an empty second chunk at the offset of another (a planner's
    doing; DCP's plan check accepts it): one record would stand for both, and loads would read the wrong one."""

    def finish(self, metadata, results):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        metadata.state_dict_metadata["a"].chunks.append(ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([0, 4])))
        return super().finish(metadata, results)


def test_two_chunks_at_one_offset_are_refused_before_the_commit(tmp_path):
    exc = failure_of(lambda: dcp.save({"a": torch.ones(6, 4)}, storage_writer=_SecondChunkWriter(tmp_path / "ck"),
                                      no_dist=True))
    assert isinstance(exc, DcpTieredError) and "tensor 'a' has two chunks at offset (0, 0)" in str(exc), exc
    assert not (tmp_path / "ck" / ".metadata").exists()


class _OffsetBytesWriter(CompressedWriter):
    """Results whose non-tensor item's index carries an offset (a custom planner's): loads look it up without one."""

    def finish(self, metadata, results):
        import dataclasses

        from torch.distributed.checkpoint.metadata import MetadataIndex

        def moved(wr):
            if wr.index.fqn != "o.x":
                return wr
            return dataclasses.replace(wr, index=MetadataIndex("o.x", torch.Size([0])))
        return super().finish(metadata, [[moved(wr) for wr in rs] for rs in results])


def test_a_non_tensor_record_with_an_offset_is_refused_before_the_commit(tmp_path):
    exc = failure_of(lambda: dcp.save({"a": torch.ones(2), "o": {"x": 1}}, no_dist=True,
                                      storage_writer=_OffsetBytesWriter(tmp_path / "ck")))
    assert isinstance(exc, DcpTieredError) and "non-tensor item 'o" in str(exc) and "no storage record" in str(exc), exc
    assert not (tmp_path / "ck" / ".metadata").exists()
