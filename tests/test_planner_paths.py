"""``planner_data`` paths are checked like every other table: no empty path, no two items on one path,
no item inside another, no key that is not an item (a crafted table made ``convert`` exit 70 on an
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


@pytest.mark.parametrize("edit, needle", [
    (lambda pd: pd.update({"a.w": ()}), "not a path"),
    (lambda pd: pd.update({"a.w": pd["a.v"]}), "the same path"),
    (lambda pd: pd.update({"a.w": (*pd["n"], "x")}), "inside"),
    (lambda pd: pd.update({"ghost": ("g",)}), "does not list"),
    (lambda pd: pd.update({"a.w": ("a",) * 65}), "at most 64"),
])
def test_crafted_planner_paths_are_refused(tmp_path, edit, needle):
    md = _saved(tmp_path / "ckpt")
    edit(md.planner_data)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=needle):
        CompressedReader(tmp_path / "ckpt")


def test_real_planner_paths_pass(tmp_path):
    md = _saved(tmp_path / "ckpt")
    assert md.planner_data and all(md.planner_data.values())
    CompressedReader(tmp_path / "ckpt")
