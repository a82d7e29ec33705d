"""Node-local tiers on a multi-node job: every node's directory is committed, and a restart of
every rank restores from it.

4 gloo ranks simulate 2 nodes of 2 ranks (``LOCAL_WORLD_SIZE=2``): ``local`` is
``.../local/{node}`` (lz4), ``shared`` a shared directory (zstd); both are due on every save.
Scenarios (each in its own data folder):

- ``sync`` / ``async``: sharded state only (DTensors ``Shard(0)`` and one key per rank), so each
  node's files hold everything its ranks need.  A restart restores from ``local`` on every rank.
- ``replicated``: DDP-style state (plain tensors and an int on every rank): DCP stores each item
  once, in one rank's file, so no node holds everything.  The restart refuses ``local`` when
  listing and restores from ``shared``; with that check bypassed (a file lost after the
  listing), the ``local`` load fails on every rank together before reading data, then ``shared``.

One spawn saves, a second spawn (the restart) restores; checks record ``ok`` or a traceback per
rank, and facts (restored steps, restore events) go to JSON files compared here.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gloo_ranks import read_records, record, run_ranks_recording

from dcp_tiered import Tier, TieredCheckpointer
from dcp_tiered.dcp.metadata_io import load_metadata
from dcp_tiered.storage import Storage
from dcp_tiered.names import rank_of_file
from dcp_tiered.tiers.save.node_commit import commit_node

WS, LOCAL = 4, 2
NODES = WS // LOCAL
SPAWN_TIMEOUT = 420.0  # 4 ranks on a loaded machine; a hang fails the tests instead of hanging them
WAIT_TIMEOUT = 180.0
STEPS = [1, 2, 3]
KEEP = 2
W_SHAPE = (37, 24)  # rows per rank: 10, 10, 10, 7
SCENARIOS = ["sync", "async", "replicated"]
SHARDED = ["sync", "async"]


def tiers(root: Path) -> list[Tier]:
    return [Tier("local", f"{root}/local/{{node}}", keep=KEEP, codec="lz4"),
            Tier("shared", f"{root}/shared", keep=KEEP, codec="zstd")]


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def full_values(step: int) -> dict[str, torch.Tensor]:
    return {"w": _randn(W_SHAPE, 1) + step, "e": _randn(W_SHAPE, 2) - 10 * step}


def own_value(rank: int, step: int) -> torch.Tensor:
    return _randn((5, 3), 100 + rank) * step


# -- code on every rank ---------------------------------------------------------------------------


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WS,))


def make_state(scenario: str, mesh, rank: int, step: int) -> dict:
    """The state of ``rank`` at ``step`` (or a zero template when ``step`` is 0)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    v = full_values(step)
    if step == 0:
        v = {k: torch.zeros_like(t) for k, t in v.items()}
    if scenario == "replicated":
        return {"model": {"w": v["w"].clone(), "e": v["e"].clone()}, "step": step}
    own = own_value(rank, step) if step else torch.zeros(5, 3)
    return {"model": {k: distribute_tensor(t.clone(), mesh, [Shard(0)]) for k, t in v.items()},
            f"own{rank}": own}


def diffs(scenario: str, sd: dict, rank: int, step: int) -> list[str]:
    want = full_values(step)
    out = []
    for k, t in want.items():
        got = sd["model"][k]
        if scenario != "replicated":
            got, t = got.to_local(), torch.chunk(t, WS, 0)[rank]
        if not torch.equal(got, t):
            out.append(f"model.{k} differs from step {step}")
    if scenario == "replicated":
        if sd["step"] != step:
            out.append(f"step is {sd['step']!r}, want {step}")
    elif not torch.equal(sd[f"own{rank}"], own_value(rank, step)):
        out.append(f"own{rank} differs from step {step}")
    return out


def _wait(ckpt: TieredCheckpointer) -> None:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("exc", _safe(ckpt.wait)), daemon=True)
    t.start()
    t.join(scaled(WAIT_TIMEOUT))
    if t.is_alive():
        raise TimeoutError(f"TieredCheckpointer.wait() did not return within {WAIT_TIMEOUT} s")
    if box.get("exc") is not None:
        raise box["exc"]


def _safe(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
        return exc
    return None


def _save(root: Path, out: Path, scenario: str, mesh, rank: int) -> None:
    events: list = []
    ckpt = TieredCheckpointer(tiers(root), async_save=scenario == "async")
    ckpt.events.hooks.append(events.append)
    try:
        for step in STEPS:
            sd = make_state(scenario, mesh, rank, step)
            assert ckpt.maybe_save(step, sd) is not None
            if scenario == "async":  # training goes on: what the async save captured must not change
                for t in sd["model"].values():
                    (t.to_local() if hasattr(t, "to_local") else t).add_(1000)
        _wait(ckpt)
    finally:
        ckpt.close()
    commits = [{k: e[k] for k in ("step", "ok", "error", "ranks")} for e in events if e.get("event") == "node_commit"]
    (out / f"commits[{scenario}].rank{rank}.json").write_text(json.dumps(commits))
    sizes = [(e["step"], e["raw_bytes"], e["stored_bytes"]) for e in events if e.get("event") == "save" and e.get("ok")]
    (out / f"sizes[{scenario}].rank{rank}.json").write_text(json.dumps(sizes))


def _direct(root: Path, out: Path, mesh, rank: int) -> None:
    """``dcp.save`` and ``dcp.async_save``'s future hand every rank the committed Metadata, and
    ``TieredWriter.commit_node`` commits the other node with it."""
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_tiered.tiers.save.writer import TieredWriter

    for i, use_async in enumerate((False, True)):
        writer = TieredWriter(tiers(root), due=["local"])
        sd = make_state("sync", mesh, rank, 1)
        name = step_dir(50 + i)
        if use_async:
            md = dcp.async_save(sd, storage_writer=writer, checkpoint_id=name).result()
        else:
            md = dcp.save(sd, storage_writer=writer, checkpoint_id=name)
        assert type(md) is Metadata, f"{'async_save future' if use_async else 'save'} returned {type(md).__name__}"
        ids: list = [None] * WS
        dist.all_gather_object(ids, md.storage_meta.save_id)
        committed = load_metadata(Storage(f"{root}/local/0/{name}")).storage_meta.save_id
        assert ids == [committed] * WS, f"ranks got save ids {ids}, the commit holds {committed}"
        done = writer.commit_node(md, WS)
        assert (done is not None and done.ok) == (rank == LOCAL), f"rank {rank}: commit_node returned {done}"
        writer.close()
        dist.barrier()


def _save_worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)  # gloo_ranks puts every rank on one node
    mesh = _mesh()
    root, out_p = Path(data), Path(out)
    for scenario in SCENARIOS:
        record(out_p, f"save[{scenario}]", rank, lambda s=scenario: _save(root / s, out_p, s, mesh, rank))
    record(out_p, "direct", rank, lambda: _direct(root / "direct", out_p, mesh, rank))


def _restore(root: Path, out: Path, scenario: str, mesh, rank: int, tag: str = "") -> None:
    ckpt = TieredCheckpointer(tiers(root))
    events: list = []
    ckpt.events.hooks.append(events.append)
    try:
        sd = make_state(scenario, mesh, rank, 0)
        got = ckpt.restore(sd)
        facts = {"step": got, "diffs": diffs(scenario, sd, rank, got) if isinstance(got, int) else ["nothing restored"],
                 "failures": ckpt.restore_failures,
                 "events": [(e["event"], e["step"], e["tier"]) for e in events if e.get("event", "").startswith("restore")]}
    finally:
        ckpt.close()
    (out / f"restore[{scenario}{tag}].rank{rank}.json").write_text(json.dumps(facts))


def _restore_unchecked(root: Path, out: Path, mesh, rank: int) -> None:
    """Restore without the listing's check of the files each rank's load needs (as when a file
    vanishes after the listing): the load itself must fail on every rank together."""
    from dcp_tiered.tiers.restore import Restorer

    check = Restorer._lacking
    Restorer._lacking = lambda self, *args: None
    try:
        _restore(root, out, "replicated", mesh, rank, "-unchecked")
    finally:
        Restorer._lacking = check


def _restore_worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = _mesh()
    root, out_p = Path(data), Path(out)
    for scenario in SCENARIOS:
        record(out_p, f"restore[{scenario}]", rank, lambda s=scenario: _restore(root / s, out_p, s, mesh, rank))
    record(out_p, "restore[replicated-unchecked]", rank, lambda: _restore_unchecked(root / "replicated", out_p, mesh, rank))


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("node_local")


@pytest.fixture(scope="module")
def saved(root: Path) -> tuple[Path, str | None]:
    return run_ranks_recording(_save_worker, WS, root, str(root / "data"), root / "records_save", timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def restarted(root: Path, saved) -> tuple[Path, str | None]:
    return run_ranks_recording(_restore_worker, WS, root, str(root / "data"), root / "records_restore",
                               timeout=SPAWN_TIMEOUT)


def _facts(out: Path, name: str) -> list:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WS)]


def _committed(path: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in path.glob("step_*") if (p / ".metadata").is_file())


# -- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_node_commits_its_own_files(saved, root: Path, scenario: str) -> None:
    """Each node's directory holds ``.metadata`` and only its own ranks' data files, for the
    ``KEEP`` newest steps (retention runs per node); node 1's leader (rank 2) reports its commits."""
    read_records(saved[0], f"save[{scenario}]", WS, saved[1])
    local = root / "data" / scenario / "local"
    for node in range(NODES):
        assert _committed(local / str(node)) == STEPS[-KEEP:], f"node {node}: committed {_committed(local / str(node))}"
        for d in (local / str(node)).glob("step_*"):
            ranks = {rank_of_file(p.name) for p in d.iterdir() if p.name.endswith(".distcp")}
            assert ranks <= set(range(node * LOCAL, (node + 1) * LOCAL)), f"{d} holds files of ranks {ranks}"
    commits = _facts(saved[0], f"commits[{scenario}]")
    assert [c["step"] for c in commits[LOCAL] if c["ok"]] == STEPS, commits[LOCAL]
    assert all(c["ranks"] == [2, 3] for c in commits[LOCAL]), commits[LOCAL]
    assert all(commits[r] == [] for r in range(WS) if r != LOCAL), commits
    # every rank reports the save's sizes from the committed metadata (not 0 off the coordinator)
    sizes = _facts(saved[0], f"sizes[{scenario}]")
    assert [s[0] for s in sizes[0]] == STEPS and all(raw > 0 and 0 < stored for _, raw, stored in sizes[0]), sizes
    assert all(sizes[r] == sizes[0] for r in range(WS)), sizes


def test_save_returns_the_committed_metadata_on_every_rank(saved) -> None:
    read_records(saved[0], "direct", WS, saved[1])


@pytest.mark.parametrize("scenario", SHARDED)
def test_restart_restores_from_the_node_local_tier(saved, restarted, scenario: str) -> None:
    """After a restart of every rank, sharded state restores from ``local`` on every rank, bit-exact."""
    read_records(saved[0], f"save[{scenario}]", WS, saved[1])
    read_records(restarted[0], f"restore[{scenario}]", WS, restarted[1])
    for rank, f in enumerate(_facts(restarted[0], f"restore[{scenario}]")):
        assert f["step"] == STEPS[-1] and f["diffs"] == [], f"rank {rank}: {f}"
        assert f["events"] == [["restore", STEPS[-1], "local"]] and f["failures"] == 0, f"rank {rank}: {f}"


def test_replicated_state_restores_from_shared(saved, restarted) -> None:
    """Replicated items live in one rank's file only: every rank refuses the ``local`` candidates
    when listing (its load would need another node's file) and restores from ``shared``, bit-exact."""
    read_records(saved[0], "save[replicated]", WS, saved[1])
    read_records(restarted[0], "restore[replicated]", WS, restarted[1])
    for rank, f in enumerate(_facts(restarted[0], "restore[replicated]")):
        assert f["step"] == STEPS[-1] and f["diffs"] == [], f"rank {rank}: {f}"
        assert f["events"] == [["restore", STEPS[-1], "shared"]] and f["failures"] == 0, f"rank {rank}: {f}"


def test_a_load_lacking_files_falls_back_on_every_rank_together(saved, restarted) -> None:
    """Without the listing's check, the ``local`` attempt fails on every rank alike (before reading
    data; no hang, nothing torn) and every rank restores the same step from ``shared``."""
    read_records(saved[0], "save[replicated]", WS, saved[1])
    read_records(restarted[0], "restore[replicated-unchecked]", WS, restarted[1])
    facts = _facts(restarted[0], "restore[replicated-unchecked]")
    for rank, f in enumerate(facts):
        assert f["step"] == STEPS[-1] and f["diffs"] == [], f"rank {rank}: {f}"
        assert f["events"] == [["restore_failure", STEPS[-1], "local"], ["restore", STEPS[-1], "shared"]], f"rank {rank}: {f}"
        assert f["failures"] == 1, f"rank {rank}: {f}"


# -- the node commit itself, in this process ------------------------------------------------------------


def _node_copy(saved, root: Path, tmp_path: Path, monkeypatch) -> tuple[Tier, Path, object]:
    """A copy of node 1's directory of the last sync step without its ``.metadata``, the tier over
    it, and the committed Metadata (as every rank holds it after the save)."""
    read_records(saved[0], "save[sync]", WS, saved[1])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(LOCAL))
    src = root / "data" / "sync" / "local"
    name = step_dir(STEPS[-1])
    dst = tmp_path / "local" / "1" / name
    shutil.copytree(src / "1" / name, dst)
    (dst / ".metadata").unlink()
    md = load_metadata(Storage(str(src / "0" / name)))
    return Tier("local", f"{tmp_path}/local/{{node}}", codec="lz4"), dst, md


def test_node_commit_after_its_files_are_in(saved, root: Path, tmp_path: Path, monkeypatch) -> None:
    tier, dst, md = _node_copy(saved, root, tmp_path, monkeypatch)
    assert commit_node(tier, dst.name, md, rank=3, world=WS) is None  # not the node's leader
    assert commit_node(tier, dst.name, md, rank=2, world=WS).ok
    committed = load_metadata(Storage(str(dst)))
    assert committed.storage_meta.save_id == md.storage_meta.save_id
    assert committed.storage_meta.checkpoint_id == Storage(str(dst)).url


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_node_with_files_missing_is_never_committed(saved, root: Path, tmp_path: Path, monkeypatch, damage: str) -> None:
    tier, dst, md = _node_copy(saved, root, tmp_path, monkeypatch)
    victim = next(p for p in dst.iterdir() if rank_of_file(p.name) == 3)
    if damage == "missing":
        victim.unlink()
    else:
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size - 1)
    done = commit_node(tier, dst.name, md, rank=2, world=WS)
    assert done is not None and not done.ok and victim.name in done.error, done
    assert not (dst / ".metadata").exists()
