"""Committed checkpoints of every released format version still load, bit for bit.

tests/golden/v1/ was written once by tests/golden/make_v1.py, tests/golden/v2/ (records in a
columnar table) by tests/golden/make_v2.py, tests/golden/v3/ (names as one string, item and path
tables) by tests/golden/make_v3.py; they are never regenerated."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader
from dcp_tiered.dcp.metadata_io import decode_metadata
from dcp_tiered.dcp.record_table import is_table

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from values import golden_state  # noqa: E402

V2 = ["zstd_3", "zstd_bf16_downcast"]
V3 = [f"v3/{name}" for name in V2]


def _assert_loads_exactly(path: Path) -> None:
    want = golden_state()
    got = {"model": {n: torch.zeros_like(t) for n, t in want["model"].items()}, "step": 0,
           "extra": {"name": "", "lr": 0.0, "sizes": []}}
    dcp.load(got, storage_reader=CompressedReader(path), no_dist=True)
    for n, t in want["model"].items():
        expected = t
        if path.name.endswith("bf16_downcast") and t.dtype in (torch.float32, torch.float64):
            expected = t.to(torch.bfloat16).to(t.dtype)  # stored in bf16, original dtype back on load
        assert got["model"][n].dtype == t.dtype, n
        assert torch.equal(got["model"][n], expected), f"{path}: {n} differs"
    assert got["step"] == 1234
    assert got["extra"] == {"name": "golden-v1", "lr": 0.001, "sizes": [1, 2, 3]}


@pytest.mark.parametrize("name", ["none", "lz4", "zstd_3", "zstd_bf16_downcast"])
def test_golden_v1_checkpoint_loads_exactly(name: str) -> None:
    _assert_loads_exactly(GOLDEN / "v1" / name)


@pytest.mark.parametrize("name", [f"v2/{name}" for name in V2] + V3)
def test_golden_table_checkpoint_loads_exactly(name: str) -> None:
    path = GOLDEN / name
    on_disk = pickle.loads((path / ".metadata").read_bytes()[:-23])  # committed test data: plain pickle is fine
    assert is_table(on_disk.storage_data) and len(on_disk.storage_data) == 1  # every record in the table
    _assert_loads_exactly(path)


@pytest.mark.parametrize("name", V3)
def test_golden_v3_holds_the_items_and_paths_of_dcp(name: str) -> None:
    """Format 3 stores ``state_dict_metadata`` and ``planner_data`` as tables: they read back as DCP's."""
    v2, v3 = (decode_metadata((GOLDEN / v / ".metadata").read_bytes(), v) for v in (name.replace("v3", "v2"), name))
    head = next(iter(pickle.loads((GOLDEN / name / ".metadata").read_bytes()[:-23]).storage_data.values()))
    assert head["fmt"] == 3 and {"item_table", "path_table"} <= head.keys()
    assert v3.state_dict_metadata == v2.state_dict_metadata and v3.planner_data == v2.planner_data
    assert v3.storage_data.keys() == v2.storage_data.keys()


@pytest.mark.parametrize("name", V2)
def test_golden_v2_holds_the_records_of_v1(name: str) -> None:
    """Format 2 changes how records are stored, not what they say (bar the version and the new frames)."""
    v1, v2 = (decode_metadata((GOLDEN / v / name / ".metadata").read_bytes(), v).storage_data for v in ("v1", "v2"))
    assert v1.keys() == v2.keys()
    for index, rec in v1.items():
        new = v2[index]
        assert rec["fmt"] == 1 and new["fmt"] == 2
        same = set(rec) - {"fmt", "offset", "length", "frames", "sums"}
        assert {k: rec[k] for k in same} == {k: new[k] for k in same}, index.fqn


def test_golden_checkpoints_verify_clean(tmp_path: Path) -> None:
    """The `verify` command reads every frame of every golden checkpoint and finds no problem."""
    from dcp_tiered.cli.__main__ import main

    for d in sorted(d for v in ("v1", "v2", "v3") for d in (GOLDEN / v).iterdir()):
        assert main(["verify", str(d)]) == 0, d.name
