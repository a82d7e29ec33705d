"""``dcp-tiered gc --dry-run`` on a replicated node-local tier lists exactly what in-job retention deletes.

4 gloo ranks simulate 2 nodes of 2 ranks (``LOCAL_WORLD_SIZE=2``), as in ``test_replication.py``:
``local`` is ``.../local/{node}`` with ``replicas=2, replication_jump=2`` (cliques [0, 2] and
[1, 3]).  Steps 1, 2 and 3 are saved with ``keep=3`` (nothing deleted) and replicate fully; then
node 0's marker of rank 3's files of step 3 is deleted, so in node 0's directory step 3 is no
longer fully replicated and step 2 is its newest fully replicated step.

In the job (the same ranks, a checkpointer built with ``keep=1``), retention of node 0's directory
keeps step 3 (the newest) and step 2 (the newest fully replicated one) and deletes step 1.
``dcp-tiered gc --tiers YAML --dry-run --json`` with the same tiers (``keep: 1``), run in this
process without ``LOCAL_WORLD_SIZE`` as a user's shell would, must list the same.

gc acts as rank 0 of a single process (docs/cli.md), so a ``{node}`` tier is seen through node 0's
directory; it has no flag naming another node (nor ``--ranks-per-node`` as ``ls`` has).  The lists
are compared per node directory, for node 0 and for every other directory gc lists a row in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from speed import scaled
from gloo_ranks import read_records, record, run_ranks_recording
from test_replication import LOCAL, WS, _mesh, make_state, step_dir

from dcp_tiered import Tier, TieredCheckpointer

SPAWN_TIMEOUT = 180.0  # quiet-machine seconds: run_ranks scales it
WAIT_TIMEOUT = scaled(120.0)
STEPS = [1, 2, 3]
DAMAGED = (0, 3, 3)  # node 0's directory, step 3: the marker of rank 3's replica is deleted


def tier(data: Path, keep: int) -> Tier:
    return Tier("local", f"{data}/local/{{node}}", keep=keep, codec="lz4", replicas=2, replication_jump=2)


def _in_job_retention(ckpt: TieredCheckpointer):
    """The retention object the checkpointer itself runs after each save (one place to adapt if it moves)."""
    return ckpt.promoter.keeper


# -- code on every rank ---------------------------------------------------------------------------


def _job(data: Path, out: Path, mesh, rank: int) -> None:
    import torch.distributed as dist

    ckpt = TieredCheckpointer([tier(data, keep=3)])
    try:
        for step in STEPS:
            assert ckpt.maybe_save(step, make_state(mesh, rank, step), force=True) is not None
            ckpt.wait(timeout=WAIT_TIMEOUT)
    finally:
        ckpt.close(timeout=WAIT_TIMEOUT)
    dist.barrier()
    node, step, owner = DAMAGED
    if rank == 0:
        (data / "local" / str(node) / step_dir(step) / f".replica-{owner}.json").unlink()
    dist.barrier()
    ckpt = TieredCheckpointer([tier(data, keep=1)])  # the job restarted with keep=1: what its retention deletes now
    try:
        plan = _in_job_retention(ckpt).plan(ckpt.tiers[0])
        victims = sorted([v.tier, v.url, v.step] for v in plan.victims)
    finally:
        ckpt.close(timeout=WAIT_TIMEOUT)
    (out / f"job.rank{rank}.json").write_text(json.dumps({"node": rank // LOCAL, "victims": victims}))


def _worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = _mesh()
    record(Path(out), "job", rank, lambda: _job(Path(data), Path(out), mesh, rank))


# -- the test ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("gc_replicated")
    data = root / "data"
    out, error = run_ranks_recording(_worker, WS, root, str(data), root / "records", timeout=SPAWN_TIMEOUT)
    read_records(out, "job", WS, error)
    return data, [json.loads((out / f"job.rank{r}.json").read_text()) for r in range(WS)]


def _by_node(rows: list[list]) -> dict[int, list[list]]:
    out: dict[int, list[list]] = {}
    for t, url, step in rows:
        out.setdefault(int(Path(url).parent.name), []).append([t, url, step])
    return {k: sorted(v) for k, v in out.items()}


def test_gc_dry_run_lists_what_in_job_retention_deletes(job, tmp_path: Path, capsys, monkeypatch) -> None:
    from dcp_tiered.cli.__main__ import main

    data, facts = job
    # the situation: every step still there on both nodes; in node 0's directory step 3 lacks rank 3's marker
    for node in (0, 1):
        for step in STEPS:
            d = data / "local" / str(node) / step_dir(step)
            markers = sorted(p.name for p in d.glob(".replica-*.json"))
            peers = [r for r in range(WS) if r // LOCAL != node and (node, step, r) != DAMAGED]
            assert (d / ".metadata").is_file() and markers == [f".replica-{r}.json" for r in peers], (d, markers)
    in_job: dict[int, list[list]] = {}
    for rank, f in enumerate(facts):  # every rank of a node plans its node's directory: they agree
        assert in_job.setdefault(f["node"], f["victims"]) == f["victims"], f"rank {rank} disagrees: {facts}"

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # a user's shell, not torchrun
    y = tmp_path / "tiers.yaml"
    y.write_text(f"tiers:\n  - {{name: local, url: '{data}/local/{{node}}', keep: 1, codec: lz4, "
                 "replicas: 2, replication_jump: 2}\n")
    capsys.readouterr()
    code = main(["gc", "--tiers", str(y), "--dry-run", "--json"])
    text = capsys.readouterr()
    assert code == 0, text.out + text.err
    gc_rows = _by_node([[r["tier"], r["url"], r["step"]] for r in json.loads(text.out)["would_delete"]])

    for node in sorted({0} | set(gc_rows)):
        want, got = _by_node(in_job[node]).get(node, []), gc_rows.get(node, [])
        assert got == want, (
            f"node {node}'s directory: `dcp-tiered gc --dry-run` would delete steps {[s for *_, s in got]}, "
            f"in-job retention (keep=1, replicas=2, 4 ranks, 2 per node) deletes steps {[s for *_, s in want]}: "
            f"gc does not keep the newest fully replicated step (step 2 here; gc knows no world size nor "
            f"ranks per node)\n gc: {got}\n in-job: {want}\n in-job per node: {in_job}")
    assert all((data / "local" / str(n) / step_dir(s)).is_dir() for n in (0, 1) for s in STEPS), "gc --dry-run deleted a step"
