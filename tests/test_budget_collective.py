"""The memory budget check on 4 gloo ranks as 2 nodes of 2: replicas count, failures reach every rank.

- A replicated memory tier holds each rank's files on its own node and on each clique peer's node:
  the budget counts both (a save that passed the check used to leave each node over its budget).
- A failure on one rank inside the check (its plan, a marker, its listing) used to raise on that
  rank at once while its peers waited in the collective for as long as it lived; every rank now
  raises the same ``SaveError``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from gloo_ranks import read_records, record, run_ranks_recording

LOCAL, WS = 2, 4
SHM = Path("/dev/shm")


def _tier(root: str, budget: str):
    from dcp_tiered import Tier

    return Tier("mem", f"{root}/{{node}}", memory_budget=budget, replicas=2, replication_jump=LOCAL, keep=1)


def _over_budget_with_replicas(root: str, rank: int) -> None:
    from dcp_tiered import SaveError, TieredCheckpointer

    # 1 MiB of floats per rank (a key of its own: DCP would store a shared key once): 2 MiB of own
    # files per node, 4 MiB with the peers' copies
    with TieredCheckpointer([_tier(root, "3MiB")]) as ck:
        with pytest.raises(SaveError, match="memory_budget"):
            ck.save_now(1, {f"w{rank}": torch.full((1 << 18,), float(rank))})


def _fits_with_replicas(root: str, rank: int) -> None:
    from dcp_tiered import TieredCheckpointer

    with TieredCheckpointer([_tier(root, "6MiB")]) as ck:
        assert ck.save_now(1, {f"w{rank}": torch.full((1 << 18,), float(rank))}).ok


def _one_rank_fails_inside_the_check(root: str, rank: int) -> None:
    from dcp_tiered import SaveError, TieredCheckpointer
    from dcp_tiered.tiers.save import budget

    if rank == 1:
        budget.local_item_bytes = lambda *a, **k: (_ for _ in ()).throw(OverflowError("cannot convert float infinity"))
    with TieredCheckpointer([_tier(root, "64MiB")]) as ck:
        with pytest.raises(SaveError, match="rank 1: OverflowError"):
            ck.save_now(1, {"w": torch.ones(16)})


def _node_copies_count(root: str, rank: int) -> None:
    from dcp_tiered import SaveError, Tier, TieredCheckpointer

    # node 1 holds 2 MiB of its own ranks' floats and, as its node copy, the 1 MiB replicated tensor
    # that DCP stores on node 0: 3 MiB against a 2.5 MiB budget (without the copy it would fit)
    own = torch.full((1 << 18 if rank >= LOCAL else 16,), float(rank))
    with TieredCheckpointer([Tier("mem", f"{root}/{{node}}", memory_budget="2560KiB", keep=1)]) as ck:
        with pytest.raises(SaveError, match="memory_budget"):
            ck.save_now(1, {f"w{rank}": own, "shared": torch.ones(1 << 18)})


def _worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    rec = Path(out)
    record(rec, "over_budget", rank, lambda: _over_budget_with_replicas(f"{data}/a", rank))
    record(rec, "fits", rank, lambda: _fits_with_replicas(f"{data}/b", rank))
    record(rec, "node_copies", rank, lambda: _node_copies_count(f"{data}/d", rank))
    record(rec, "one_fails", rank, lambda: _one_rank_fails_inside_the_check(f"{data}/c", rank))  # patches rank 1: last


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("no writable /dev/shm")
    root = SHM / f"dcp-tiered-test-{uuid.uuid4().hex}"
    root.mkdir()
    tmp = tmp_path_factory.mktemp("budget")
    try:
        out, crash = run_ranks_recording(_worker, WS, tmp, str(root), tmp / "out", timeout=300)
        yield out, crash
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("check", ["over_budget", "fits", "one_fails", "node_copies"])
def test_budget_check_on_four_ranks(outcomes, check):
    out, crash = outcomes
    read_records(out, check, WS, crash)
