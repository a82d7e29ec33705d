"""No collective of this library sends every rank's value to every rank (4 gloo ranks as 2 nodes).

An ``all_gather_object`` costs N^2 bytes over the job: at 16k ranks even a small listing per rank
is gigabytes received per rank.  Each agreement here gathers on one rank, decides there and
broadcasts the decision (``dcp_tiered.dcp.agree``).  DCP's own collectives are not counted: only
the calls made from this library's modules.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from gloo_ranks import read_records, record, run_ranks_recording

WS, LOCAL = 4, 2


def _count_library_collectives() -> dict:
    """Wrap torch.distributed's object collectives so that calls made from dcp_tiered modules are counted."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    for name in ("all_gather_object", "all_gather", "gather_object", "broadcast_object_list"):
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("dcp_tiered."):
                counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        setattr(dist, name, wrapper)
    return counts


def _save_and_restore(root: str, rank: int, out: str) -> None:
    from dcp_tiered import Tier, TieredCheckpointer

    counts = _count_library_collectives()
    tiers = [Tier("local", f"{root}/local/{{node}}", codec="lz4", replicas=2, replication_jump=LOCAL),
             Tier("shared", f"{root}/shared", every_steps=1)]
    state = {f"w{rank}": torch.full((64,), float(rank)), "shared": torch.arange(8.0)}
    with TieredCheckpointer(tiers) as ck:
        ck.save_now(1, state)
        ck.wait()
    setup_and_save = dict(counts)
    counts.clear()
    with TieredCheckpointer(tiers) as ck:
        into = {f"w{rank}": torch.zeros(64), "shared": torch.zeros(8)}
        assert ck.restore(into) == 1
        assert torch.equal(into[f"w{rank}"], state[f"w{rank}"]) and torch.equal(into["shared"], state["shared"])
    Path(out, f"counts.rank{rank}").write_text(json.dumps({"save": setup_and_save, "restore": dict(counts)}))
    assert "all_gather_object" not in setup_and_save and "all_gather" not in setup_and_save, setup_and_save
    assert "all_gather_object" not in counts and "all_gather" not in counts, counts


def _worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    record(Path(out), "no_all_gather", rank, lambda: _save_and_restore(f"{data}/a", rank, out))


def test_save_and_restore_gather_on_one_rank_only(tmp_path) -> None:
    out, crash = run_ranks_recording(_worker, WS, tmp_path, str(tmp_path / "data"), tmp_path / "out", timeout=240)
    read_records(out, "no_all_gather", WS, crash)
