"""Committed checkpoints of every released format version still load, bit for bit.

tests/golden/v1/ was written once by tests/golden/make_v1.py and is never regenerated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from values import golden_state  # noqa: E402


@pytest.mark.parametrize("name", ["none", "lz4", "zstd_3", "zstd_bf16_downcast"])
def test_golden_v1_checkpoint_loads_exactly(name: str) -> None:
    want = golden_state()
    got = {"model": {n: torch.zeros_like(t) for n, t in want["model"].items()}, "step": 0,
           "extra": {"name": "", "lr": 0.0, "sizes": []}}
    dcp.load(got, storage_reader=CompressedReader(GOLDEN / "v1" / name), no_dist=True)
    for n, t in want["model"].items():
        expected = t
        if name.endswith("bf16_downcast") and t.dtype in (torch.float32, torch.float64):
            expected = t.to(torch.bfloat16).to(t.dtype)  # stored in bf16, original dtype back on load
        assert got["model"][n].dtype == t.dtype, n
        assert torch.equal(got["model"][n], expected), f"{name}: {n} differs"
    assert got["step"] == 1234
    assert got["extra"] == {"name": "golden-v1", "lr": 0.001, "sizes": [1, 2, 3]}


def test_golden_v1_verifies_clean(tmp_path: Path) -> None:
    """The `verify` command reads every frame of every golden checkpoint and finds no problem."""
    from dcp_tiered.cli.__main__ import main

    for d in sorted((GOLDEN / "v1").iterdir()):
        assert main(["verify", str(d)]) == 0, d.name
