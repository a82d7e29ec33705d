"""``planner_data`` paths are checked like every other table: no empty path, none that does not spell
its key, no item inside another, no key that is not an item (a crafted table made ``convert`` exit 70 on an
empty path and silently drop a tensor on colliding paths)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader, CompressedWriter, CorruptCheckpointError
from dcp_tiered.dcp.metadata_io import unpack_metadata


def _saved(path):
    dcp.save({"a": {"w": torch.ones(3), "v": torch.zeros(2)}, "n": 5},
             storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    return unpack_metadata((path / ".metadata").read_bytes())


def _inside_a_leaf(md):
    """``n.x`` listed as a second item, with its path under the leaf ``n``."""
    md.state_dict_metadata["n.x"] = md.state_dict_metadata["n"]
    md.planner_data["n.x"] = ("n", "x")


@pytest.mark.parametrize("edit, needle", [
    (lambda md: md.planner_data.update({"a.w": ()}), "not a path"),
    (lambda md: md.planner_data.update({"a.w": md.planner_data["a.v"]}), "does not spell"),
    (_inside_a_leaf, "inside"),
    (lambda md: md.planner_data.update({"ghost": ("g",)}), "does not list"),
    (lambda md: md.planner_data.update({"a.w": ("a",) * 65}), "at most 64"),
])
def test_crafted_planner_paths_are_refused(tmp_path, edit, needle):
    md = _saved(tmp_path / "ckpt")
    edit(md)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=needle):
        CompressedReader(tmp_path / "ckpt")


def test_real_planner_paths_pass(tmp_path):
    md = _saved(tmp_path / "ckpt")
    assert md.planner_data and all(md.planner_data.values())
    CompressedReader(tmp_path / "ckpt")


def test_sparse_integer_keys_convert(tmp_path):
    """An optimizer's raw state keyed by parameter id may skip ids (parameters without state): DCP makes
    mapping keys names, so only lists carry indices, and those have no gaps; such a checkpoint converts."""
    from dcp_tiered.inspect import convert, load_any

    path = tmp_path / "ckpt"
    state = {"state": {0: {"m": torch.ones(2)}, 2: {"m": torch.full((2,), 3.0)}}, "l": [torch.zeros(1), 4]}
    dcp.save(state, storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    convert(path, tmp_path / "out.pt")
    loaded = load_any(tmp_path / "out.pt")
    assert torch.equal(loaded["state"]["2"]["m"], torch.full((2,), 3.0)) and loaded["l"][1] == 4


def test_an_empty_dict_in_a_list_leaves_a_gap_that_still_opens(tmp_path):
    """DCP writes no path for an empty dict inside a list: index 0 of ``l`` has none.  Such a
    checkpoint, saved by this package or by stock DCP, is no corrupt one: it opens, and its items load
    (DCP itself cannot load ``l`` back into a state dict holding that empty dict: 'Missing key l.0')."""
    for writer in (CompressedWriter(tmp_path / "ours", sync_files=False), dcp.FileSystemWriter(str(tmp_path / "stock"))):
        dcp.save({"l": [{}, torch.ones(2)], "x": torch.zeros(1)}, storage_writer=writer, no_dist=True)
    for name in ("ours", "stock"):
        assert CompressedReader(tmp_path / name).read_metadata().planner_data["l.1"] == ("l", 1)
        into = {"x": torch.ones(1)}
        dcp.load(into, storage_reader=CompressedReader(tmp_path / name), no_dist=True)
        assert torch.equal(into["x"], torch.zeros(1))


def test_a_state_nested_deeper_than_readers_accept_is_refused_before_the_commit(tmp_path):
    """A dict 70 levels deep saved as readers then refused it: the save fails and commits nothing."""
    from dcp_tiered import UnsupportedFormatError
    from dcp_tiered.tiers.events import root_cause

    deep: dict = {"w": torch.ones(2)}
    for _ in range(70):
        deep = {"d": deep}
    with pytest.raises(BaseException) as info:  # DCP wraps it in its CheckpointException
        dcp.save(deep, storage_writer=CompressedWriter(tmp_path / "ck", sync_files=False), no_dist=True)
    assert isinstance(root_cause(info.value), UnsupportedFormatError) and "at most 64 levels" in str(root_cause(info.value))
    assert not (tmp_path / "ck" / ".metadata").exists()


def test_convert_of_a_list_with_an_empty_dict_says_why_it_cannot_rebuild(tmp_path):
    """DCP's rebuild leaves None where the empty dict was and fails 'Missing key' (a builtin, found by the
    harness on a crafted path): convert refuses first, naming the list, the slot and the way out."""
    from dcp_tiered import UnsupportedFormatError
    from dcp_tiered.inspect import convert

    dcp.save({"l": [{}, torch.ones(2)]}, storage_writer=CompressedWriter(tmp_path / "ck", sync_files=False), no_dist=True)
    with pytest.raises(UnsupportedFormatError, match=r"'l' has no item at \[0\].*dcp.load"):
        convert(tmp_path / "ck", tmp_path / "out.pt")
