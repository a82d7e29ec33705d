"""Node-local tiers on a multi-node job: every node's directory is committed, and a restart of
every rank restores from it.

4 gloo ranks simulate 2 nodes of 2 ranks (``LOCAL_WORLD_SIZE=2``): ``local`` is
``.../local/{node}`` (lz4), ``shared`` a shared directory (zstd); both are due on every save.
Scenarios (each in its own data folder):

- ``sync`` / ``async``: sharded state only (DTensors ``Shard(0)`` and one key per rank), so each
  node's files hold everything its ranks need.  A restart restores from ``local`` on every rank.
- ``replicated``: DDP-style state (plain tensors and an int on every rank) and ``fsdp_adam``:
  parameters sharded as FSDP2 shards them (DTensor ``Shard(0)``) with a torch Adam's state (its
  ``step`` tensors and param groups are the same on every rank).  DCP stores a replicated item once,
  in one rank's file; each other node's directory gets a copy of what its ranks need (node copies,
  :mod:`dcp_tiered.tiers.save.node_commit`), so the restart restores from ``local`` on every rank.
  For ``fsdp_adam`` the shared tier is moved away before the restart: nothing can come from it.
- ``replicated-old``: ``replicated`` with node 1's ``.metadata`` replaced by node 0's (a directory
  committed without node copies): the restart refuses ``local`` when listing and restores from
  ``shared``; with that check bypassed (a file lost after the listing), the ``local`` load fails on
  every rank together before reading data, then ``shared``.

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
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from gloo_ranks import read_records, record, run_ranks_recording

from dcp_tiered import CompressedReader, Tier, TieredCheckpointer
from dcp_tiered.dcp.format import record_view
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
SCENARIOS = ["sync", "async", "replicated", "fsdp_adam"]
SHARDED = ["sync", "async"]
AWAY = "shared-away"  # where fsdp_adam's shared tier goes before the restart


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


def fsdp_adam_state(mesh, step: int) -> dict:
    """A model sharded as FSDP2 shards it (every parameter a DTensor ``Shard(0)``) with its torch Adam
    after ``step`` steps, as ``get_state_dict`` gives them (at step 0: a fresh model, the optimizer's
    state made by DCP's initialization)."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Shard, distribute_tensor

    def shard(t: torch.Tensor):
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    model = nn.Sequential(nn.Linear(24, 37), nn.Tanh(), nn.Linear(37, 8))
    for i, (name, p) in enumerate(list(model.named_parameters())):
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner).register_parameter(attr, nn.Parameter(shard(_randn(tuple(p.shape), 300 + i))))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    for s in range(1, step + 1):
        for i, p in enumerate(model.parameters()):
            p.grad = shard(_randn(tuple(p.shape), 1000 * s + i))
        opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def leaves(tree, path: str = ""):
    """``(dotted path, value)`` of every leaf of nested dicts and lists; a DTensor as its local shard."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}.{i}")
    else:
        yield path, tree.to_local() if hasattr(tree, "to_local") else tree


def make_state(scenario: str, mesh, rank: int, step: int) -> dict:
    """The state of ``rank`` at ``step`` (or a zero template when ``step`` is 0)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if scenario == "fsdp_adam":
        return fsdp_adam_state(mesh, step)
    v = full_values(step)
    if step == 0:
        v = {k: torch.zeros_like(t) for k, t in v.items()}
    if scenario == "replicated":
        return {"model": {"w": v["w"].clone(), "e": v["e"].clone()}, "step": step}
    own = own_value(rank, step) if step else torch.zeros(5, 3)
    return {"model": {k: distribute_tensor(t.clone(), mesh, [Shard(0)]) for k, t in v.items()},
            f"own{rank}": own}


def diffs(scenario: str, sd: dict, rank: int, step: int, mesh=None) -> list[str]:
    if scenario == "fsdp_adam":
        got = dict(leaves(sd))
        return [f"{k} differs from step {step}" for k, v in leaves(fsdp_adam_state(mesh, step))
                if not (torch.equal(got[k], v) and got[k].dtype == v.dtype if isinstance(v, torch.Tensor) else got[k] == v)]
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
    # replicated items (Adam's): the copies' records reach node 1's leader through its directory, never
    # through the Metadata DCP broadcasts to every rank (every node's copies to every rank: N^2 bytes)
    import pickle

    writer, name = TieredWriter(tiers(root), due=["local"]), step_dir(60)
    md = dcp.save(fsdp_adam_state(mesh, 1), storage_writer=writer, checkpoint_id=name)
    assert b"node_0.distcp" not in pickle.dumps(md), f"rank {rank}: the broadcast Metadata carries node copies"
    done = writer.commit_node(md, WS)
    assert (done is not None and done.ok and done.copied_bytes > 0) == (rank == LOCAL), f"rank {rank}: {done}"
    writer.close()
    dist.barrier()
    files = {record_view(r).file for r in load_metadata(Storage(f"{root}/local/1/{name}")).storage_data.values()}
    assert files & {"__2_node_0.distcp", "__3_node_0.distcp"}, f"node 1 names no node copies: {sorted(files)}"


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
        facts = {"step": got, "diffs": diffs(scenario, sd, rank, got, mesh) if isinstance(got, int) else ["nothing restored"],
                 "failures": ckpt.restore_failures,
                 "events": [(e["event"], e["step"], e["tier"]) for e in events if e.get("event", "").startswith("restore")]}
    finally:
        ckpt.close()
    (out / f"restore[{scenario}{tag}].rank{rank}.json").write_text(json.dumps(facts))
    if scenario == "fsdp_adam":  # compared with the shared tier's copy
        torch.save(dict(leaves(sd)), out / f"restored[{scenario}].rank{rank}.pt")


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
    old = root / "replicated-old"
    record(out_p, "restore[replicated-old]", rank, lambda: _restore(old, out_p, "replicated", mesh, rank, "-old"))
    record(out_p, "restore[replicated-unchecked]", rank, lambda: _restore_unchecked(old, out_p, mesh, rank))


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("node_local")


@pytest.fixture(scope="module")
def saved(root: Path) -> tuple[Path, str | None]:
    return run_ranks_recording(_save_worker, WS, root, str(root / "data"), root / "records_save", timeout=SPAWN_TIMEOUT)


def _without_node_copies(src: Path, dst: Path) -> None:
    """``dst``: a copy of the checkpoints in ``src`` whose node 1 directories hold node 0's ``.metadata``,
    as committed before node copies (it names the replicated items where DCP stored them, on node 0)."""
    shutil.copytree(src, dst)
    for d in (dst / "local" / "1").glob("step_*"):
        shutil.copyfile(dst / "local" / "0" / d.name / ".metadata", d / ".metadata")


@pytest.fixture(scope="module")
def restarted(root: Path, saved) -> tuple[Path, str | None]:
    data = root / "data"
    if (data / "fsdp_adam" / "shared").is_dir():  # the restart must not be able to read it
        (data / "fsdp_adam" / "shared").rename(data / "fsdp_adam" / AWAY)
    if (data / "replicated").is_dir():
        _without_node_copies(data / "replicated", data / "replicated-old")
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


@pytest.mark.parametrize("scenario", ["replicated", "fsdp_adam"])
def test_replicated_items_restore_from_the_node_local_tier(saved, restarted, scenario: str) -> None:
    """Items DCP stored once (DDP-style tensors; Adam's ``step`` tensors and param groups beside FSDP
    shards) have a copy in every other node's directory: every rank restores from ``local``,
    bit-exact (for ``fsdp_adam`` with the shared tier moved away: nothing was read from it)."""
    read_records(saved[0], f"save[{scenario}]", WS, saved[1])
    read_records(restarted[0], f"restore[{scenario}]", WS, restarted[1])
    for rank, f in enumerate(_facts(restarted[0], f"restore[{scenario}]")):
        assert f["step"] == STEPS[-1] and f["diffs"] == [], f"rank {rank}: {f}"
        assert f["events"] == [["restore", STEPS[-1], "local"]] and f["failures"] == 0, f"rank {rank}: {f}"


def _files(path: Path) -> dict:
    """The data file of each item of the checkpoint in ``path``."""
    return {i: record_view(r).file for i, r in load_metadata(Storage(str(path))).storage_data.items()}


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
def test_node_copies_hold_only_replicated_items_and_shared_stays_a_plain_checkpoint(saved, restarted, root: Path) -> None:
    """Node 1's ``.metadata`` names node 0's files for node 0's shards only; the items it names elsewhere
    than the shared checkpoint are Adam's replicated ones (never a shard), in node-copies files.  The
    shared checkpoint (promoted from node 0's) names only the ranks' own data files, loads with stock
    DCP's loader and ``CompressedReader`` into an empty state dict, and equals what every rank restored."""
    read_records(saved[0], "save[fsdp_adam]", WS, saved[1])
    read_records(restarted[0], "restore[fsdp_adam]", WS, restarted[1])
    name = step_dir(STEPS[-1])
    data = root / "data" / "fsdp_adam"
    node1, shared = _files(data / "local" / "1" / name), _files(data / AWAY / name)
    assert _files(data / "local" / "0" / name) == shared
    assert set(shared.values()) == {f"__{r}_0.distcp" for r in range(WS)}, shared

    def replicated(fqn: str) -> bool:
        return fqn.endswith(".step") or ".param_groups." in fqn

    moved = {i.fqn for i in node1 if node1[i] != shared[i]}
    assert moved and all(map(replicated, moved)), moved
    assert {node1[i] for i in node1 if node1[i] != shared[i]} <= {"__2_node_0.distcp", "__3_node_0.distcp"}, node1
    elsewhere = {i.fqn for i, f in node1.items() if rank_of_file(f) not in (2, 3)}  # node 0's shards only
    assert elsewhere and not any(map(replicated, elsewhere)), elsewhere
    full = _load_state_dict_from_keys(storage_reader=CompressedReader(str(data / AWAY / name)))
    want = dict(leaves(full))
    for rank in range(WS):
        got = torch.load(restarted[0] / f"restored[fsdp_adam].rank{rank}.pt", weights_only=True)
        assert set(got) == set(want), set(got) ^ set(want)
        for k, v in got.items():
            w = want[k]
            if isinstance(w, torch.Tensor) and w.shape != v.shape:
                w = torch.chunk(w, WS, 0)[rank]
            assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), f"rank {rank}: {k}"


def test_a_node_committed_without_node_copies_restores_from_shared(saved, restarted) -> None:
    """A node directory whose ``.metadata`` names replicated items in another node's file (committed
    without node copies): every rank refuses the ``local`` candidates when listing (its load would
    need another node's file) and restores from ``shared``, bit-exact."""
    read_records(saved[0], "save[replicated]", WS, saved[1])
    read_records(restarted[0], "restore[replicated-old]", WS, restarted[1])
    for rank, f in enumerate(_facts(restarted[0], "restore[replicated-old]")):
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
