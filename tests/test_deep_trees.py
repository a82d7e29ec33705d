"""A directory nested thousands deep inside an old step never makes a tier unlistable or undeletable.

It used to: the recursive walk raised ``RecursionError``, so restore failed although an intact step
existed, and retention and ``gc`` stopped on that tier for good.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedWriter, Tier, TieredCheckpointer
from dcp_tiered.cli.__main__ import main
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.catalog import list_tier


def _nest(directory: Path, depth: int) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("a", dir_fd=fd)
            child = os.open("a", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "wb") as f:
            f.write(b"x")
    finally:
        os.close(fd)


@pytest.fixture
def tmp_tree(tmp_path):
    """``tmp_path``, emptied with the library's own iterative delete afterwards (pytest's recursive
    cleanup cannot remove a tree 1,100 deep)."""
    yield tmp_path
    Storage(str(tmp_path)).remove_tree()


def _tier(tmp_path: Path) -> Path:
    root = tmp_path / "tier"
    for step in (1, 2):
        dcp.save({"w": torch.full((5,), float(step))},
                 storage_writer=CompressedWriter(root / f"step_{step:09d}", sync_files=False), no_dist=True)
    _nest(root / "step_000000001", 1100)
    return root


def test_listing_and_restore_skip_a_deep_tree(tmp_tree):
    root = _tier(tmp_tree)
    infos = {i.step: i for i in list_tier(Tier("local", str(root)))}
    assert infos[1].committed and infos[2].committed and infos[2].complete
    state = {"w": torch.zeros(5)}
    with TieredCheckpointer([Tier("local", str(root), keep=2)]) as ck:
        assert ck.restore(state) == 2
    assert torch.equal(state["w"], torch.full((5,), 2.0))


def test_gc_deletes_a_step_holding_a_deep_tree(tmp_tree, capsys):
    root = _tier(tmp_tree)
    assert main(["gc", "--local-path", str(root), "--keep-local", "1"]) == 0, capsys.readouterr()
    assert not (root / "step_000000001").exists() and (root / "step_000000002" / ".metadata").exists()
