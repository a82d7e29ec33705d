"""Peer replication of a node-local tier (``Tier(replicas=F, replication_jump=J)``).

4 gloo ranks simulate 2 nodes of 2 ranks (``LOCAL_WORLD_SIZE=2``); ``local`` is
``.../local/{node}`` with ``replicas=2, replication_jump=2`` (cliques [0, 2] and [1, 3]: each
rank's files get a copy on the other node), ``shared`` a shared directory.  State is sharded
(DTensor ``Shard(0)`` plus one key per rank), so each rank's load reads its own file only.

- The save spawn holds the replication thread of step 1 behind a gate: the save returns, the
  step is busy for retention and has no replica marker until the gate opens (never blocks training).
- Step 3's replication fails on clique [1, 3] (rank 1 cannot read its files): the save returns,
  the failure is raised at ``wait()`` on ranks 1 and 3 only.
- After the save, each node holds the other node's files under committed markers whose digests
  match the originals (all but rank 1's of step 3).
- Node 1's directory is deleted (a replaced node) and the shared tier's data files are moved
  away (any read of them fails); the restart restores step 3 from ``local`` on every rank,
  bit-exact, node 1's files fetched from node 0's replicas (and node 0's files kept on node 1 as
  committed replicas again).
- A SIGKILL of rank 0 halfway through writing rank 2's file of step 2 (step 1 fully replicated), then
  node 1's directory deleted: the restart never loads a torn state and never hangs; it restores
  bit-exact from the shared tier or an older step (step 2 on ``local`` lacks rank 2's replica).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from gloo_ranks import read_records, record, run_ranks_recording

from dcp_tiered import ConfigError, ReplicationError, StorageError, Tier, TieredCheckpointer
from dcp_tiered.dcp.writer import CompressedWriter
from dcp_tiered.storage import Storage
from dcp_tiered.names import rank_of_file
from dcp_tiered.tiers.save.node_commit import lacking_files
from dcp_tiered.tiers.replicas.markers import marker_name
from dcp_tiered.tiers.topology import check_replication, cliques

WS, LOCAL = 4, 2
SPAWN_TIMEOUT = 420.0
WAIT_TIMEOUT = 180.0
STEPS = [1, 2, 3]  # step 3: rank 1 cannot send its files (replication fails, training goes on)
W_SHAPE = (37, 24)


def tiers(root: Path) -> list[Tier]:
    return [Tier("local", f"{root}/local/{{node}}", keep=3, codec="lz4", replicas=2, replication_jump=2),
            Tier("shared", f"{root}/shared", keep=2, codec="zstd")]


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def make_state(mesh, rank: int, step: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    w = _randn(W_SHAPE, 1) + step if step else torch.zeros(W_SHAPE)
    own = _randn((5, 3), 100 + rank) * step if step else torch.zeros(5, 3)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)])}, f"own{rank}": own}


def diffs(sd: dict, rank: int, step: int) -> list[str]:
    out = []
    w = torch.chunk(_randn(W_SHAPE, 1) + step, WS, 0)[rank]
    if not torch.equal(sd["model"]["w"].to_local(), w):
        out.append(f"model.w differs from step {step}")
    if not torch.equal(sd[f"own{rank}"], _randn((5, 3), 100 + rank) * step):
        out.append(f"own{rank} differs from step {step}")
    return out


def _in_thread(fn, timeout: float = WAIT_TIMEOUT):
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    timeout = scaled(timeout)
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{fn} did not return within {timeout} s")
    if "exc" in box:
        raise box["exc"]
    return box.get("value")


# -- code on every rank ---------------------------------------------------------------------------


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WS,))


def _save(root: Path, out: Path, mesh, rank: int) -> None:
    """Save steps 1 and 2; the replication of step 1 is held until the save of step 1 returned."""
    from dcp_tiered.tiers.replicas import replicate as replication

    held, release = threading.Event(), threading.Event()
    original = replication.Replicator._run_job

    def gated(self, step, tier, metadata):
        if step == 1:
            held.set()
            assert release.wait(scaled(WAIT_TIMEOUT)), "the gate was never opened"
        return original(self, step, tier, metadata)

    original_files = replication.owner_files

    def failing(storage, metadata, owner):
        if owner == 1:
            raise StorageError(f"rank {owner}: injected read failure")
        return original_files(storage, metadata, owner)

    replication.Replicator._run_job = gated
    events: list = []
    ckpt = TieredCheckpointer(tiers(root))
    ckpt.events.hooks.append(events.append)
    facts: dict = {}
    try:
        assert ckpt.maybe_save(1, make_state(mesh, rank, 1)) is not None  # returns with replication held
        assert held.wait(scaled(WAIT_TIMEOUT)), "replication of step 1 never started"
        facts["busy_while_held"] = sorted(ckpt.replicator.busy_steps("local"))
        facts["pinned_while_held"] = sorted(ckpt.promoter.busy_steps("local"))
        mine = root / "local" / str(rank // LOCAL) / step_dir(1)
        peer = (rank + LOCAL) % WS  # this rank's clique partner; the other clique of the node runs on its own
        facts["markers_while_held"] = sorted(p.name for p in mine.glob(f".replica-{peer}.json"))
        facts["replicated_while_held"] = ckpt.replicator.state(1)["local"]["replicated"]
        release.set()
        assert ckpt.maybe_save(2, make_state(mesh, rank, 2)) is not None
        _in_thread(ckpt.wait)
        facts["replicated"] = ckpt.replicator.state(2)["local"]["replicated"]
        replication.owner_files = failing
        assert ckpt.maybe_save(3, make_state(mesh, rank, 3)) is not None  # the failure is not raised here
        try:
            _in_thread(ckpt.wait)
            facts["wait_error"] = None
        except ReplicationError as exc:
            facts["wait_error"] = str(exc)
    finally:
        release.set()
        replication.Replicator._run_job = original
        replication.owner_files = original_files
        ckpt.close()
    facts["replication"] = [(e["step"], e["ok"]) for e in events if e.get("event") == "replication"]
    (out / f"save.rank{rank}.json").write_text(json.dumps(facts))


def _save_worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = _mesh()
    record(Path(out), "save", rank, lambda: _save(Path(data), Path(out), mesh, rank))


class _KillingStorage:
    """A Storage whose written file SIGKILLs the process once ``after`` bytes are written."""

    def __init__(self, inner, after: int, out: Path) -> None:
        self.inner, self.after, self.out = inner, after, out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def open_write(self, name: str):
        with self.inner.open_write(name) as f:
            yield _KillingFile(f, self.after, self.out)


class _KillingFile:
    def __init__(self, f, after: int, out: Path) -> None:
        self.f, self.left, self.out = f, after, out

    def write(self, data) -> int:
        n = self.f.write(data)
        self.left -= len(data)
        if self.left <= 0:
            self.f.flush()
            (self.out / "killed").write_text("rank 0")
            os.kill(os.getpid(), signal.SIGKILL)
        return n


def _killed_worker(rank: int, world_size: int, data: str, out: str) -> None:
    """Save step 1 (replicated to the end), then step 2, whose replication rank 0 dies in: SIGKILL as it
    starts receiving rank 2's file.  The spawn fails (the other ranks are killed with it)."""
    from dcp_tiered.tiers.replicas import replicate as replication, stream

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = _mesh()
    original = replication.stream_file

    def killing(group, src, me, entry, read, write, *args):
        if me == 0 and write is not None and write.url.rstrip("/").endswith(step_dir(2)):
            # dies inside the chunk loop, half of rank 2's file written (256-byte chunks)
            return original(group, src, me, entry, read, _KillingStorage(write, entry[1] // 2, Path(out)), *args)
        return original(group, src, me, entry, read, write, *args)

    replication.stream_file = killing
    stream.CHUNK_BYTES = 256
    ckpt = TieredCheckpointer(tiers(Path(data)))
    ckpt.maybe_save(1, make_state(mesh, rank, 1))
    _in_thread(ckpt.wait)
    ckpt.maybe_save(2, make_state(mesh, rank, 2))
    _in_thread(ckpt.wait)  # rank 0 dies; the others fail here or are killed by the spawn


def _restore(root: Path, out: Path, mesh, rank: int) -> None:
    ckpt = TieredCheckpointer(tiers(root))
    events: list = []
    ckpt.events.hooks.append(events.append)
    try:
        sd = make_state(mesh, rank, 0)
        got = _in_thread(lambda: ckpt.restore(sd))
        facts = {"step": got, "diffs": diffs(sd, rank, got) if isinstance(got, int) else ["nothing restored"],
                 "failures": ckpt.restore_failures,
                 "events": [(e["event"], e["step"], e["tier"]) for e in events if e.get("event", "").startswith("restore")],
                 "fetched": [e.get("fetched_bytes") for e in events if e.get("event") == "restore" and e.get("through_peers")]}
    finally:
        ckpt.close()
    (out / f"restore.rank{rank}.json").write_text(json.dumps(facts))


def _restore_worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = _mesh()
    record(Path(out), "restore", rank, lambda: _restore(Path(data), Path(out), mesh, rank))


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replication")


@pytest.fixture(scope="module")
def saved(root: Path) -> tuple[Path, str | None]:
    return run_ranks_recording(_save_worker, WS, root, str(root / "data"), root / "records_save", timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def node_lost(root: Path, saved) -> Path:
    """Node 1's local directory deleted; the shared tier's data files moved away (reading them fails)."""
    read_records(saved[0], "save", WS, saved[1])
    data = root / "data"
    shutil.rmtree(data / "local" / "1")
    hidden = root / "hidden_shared"
    hidden.mkdir()
    for f in (data / "shared").glob("step_*/__*.distcp"):
        (hidden / f.parent.name).mkdir(exist_ok=True)
        f.rename(hidden / f.parent.name / f.name)
    return data


@pytest.fixture(scope="module")
def restarted(root: Path, node_lost: Path) -> tuple[Path, str | None]:
    return run_ranks_recording(_restore_worker, WS, root, str(node_lost), root / "records_restore",
                               timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def killed(root: Path) -> tuple[Path, str | None]:
    """The kill during replication, node 1's directory deleted, then a restart of every rank."""
    data, out = root / "kill", root / "records_kill"
    _, error = run_ranks_recording(_killed_worker, WS, root, str(data), out, timeout=SPAWN_TIMEOUT)
    assert (out / "killed").exists(), f"rank 0 was not killed during replication: {error}"
    shutil.rmtree(data / "local" / "1")
    return run_ranks_recording(_restore_worker, WS, root, str(data), root / "records_kill_restore",
                               timeout=SPAWN_TIMEOUT)


def _facts(out: Path, name: str) -> list:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WS)]


# -- tests ---------------------------------------------------------------------------------------------


def test_cliques_as_nvrx() -> None:
    assert cliques(4, 2, 2) == [[0, 2], [1, 3]]
    assert cliques(8, 2, 1) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cliques(12, 3, 2) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    with pytest.raises(ConfigError, match="multiple of 4"):
        cliques(6, 2, 2)


def test_tier_fields_are_validated(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="node-local"):
        Tier("l", "/tmp/x", replicas=2)
    for bad in ({"replicas": 0}, {"replication_jump": 0}, {"replicas": True}, {"replicas": 1.5}):
        with pytest.raises(ConfigError):
            Tier("l", "/tmp/{node}", **bad)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    tier = Tier("l", "/tmp/{node}", replicas=2, replication_jump=1)
    with pytest.raises(ConfigError, match="multiple of the ranks per node"):
        check_replication(tier, 4)
    with pytest.raises(ConfigError, match="world size"):
        check_replication(Tier("l", "/tmp/{node}", replicas=2), 6)
    assert check_replication(Tier("l", "/tmp/{node}", replicas=2), 4) == [[0, 2], [1, 3]]  # J defaults to 2


def test_copies_never_share_their_owner_directory(monkeypatch) -> None:
    """Without LOCAL_WORLD_SIZE every rank maps to node 0: a ``{node}`` tier would write each copy over
    its original, so it is refused; a ``{rank}`` tier keeps one directory per rank."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="same directory"):
        check_replication(Tier("l", "/tmp/{node}", replicas=2), 4)
    assert check_replication(Tier("l", "/tmp/{rank}", replicas=2), 4) == [[0, 1], [2, 3]]


def test_markers_of_an_earlier_save_are_dropped(tmp_path: Path) -> None:
    """A step saved again (after a restore from an older step) first loses the replicas of the earlier
    save: a stale marker never vouches for files of another save."""
    from dcp_tiered.tiers.replicas.markers import read_markers
    from dcp_tiered.tiers.replicas.replicate import Replicator

    child = Storage(str(tmp_path / "step_000000001"))
    child.makedirs()
    for owner, save_id in ((2, "old"), (3, "new")):
        child.commit_bytes(f"__{owner}_0.distcp", b"x" * 8)
        marker = {"owner": owner, "save_id": save_id, "files": [{"file": f"__{owner}_0.distcp", "size": 8, "xxh3": "0"}]}
        child.commit_bytes(marker_name(owner), json.dumps(marker).encode())
    rep = Replicator.__new__(Replicator)
    rep.rank = 0
    rep._drop_stale(child, [0, 2, 3], "new")
    assert sorted(read_markers(child)) == [3] and sorted(child.file_sizes()) == [".replica-3.json", "__3_0.distcp"]


def test_a_save_returns_before_its_replication(saved) -> None:
    """The save of step 1 returned while its replication was held: the step was busy (retention
    keeps it) and had no replica marker; once released, both steps replicated."""
    read_records(saved[0], "save", WS, saved[1])
    for rank, f in enumerate(_facts(saved[0], "save")):
        assert f["busy_while_held"] == [1] and 1 in f["pinned_while_held"], f"rank {rank}: {f}"
        assert f["markers_while_held"] == [], f"rank {rank}: {f}"
        assert f["replicated_while_held"] is False and f["replicated"] is True, f"rank {rank}: {f}"
        failed = rank in (1, 3)  # clique [1, 3]: rank 1 could not send its files of step 3
        assert f["replication"] == [[1, True], [2, True], [3, not failed]], f"rank {rank}: {f}"
        assert (f["wait_error"] is not None and "injected read failure" in f["wait_error"]) == failed, f"rank {rank}: {f}"


def test_each_node_holds_committed_replicas_of_the_other(saved, root: Path) -> None:
    read_records(saved[0], "save", WS, saved[1])
    local = root / "data" / "local"
    for step in STEPS:
        for node in (0, 1):
            mine = local / str(node) / step_dir(step)
            peers = [r for r in range(WS) if r // LOCAL != node and (step, r) != (3, 1)]
            assert sorted(p.name for p in mine.glob(".replica-*")) == [f".replica-{r}.json" for r in peers]
            for r in peers:
                marker = json.loads((mine / f".replica-{r}.json").read_text())
                assert marker["owner"] == r and marker["step"] == step and marker["files"], marker
                for entry in marker["files"]:
                    original = local / str(r // LOCAL) / step_dir(step) / entry["file"]
                    data = original.read_bytes()
                    assert (mine / entry["file"]).read_bytes() == data
                    assert entry["size"] == len(data) and entry["xxh3"] == xxhash.xxh3_64(data).hexdigest()


def test_lost_node_restores_from_peer_replicas(restarted, root: Path) -> None:
    """Node 1 replaced (its local directory gone): every rank restores the newest step from
    ``local`` bit-exact, without reading the shared tier (its data files are gone, so any read
    of it would fail); node 1's directory is whole and committed again."""
    read_records(restarted[0], "restore", WS, restarted[1])
    for rank, f in enumerate(_facts(restarted[0], "restore")):
        assert f["step"] == STEPS[-1] and f["diffs"] == [], f"rank {rank}: {f}"
        assert f["events"] == [["restore", STEPS[-1], "local"]] and f["failures"] == 0, f"rank {rank}: {f}"
        # the restore event says it came through peers; node 1's ranks received their files, node 0's nothing
        assert len(f["fetched"]) == 1 and (f["fetched"][0] > 0) == (rank >= 2), f"rank {rank}: {f}"
    node1 = root / "data" / "local" / "1" / step_dir(STEPS[-1])
    assert (node1 / ".metadata").is_file()
    # its ranks' files, and the holders' files kept as committed replicas again (node 1 holds what it held)
    assert {p.name.split("_")[2] for p in node1.glob("__*.distcp")} == {"0", "1", "2", "3"}
    save_id = json.loads((node1.parent.parent / "0" / step_dir(STEPS[-1]) / ".replica-2.json").read_text())["save_id"]
    for owner in (0, 1):
        marker = json.loads((node1 / f".replica-{owner}.json").read_text())
        assert marker["save_id"] == save_id and marker["step"] == STEPS[-1], marker
        for entry in marker["files"]:
            assert xxhash.xxh3_64((node1 / entry["file"]).read_bytes()).hexdigest() == entry["xxh3"], entry


def test_kill_during_replication_never_restores_a_torn_state(killed, root: Path) -> None:
    read_records(killed[0], "restore", WS, killed[1])
    facts = _facts(killed[0], "restore")
    for rank, f in enumerate(facts):
        assert f["diffs"] == [], f"rank {rank}: {f}"
        assert f["events"][-1][0] == "restore" and f["events"][-1][1] == f["step"], f"rank {rank}: {f}"
        assert f["events"][-1][1:] != [2, "local"], f"rank {rank}: step 2 on local lacks rank 2's files: {f}"
    assert len({(f["step"], tuple(f["events"][-1])) for f in facts}) == 1, facts
    node0 = root / "kill" / "local" / "0" / step_dir(2)
    assert not (node0 / ".replica-2.json").exists(), "rank 0 was killed before it received rank 2's files"
    assert list(node0.glob("__2_*.distcp")), "rank 0 was killed before it wrote part of rank 2's file"


def test_pins_are_counted() -> None:
    """A restore pinning and releasing a step that a replication also pins leaves it pinned (busy for retention)."""
    from dcp_tiered.tiers.pins import StepMarks

    marks = StepMarks()
    marks.pin(["local"], 5, True)  # the replication of step 5
    marks.pin(["local"], 5, True)  # a restore reading it
    marks.pin(["local"], 5, False)
    assert marks.pinned("local") == {5}
    marks.pin(["local"], 5, False)
    marks.pin(["local"], 5, False)  # one release too many changes nothing
    assert marks.pinned("local") == set()


# -- replica files count only under a committed marker of the same save -----------------------------


def _saved_dir(tmp_path: Path) -> tuple[Storage, dict[str, int], dict]:
    """A committed checkpoint written by rank 0 alone (its file ``__0_0.distcp``), save id ``new``."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    url = str(tmp_path / "step_000000001")
    dcp.save(state, storage_writer=CompressedWriter(url, save_id="new"), no_dist=True)
    child = Storage(url)
    return child, child.file_sizes(), {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.mark.parametrize("marker", ["none", "other save", "other size", "same save"])
def test_a_replica_file_counts_only_under_a_committed_marker_of_the_save(tmp_path: Path, marker: str) -> None:
    """The directory is node 1's (ranks 2 and 3); ``__0_0.distcp`` is rank 0's file, which node 1 holds
    only as a replica: without a marker of this save at this size, a load needing it lacks it."""
    child, files, template = _saved_dir(tmp_path)
    data = [f for f in files if rank_of_file(f) == 0]
    assert data, files
    if marker != "none":
        entries = [{"file": f, "size": files[f] + (marker == "other size"), "xxh3": "0"} for f in data]
        save_id = "old" if marker == "other save" else "new"
        child.commit_bytes(marker_name(0), json.dumps({"owner": 0, "save_id": save_id, "files": entries}).encode())
    node1 = lambda f: rank_of_file(f) in (2, 3)  # noqa: E731
    got = lacking_files(child, child.file_sizes(), template, node1)
    assert got == ([] if marker == "same save" else sorted(data)), (marker, got)
    # the directory's own ranks' files count as they are, marker or not
    assert lacking_files(child, child.file_sizes(), template, lambda f: rank_of_file(f) in (0, 1)) == []
