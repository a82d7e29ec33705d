"""Hostile replica markers, record names and links, found by the hostile review of the re-cut."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedWriter, UnsafeCheckpointError
from dcp_tiered.cli.__main__ import main
from dcp_tiered.dcp.metadata_io import unpack_metadata
from dcp_tiered.names import rank_of_file
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.replicas.markers import marker_files, vouches


def test_rank_numbers_are_short_ascii_digits():
    assert rank_of_file("__12_0.distcp") == 12
    assert rank_of_file("__" + "1" * 5000 + "_0.distcp") is None  # int() would raise past 4300 digits
    assert rank_of_file("__\u0661_0.distcp") is None  # ARABIC-INDIC DIGIT ONE


@pytest.mark.parametrize("size", [-1, "10", True, 9.9, None, 10 ** 30 * -1])
def test_a_marker_entry_with_a_size_that_is_no_byte_count_is_malformed(size):
    marker = {"owner": 1, "save_id": "s", "files": [{"file": "__1_0.distcp", "size": size, "xxh3": "0"}]}
    assert marker_files(marker, 1) == {}
    assert not vouches(marker, 1, "s", files={})  # never vouches for a file that is not there


def test_remove_tree_never_goes_through_a_link(tmp_path):
    (tmp_path / "target" / "sub").mkdir(parents=True)
    (tmp_path / "target" / "a.txt").write_text("precious")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        Storage(str(tmp_path / "link")).remove_tree()
    assert (tmp_path / "target" / "a.txt").read_text() == "precious"


def test_ls_replicas_refuses_a_world_no_job_runs(tmp_path, capsys):
    path = tmp_path / "0" / "step_000000001"
    dcp.save({"w": torch.ones(4)}, storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    md = unpack_metadata((path / ".metadata").read_bytes())
    for record in md.storage_data.values():
        record["file"] = "__999999_0.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    (path / ".replica-1.json").write_text(json.dumps({"owner": 1, "files": []}))
    rc = main(["ls", "--local-path", str(tmp_path / "{rank}"), "--replicas", "2", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "more ranks than a job runs" in out.out, out.out
