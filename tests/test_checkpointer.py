"""TieredCheckpointer end to end in one process: schedules, promotion, retention, async, restore."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import (CompressedReader, ConfigError, PromotionError, RestoreError, SaveError, Tier, TieredCheckpointer,
                        TieredWriter)
from dcp_tiered.storage.retry import RetryPolicy

from faults import FaultyFS, register

register()
FAST_RETRY = RetryPolicy(attempts=3, base=0.01, cap=0.05)


class Clock:
    """An injectable wall clock."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture(autouse=True)
def _reset_faults():
    FaultyFS.faults.reset()
    yield
    FaultyFS.faults.reset()


def make_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def three_tiers(root: Path, durable_url: str | None = None, durable_opts: dict | None = None, **durable_kw) -> list[Tier]:
    return [
        Tier("local", str(root / "local"), every="5m", keep=2, codec="lz4"),
        Tier("shared", str(root / "shared"), every="30m", keep=3, codec="zstd"),
        Tier("durable", durable_url or str(root / "durable"), every="1h", keep=4, max_per_hour=1, codec="zstd:3",
             storage_options=durable_opts or {}, **durable_kw),
    ]


def committed_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return sorted(int(p.name[5:]) for p in path.iterdir() if p.name.startswith("step_") and (p / ".metadata").exists())


def load_flat(url: str, like: dict, **opts) -> dict:
    out = {k: {kk: torch.zeros_like(vv) if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()} for k, v in like.items()}
    dcp.load(out, storage_reader=CompressedReader(url, **opts), no_dist=True)
    return out


@pytest.mark.parametrize("async_save", [False, True])
def test_schedules_promotion_and_retention(tmp_path: Path, async_save: bool) -> None:
    clock = Clock()
    model, opt = make_model()
    ckpt = TieredCheckpointer(three_tiers(tmp_path), async_save=async_save, clock=clock, retry=FAST_RETRY,
                              event_log=tmp_path / "events.jsonl")
    saved: dict[int, dict] = {}
    for step in range(1, 61):  # one minute per step: local every 5, shared every 30, durable hourly
        train_step(model, opt)
        clock.advance(60)
        report = ckpt.maybe_save(step, state(model, opt))
        if report is not None:
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            assert report.tiers[0] == "local"
    ckpt.close()
    tiers_by_step = {r.step: r.tiers for r in ckpt.reports}
    assert tiers_by_step[1] == ["local", "shared", "durable"]
    assert tiers_by_step[31] == ["local", "shared"]
    assert [s for s, t in tiers_by_step.items() if t == ["local"]] == [6, 11, 16, 21, 26, 36, 41, 46, 51, 56]
    assert all(r.ok for r in ckpt.reports) and all(r.stored_bytes > 0 for r in ckpt.reports)
    # retention kept `keep` committed checkpoints per tier, the newest included
    assert committed_steps(tmp_path / "local") == [51, 56]
    assert committed_steps(tmp_path / "shared") == [1, 31]  # keep=3, only two were due
    assert committed_steps(tmp_path / "durable") == [1]
    # promoted copies are re-encoded for their tier and load back exactly
    for tier, step in (("shared", 31), ("durable", 1)):
        url = str(tmp_path / tier / f"step_{step:09d}")
        md = CompressedReader(url).read_metadata()
        assert {r["codec"] for r in md.storage_data.values()} == {"zstd:1" if tier == "shared" else "zstd:3"}
        out = load_flat(url, state(model, opt))
        for k, v in saved[step].items():
            assert torch.equal(out["model"][k], v)
    assert not list((tmp_path / "shared").rglob(".promote-*")), "finished promotions leave no intent files"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert {e["event"] for e in events} >= {"save", "promotion"}
    assert all(e["ok"] for e in events if e["event"] == "promotion")


def test_optimizer_every_and_restore_never_mixes_steps(tmp_path: Path) -> None:
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=10, codec="zstd")]
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, optimizer_every=3)
    models = {}
    for step in range(1, 6):
        train_step(model, opt)
        ckpt.maybe_save(step, state(model, opt))
        models[step] = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.close()
    # step schedule: the full saves are at the multiples of optimizer_every * every_steps
    assert [r.optimizer for r in ckpt.reports] == [False, False, True, False, False]
    infos = {i.step: i for i in ckpt.list()}
    assert infos[3].has_prefix(["optim"]) and not infos[5].has_prefix(["optim"])

    m2, o2 = make_model(seed=1)
    train_step(m2, o2)  # so that the optimizer has state to load into
    restorer = TieredCheckpointer(tiers)
    full = state(m2, o2)
    assert restorer.restore(full) == 3  # newest holding the optimizer too
    for k, v in models[3].items():
        assert torch.equal(m2.state_dict()[k], v)
    model_only = {"model": m2.state_dict()}
    assert restorer.restore(model_only) == 5  # the caller asked for the model only
    assert torch.equal(m2.state_dict()["0.weight"], models[5]["0.weight"])
    assert restorer.restore(state(m2, o2), step=3) == 3
    with pytest.raises(RestoreError, match=r"step 2 on tier 'local': lacks key\(s\) \['optim"):
        restorer.restore(state(m2, o2), step=2)  # step 2 has no optimizer state
    restorer.close()


def test_optimizer_every_counts_saves_with_time_schedules(tmp_path: Path) -> None:
    clock = Clock()
    ckpt = TieredCheckpointer([Tier("local", str(tmp_path / "l"), every="1m", keep=10)], optimizer_every=3, clock=clock)
    model, opt = make_model()
    for step in range(1, 6):
        clock.advance(60)
        ckpt.maybe_save(step, state(model, opt))
    ckpt.close()
    assert [r.optimizer for r in ckpt.reports] == [True, False, False, True, False]  # every 3rd save, the 1st first


def _steps(ckpt: TieredCheckpointer, model, opt, steps) -> dict[int, dict]:
    """Train ``steps``, offering each to ``maybe_save``; return the model of each saved step."""
    saved = {}
    for step in steps:
        train_step(model, opt)
        if ckpt.maybe_save(step, state(model, opt)) is not None:
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


@pytest.mark.parametrize("async_save", [False, True])
def test_every_steps_saves_at_multiples_across_a_restart(tmp_path: Path, async_save: bool) -> None:
    def tiers():
        return [Tier("local", str(tmp_path / "local"), every_steps=5, keep=10, codec="lz4"),
                Tier("shared", str(tmp_path / "shared"), every_steps=10, keep=10, codec="zstd")]

    model, opt = make_model()
    first = TieredCheckpointer(tiers(), async_save=async_save, optimizer_every=2)
    saved = _steps(first, model, opt, range(1, 13))  # "crashes" after step 12: 11 and 12 are lost
    first.wait()
    first_reports = list(first.reports)
    first.close()
    model, opt = make_model(seed=1)
    train_step(model, opt)
    ckpt = TieredCheckpointer(tiers(), async_save=async_save, optimizer_every=2)  # a new process, same dirs
    assert ckpt.restore(state(model, opt)) == 10
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[10].items())
    assert not ckpt.due(11)  # not at once after the restore: the next multiple
    _steps(ckpt, model, opt, range(11, 21))
    ckpt.close()
    assert committed_steps(tmp_path / "local") == [5, 10, 15, 20]
    assert committed_steps(tmp_path / "shared") == [10, 20]
    reports = first_reports + ckpt.reports
    assert [(r.step, r.optimizer) for r in reports] == [(5, False), (10, True), (15, False), (20, True)]
    assert [r.tiers for r in reports] == [["local"], ["local", "shared"], ["local"], ["local", "shared"]]


def test_save_now_saves_every_tier_whatever_the_schedule(tmp_path: Path) -> None:
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=5, keep=10),
             Tier("shared", str(tmp_path / "shared"), every_steps=100, keep=10)]
    model, opt = make_model()
    with TieredCheckpointer(tiers, optimizer_every=4) as ckpt:
        _steps(ckpt, model, opt, range(1, 8))
        report = ckpt.save_now(7, lambda: state(model, opt))
        assert report.tiers == ["local", "shared"] and report.optimizer  # full whatever optimizer_every
        assert [s for s in range(8, 16) if ckpt.due(s)] == [10, 15]  # the grid is not shifted
        with pytest.raises(ConfigError, match="closed"):
            ckpt.close()
            ckpt.save_now(16, state(model, opt))
    assert committed_steps(tmp_path / "local") == [5, 7]
    assert committed_steps(tmp_path / "shared") == [7]


def test_close_saves_the_final_step_once(tmp_path: Path) -> None:
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=5, keep=10),
             Tier("shared", str(tmp_path / "shared"), every_steps=10, keep=10)]
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, async_save=True)
    _steps(ckpt, model, opt, range(1, 14))
    with pytest.raises(ConfigError, match="state_dict"):
        ckpt.close(final_step=13)
    ckpt.close(final_step=13, state_dict=state(model, opt))
    assert committed_steps(tmp_path / "local") == [5, 10, 13]
    assert committed_steps(tmp_path / "shared") == [10, 13]
    assert ckpt.reports[-1].step == 13 and ckpt.reports[-1].optimizer
    ckpt.close(final_step=14, state_dict=state(model, opt))  # already closed: nothing more
    assert committed_steps(tmp_path / "local") == [5, 10, 13]

    # A final step the schedule already saved is not saved again; a tier that lacks it gets it.
    again = TieredCheckpointer(tiers)
    assert again.restore(state(model, opt)) == 13
    _steps(again, model, opt, range(14, 16))
    n = len(again.reports)
    again.close(final_step=15, state_dict=lambda: state(model, opt))
    assert [r.tiers for r in again.reports[n - 1:]] == [["local"], ["shared"]]
    assert committed_steps(tmp_path / "shared") == [10, 13, 15]
    with TieredCheckpointer(tiers) as third:
        assert third.restore(state(model, opt)) == 15
        n = len(third.reports)
        third.close(final_step=15, state_dict=state(model, opt))  # both tiers hold 15 (restored)
        assert len(third.reports) == n


def test_restore_with_nothing_returns_none(tmp_path: Path) -> None:
    ckpt = TieredCheckpointer([Tier("local", str(tmp_path / "none"))])
    model, opt = make_model()
    assert ckpt.restore(state(model, opt)) is None
    ckpt.close()


def test_async_save_captures_values_at_the_call(tmp_path: Path) -> None:
    model, opt = make_model()
    ckpt = TieredCheckpointer([Tier("local", str(tmp_path / "l"), every_steps=1, keep=5)], async_save=True)
    train_step(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = ckpt.maybe_save(1, state(model, opt))
    assert report is not None and report.async_save
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)  # mutate right after maybe_save returned
    ckpt.wait()
    assert report.ok
    out = load_flat(str(tmp_path / "l" / "step_000000001"), state(model, opt))
    for k, v in before.items():
        assert torch.equal(out["model"][k], v)
    ckpt.close()


def test_async_saves_write_on_one_long_lived_thread_that_close_stops(tmp_path: Path, monkeypatch) -> None:
    """``maybe_save`` hands each async save to the checkpointer's one save thread: starting a thread per
    save (as ``dcp.async_save`` does) blocks the call until the new thread hands the GIL back."""
    from dcp_tiered.tiers.save.writer import TieredWriter

    ran_on: list[int] = []
    finish = TieredWriter.finish

    def recording(self, *args, **kwargs):
        ran_on.append(threading.get_ident())
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(TieredWriter, "finish", recording)
    model, opt = make_model()
    ckpt = TieredCheckpointer([Tier("local", str(tmp_path / "l"), every_steps=1, keep=5)], async_save=True)
    before = {t.ident for t in threading.enumerate()}
    for step in (1, 2, 3):
        train_step(model, opt)
        assert ckpt.maybe_save(step, state(model, opt)).async_save
        ckpt.wait()
    assert len(set(ran_on)) == 1 and ran_on[0] != threading.get_ident(), ran_on
    assert ran_on[0] in {t.ident for t in threading.enumerate()} - before  # still there for the next save
    ckpt.close()
    assert ran_on[0] not in {t.ident for t in threading.enumerate()}, "close() leaves the save thread running"
    out = load_flat(str(tmp_path / "l" / "step_000000003"), state(model, opt))
    assert all(torch.equal(out["model"][k], v) for k, v in model.state_dict().items())


def test_a_state_that_cannot_be_staged_fails_the_async_save_as_a_save_error(tmp_path: Path) -> None:
    ck = TieredCheckpointer([Tier("local", str(tmp_path / "l"), every_steps=1, keep=5)], async_save=True)
    with pytest.raises(SaveError, match="step 1"):
        ck.maybe_save(1, {"w": torch.ones(4), "lock": threading.Lock()})
    assert [r.ok for r in ck.reports] == [False]
    report = ck.maybe_save(2, {"w": torch.ones(4)})
    assert report.ok and not report.async_save  # the save after a failure is synchronous
    ck.close()


_CTRL_C = """
    import os, signal, threading, torch
    import torch.distributed.checkpoint as dcp
    from dcp_tiered import CompressedReader, Tier, TieredCheckpointer
    from dcp_tiered.tiers.save.writer import TieredWriter

    gate = threading.Event()
    write = TieredWriter.write_data
    def slow(self, plan, planner):
        gate.wait(120)
        return write(self, plan, planner)
    TieredWriter.write_data = slow
    ck = TieredCheckpointer([Tier("local", {root!r}, every_steps=1, keep=5)], async_save=True)
    w = torch.ones(1000)
    ck.maybe_save(1, {{"w": w}})
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        ck.wait()
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    w.fill_(2.0)  # the caller goes on after Ctrl-C
    gate.set()
    ck.maybe_save(2, {{"w": w}})  # waits for step 1 before staging into its buffers
    ck.close()
    values = []
    for step in (1, 2):
        out = {{"w": torch.zeros(1000)}}
        dcp.load(out, storage_reader=CompressedReader(os.path.join({root!r}, f"step_{{step:09d}}")), no_dist=True)
        values.append(sorted(set(out["w"].tolist())))
    emit({{"interrupted": interrupted, "values": values}})
"""


def test_ctrl_c_while_waiting_for_an_async_save_leaves_it_in_flight(tmp_path: Path) -> None:
    """A KeyboardInterrupt in ``wait()`` does not drop the save in flight: the next save waits for it
    instead of staging into the buffers it is still writing (which committed a torn step 1)."""
    from isolated import run_isolated

    res = run_isolated(_CTRL_C.format(root=str(tmp_path / "l")), timeout=120)
    assert res.returncode == 0, res.describe()
    assert res.result == {"interrupted": True, "values": [[1.0], [2.0]]}, res.result


def test_background_failure_is_raised_then_next_save_is_synchronous(tmp_path: Path) -> None:
    tiers = [Tier("local", f"faulty://{tmp_path}/l", every_steps=1, keep=5)]
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, async_save=True)
    FaultyFS.faults.fail_writes = 1
    ckpt.maybe_save(1, state(model, opt))
    with pytest.raises(SaveError, match="background checkpoint save failed"):
        ckpt.maybe_save(2, state(model, opt))
        ckpt.wait()
    report = ckpt.maybe_save(3, state(model, opt))
    assert report is not None and not report.async_save and report.ok
    report = ckpt.maybe_save(4, state(model, opt))
    assert report.async_save
    ckpt.close()
    assert committed_steps(tmp_path / "l") == [3, 4]


def test_on_busy_skip_keeps_one_save_in_flight(tmp_path: Path) -> None:
    tiers = [Tier("local", f"faulty://{tmp_path}/l", every_steps=1, keep=5)]
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, async_save=True, on_busy="skip")
    FaultyFS.faults.stall.clear()  # writes block until released
    assert ckpt.maybe_save(1, state(model, opt)) is not None
    assert FaultyFS.faults.stalled.wait(scaled(30))
    assert ckpt.maybe_save(2, state(model, opt)) is None
    assert ckpt.maybe_save(3, state(model, opt)) is None
    assert ckpt.skipped == 2
    FaultyFS.faults.stall.set()
    ckpt.wait()
    assert ckpt.maybe_save(4, state(model, opt)) is not None
    ckpt.close()
    assert committed_steps(tmp_path / "l") == [1, 4]


def test_on_busy_wait_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    tiers = [Tier("local", f"faulty://{tmp_path}/l", every_steps=1, keep=5)]
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, async_save=True)
    FaultyFS.faults.stall.clear()
    ckpt.maybe_save(1, state(model, opt))
    assert FaultyFS.faults.stalled.wait(scaled(30))
    threading.Timer(0.2, FaultyFS.faults.stall.set).start()
    ckpt.maybe_save(2, state(model, opt))  # waits for step 1, then saves step 2
    ckpt.close()
    assert committed_steps(tmp_path / "l") == [1, 2]


def test_restore_falls_back_to_another_tier_when_corrupt(tmp_path: Path) -> None:
    clock = Clock()
    tiers = three_tiers(tmp_path)
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, clock=clock)
    train_step(model, opt)
    ckpt.maybe_save(1, state(model, opt))  # all three tiers
    ckpt.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    data = tmp_path / "local" / "step_000000001" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    m2, o2 = make_model(seed=3)
    train_step(m2, o2)
    restorer = TieredCheckpointer(tiers, clock=clock)
    assert restorer.restore(state(m2, o2)) == 1
    assert restorer.restore_failures == 1
    for k, v in expected.items():
        assert torch.equal(m2.state_dict()[k], v)
    restorer.close()


def test_promotion_retries_then_fails_without_blocking_training(tmp_path: Path) -> None:
    tiers = [Tier("local", str(tmp_path / "l"), keep=5), Tier("slow", f"faulty://{tmp_path}/s", keep=5)]
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, retry=FAST_RETRY)
    FaultyFS.faults.fail_writes = 2  # two transient failures, then success
    ckpt.maybe_save(1, state(model, opt))
    ckpt.wait()
    assert committed_steps(tmp_path / "s") == [1]
    ok = [r for r in ckpt.promoter.reports if r.kind == "data"]
    assert ok and ok[0].ok and ok[0].attempts == 3
    FaultyFS.faults.fail_writes = 1000  # an outage longer than the retries
    ckpt.maybe_save(2, state(model, opt))  # returns: promotion runs in the background
    with pytest.raises(PromotionError, match="failed"):
        ckpt.wait()
    FaultyFS.faults.fail_writes = 0
    ckpt.close()
    assert committed_steps(tmp_path / "l") == [1, 2]
    assert committed_steps(tmp_path / "s") == [1]


def test_failed_deletes_do_not_stop_retention_or_saves(tmp_path: Path) -> None:
    tiers = [Tier("local", f"faulty://{tmp_path}/l", every_steps=1, keep=1)]
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers)
    FaultyFS.faults.fail_deletes = True
    for step in (1, 2, 3):
        ckpt.maybe_save(step, state(model, opt))
    ckpt.wait()
    assert committed_steps(tmp_path / "l") == [1, 2, 3]
    FaultyFS.faults.fail_deletes = False
    ckpt.maybe_save(4, state(model, opt))
    ckpt.close()
    assert committed_steps(tmp_path / "l") == [4]


def test_retention_cleans_uncommitted_leftovers_but_not_newer_ones(tmp_path: Path) -> None:
    tiers = [Tier("local", str(tmp_path / "l"), every_steps=1, keep=2)]
    (tmp_path / "l" / "step_000000002").mkdir(parents=True)
    (tmp_path / "l" / "step_000000002" / "__0_0.distcp").write_bytes(b"half a save")
    (tmp_path / "l" / "step_000000099").mkdir(parents=True)  # a save in progress elsewhere
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, leftover_grace=0)
    for step in (1, 3, 4):
        ckpt.maybe_save(step, state(model, opt))
    ckpt.close()
    names = sorted(p.name for p in (tmp_path / "l").iterdir())
    assert names == ["step_000000003", "step_000000004", "step_000000099"]


def test_s3_durable_tier_and_restore_from_it(tmp_path: Path, s3_bucket) -> None:
    bucket, opts = s3_bucket
    clock = Clock()
    tiers = three_tiers(tmp_path, durable_url=f"{bucket}/run1", durable_opts=opts)
    model, opt = make_model()
    ckpt = TieredCheckpointer(tiers, async_save=True, clock=clock)
    train_step(model, opt)
    ckpt.maybe_save(1, state(model, opt))
    ckpt.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    import shutil

    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "shared")  # node lost, shared filesystem lost: only S3 remains
    m2, o2 = make_model(seed=5)
    train_step(m2, o2)
    restorer = TieredCheckpointer(tiers, clock=clock)
    assert [i.tier for i in restorer.list() if i.committed] == ["durable"]
    assert restorer.restore(state(m2, o2)) == 1
    for k, v in expected.items():
        assert torch.equal(m2.state_dict()[k], v)
    restorer.close()


def test_tiered_writer_alone_with_dcp_save(tmp_path: Path) -> None:
    tiers = [Tier("fast", str(tmp_path / "fast"), codec="lz4"), Tier("slow", str(tmp_path / "slow"), codec="zstd")]
    writer = TieredWriter(tiers)
    sd = {"w": torch.randn(100, 10), "meta": {"epoch": 2}}
    dcp.save(sd, storage_writer=writer, checkpoint_id="step_000000100", no_dist=True)
    writer.close()
    assert writer.last_tiers == ("fast", "slow")
    for t in ("fast", "slow"):
        out = {"w": torch.zeros(100, 10), "meta": {"epoch": 0}}
        dcp.load(out, storage_reader=CompressedReader(tmp_path / t / "step_000000100"), no_dist=True)
        assert torch.equal(out["w"], sd["w"]) and out["meta"]["epoch"] == 2


def test_from_yaml(tmp_path: Path) -> None:
    (tmp_path / "tiers.yaml").write_text(textwrap.dedent(f"""
        async_save: true
        optimizer_every: 5
        tiers:
          - {{name: local, url: {tmp_path}/l, every: 5m, keep: 2, codec: lz4}}
          - {{name: shared, url: {tmp_path}/s, every: 30m, keep: 4, codec: zstd, dtype: bf16}}
    """))
    ckpt = TieredCheckpointer.from_yaml(tmp_path / "tiers.yaml")
    assert ckpt.options.async_save and ckpt.options.optimizer_every == 5
    assert [t.name for t in ckpt.tiers] == ["local", "shared"] and ckpt.tiers[1].dtype == "bf16"
    ckpt.close()


_CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from faults import FaultyFS, register
    register()
    from dcp_tiered import Tier, TieredCheckpointer
    tiers = [Tier("local", {local!r}, keep=3), Tier("shared", {shared!r}, keep=3)]
    ckpt = TieredCheckpointer(tiers)
    FaultyFS.faults.stall.clear()  # promotion to the shared tier hangs...
    ckpt.maybe_save(7, {{"w": torch.arange(1000.0)}})
    print("saved", flush=True)
    os._exit(0)  # ...and the process dies without close()
""")


def test_unfinished_promotion_resumes_after_a_crash(tmp_path: Path) -> None:
    local, shared = str(tmp_path / "local"), f"faulty://{tmp_path}/shared"
    code = _CHILD.format(tests=str(Path(__file__).parent), local=local, shared=shared)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert "saved" in out.stdout, out.stderr
    assert committed_steps(tmp_path / "local") == [7]
    assert committed_steps(tmp_path / "shared") == []
    assert (tmp_path / "local" / "step_000000007" / ".promote-0.json").exists()
    tiers = [Tier("local", local, keep=3), Tier("shared", shared, keep=3)]
    ckpt = TieredCheckpointer(tiers)  # resumes the recorded promotion
    ckpt.wait()
    assert committed_steps(tmp_path / "shared") == [7]
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "shared" / "step_000000007"), no_dist=True)
    assert torch.equal(out["w"], torch.arange(1000.0))
    assert not (tmp_path / "local" / "step_000000007" / ".promote-0.json").exists()
    ckpt.close()


def test_restore_says_which_newer_checkpoints_it_passed_over(tmp_path: Path, caplog) -> None:
    """Going back in steps is never silent: restore warns, naming each newer checkpoint it skipped and why."""
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=3), Tier("shared", str(tmp_path / "shared"),
                                                                                  every_steps=2, keep=3)]
    sd = {"w": torch.arange(1024, dtype=torch.float32)}
    with TieredCheckpointer(tiers) as ck:
        for step in (2, 3):
            sd["w"] += 1
            ck.maybe_save(step, sd)
        ck.wait()
    (tmp_path / "local" / "step_000000003" / "__0_0.distcp").write_bytes(b"torn")  # step 3 exists only here
    out = {"w": torch.zeros(1024)}
    with TieredCheckpointer(tiers) as ck, caplog.at_level("WARNING", logger="dcp_tiered.tiers.restore"):
        assert ck.restore(out) == 2
    skipped = [r.getMessage() for r in caplog.records if "newer checkpoint(s) skipped" in r.getMessage()]
    assert len(skipped) == 1 and "restored step 2" in skipped[0] and "step 3 on local" in skipped[0], skipped


def test_a_late_retention_never_deletes_the_newest_save_of_this_run(tmp_path: Path) -> None:
    """A run resumed from an older step saves 4, 5, 6 beside steps 7 and 8 of an abandoned run (keep=2). The
    retention queued after step 5's save may run only after step 6 committed: it keeps step 6, this run's
    newest save, as the retention after step 6 does (the Lightning ckpt_path test failed so under load)."""
    tier = Tier("local", str(tmp_path / "l"), every_steps=1, keep=2)
    with TieredCheckpointer([tier]) as old:
        for step in (7, 8):
            old.maybe_save(step, {"w": torch.full((4,), float(step))})
    ck = TieredCheckpointer([tier])
    for step in (4, 5, 6):
        ck.maybe_save(step, {"w": torch.full((4,), float(step))})
    ck.promoter.retention(tier, protect=[5])  # step 5's, late
    ck.close()
    assert committed_steps(tmp_path / "l")[-3:] == [6, 7, 8]
