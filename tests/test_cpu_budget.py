"""The CPU budget of background work (issue 15, "a budget knob") and the fallback of a save that a
memory tier refuses for its budget (issue 16).

``background_threads`` caps the encode threads of async saves; ``nice`` lowers the priority of
async saves and promotions; synchronous saves keep every thread.  Counted by instrumenting the
encoders, never timed."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader, SaveError, Tier, TieredCheckpointer
from dcp_tiered.codecs import FrameCodec
from dcp_tiered.tiers import config as options_mod
from dcp_tiered.tiers.config import CheckpointerOptions, default_background_threads
from test_config_validation import config_error
from test_memory_tier import MIB, _assert_same, _files, _state, _zeros_like, shm_dir  # noqa: F401 (fixture)

from gloo_ranks import run_ranks

# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("field, value", [
    ("background_threads", 0), ("background_threads", "2"), ("background_threads", True), ("background_threads", 1.5),
    ("nice", -1), ("nice", 20), ("nice", "10"), ("nice", None), ("nice", False),
])
def test_budget_options_are_validated(field, value):
    msg = config_error(CheckpointerOptions.from_mapping, {field: value}, where="t.yaml")
    assert msg.startswith("t.yaml: ") and field in msg


def test_budget_option_defaults_and_round_trip():
    o = CheckpointerOptions()
    assert (o.background_threads, o.nice) == (None, 10)
    o = CheckpointerOptions(background_threads=3, nice=0)
    assert CheckpointerOptions(**o.as_dict()) == o and o.background_threads_or_default() == 3


def test_default_background_threads_leaves_torchs_threads_to_training(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    assert default_background_threads() == 2
    assert default_background_threads(threads=1) == 1  # never more than the save's threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert default_background_threads() == 1  # at least one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 2 cores per rank, torchrun's 1 torch thread each
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert default_background_threads() == 1
    assert CheckpointerOptions().background_threads_or_default() == 1
    assert options_mod.default_background_threads is default_background_threads


def test_from_yaml_reads_the_budget(tmp_path):
    p = tmp_path / "tiers.yaml"
    p.write_text(f"background_threads: 1\nnice: 5\ntiers:\n  - {{name: local, url: {tmp_path}/l}}\n")
    with TieredCheckpointer.from_yaml(p) as ck:
        assert (ck.options.background_threads, ck.options.nice) == (1, 5)
        assert ck.promoter.jobs.nice == 5
    p.write_text(f"nice: 25\ntiers:\n  - {{name: local, url: {tmp_path}/l}}\n")
    msg = config_error(TieredCheckpointer.from_yaml, p)
    assert str(p) in msg and "nice" in msg


# --------------------------------------------------------------------------- encode threads


class _EncodeCounter:
    """Wraps ``FrameCodec.encode``: the most encodes running at once, and the threads that ran them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.active = self.most = 0
        self.threads: set[int] = set()
        real = FrameCodec.encode

        def encode(fc, *args, **kwargs):
            with self.lock:
                self.active += 1
                self.most = max(self.most, self.active)
                self.threads.add(threading.get_ident())
            try:
                time.sleep(0.02)  # lets a second encoder start if the pool has one
                return real(fc, *args, **kwargs)
            finally:
                with self.lock:
                    self.active -= 1

        monkeypatch.setattr(FrameCodec, "encode", encode)

    def reset(self) -> None:
        self.most, self.threads = 0, set()


def _many_frames() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(128 * 1024, generator=g) for i in range(8)}  # 4 MiB: 16 frames of 256 KiB


def test_async_saves_keep_to_background_threads_sync_saves_use_all(tmp_path, monkeypatch):
    counter = _EncodeCounter(monkeypatch)
    sd = _many_frames()
    opts = {"threads": 4, "frame_size": 256 * 1024}  # frames this large go to the pool one by one
    with TieredCheckpointer([Tier("a", tmp_path / "a", codec="zstd:1")], **opts, background_threads=1,
                            async_save=True) as ck:
        ck.maybe_save(1, sd, force=True)
        ck.wait()
        assert ck.reports[-1].ok and counter.threads
        assert counter.most == 1 and len(counter.threads) == 1  # the async save: one encoder
    counter.reset()
    with TieredCheckpointer([Tier("s", tmp_path / "s", codec="zstd:1")], **opts, background_threads=1) as ck:
        ck.save_now(1, sd)
        assert counter.most > 1  # a synchronous save: all of its 4 threads (training waits anyway)
    counter.reset()
    with TieredCheckpointer([Tier("b", tmp_path / "b", codec="zstd:1")], **opts, background_threads=2,
                            async_save=True) as ck:
        ck.maybe_save(1, sd, force=True)
        ck.wait()
        assert 1 <= counter.most <= 2 and len(counter.threads) <= 2


# --------------------------------------------------------------------------- promotions


def test_promotions_run_at_the_nice_option(tmp_path):
    with TieredCheckpointer([Tier("a", tmp_path / "a"), Tier("b", tmp_path / "b"), Tier("c", tmp_path / "c")],
                            nice=3) as ck:
        assert ck.promoter.jobs.nice == 3
        sd = _many_frames()
        ck.save_now(1, sd)
        ck.wait()
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        assert ck.restore(out) == 1
    assert (tmp_path / "b" / "step_000000001" / ".metadata").is_file()
    assert (tmp_path / "c" / "step_000000001" / ".metadata").is_file()


@pytest.mark.parametrize("slots", [1, 2])
def test_promotion_reencodes_keep_to_background_threads(tmp_path, monkeypatch, slots):
    """Promotions to several tiers run at once, but their re-encodes share ``background_threads`` coders."""
    sd = _many_frames()
    tiers = [Tier("a", tmp_path / "a", codec="none")] + [Tier(n, tmp_path / n, codec=c)
                                                       for n, c in (("b", "zstd:1"), ("c", "lz4"), ("d", "zstd:3"))]
    with TieredCheckpointer(tiers, frame_size=256 * 1024, background_threads=slots) as ck:
        assert ck.promoter.cpu is not None
        counter = _EncodeCounter(monkeypatch)  # after the (uncapped, synchronous) save's own encodes
        ck.save_now(1, sd)
        counter.reset()
        ck.wait()
        assert ck.promoter.reports and all(r.ok for r in ck.promoter.reports)
        assert counter.most == slots and len(counter.threads) >= slots  # three tiers re-encode, slots at a time
    for name in "bcd":  # every re-encoded copy loads exact
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=CompressedReader(tmp_path / name / "step_000000001"), no_dist=True)
        _assert_same(out, sd)


def test_async_saves_and_promotion_reencodes_share_one_budget(tmp_path, monkeypatch):
    """With ``background_threads=1`` an async save's encoders and a promotion's re-encodes, running
    in the same window, never encode at the same time: one budget of coders for all background work."""
    counter = _EncodeCounter(monkeypatch)
    spans: list[tuple[str, float, float]] = []
    counted = FrameCodec.encode

    def encode(fc, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return counted(fc, *args, **kwargs)
        finally:
            spans.append((threading.current_thread().name, t0, time.monotonic()))

    monkeypatch.setattr(FrameCodec, "encode", encode)
    sd = _many_frames()
    tiers = [Tier("a", tmp_path / "a", codec="zstd:1"), Tier("b", tmp_path / "b", codec="lz4")]
    with TieredCheckpointer(tiers, frame_size=256 * 1024, background_threads=1, async_save=True) as ck:
        for step in (1, 2, 3):  # each save's promotion to b re-encodes while the next save encodes
            ck.maybe_save(step, sd, force=True)
        ck.wait()
    saves = [(a, b) for name, a, b in spans if "encode" in name]
    promos = [(a, b) for name, a, b in spans if "promoter" in name]
    assert saves and promos
    assert min(b for _a, b in promos) < max(b for _a, b in saves)  # the two kinds ran in the same window
    assert counter.most == 1  # ...but never two coders at once


# --------------------------------------------------------------------------- memory tier refusal: fall back


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("use_async", [False, True])
def test_refused_memory_save_falls_back_to_the_other_due_tiers(shm_dir, tmp_path, use_async):  # noqa: F811
    mem = Tier("mem", shm_dir / "ckpt", memory_budget=3 * MIB)
    disk, far = Tier("disk", tmp_path / "disk", keep=5), Tier("far", tmp_path / "far", keep=5)
    log = tmp_path / "events.jsonl"
    big = _state(2, 1 << 20)  # 4 MiB of float32 alone
    with TieredCheckpointer([mem, disk, far], async_save=use_async, event_log=log) as ck:
        ck.save_now(1, _state(1, 64 * 1024))
        ck.wait()
        before = _files(shm_dir / "ckpt")
        report = ck.save_now(2, big)
        ck.wait()
        assert report.ok and report.tiers == ["disk", "far"] and report.error is None
        assert _files(shm_dir / "ckpt") == before  # the memory tier wrote nothing of step 2
        for tier in ("disk", "far"):  # the next due tier was written, and promoted from
            assert (tmp_path / tier / "step_000000002" / ".metadata").is_file()
        refused = [e for e in _events(log) if e.get("event") == "memory_fallback"]
        assert len(refused) == 1 and refused[0]["refused_by"] == "mem" and refused[0]["tiers"] == ["disk", "far"]
        assert refused[0]["step"] == 2 and "memory_budget" in refused[0]["error"]
        assert [e["tiers"] for e in _events(log) if e.get("event") == "save"] == [["mem", "disk", "far"], ["disk", "far"]]
        out = _zeros_like(big)
        assert ck.restore(out) == 2
        ck.save_now(3, _state(3, 1024))  # the memory tier takes the next save that fits
        ck.wait()
        assert sorted(p.name for p in (shm_dir / "ckpt").iterdir()) == ["step_000000003"]
    _assert_same(big, out)


def test_refused_memory_save_with_no_other_due_tier_still_fails(shm_dir, tmp_path):  # noqa: F811
    mem = Tier("mem", shm_dir / "ckpt", memory_budget=2 * MIB)
    disk = Tier("disk", tmp_path / "disk", every_steps=10)
    with TieredCheckpointer([mem, disk], async_save=True) as ck:
        with pytest.raises(SaveError, match="memory tier 'mem' refuses the save"):  # decided before staging
            ck.maybe_save(1, _state(1, 1 << 20))  # only the memory tier is due at step 1
        ck.wait()
    assert _files(shm_dir / "ckpt") == {} and not (tmp_path / "disk").exists()


def _two_rank_fallback(rank: int, world: int, root: str, disk: str) -> None:
    mem = Tier("mem", f"{root}/ckpt", memory_budget=2 * MIB)
    with TieredCheckpointer([mem, Tier("disk", disk)], async_save=True) as ck:
        sd = {f"v{rank}": torch.ones(1 << 18) * rank}  # 1 MiB per rank: 2 MiB + headers on the node
        report = ck.save_now(1, sd)
        ck.wait()
        assert report.ok and report.tiers == ["disk"], report
        out = {f"v{rank}": torch.zeros(1 << 18)}
        assert ck.restore(out) == 1 and torch.equal(out[f"v{rank}"], sd[f"v{rank}"])
    Path(root, f"ok{rank}").write_text("ok")


def test_two_ranks_fall_back_together(shm_dir, tmp_path):  # noqa: F811
    run_ranks(_two_rank_fallback, 2, tmp_path, str(shm_dir), str(tmp_path / "disk"), timeout=300)
    assert (shm_dir / "ok0").is_file() and (shm_dir / "ok1").is_file()
    assert not (shm_dir / "ckpt").exists() or not any((shm_dir / "ckpt").iterdir())
    assert (tmp_path / "disk" / "step_000000001" / ".metadata").is_file()


@pytest.mark.parametrize("use_async", [False, True])
def test_sync_and_async_refusals_give_the_same_steps_on_disk(shm_dir, tmp_path, use_async):  # noqa: F811
    """A memory tier too small for the state, disk due every 2 steps: the refusal is decided before
    staging, so an async save refuses at the call that asked for it, exactly as a sync one (falling
    back to disk when it is due, raising at once when not), and never costs the next save."""
    mem = Tier("mem", shm_dir / "ckpt", memory_budget=3 * MIB)
    disk = Tier("disk", tmp_path / "disk", every_steps=2, keep=10)
    outcome = {}
    with TieredCheckpointer([mem, disk], async_save=use_async) as ck:
        for step in range(1, 8):
            try:
                report = ck.maybe_save(step, {"w": torch.full((1 << 20,), float(step))})  # 4 MiB
                outcome[step] = report.tiers
            except SaveError as exc:
                assert "memory tier 'mem' refuses the save" in str(exc)
                outcome[step] = "refused"
        ck.wait()
        assert all(r.ok for r in ck.reports if r.tiers == ["disk"])
    on_disk = sorted(int(p.name[5:]) for p in (tmp_path / "disk").iterdir() if (p / ".metadata").is_file())
    assert on_disk == [2, 4, 6], (on_disk, outcome)
    assert outcome == {1: "refused", 2: ["disk"], 3: "refused", 4: ["disk"], 5: "refused", 6: ["disk"], 7: "refused"}
    assert _files(shm_dir / "ckpt") == {}
