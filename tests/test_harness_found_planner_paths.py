"""Found by ``tools/crash_harness --hostile`` (class ``paths``): ``planner_data`` paths that are each a
non-empty tuple of names and indices, distinct and not nested, but do not spell their key, or hold a
negative or huge index, passed ``_check_planner_data`` (dcp_tiered/dcp/metadata_io.py), and
``dcp_tiered.inspect.convert`` (DCP's ``_EmptyStateDictLoadPlanner`` rebuilding the nested dict with
``set_element``) then raised builtin errors, dropped a tensor silently, or built a list of that many slots.
Each is now a ``CorruptCheckpointError``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedWriter, CorruptCheckpointError
from dcp_tiered.dcp.metadata_io import unpack_metadata
from dcp_tiered.inspect import convert
from dcp_tiered.tiers.events import root_cause


def _crafted(tmp_path, edit):
    path = tmp_path / "ckpt"
    dcp.save({"a": {"w": torch.ones(3)}, "l": [torch.zeros(2), torch.arange(2)], "n": 5},
             storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    md = unpack_metadata((path / ".metadata").read_bytes())
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return path


def _spelled(md, old: str, new_path: tuple) -> None:
    """Item ``old`` renamed to the key ``new_path`` spells, with that path: only the index lies."""
    new = ".".join(map(str, new_path))
    md.state_dict_metadata = {new if k == old else k: v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {(type(i)(new, i.offset, i.index) if i.fqn == old else i): r for i, r in md.storage_data.items()}
    md.planner_data = {(new if k == old else k): (new_path if k == old else v) for k, v in md.planner_data.items()}


def _convert_refused(path, tmp_path) -> None:
    """``convert`` refuses ``path`` with ``CorruptCheckpointError``."""
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        convert(path, tmp_path / "out.pt")
    assert isinstance(root_cause(info.value), CorruptCheckpointError), repr(root_cause(info.value))


@pytest.mark.parametrize("edit", [
    lambda md: md.planner_data.update({"a.w": ("b", "x")}),  # RuntimeError: Missing key in checkpoint state_dict: b.x
    lambda md: md.planner_data.update({"l.1": ("l", 3)}),  # ValueError: Invalid checkpoint metadata for l.1
    lambda md: md.planner_data.update({"l.1": ("l", "1")}),  # TypeError: list indices must be integers
    lambda md: md.planner_data.update({"l.1": ("l", -1)}),  # converts, without l.1
    lambda md: md.planner_data.update({"l.0": ("l", -2)}),  # IndexError: list assignment index out of range
    lambda md: md.planner_data.update({"l.0": ("l", 1), "l.1": ("l", 0)}),  # converts, l.0 int64 and l.1 float32
], ids=["other-name", "gap", "str-index", "negative-drops-a-tensor", "negative-index-error", "swap-changes-dtypes"])
def test_a_path_that_does_not_spell_its_key_is_refused(tmp_path, edit):
    path = _crafted(tmp_path, edit)
    _convert_refused(path, tmp_path)


def test_an_index_past_the_items_is_refused(tmp_path):
    path = _crafted(tmp_path, lambda md: _spelled(md, "l.1", ("l", 10**5)))
    _convert_refused(path, tmp_path)
