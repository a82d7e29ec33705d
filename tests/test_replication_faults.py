"""Peer replication and restore through peers under faults (a hostile review of issue 16).

4 gloo ranks simulate 2 nodes of 2 ranks (``LOCAL_WORLD_SIZE=2``); ``local`` is
``.../local/{node}`` with ``replicas=2, replication_jump=2`` (cliques [0, 2] and [1, 3]), tiny
states and 64-byte chunks (several chunks per file), clique collectives time out after 30 s.
One spawn runs every scenario in turn (each recorded per rank), then the tests read the records:

- a receiver's write failing (ENOSPC) at the first chunk fails that step's replication on that rank
  only, at ``wait()``; the clique stays in step, the next step replicates; no partial file is left;
- with ``keep=1``, the newest fully replicated step is kept while the next step's replication runs;
- node 1 lost, then at restore: a fetched file's write failing on one rank, a replica marker
  claiming a huge size, a replica with a flipped byte: every rank moves on together and restores
  the same step bit-exact, no garbage is written, no ``.metadata`` commits a node whose files are not
  all verified;
- replica markers whose ``files`` is not a list are treated as absent: restore still uses the
  node-local tier, ``dcp-tiered ls`` works;
- one rank configured with other replication settings: the same ``ConfigError`` on every rank, no hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from speed import scaled
import torch
from gloo_ranks import read_records, record, run_ranks_recording
from test_replication import _in_thread

from dcp_tiered import ConfigError, ReplicationError, Tier, TieredCheckpointer
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.replicas.markers import marker_name, read_markers

WS, LOCAL = 4, 2
SPAWN_TIMEOUT = 600.0
OP_TIMEOUT = 150.0
HUGE = 10**6  # the size a hostile marker claims (small: an earlier run with 10**13 filled the disk)
RESTORES = ("f7_write_fails", "f2_huge_marker", "f6_flipped_byte", "f1_marker_not_list")


def tiers(root: Path, keep: int = 3) -> list[Tier]:
    return [Tier("local", f"{root}/local/{{node}}", keep=keep, codec="none", replicas=2, replication_jump=2),
            Tier("shared", f"{root}/shared", keep=3, codec="none")]


def state(rank: int, step: int) -> dict:
    return {f"own{rank}": torch.full((64,), float(step * 10 + rank))}


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


class _NoSpace:
    """A Storage whose files fail every write with ENOSPC."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def open_write(self, name: str):
        with self.inner.open_write(name) as f:
            yield _NoSpaceFile(f)


class _NoSpaceFile:
    def __init__(self, f) -> None:
        self.f = f

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


@contextlib.contextmanager
def _failing_writes(module, rank: int, step: int):
    """``module.stream_file`` with rank ``rank``'s writes into ``step``'s directory failing."""
    original = module.stream_file

    def injected(group, src, me, entry, read, write, *args):
        if me == rank and write is not None and write.url.rstrip("/").endswith(step_dir(step)):
            write = _NoSpace(write)
        return original(group, src, me, entry, read, write, *args)

    module.stream_file = injected
    try:
        yield
    finally:
        module.stream_file = original


def _dump(out: Path, name: str, rank: int, facts: dict) -> None:
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(facts))


# -- scenarios, on every rank ------------------------------------------------------------------------


def _write_fails_in_replication(root: Path, out: Path, rank: int) -> None:
    from dcp_tiered.tiers.replicas import replicate as replication

    ckpt = TieredCheckpointer(tiers(root))
    events: list = []
    ckpt.events.hooks.append(events.append)
    facts: dict = {}
    try:
        with _failing_writes(replication, 2, 1):  # rank 2 receives rank 0's files of step 1: ENOSPC
            ckpt.save_now(1, state(rank, 1))
            try:
                _in_thread(ckpt.wait)
                facts["error1"] = None
            except ReplicationError as exc:
                facts["error1"] = str(exc)
        ckpt.save_now(2, state(rank, 2))
        _in_thread(ckpt.wait)  # the clique is in step: step 2 replicates
    finally:
        ckpt.close()
    facts["events"] = [(e["step"], e["ok"], e.get("sent_bytes")) for e in events if e.get("event") == "replication"]
    _dump(out, "replication_write_fails", rank, facts)


def _keep1(root: Path, out: Path, rank: int) -> None:
    """keep=1: step 1 replicated; step 2 saved, its replication held; after step 2's node commit and
    retention, step 1 (the newest fully replicated step) is still on every node."""
    import torch.distributed as dist

    from dcp_tiered.tiers.replicas import replicate as replication

    ckpt = TieredCheckpointer(tiers(root, keep=1))
    release = threading.Event()
    original = replication.Replicator._run_job

    def held(self, step, tier, metadata):
        if step == 2:
            release.wait(scaled(OP_TIMEOUT))
            return None
        return original(self, step, tier, metadata)

    try:
        ckpt.save_now(1, state(rank, 1))
        _in_thread(ckpt.wait)
        replication.Replicator._run_job = held
        ckpt.save_now(2, state(rank, 2))
        ckpt.promoter.wait(scaled(OP_TIMEOUT))  # node commit done; retention ran
        dist.barrier()
        ckpt.promoter.retention(next(t for t in ckpt.tiers if t.name == "local"))  # once more, every node committed
        ckpt.promoter.wait(scaled(OP_TIMEOUT))
        dist.barrier()
        facts = {"dirs": sorted(str(p.relative_to(root)) for p in (root / "local").glob("*/step_*")
                                if (p / ".metadata").is_file())}
    finally:
        release.set()
        replication.Replicator._run_job = original
        ckpt.close()
    _dump(out, "keep1", rank, facts)


def _save_base(root: Path, rank: int) -> None:
    ckpt = TieredCheckpointer(tiers(root))
    try:
        for step in (1, 2):
            ckpt.save_now(step, state(rank, step))
            _in_thread(ckpt.wait)
    finally:
        ckpt.close()


def _damage(data: Path) -> None:
    """Rank 0: one copy of the base checkpoints per restore scenario, damaged as it says."""
    base = data / "base"
    for name in RESTORES:
        shutil.copytree(base, data / name)
        if not name.startswith("f1"):
            shutil.rmtree(data / name / "local" / "1")  # node 1 lost
    node0 = lambda name: data / name / "local" / "0" / step_dir(2)  # noqa: E731
    marker = node0("f2_huge_marker") / marker_name(2)
    m = json.loads(marker.read_text())
    m["files"][0]["size"] = HUGE
    marker.write_text(json.dumps(m))
    (replica,) = node0("f6_flipped_byte").glob("__2_*.distcp")
    b = bytearray(replica.read_bytes())
    b[-5] ^= 0xFF
    replica.write_bytes(bytes(b))
    for node, owner in ((0, 2), (1, 0)):
        marker = data / "f1_marker_not_list" / "local" / str(node) / step_dir(2) / marker_name(owner)
        m = json.loads(marker.read_text())
        m["files"] = 5
        marker.write_text(json.dumps(m))


def _restore(root: Path, out: Path, name: str, rank: int) -> None:
    from dcp_tiered.tiers.replicas import fetch as peer_fetch

    ckpt = TieredCheckpointer(tiers(root))
    events: list = []
    ckpt.events.hooks.append(events.append)
    sd = {f"own{rank}": torch.zeros(64)}
    injected = _failing_writes(peer_fetch, 2, 2) if name.startswith("f7") else contextlib.nullcontext()
    try:
        with injected:
            got = _in_thread(lambda: ckpt.restore(sd))
    finally:
        ckpt.close()
    facts = {"step": got, "exact": isinstance(got, int) and torch.equal(sd[f"own{rank}"], state(rank, got)[f"own{rank}"]),
             "restored_from": [e["tier"] for e in events if e.get("event") == "restore"]}
    _dump(out, name, rank, facts)


def _odd_config(root: Path, out: Path, rank: int) -> None:
    """Rank 3 without replication, the others with: every rank raises the same ConfigError, none hangs."""
    chosen = tiers(root)
    if rank == 3:
        chosen[0] = dataclasses.replace(chosen[0], replicas=1, replication_jump=None)
    try:
        TieredCheckpointer(chosen)  # before the fix: ranks 0-2 hang in new_group
        got = "constructed"
    except ConfigError as exc:
        got = str(exc)
    _dump(out, "odd_config", rank, {"got": got})


def _worker(rank: int, world_size: int, data: str, out: str) -> None:
    from dcp_tiered.tiers.replicas import replicate as replication, stream

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    stream.CHUNK_BYTES = 64
    replication.TIMEOUT_S = scaled(30.0)
    root, rec = Path(data), Path(out)
    record(rec, "replication_write_fails", rank, lambda: _write_fails_in_replication(root / "f5", rec, rank))
    record(rec, "keep1", rank, lambda: _keep1(root / "f3", rec, rank))
    record(rec, "base", rank, lambda: _save_base(root / "base", rank))
    record(rec, "damage", rank, lambda: _damage(root) if rank == 0 else None)
    for name in RESTORES:
        record(rec, name, rank, lambda name=name: _restore(root / name, rec, name, rank))
    record(rec, "odd_config", rank, lambda: _odd_config(root / "f4", rec, rank))


# -- fixtures and tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replication_faults")


@pytest.fixture(scope="module")
def ran(root: Path) -> tuple[Path, str | None]:
    return run_ranks_recording(_worker, WS, root, str(root / "data"), root / "records", timeout=SPAWN_TIMEOUT)


def _facts(ran, name: str) -> list[dict]:
    read_records(ran[0], name, WS, ran[1])
    return [json.loads((ran[0] / f"{name}.rank{r}.json").read_text()) for r in range(WS)]


def test_a_failed_write_fails_one_step_on_one_rank_and_the_clique_goes_on(ran, root: Path) -> None:
    for rank, f in enumerate(_facts(ran, "replication_write_fails")):
        assert (f["error1"] is not None) == (rank == 2), f"rank {rank}: {f}"
        assert rank != 2 or "No space left" in f["error1"], f
        assert [e[:2] for e in f["events"]] == [[1, rank != 2], [2, True]], f"rank {rank}: {f}"
        assert all(e[2] > 0 for e in f["events"]), f"rank {rank}: {f}"  # rank 2 sent its files before failing
    step1 = root / "data" / "f5" / "local" / "1" / step_dir(1)
    assert not list(step1.glob("__0_*")) and not (step1 / marker_name(0)).exists(), sorted(os.listdir(step1))
    assert (root / "data" / "f5" / "local" / "1" / step_dir(2) / marker_name(0)).is_file()


def test_keep1_keeps_the_newest_fully_replicated_step_while_the_next_replicates(ran) -> None:
    for rank, f in enumerate(_facts(ran, "keep1")):
        assert f["dirs"] == [f"local/{n}/{step_dir(s)}" for n in (0, 1) for s in (1, 2)], f"rank {rank}: {f}"


@pytest.mark.parametrize("name", RESTORES)
def test_restore_through_faulty_peers_moves_on_together(ran, root: Path, name: str) -> None:
    read_records(ran[0], "damage", WS, ran[1])
    facts = _facts(ran, name)
    for rank, f in enumerate(facts):
        assert f["step"] == 2 and f["exact"], f"rank {rank}: {f}"
    assert len({tuple(f["restored_from"]) for f in facts}) == 1, facts
    node1 = root / "data" / name / "local" / "1" / step_dir(2)
    files = {p.name: p.stat().st_size for p in node1.glob("*")} if node1.exists() else {}
    if name.startswith("f1"):  # nothing lost: the malformed markers are absent, the local tier restores
        assert facts[0]["restored_from"] == ["local"], facts
        return
    assert facts[0]["restored_from"] == ["shared"], facts
    assert all(size < HUGE for size in files.values()), files  # no garbage written
    assert ".metadata" not in files, files  # node 1 never committed: rank 2's files were not all verified
    assert not [f for f in files if f.startswith("__2_")], files  # no failed or partial file of rank 2 kept


def test_ls_survives_a_malformed_marker(ran, root: Path) -> None:
    read_records(ran[0], "f1_marker_not_list", WS, ran[1])
    local = root / "data" / "f1_marker_not_list" / "local"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "dcp_tiered.cli", "ls", "--local-path", f"{local}/{{node}}",
                           "--replicas", "2", "--replication-jump", "2", "--ranks-per-node", "2"],
                          capture_output=True, text=True, timeout=scaled(120), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ranks_configured_differently_all_raise_the_same_config_error(ran) -> None:
    facts = _facts(ran, "odd_config")
    for rank, f in enumerate(facts):
        assert "disagree on replication" in f["got"], f"rank {rank}: {f}"
    assert len({f["got"] for f in facts}) == 1, facts


# -- pure checks -------------------------------------------------------------------------------------------


def _marker(child: Storage, file_owner: int, owner: int, files) -> None:
    child.commit_bytes(marker_name(file_owner), json.dumps({"owner": owner, "save_id": "s", "files": files}).encode())


def test_malformed_markers_are_absent_and_never_shadow_a_good_one(tmp_path: Path) -> None:
    child = Storage(str(tmp_path / step_dir(1)))
    child.makedirs()
    good = [{"file": "__2_0.distcp", "size": 8, "xxh3": "0"}]
    _marker(child, 2, 2, good)
    _marker(child, 3, 2, good)  # .replica-3.json claiming owner 2
    _marker(child, 1, 1, 5)  # files not a list
    assert {o: m["files"] for o, m in read_markers(child).items()} == {2: good}


def test_offers_are_checked_against_the_metadata(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_tiered.dcp.metadata_io import load_metadata
    from dcp_tiered.dcp.writer import CompressedWriter
    from dcp_tiered.tiers.replicas.replicate import offer_problem

    url = str(tmp_path / step_dir(1))
    dcp.save({"w": torch.arange(12.0)}, storage_writer=CompressedWriter(url, save_id="s"), no_dist=True)
    child = Storage(url)
    metadata = load_metadata(child)
    (name,) = [f for f in child.file_sizes() if f.startswith("__0_")]
    size = child.size(name)
    assert offer_problem([(name, size, "0")], metadata, 0) is None
    assert "refused" in offer_problem([(name, HUGE, "0")], metadata, 0)
    assert "refused" in offer_problem([("__0_9.distcp", 1, "0")], metadata, 0)
    assert "refused" in offer_problem([(name, size, "0"), (name, size, "0")], metadata, 0)


def test_a_broken_clique_group_fails_fast() -> None:
    from dcp_tiered.tiers.replicas.stream import _BROKEN, check_group, mark_broken

    group = object()
    check_group(group, [0, 2])  # not broken: nothing raised
    mark_broken(group, "broadcast timed out")
    try:
        with pytest.raises(ReplicationError, match="failed earlier .broadcast timed out"):
            check_group(group, [0, 2])
    finally:
        _BROKEN.pop(id(group), None)
