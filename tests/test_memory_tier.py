"""Memory tiers (issue 16): a ``Tier`` on ``/dev/shm``/tmpfs, its budget, crash survival, and the
``none``-codec read path that loads straight into the destination tensors."""

from __future__ import annotations

import io
import os
import shutil
import signal
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered import (CompressedReader, CompressedWriter, ConfigError, CorruptCheckpointError, MemoryBudgetError,
                        SaveError, StorageError, Tier, TieredCheckpointer)
from dcp_tiered.dcp.format import record_view
from dcp_tiered.tiers.save import budget as memory
from dcp_tiered.tiers.events import root_cause
from dcp_tiered.tiers.config import is_memory_path, mount_fstype, parse_bytes
from dcp_tiered.tiers.save.budget import budget_problem, held_bytes, node_save_bytes

from gloo_ranks import run_ranks
from isolated import run_isolated

SHM = Path("/dev/shm")
MIB = 1 << 20


def _shm_usable() -> str | None:
    """None when /dev/shm is a writable tmpfs, else why the tests that need it are skipped."""
    if not SHM.is_dir():
        return "no /dev/shm on this machine"
    if not os.access(SHM, os.W_OK | os.X_OK):
        return "/dev/shm is not writable"
    if not is_memory_path(str(SHM)):
        return "/dev/shm is not a tmpfs here"
    return None


@pytest.fixture
def shm_dir():
    """A fresh ``/dev/shm/dcp-tiered-test-<uuid>`` directory, removed afterwards even when the test fails."""
    why = _shm_usable()
    if why:
        pytest.skip(why)
    path = SHM / f"dcp-tiered-test-{uuid.uuid4().hex}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _state(seed: int, numel: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(numel, generator=g),
        "h": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**40), 2**40, (257,), generator=g, dtype=torch.int64),
        "meta": {"step": seed, "note": "x" * 10},
    }


def _zeros_like(sd: dict) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1, "note": ""}) for k, v in sd.items()}


def _assert_same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].dtype == v.dtype and torch.equal(b[k].view(torch.uint8) if v.dtype == torch.bfloat16 else b[k],
                                                         v.view(torch.uint8) if v.dtype == torch.bfloat16 else v), k
        else:
            assert b[k] == v, k


def _files(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its size (nothing when ``root`` does not exist)."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- detection and fields


def test_shm_tier_is_memory_with_defaults(shm_dir, tmp_path):
    t = Tier("mem", shm_dir / "ckpt" / "{rank}")
    assert (t.kind, t.keep, t.codec, t.memory_budget) == ("memory", 1, "none", None)
    # the user's choices win over the memory defaults
    t2 = Tier("mem", f"file://{shm_dir}/c", keep=2, codec="zstd:1", memory_budget="512MiB")
    assert (t2.kind, t2.keep, t2.codec, t2.memory_budget) == ("memory", 2, "zstd:1", 512 * MIB)
    # an explicit kind turns detection off
    t3 = Tier("mem", shm_dir / "c3", kind="storage")
    assert t3.keep == 2 and t3.codec.startswith("zstd")
    assert Tier("s3", "s3://bucket/ckpt").kind == "storage"
    if not is_memory_path(str(tmp_path)):
        disk = Tier("disk", tmp_path / "d")
        assert (disk.kind, disk.keep) == ("storage", 2) and disk.codec.startswith("zstd")
        forced = Tier("ram", tmp_path / "r", kind="memory")
        assert (forced.keep, forced.codec) == (1, "none")


def test_memory_fields_from_yaml_mapping_and_errors(shm_dir):
    t = Tier.from_dict({"name": "m", "url": str(shm_dir / "x"), "memory_budget": "1.5GiB"})
    assert t.memory_budget == 3 * (1 << 29) and t.kind == "memory"
    for bad in ("lots", "-1GiB", 0, True, "8 parsecs", 1.5):
        with pytest.raises(ConfigError, match="tier 'm': field 'memory_budget'"):
            Tier("m", shm_dir / "x", memory_budget=bad)
    with pytest.raises(ConfigError, match="field 'kind'"):
        Tier("m", shm_dir / "x", kind="ram")
    with pytest.raises(ConfigError, match="field 'keep'"):
        Tier("m", shm_dir / "x", keep=None)


@pytest.mark.parametrize("text, n", [("8GiB", 8 << 30), ("512MiB", 512 * MIB), ("2GB", 2 * 10**9), ("1024", 1024),
                                     (" 4 kib ", 4096), ("1.5KiB", 1536), (7, 7), ("3b", 3)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_mount_fstype_longest_mount_point_wins():
    mounts = ("overlay / overlay rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
              "tmpfs /mnt/ram\\040disk tmpfs rw 0 0\n/dev/sda1 /dev/shm/disk ext4 rw 0 0\n")
    assert mount_fstype(mounts, "/dev/shm/x/y") == "tmpfs"
    assert mount_fstype(mounts, "/dev/shm/disk/x") == "ext4"
    assert mount_fstype(mounts, "/dev/shmx") == "overlay"
    assert mount_fstype(mounts, "/mnt/ram disk/a") == "tmpfs"
    assert mount_fstype("", "/x") is None


# --------------------------------------------------------------------------- budget: pure parts


def _plan(*numels: int):
    items = [SimpleNamespace(tensor_data=SimpleNamespace(chunk=SimpleNamespace(sizes=torch.Size([n])),
                                                          properties=SimpleNamespace(dtype=torch.float32)))
             for n in numels]
    return SimpleNamespace(items=items)


def test_node_save_bytes_sums_each_node_ranks():
    plans = [_plan(1000), _plan(2000), _plan(10), _plan()]  # 4 ranks, 2 per node
    got = node_save_bytes(plans, lambda r: r // 2)
    assert set(got) == {0, 1}
    assert got[0] >= 3000 * 4 and got[1] >= 10 * 4
    assert got[0] - 3000 * 4 < 4096 and got[1] - 40 < 4096  # headers and metadata: small


@settings(max_examples=200, deadline=None)
@given(needed=st.integers(0, 1 << 40), held=st.integers(0, 1 << 40), budget=st.integers(1, 1 << 41))
def test_budget_problem_refuses_exactly_over_budget(needed, held, budget):
    problem = budget_problem("mem", needed, held, budget, None, 1)
    assert (problem is not None) == (needed + held > budget)
    if problem:
        assert "'mem'" in problem and str(budget) in problem and str(needed + held) in problem
        assert "raise memory_budget" in problem and "lower keep" in problem and "dtype='bf16'" in problem
        assert "codec" not in problem  # the estimate counts raw bytes: a codec would not change it


def _info(step: int, size: int, committed: bool = True, pending: tuple = (), keys: frozenset | None = None):
    from dcp_tiered.tiers.catalog import CheckpointInfo

    name = f"step_{step:09d}"
    return CheckpointInfo("mem", 0, step, name, f"/x/{name}", committed, size, pending_promotions=pending, keys=keys)


def test_budget_problem_free_space_and_held_bytes():
    assert "only 100 bytes free" in budget_problem("mem", 200, 0, None, 100, 1)
    assert budget_problem("mem", 100, 10**9, None, 100, 1) is None  # held bytes already take their space
    assert "dtype='bf16'" not in budget_problem("mem", 200, 0, 100, None, 1, dtype="bf16")
    infos = [_info(1, 105), _info(2, 7, committed=False), _info(3, 53)]
    # keep=1: step 1 is retention's to delete; step 2, a crashed save's leftover, stays for the grace period
    assert held_bytes(infos, keep=1) == 60
    assert held_bytes(infos, keep=1, own=[2]) == 53  # this process's own leftover: deleted at once
    assert held_bytes(infos, keep=2) == 165
    assert held_bytes(infos, keep=2, replacing="step_000000003") == 112
    assert held_bytes([], keep=1) == 0


def test_held_bytes_counts_steps_promotions_still_read():
    """Steps pinned by pending promotions (an intent in the directory, or a queued job of this process)
    stay in the tier past keep: the budget counts them."""
    infos = [_info(1, 100, pending=("disk",)), _info(2, 10), _info(3, 1)]
    assert held_bytes(infos, keep=1) == 101
    assert held_bytes(infos, keep=1, busy=[2]) == 111
    assert held_bytes(infos, keep=1, known_tiers={"other"}) == 1  # an intent naming no known tier pins nothing


def test_held_bytes_counts_the_newest_full_checkpoint_beyond_keep():
    """optimizer_every > 1: retention keeps the newest checkpoint holding the optimizer state beyond keep."""
    infos = [_info(1, 300, keys=frozenset({"model.w", "optim.m"})), _info(2, 100, keys=frozenset({"model.w"}))]
    assert held_bytes(infos, keep=1, optimizer_keys=("optim",)) == 400
    assert held_bytes(infos, keep=1) == 100


def test_object_bytes_counts_lengths_and_pickled_sizes():
    import io
    import pickle

    assert memory.object_bytes(b"x" * 5000) == 5000
    assert memory.object_bytes(bytearray(7)) == 7
    assert memory.object_bytes(io.BytesIO(b"y" * 123)) == 123
    big = list(range(100_000))
    assert memory.object_bytes(big) == len(pickle.dumps(big, protocol=pickle.DEFAULT_PROTOCOL))
    assert memory.object_bytes(lambda: 1) == memory.OBJECT_ESTIMATE  # cannot be pickled: the save names it


def test_free_ram_is_the_least_of_tmpfs_meminfo_and_cgroup(tmp_path, monkeypatch):
    assert memory.mem_available("MemTotal: 100 kB\nMemAvailable:     2048 kB\n") == 2 << 20
    assert memory.mem_available("") is None
    cg = tmp_path / "cg"
    (cg / "job" / "step").mkdir(parents=True)
    for d, limit, cur in ((cg, "max", 10), (cg / "job", "5000", 1000), (cg / "job" / "step", "max", 900)):
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{cur}\n")
    assert memory.cgroup_room("0::/job/step\n", str(cg)) == 4000  # the parent's limit applies
    assert memory.cgroup_room("12:memory:/x\n", str(cg)) is None  # cgroup v1: not read
    reads = {"/proc/meminfo": "MemAvailable: 1 kB\n", "/proc/self/cgroup": ""}
    monkeypatch.setattr(memory, "_read", lambda path: reads.get(path, ""))
    assert memory._free_bytes("/") == 1024
    assert memory._free_bytes("/", ram=False) > 1024  # a disk tier: its file system only


# --------------------------------------------------------------------------- budget: real saves


def _over_budget(exc: BaseException) -> MemoryBudgetError:
    cause = exc.__cause__
    assert isinstance(cause, MemoryBudgetError), repr(exc)
    assert isinstance(cause, StorageError)
    return cause


def test_over_budget_save_writes_nothing_and_later_saves_work(shm_dir, tmp_path):
    mem = Tier("mem", shm_dir / "ckpt", memory_budget=3 * MIB)
    disk = Tier("disk", tmp_path / "disk", keep=5, every_steps=3)  # not due at step 2: nothing to fall back to
    with TieredCheckpointer([mem, disk]) as ck:
        small = _state(1, 64 * 1024)  # ~0.3 MiB
        ck.save_now(1, small)
        ck.wait()  # step 1's promotion rewrites its intent as it goes: compare after it is done
        before = _files(shm_dir / "ckpt")
        with pytest.raises(SaveError) as info:
            ck.maybe_save(2, _state(2, 1 << 20))  # 4 MiB of float32 alone
        err = _over_budget(info.value)
        msg = str(info.value)
        assert "memory tier 'mem'" in msg and str(3 * MIB) in msg and str(err.needed) in msg
        assert "raise memory_budget" in msg and "lower keep" in msg and "nothing was written" in msg
        assert err.tier == "mem" and err.budget == 3 * MIB and err.needed > 4 * MIB
        assert _files(shm_dir / "ckpt") == before  # not even a directory or lock of step 2
        assert not (tmp_path / "disk" / "step_000000002").exists()
        later = _state(3, 64 * 1024)
        ck.save_now(3, later)  # fits again: the checkpointer and every tier keep working
        ck.wait()
        assert (tmp_path / "disk" / "step_000000003" / ".metadata").is_file()
        assert sorted(p.name for p in (shm_dir / "ckpt").iterdir()) == ["step_000000003"]  # keep=1
        out = _zeros_like(later)
        assert ck.restore(out) == 3
    _assert_same(later, out)


def test_budget_counts_the_checkpoint_kept_while_the_next_is_written(shm_dir):
    """keep=1 deletes the previous step only after the new one commits: the budget must hold two."""
    sd = _state(1, 256 * 1024)  # ~1 MiB stored
    with TieredCheckpointer([Tier("mem", shm_dir / "ckpt", memory_budget="1700KiB")]) as ck:
        ck.save_now(1, sd)
        with pytest.raises(SaveError) as info:
            ck.save_now(2, sd)
        assert "the tier holds" in str(info.value)
        assert [p.name for p in (shm_dir / "ckpt").iterdir()] == ["step_000000001"]
    with TieredCheckpointer([Tier("mem", shm_dir / "ckpt2", memory_budget="2200KiB")]) as ck:
        for step in (1, 2, 3):
            ck.save_now(step, sd)
    assert [p.name for p in (shm_dir / "ckpt2").iterdir()] == ["step_000000003"]


def test_async_over_budget_save_is_refused_at_once(shm_dir):
    """Decided on the main thread before staging, as in sync mode: raised by the call that asked for it."""
    with TieredCheckpointer([Tier("mem", shm_dir / "ckpt", memory_budget=2 * MIB)], async_save=True) as ck:
        with pytest.raises(SaveError) as info:
            ck.maybe_save(1, _state(1, 1 << 20), force=True)
        assert isinstance(info.value.__cause__, MemoryBudgetError)
        ck.wait()
        assert "memory tier 'mem'" in str(info.value) and "nothing was written" in str(info.value)
        assert _files(shm_dir / "ckpt") == {}
        small = _state(2, 1024)
        ck.maybe_save(2, small, force=True)
        ck.wait()
        out = _zeros_like(small)
        assert ck.restore(out) == 2
    _assert_same(small, out)


def test_free_space_is_checked_without_a_budget(shm_dir, monkeypatch):
    monkeypatch.setattr(memory, "_free_bytes", lambda path, ram=True: 1000)
    with TieredCheckpointer([Tier("mem", shm_dir / "ckpt")]) as ck:
        with pytest.raises(SaveError, match="only 1000 bytes free"):
            ck.save_now(1, _state(1, 1024))
    assert _files(shm_dir / "ckpt") == {}


def test_fitting_save_commits_with_none_codec_and_restores_bit_exact(shm_dir):
    sd = _state(7, 300_001)
    with TieredCheckpointer([Tier("mem", shm_dir / "ckpt", memory_budget="64MiB")]) as ck:
        report = ck.save_now(7, sd)
        assert report.ok and report.tiers == ["mem"]
        out = _zeros_like(sd)
        assert ck.restore(out) == 7
    _assert_same(sd, out)
    reader = CompressedReader(shm_dir / "ckpt" / "step_000000007")
    codecs = {record_view(r).codec for r in reader.read_metadata().storage_data.values()}
    assert codecs == {"none"}


def _two_rank_budget(rank: int, world: int, root: str) -> None:
    """Each rank's 1 MiB fits the 2 MiB budget alone, both together do not: the node's sum is checked."""
    url = f"{root}/ckpt"
    with TieredCheckpointer([Tier("mem", url, memory_budget=2 * MIB)]) as ck:
        big = {f"w{rank}": torch.full((1 << 18,) if rank else (1 << 15,), float(rank))}  # 1 MiB + 128 KiB
        with pytest.raises(SaveError, match="memory tier 'mem' refuses the save"):
            ck.save_now(1, {f"v{rank}": torch.ones(1 << 18) * rank})  # 1 MiB per rank, 2 MiB + headers on the node
        assert _files(Path(url)) == {}
        ck.save_now(2, big)
        out = {f"w{rank}": torch.zeros_like(big[f"w{rank}"])}
        assert ck.restore(out) == 2 and torch.equal(out[f"w{rank}"], big[f"w{rank}"])
    Path(root, f"ok{rank}").write_text("ok")


def test_budget_counts_every_rank_of_the_node(shm_dir, tmp_path):
    run_ranks(_two_rank_budget, 2, tmp_path, str(shm_dir), timeout=300)
    assert (shm_dir / "ok0").is_file() and (shm_dir / "ok1").is_file()


# --------------------------------------------------------------------------- crash survival


_CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_memory_tier import _state
from dcp_tiered import Tier, TieredCheckpointer
ck = TieredCheckpointer([Tier("mem", {url!r}, memory_budget="256MiB")], async_save={use_async})
for step in range(1, 5):
    ck.maybe_save(step, _state(step, 100_000), force=True)
ck.wait()
emit("saved")
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("use_async", [False, True])
def test_memory_tier_survives_sigkill_of_the_training_process(shm_dir, use_async):
    url = str(shm_dir / "ckpt")
    res = run_isolated(_CHILD.format(tests=str(Path(__file__).parent), url=url, use_async=use_async), timeout=300)
    assert res.returncode == -signal.SIGKILL and res.result == "saved", res.describe()
    assert sorted(p.name for p in Path(url).iterdir()) == ["step_000000004"]  # keep=1 by default
    expected = _state(4, 100_000)
    out = _zeros_like(expected)
    with TieredCheckpointer([Tier("mem", url)]) as ck:  # a new process restores from RAM
        assert ck.restore(out) == 4
    _assert_same(expected, out)


# --------------------------------------------------------------------------- none-codec read path


def _save_none(path: Path, sd: dict, frame_size: int = 64 * 1024) -> None:
    dcp.save(sd, storage_writer=CompressedWriter(path, codec="none", frame_size=frame_size), no_dist=True)


def _load(path: Path, out: dict, **kwargs) -> None:
    dcp.load(out, storage_reader=CompressedReader(path, **kwargs), no_dist=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_none_codec_fast_path_bit_exact_with_partial_and_odd_destinations(tmp_path):
    sd = _state(3, 100_003)
    sd["empty"] = torch.empty(0, 3)
    sd["odd"] = torch.arange(9, dtype=torch.int16)
    _save_none(tmp_path / "c", sd)
    out = _zeros_like(sd)
    out["empty"], out["odd"] = torch.empty(0, 3), torch.zeros(9, dtype=torch.int16)
    _load(tmp_path / "c", out)
    _assert_same(sd, out)
    # destinations the fast path does not serve still load: non-contiguous, another dtype
    strided = torch.zeros(2, 100_003)[0]
    other = {"w": strided, "h": torch.zeros(64, 33, dtype=torch.float32)}
    _load(tmp_path / "c", other)
    assert torch.equal(strided, sd["w"]) and torch.equal(other["h"], sd["h"].float())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["payload", "header"])
def test_none_codec_fast_path_detects_a_corrupted_byte(tmp_path, where):
    sd = {"w": torch.randn(50_000)}
    _save_none(tmp_path / "c", sd)
    rec = record_view(next(iter(CompressedReader(tmp_path / "c").read_metadata().storage_data.values())))
    data_file = tmp_path / "c" / rec.file
    offset = rec.offset + (1 if where == "header" else 6 + 70_000)
    raw = bytearray(data_file.read_bytes())
    raw[offset] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        _load(tmp_path / "c", {"w": torch.zeros(50_000)})
    err = root_cause(info.value)  # DCP wraps it in a CheckpointException
    assert isinstance(err, CorruptCheckpointError), repr(info.value)
    assert ("checksum mismatch" if where == "payload" else "not a raw frame") in str(err)
    assert "'w'" in str(err)


def _peak_traced(path: Path, out: dict) -> int:
    tracemalloc.start()
    try:
        _load(path, out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_none_codec_fast_path_reads_without_an_intermediate_buffer(tmp_path, monkeypatch):
    """Peak Python-side allocation during the load: the read buffers (numpy/bytearray, traced) of the
    frame path hold a local read chunk (4 MiB) or more; the fast path holds only frame headers (the
    destination tensor is allocated by torch before the load and is not traced)."""
    numel = 4 << 20  # 16 MiB
    sd = {"w": torch.randn(numel)}
    _save_none(tmp_path / "c", sd, frame_size=1 << 20)
    out = {"w": torch.zeros(numel)}
    fast = _peak_traced(tmp_path / "c", out)
    assert torch.equal(out["w"], sd["w"])
    monkeypatch.setattr(CompressedReader, "_reads_raw", lambda self, r: False)
    out2 = {"w": torch.zeros(numel)}
    framed = _peak_traced(tmp_path / "c", out2)
    assert torch.equal(out2["w"], sd["w"])
    assert framed >= 4 << 20  # the stored bytes went through read buffers
    assert fast < numel * 4 // 16, (fast, framed)


def test_cli_tier_flags_on_tmpfs_get_the_memory_defaults(tmp_path: Path) -> None:
    """``--local-path /dev/shm/...`` without --keep-local/--codec is a memory tier with its own
    defaults (keep 1, codec none), not the disk tier's (keep 3, lz4)."""
    import argparse

    from dcp_tiered.cli.args import add_tier_encoding_args, add_tier_location_args, tiers_from_args

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    p = argparse.ArgumentParser()
    add_tier_location_args(p)
    add_tier_encoding_args(p)
    url = f"/dev/shm/dcp-tiered-test-{uuid.uuid4().hex}"
    (mem,), _ = tiers_from_args(p.parse_args(["--local-path", url]))
    assert (mem.kind, mem.keep, mem.codec) == ("memory", 1, "none")
    (mem,), _ = tiers_from_args(p.parse_args(["--local-path", url, "--keep-local", "2", "--codec", "zstd:1"]))
    assert (mem.keep, mem.codec) == (2, "zstd:1")
    (disk,), _ = tiers_from_args(p.parse_args(["--local-path", str(tmp_path / "local")]))
    assert disk.kind == "storage" and (disk.keep, disk.codec) != (1, "none")


# --------------------------------------------------------------------------- budget: lagging promotions


def _dirs(root: Path) -> set[int]:
    return {int(p.name.split("_")[1]) for p in root.iterdir() if p.name.startswith("step_")} if root.exists() else set()


def _held(root: Path) -> int:
    total = 0
    for top, _dirs, files in os.walk(root):  # os.walk skips a directory retention deletes meanwhile
        for name in files:
            try:
                total += os.stat(os.path.join(top, name)).st_size
            except OSError:  # deleted meanwhile by retention
                pass
    return total


def _eventually(check, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + scaled(timeout)
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("use_async", [False, True])
def test_lagging_promotions_never_grow_the_memory_tier_past_its_budget(shm_dir, tmp_path, monkeypatch, use_async):
    """Promotions to a stalled slower tier pin their source steps in RAM; every other step goes at
    once (retention waits for no promotion), and the budget counts the pinned steps, so a save that
    would not fit is refused (falling back to the slow tier when it is due) instead of filling RAM."""
    import dcp_tiered.tiers.promote.promoter as promotion

    gate, real = threading.Event(), promotion.copy_with_fragment

    def stalled(src, dst, *args, **kwargs):
        if "/disk/" in dst.url + "/":
            gate.wait(scaled(120))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(promotion, "copy_with_fragment", stalled)
    ram = shm_dir / "ckpt"
    budget = 4 * MIB + 512 * 1024  # four 1 MiB checkpoints and their headers
    tiers = [Tier("ram", ram, memory_budget=budget), Tier("disk", tmp_path / "disk", every_steps=3, keep=10)]
    sd = {"w": torch.randn(1 << 18)}  # 1 MiB
    saved, refused, peak = {}, [], 0
    try:
        with TieredCheckpointer(tiers, async_save=use_async) as ck:
            for step in range(1, 13):
                try:
                    report = ck.maybe_save(step, sd)
                    saved[step] = report.tiers
                except SaveError as exc:
                    assert isinstance(exc.__cause__, MemoryBudgetError), exc
                    refused.append(step)
                ck.raise_if_failed()
                peak = max(peak, _held(ram))
            ck._finish_inflight(wait=True)
            pinned = {s for s, t in saved.items() if t[0] == "ram" and "disk" in t}
            newest = max(s for s, t in saved.items() if t[0] == "ram")
            # the steps no promotion reads are gone without waiting for the stalled tier
            assert _eventually(lambda: _dirs(ram) == pinned | {newest}), (_dirs(ram), pinned, newest, saved)
            assert refused and pinned, (saved, refused)
            assert any(t == ["disk"] for t in saved.values()), saved  # refused by RAM, saved to disk instead
            gate.set()
            ck.wait()
            assert _eventually(lambda: _dirs(ram) == {newest})  # promoted: the pinned steps go too
    finally:
        gate.set()
    assert peak <= budget, (peak, budget)
    for step, names in saved.items():  # every step due to disk reached it, directly or promoted
        if "disk" in names:
            assert (tmp_path / "disk" / f"step_{step:09d}" / ".metadata").is_file(), step


def test_budget_counts_non_tensor_values_by_their_size(shm_dir):
    sd = {"w": torch.randn(1024), "blob": os.urandom(3 * MIB), "io": io.BytesIO(b"z" * MIB)}
    with TieredCheckpointer([Tier("mem", shm_dir / "ckpt", memory_budget=2 * MIB)]) as ck:
        with pytest.raises(SaveError, match="memory tier 'mem' refuses the save") as info:
            ck.save_now(1, sd)
        assert info.value.__cause__.needed > 4 * MIB
        ck.save_now(2, {"w": sd["w"], "lst": list(range(1000))})
    assert sorted(_files(shm_dir / "ckpt")) and _dirs(shm_dir / "ckpt") == {2}


def test_budget_counts_the_newest_optimizer_checkpoint_retention_keeps(shm_dir):
    """optimizer_every=3, keep=1: retention also keeps the newest save holding the optimizer state."""
    sd = {"model": {"w": torch.randn(1 << 18)}, "optim": {"m": torch.randn(1 << 18), "v": torch.randn(1 << 18)}}
    tier = Tier("mem", shm_dir / "ckpt", memory_budget=5 * MIB)
    with TieredCheckpointer([tier], optimizer_every=3, optimizer_keys=["optim"]) as ck:
        assert ck.maybe_save(1, sd).optimizer  # 3 MiB
        assert not ck.maybe_save(2, sd).optimizer  # 1 MiB; step 1 stays (the newest with the optimizer)
        ck.wait()
        with pytest.raises(SaveError, match="refuses the save"):  # 3 MiB more: 7 MiB > 5 MiB
            ck.maybe_save(3, sd)
    assert _held(shm_dir / "ckpt") <= 5 * MIB and _dirs(shm_dir / "ckpt") == {1, 2}


def test_bf16_tier_is_estimated_at_its_stored_size(shm_dir):
    sd = {"w": torch.randn(1 << 20), "b": torch.randn(1 << 20)}  # 8 MiB of float32, 4 MiB as bf16
    with TieredCheckpointer([Tier("mem", shm_dir / "ckpt", memory_budget=6 * MIB, dtype="bf16")]) as ck:
        report = ck.save_now(1, sd)
        assert report.ok and report.stored_bytes < 5 * MIB
        with pytest.raises(SaveError) as info:  # 8 MiB as bf16 + the 4 MiB held: over; no dtype advice now
            ck.save_now(2, {"w": torch.randn(1 << 21), "b": torch.randn(1 << 21)})
        assert "dtype='bf16'" not in str(info.value) and "codec" not in str(info.value)


def test_wait_timeout_is_honoured_while_a_refused_async_save_falls_back(shm_dir, tmp_path, monkeypatch):
    """The writer refusing in the background (the tier changed after the main thread's check): the
    fallback save to the slow tier is in flight, and wait(timeout=) raises instead of blocking on it."""
    import dcp_tiered.dcp.writer as dcp_writer
    from dcp_tiered.tiers import checkpointer

    monkeypatch.setattr(checkpointer, "save_budget_error", lambda *a, **k: None, raising=False)  # only the writer checks
    gate, real = threading.Event(), dcp_writer.CompressedWriter.write_data

    def slow(self, plan, planner):
        if "/disk/" in self.storage.url + "/":
            gate.wait(scaled(30))
        return real(self, plan, planner)

    monkeypatch.setattr(dcp_writer.CompressedWriter, "write_data", slow)
    tiers = [Tier("mem", shm_dir / "ckpt", memory_budget=MIB), Tier("disk", tmp_path / "disk")]
    try:
        with TieredCheckpointer(tiers, async_save=True) as ck:
            ck.maybe_save(1, {"w": torch.randn(1 << 19)})  # 2 MiB
            with pytest.raises(SaveError, match="still in flight"):
                ck.wait(timeout=1)
            gate.set()
            ck.wait()
            assert ck.reports[-1].ok and ck.reports[-1].tiers == ["disk"]
    finally:
        gate.set()
    assert (tmp_path / "disk" / "step_000000001" / ".metadata").is_file()
