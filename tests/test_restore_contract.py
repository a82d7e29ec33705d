"""The TieredCheckpointer restore contract and per-step API: ``due``/``maybe_save`` with a
callable state, step and option checks, ``Stateful`` state, ``RestoreError``, a collective
restore that survives SIGKILLs mid-promotion with ``keep=1``."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from speed import scaled

import torch

from dcp_tiered import ConfigError, Tier, TieredCheckpointer


def two_tiers(root: Path, **kw) -> list[Tier]:
    return [Tier("local", str(root / "local"), every_steps=kw.get("local_every", 2), keep=2, codec="lz4"),
            Tier("shared", str(root / "shared"), every_steps=kw.get("shared_every", 4), keep=1, codec="zstd")]


def small_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(8, 4, generator=g)}, "optim": {"m": torch.randn(8, generator=g)}}


# -- due / maybe_save --------------------------------------------------------------------


def test_due_decides_once_and_maybe_save_reuses_it(tmp_path: Path) -> None:
    ck = TieredCheckpointer(two_tiers(tmp_path))
    calls = []

    def build() -> dict:
        calls.append(1)
        return small_state()

    assert ck.due(0) is True
    assert ck.due(0) is True  # cached: asking again does not decide again (the first save stays due)
    report = ck.maybe_save(0, build)
    assert report is not None and report.tiers == ["local", "shared"] and calls == [1]
    assert ck.due(1) is False
    assert ck.maybe_save(1, build) is None and calls == [1]  # the callable is not called when nothing is due
    assert ck.maybe_save(2, build) is not None and calls == [1, 1]  # without due(): decided by maybe_save
    ck.close()


def test_maybe_save_reuses_a_due_decision_made_before_its_time(tmp_path: Path) -> None:
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    ck = TieredCheckpointer([Tier("local", str(tmp_path / "l"), every="10s", keep=1)], clock=clock)
    assert ck.maybe_save(0, small_state()) is not None
    clock.t = 5.0
    assert ck.due(1) is False
    clock.t = 20.0  # the schedule would now say due: the decision of due(1) holds for step 1
    assert ck.maybe_save(1, small_state()) is None
    assert ck.maybe_save(2, small_state()) is not None
    ck.close()


@pytest.mark.parametrize("step", [-5, 1.0, "3", True, None])
def test_bad_steps_are_refused(tmp_path: Path, step) -> None:
    ck = TieredCheckpointer(two_tiers(tmp_path))
    with pytest.raises(ConfigError, match="step"):
        ck.maybe_save(step, small_state())
    with pytest.raises(ConfigError, match="step"):
        ck.due(step)
    ck.close()
    assert not (tmp_path / "local").exists() or not any((tmp_path / "local").iterdir())


def test_optimizer_keys_as_a_string_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="optimizer_keys") as info:
        TieredCheckpointer(two_tiers(tmp_path), optimizer_keys="optim")
    assert len(str(info.value)) < 200


# -- Stateful ------------------------------------------------------------------------------


class AppState:
    """The DCP tutorial's wrapper: model and optimizer behind state_dict()/load_state_dict()."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        self.loaded = 0

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])
        self.loaded += 1


class Counter:
    """A Stateful holding a plain Python value (replaced, not loaded in place)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def make_app(seed: int) -> AppState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    return AppState(model, optim)


def app_tensors(app: AppState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in app.model.state_dict().items()}
    for pid, st in app.optim.state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_flatten_keys_expands_stateful_at_any_depth() -> None:
    from dcp_tiered.dcp.statedict import flatten_keys

    app = make_app(0)
    keys = flatten_keys({"app": app, "extra": {"counter": Counter(3), "lr": 0.1}})
    assert "app.model.0.weight" in keys and "app.optim.state.0.exp_avg" in keys
    assert "extra.counter.n" in keys and "extra.lr" in keys and "app" not in keys


def test_stateful_app_state_round_trips_through_restore(tmp_path: Path) -> None:
    ck = TieredCheckpointer(two_tiers(tmp_path))
    saved = make_app(0)
    nested = Counter(41)
    assert ck.maybe_save(0, {"app": saved, "extra": {"counter": nested, "epoch": 7}}) is not None
    ck.close()
    want = app_tensors(saved)

    fresh = make_app(1)
    counter = Counter(0)
    sd = {"app": fresh, "extra": {"counter": counter, "epoch": 0}}
    ck2 = TieredCheckpointer(two_tiers(tmp_path))
    assert ck2.restore(sd) == 0
    ck2.close()
    assert fresh.loaded == 1 and counter.n == 41 and sd["extra"]["epoch"] == 7
    assert sd["app"] is fresh and sd["extra"]["counter"] is counter
    assert_same(app_tensors(fresh), want)


def test_stateful_inside_a_stateful_is_loaded_first_and_handed_back(tmp_path: Path) -> None:
    class Outer:
        def __init__(self, inner: Counter, w: torch.Tensor) -> None:
            self.inner, self.w, self.got = inner, w, None

        def state_dict(self) -> dict:
            return {"inner": self.inner, "w": self.w, "tag": "x"}

        def load_state_dict(self, sd: dict) -> None:
            self.got = dict(sd)

    ck = TieredCheckpointer(two_tiers(tmp_path))
    ck.maybe_save(0, {"outer": Outer(Counter(5), torch.arange(4.0)), "lst": [Counter(9), torch.ones(2)]})
    ck.close()
    inner, lst_counter = Counter(0), Counter(0)
    outer = Outer(inner, torch.zeros(4))
    sd = {"outer": outer, "lst": [lst_counter, torch.zeros(2)]}
    assert TieredCheckpointer(two_tiers(tmp_path)).restore(sd) == 0
    assert inner.n == 5 and lst_counter.n == 9 and torch.equal(sd["lst"][1], torch.ones(2))
    assert outer.got is not None and outer.got["inner"] is inner and outer.got["tag"] == "x"
    assert torch.equal(outer.w, torch.arange(4.0))


# -- RestoreError / None ---------------------------------------------------------------------


def test_restore_returns_none_only_when_no_tier_holds_a_committed_checkpoint(tmp_path: Path) -> None:
    ck = TieredCheckpointer(two_tiers(tmp_path))
    assert ck.restore(small_state()) is None
    # an uncommitted leftover is no checkpoint either
    (tmp_path / "shared" / "step_000000003").mkdir(parents=True)
    (tmp_path / "shared" / "step_000000003" / "__0_0.distcp").write_bytes(b"partial")
    assert ck.restore(small_state()) is None
    ck.close()


def test_missing_keys_raise_restore_error_naming_every_candidate(tmp_path: Path) -> None:
    from dcp_tiered import DcpTieredError, RestoreError

    ck = TieredCheckpointer(two_tiers(tmp_path))
    ck.maybe_save(0, small_state())
    ck.close()
    with pytest.raises(RestoreError) as info:
        TieredCheckpointer(two_tiers(tmp_path)).restore({"model": {"w": torch.zeros(8, 4)}, "sched": {"x": torch.zeros(1)}})
    err = info.value
    assert isinstance(err, DcpTieredError) and isinstance(err, RuntimeError)
    assert sorted((t, s) for t, s, _ in err.candidates) == [("local", 0), ("shared", 0)]
    assert all("sched.x" in why for _, _, why in err.candidates)
    assert "step 0 on tier 'local'" in str(err) and "step 0 on tier 'shared'" in str(err)


def test_every_candidate_failing_raises_restore_error_with_each_failure(tmp_path: Path) -> None:
    from dcp_tiered import RestoreError

    ck = TieredCheckpointer(two_tiers(tmp_path, local_every=1, shared_every=1))
    ck.maybe_save(0, small_state(0))
    ck.maybe_save(1, small_state(1))
    ck.close()
    for f in tmp_path.rglob("*.distcp"):  # every data file of every step on every tier
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    ck2 = TieredCheckpointer(two_tiers(tmp_path))
    with pytest.raises(RestoreError) as info:
        ck2.restore(small_state(5))
    got = [(t, s) for t, s, _ in info.value.candidates]
    assert got == [("local", 1), ("shared", 1), ("local", 0)]  # newest first, fastest first (shared keeps 1)
    assert all("Corrupt" in why or "checksum" in why.lower() for _, _, why in info.value.candidates), info.value
    assert ck2.restore_failures == 3
    ck2.close()


def test_a_tier_that_cannot_be_listed_is_no_empty_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_tiered import RestoreError, StorageError
    from dcp_tiered.tiers import restore as mod

    ck = TieredCheckpointer([Tier("local", str(tmp_path / "l")), Tier("shared", str(tmp_path / "s"))],
                            resume_promotions=False)
    real = mod.list_tier

    def outage(tier, *args, **kwargs):  # the shared tier became unreachable after construction
        if tier.name == "shared":
            raise StorageError(f"cannot list {tier.url}: connection refused")
        return real(tier, *args, **kwargs)

    monkeypatch.setattr(mod, "list_tier", outage)
    with pytest.raises(RestoreError, match="tier 'shared' cannot be listed"):
        ck.restore(small_state())  # None would restart training at step 0 while checkpoints may exist
    ck.close()


def test_requested_step_that_does_not_exist_raises(tmp_path: Path) -> None:
    from dcp_tiered import RestoreError

    ck = TieredCheckpointer(two_tiers(tmp_path))
    ck.maybe_save(0, small_state())
    assert ck.restore(small_state(), step=0) == 0
    with pytest.raises(RestoreError, match="of step 9"):
        ck.restore(small_state(), step=9)
    ck.close()


CRASH_DURING_PROMOTION = """
import os
import torch
from faults import FaultyFS, register
from speed import scaled
from dcp_tiered import Tier, TieredCheckpointer
register()
tiers = [Tier("local", {local!r}, every_steps=1, keep=1), Tier("shared", {shared!r}, every_steps=1, keep=1)]
ck = TieredCheckpointer(tiers)
for step in (8, 10):
    if step == 10:
        FaultyFS.faults.stall.clear()  # the promotion of step 10 to shared hangs ...
    ck.maybe_save(step, {{"model": {{"w": torch.arange(1 << 16, dtype=torch.float32) + step}}}})
    if step == 8:
        ck.wait(timeout=scaled(60))
assert FaultyFS.faults.stalled.wait(scaled(60))
os.kill(os.getpid(), 9)  # ... and the process dies: a restart resumes it
"""


def test_restore_pins_its_candidate_against_a_resumed_promotions_retention(tmp_path: Path, monkeypatch) -> None:
    """keep=1 on shared: the restart resumes the promotion of step 10, whose commit makes retention
    delete step 8 — the very step a restore (of step 8) is reading at that moment."""
    import torch.distributed.checkpoint as dcp
    from faults import FaultyFS, register
    from isolated import run_isolated

    register()
    local, shared = str(tmp_path / "local"), f"faulty://{tmp_path}/shared"
    res = run_isolated(CRASH_DURING_PROMOTION.format(local=local, shared=shared), timeout=180,
                       env={"PYTHONPATH": str(Path(__file__).parent)})
    assert res.returncode == -9, res.describe()
    assert (tmp_path / "shared" / "step_000000008" / ".metadata").exists()
    assert not (tmp_path / "shared" / "step_000000010" / ".metadata").exists()
    # keep=1 on local: step 8 goes there once step 10 commits (retention waits for no promotion)
    __import__("shutil").rmtree(tmp_path / "local" / "step_000000008", ignore_errors=True)

    FaultyFS.faults.reset()
    FaultyFS.faults.stall.clear()  # the resumed promotion waits until the restore is reading
    tiers = [Tier("local", local, every_steps=1, keep=1), Tier("shared", shared, every_steps=1, keep=1)]
    ck = TieredCheckpointer(tiers)
    real_load = dcp.load

    pending_during_load: list = []

    def load_while_the_promotion_could_commit(*args, **kwargs):
        FaultyFS.faults.stall.set()
        pending_during_load.append(ck.promoter.pending())
        time.sleep(0.5)  # a resumed promotion running now would commit step 10 and delete step 8 (keep=1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", load_while_the_promotion_could_commit)
    try:
        sd = {"model": {"w": torch.zeros(1 << 16)}}
        assert ck.restore(sd, step=8) == 8
        assert torch.equal(sd["model"]["w"], torch.arange(1 << 16, dtype=torch.float32) + 8)
        assert pending_during_load == [[]]  # resumed promotions wait for the restore to finish
        ck.wait(timeout=scaled(60))  # then the resumed promotion commits step 10 (and retention runs)
        assert (tmp_path / "shared" / "step_000000010" / ".metadata").exists()
    finally:
        FaultyFS.faults.stall.set()
        ck.close(timeout=scaled(60))
        FaultyFS.faults.reset()


# -- SaveError, wait/close timeouts ------------------------------------------------------------


def test_save_error_is_short_and_carries_its_cause(tmp_path: Path) -> None:
    from dcp_tiered import SaveError

    ck = TieredCheckpointer([Tier("local", str(tmp_path / "local"), every_steps=1, keep=1)])
    (tmp_path / "local").mkdir(exist_ok=True)
    (tmp_path / "local" / "step_000000000").write_text("a file where the checkpoint directory should be")
    with pytest.raises(SaveError) as info:
        ck.maybe_save(0, small_state())
    err = info.value
    assert len(str(err)) < 500, str(err)
    assert "Traceback" not in str(err) and "step 0" in str(err)
    assert err.__cause__ is not None and type(err.__cause__).__name__ in str(err)
    assert type(err.__cause__).__name__ != "CheckpointException"


@contextlib.contextmanager
def stalled_promotion(tmp_path: Path):
    """A checkpointer whose step 0 is committed locally while its promotion to "shared" hangs
    (until ``FaultyFS.faults.stall`` is set)."""
    from faults import FaultyFS, register

    register()
    FaultyFS.faults.reset()
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=2),
             Tier("shared", f"faulty://{tmp_path}/shared", every_steps=1, keep=2)]
    ck = TieredCheckpointer(tiers)
    FaultyFS.faults.stall.clear()  # the shared filesystem hangs
    try:
        ck.maybe_save(0, small_state())
        assert FaultyFS.faults.stalled.wait(scaled(30))
        yield ck, FaultyFS.faults
    finally:
        FaultyFS.faults.stall.set()
        FaultyFS.faults.reset()


def test_close_with_a_timeout_gives_up_on_a_stuck_promotion(tmp_path: Path) -> None:
    import threading

    from dcp_tiered import PromotionError

    with stalled_promotion(tmp_path) as (ck, faults):
        gave_up = threading.Event()

        def release_later() -> None:  # the storage comes back only long after close() gave up
            gave_up.wait(scaled(120))
            faults.stall.set()

        threading.Thread(target=release_later, daemon=True).start()
        with pytest.raises(PromotionError):
            try:
                ck.wait(timeout=0.5)
            finally:
                stuck = not faults.stall.is_set()
                gave_up.set()
        assert stuck  # wait() returned while the promotion was still blocked
        ck.close(timeout=scaled(60))


def test_a_close_that_timed_out_leaves_the_checkpointer_open_and_a_second_close_finishes(tmp_path: Path) -> None:
    from dcp_tiered import PromotionError

    with stalled_promotion(tmp_path) as (ck, faults):
        with pytest.raises(PromotionError, match="pending"):
            ck.close(timeout=0.5)
        faults.stall.set()  # the storage comes back
        ck.close(timeout=scaled(120))  # still open: this close waits for the promotion
        assert (tmp_path / "shared" / "step_000000000" / ".metadata").exists()
        with pytest.raises(ConfigError, match="closed"):
            ck.maybe_save(1, small_state())


# -- 4 gloo ranks ----------------------------------------------------------------------------------

WS = 4
SPAWN_TIMEOUT = 300.0


def _app_worker(rank: int, world: int, data: str, out: str) -> None:
    from gloo_ranks import record

    outp = Path(out)
    tiers = [Tier("local", f"{data}/local/{{node}}", every_steps=1, keep=2, codec="lz4"),
             Tier("shared", f"{data}/shared", every_steps=1, keep=1, codec="zstd")]
    saved = make_app(0)
    want = app_tensors(saved)
    counter = Counter(10 + rank)  # per-rank plain state under a per-rank key

    def save() -> None:
        ck = TieredCheckpointer(tiers)
        assert ck.maybe_save(3, lambda: {"app": saved, "ranks": {f"r{rank}": counter}}) is not None
        ck.close(timeout=scaled(120))

    def restore(broadcast: bool) -> None:
        fresh, mine = make_app(1 + rank), Counter(0)
        ck = TieredCheckpointer(tiers)
        # broadcast=True is for replicated state: every rank asks for the same keys
        sd = {"app": fresh} if broadcast else {"app": fresh, "ranks": {f"r{rank}": mine}}
        got = ck.restore(sd, broadcast=broadcast)
        ck.close(timeout=scaled(120))
        assert got == 3, f"rank {rank} restored {got}"
        assert fresh.loaded == 1, fresh.loaded
        assert broadcast or mine.n == 10 + rank, mine.n
        assert_same(app_tensors(fresh), want)

    record(outp, "app_save", rank, save)
    record(outp, "app_restore", rank, lambda: restore(False))
    record(outp, "app_restore_broadcast", rank, lambda: restore(True))


@pytest.fixture(scope="module")
def app_run(tmp_path_factory) -> tuple[Path, str | None]:
    from gloo_ranks import run_ranks_recording

    root = tmp_path_factory.mktemp("app4")
    return run_ranks_recording(_app_worker, WS, root, str(root / "data"), root / "records", timeout=SPAWN_TIMEOUT)


@pytest.mark.parametrize("check", ["app_save", "app_restore", "app_restore_broadcast"])
def test_app_state_round_trips_on_four_ranks(app_run, check: str) -> None:
    """The DCP tutorial's AppState (plus a per-rank Stateful) through restore and restore(broadcast=True)."""
    from gloo_ranks import read_records

    read_records(app_run[0], check, WS, app_run[1])


# -- SIGKILL mid-promotion, restart, 10 times ------------------------------------------------------

KILL_TRIALS = 10


def kill_tiers(data: str) -> list[Tier]:
    # local: per rank ({rank}), every step, never whole from one rank, so every restore comes from
    # shared, keep=1, every 2nd step: the step being restored is the one retention deletes as soon
    # as a resumed promotion commits a newer one
    return [Tier("local", f"{data}/local/{{rank}}", every_steps=1, keep=2, codec="lz4"),
            Tier("shared", f"{data}/shared", every_steps=2, keep=1, codec="zstd")]


def step_state(step: int, rank: int) -> dict:
    """The state at ``step``: replicated model and optimizer, and one per-rank entry; every value depends on the step."""
    g = torch.Generator().manual_seed(1000 + step)
    model = {f"l{i}": torch.randn(96, 96, generator=g) for i in range(6)}
    optim = {f"l{i}.exp_avg": torch.randn(96, 96, generator=g) for i in range(6)}
    own = torch.full((64,), float(step * 10 + rank))
    return {"model": model, "optim": {**optim, "step": torch.tensor(step)}, "ranks": {f"r{rank}": own}}


def blank_state(rank: int) -> dict:
    return {k: {kk: torch.full_like(v, -1) for kk, v in d.items()} for k, d in step_state(0, rank).items()}


def _kill_worker(rank: int, world: int, data: str, out: str, seed: int, steps: int) -> None:
    import json
    import os
    import random
    import time

    rng = random.Random(seed)
    victim, kill_after = rng.randrange(world), rng.randrange(1, 5)  # same on every rank
    delay = rng.random() * 0.3
    ck = TieredCheckpointer(kill_tiers(data), optimizer_every=1, leftover_grace=0)
    sd = blank_state(rank)
    try:
        got = ck.restore(sd)
    except Exception as exc:  # recorded: the test reports it
        Path(out, f"restore.rank{rank}.json").write_text(json.dumps({"step": "error", "error": repr(exc)}))
        raise
    exact = None
    if got is not None:
        want = step_state(got, rank)
        exact = all(torch.equal(sd[k][kk], want[k][kk]) for k in want for kk in want[k])
    Path(out, f"restore.rank{rank}.json").write_text(json.dumps({"step": got, "exact": exact}))
    start = 0 if got is None else got + 1
    if got is None:  # a fresh start: the first checkpoint reaches shared before anything is killed
        ck.maybe_save(start, step_state(start, rank))
        ck.wait(timeout=scaled(120))
        start += 1
    saves_to_shared = 0
    for step in range(start, start + steps):
        report = ck.maybe_save(step, lambda step=step: step_state(step, rank))
        if report is not None and "shared" in report.tiers:
            saves_to_shared += 1
            if rank == victim and saves_to_shared == kill_after:
                time.sleep(delay)  # the promotion to shared runs in the background now
                os.kill(os.getpid(), 9)
    ck.close(timeout=scaled(120))


def kill_trials(tmp: Path, data: Path, trials: int) -> list[dict]:
    """Run the 4 ranks ``trials + 1`` times over ``data`` (they fork from one preloaded forkserver):
    what the local and shared tiers committed before each run, each rank's restore facts, how it ended."""
    import json

    from gloo_ranks import run_ranks

    history = []
    for trial in range(trials + 1):
        before = {"local": _committed(data / "local" / "0"), "shared": _committed(data / "shared")}
        out = tmp / f"run{trial}"
        out.mkdir()
        try:
            run_ranks(_kill_worker, WS, tmp, str(data), str(out), trial, 12, timeout=240)
            ended = "finished"
        except BaseException as exc:  # noqa: BLE001 - a killed rank ends the run; reported by the test
            ended = type(exc).__name__
        restored = {r: json.loads(f.read_text()) if (f := out / f"restore.rank{r}.json").exists() else None
                    for r in range(WS)}
        history.append({"before": before, "restored": restored, "ended": ended})
    return history


KILL_RUN = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_restore_contract import kill_trials
emit(kill_trials(Path({tmp!r}), Path({data!r}), {trials}))
"""


def _committed(path: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in path.glob("step_*") if (p / ".metadata").exists()) if path.exists() else []


def test_sigkill_mid_promotion_then_restart_restores_the_same_step_everywhere(tmp_path: Path) -> None:
    """A rank SIGKILLs itself while the promotion to the keep=1 shared tier runs; all ranks restart.
    Every restart restores one step on all 4 ranks, bit-exact, never None while a checkpoint exists.
    The local tier is per rank, so each restore reads the shared tier (keep=1) while the promotions
    resumed at the restart commit newer steps there and retention deletes older ones."""
    from isolated import run_isolated

    data = tmp_path / "data"
    tests = str(Path(__file__).parent)
    # one isolated child runs every restart (the ranks of all of them fork from its forkserver)
    res = run_isolated(KILL_RUN.format(tests=tests, tmp=str(tmp_path), data=str(data), trials=KILL_TRIALS),
                       timeout=300 * (KILL_TRIALS + 1), memory_mb=16384)
    assert not res.timed_out and res.result is not None, res.describe()
    history = res.result
    for trial, run in enumerate(history):
        before, restored = run["before"], run["restored"]
        assert run["ended"] != "TimeoutError", f"trial {trial}: the ranks hung {history}"
        for r, facts in restored.items():
            assert facts is not None, f"trial {trial}: rank {r} never finished its restore\n{res.describe()}"
        steps = {v["step"] for v in restored.values()}
        assert len(steps) == 1, f"trial {trial}: ranks restored different steps {restored}"
        step = steps.pop()
        if trial == 0:
            assert step is None
            continue
        assert before["shared"], f"trial {trial}: shared holds no committed checkpoint after the last run {history}"
        assert step not in (None, "error"), f"trial {trial}: restore gave {restored} although {before} was committed"
        assert all(v["exact"] for v in restored.values()), f"trial {trial}: restored step {step} not bit-exact"
        assert step >= min(before["shared"]), (trial, step, before)


class _Optim:
    def __init__(self) -> None:
        self.m = torch.zeros(4)

    def state_dict(self) -> dict:
        return {"m": self.m}

    def load_state_dict(self, sd: dict) -> None:
        self.m.copy_(sd["m"])


class _App:
    def __init__(self) -> None:
        self.w, self.opt = torch.zeros(4), _Optim()

    def state_dict(self) -> dict:
        return {"model": {"w": self.w}, "optim": self.opt}

    def load_state_dict(self, sd: dict) -> None:
        self.w.copy_(sd["model"]["w"])


def test_optimizer_every_reaches_inside_stateful_state_with_a_dotted_key(tmp_path: Path, caplog) -> None:
    tiers = [Tier("local", str(tmp_path / "l"), every_steps=1, keep=10)]
    app = _App()
    with TieredCheckpointer(tiers, optimizer_every=2, optimizer_keys=["app.optim"]) as ck:
        reports = [ck.maybe_save(s, {"app": app}) for s in range(4)]
        assert [r.optimizer for r in reports] == [True, False, True, False]
        held = {i.step: i.has_prefix(["app.optim"]) for i in ck.list()}
    assert held == {0: True, 1: False, 2: True, 3: False}
    with TieredCheckpointer(tiers, optimizer_every=2) as ck:  # the default keys match nothing here
        ck.maybe_save(10, {"app": app})
        assert "no entry of the state matches optimizer_keys" in caplog.text
    fresh = _App()
    with TieredCheckpointer(tiers) as ck:  # the newest step holding the optimizer, loaded into both objects
        app.w += 1
        app.opt.m += 2
        ck.maybe_save(11, {"app": app})
        assert ck.restore({"app": fresh}) == 11
    assert torch.equal(fresh.w, app.w) and torch.equal(fresh.opt.m, app.opt.m)


@pytest.mark.parametrize("timeout", ["5", -1.0, float("nan"), True])
def test_wait_and_close_refuse_a_timeout_that_is_no_duration(tmp_path: Path, timeout) -> None:
    ck = TieredCheckpointer([Tier("local", str(tmp_path / "l"))])
    for call in (ck.wait, ck.close):
        with pytest.raises(ConfigError, match="timeout"):
            call(timeout=timeout)
    ck.close()


def test_every_ranks_listing_problems_reach_every_rank_as_a_bounded_sample() -> None:
    """The coordinator's decision goes to every rank: with a problem on each of N ranks (a node-local tier
    no node can list) it carried N lines to N ranks; now a sample and a count."""
    from dcp_tiered.tiers.restore import MAX_PROBLEM_LINES, Restorer

    restorer = object.__new__(Restorer)
    restorer.distributed, restorer.tiers = True, []
    views = [([], [f"tier 'local' could not be listed: /nvme/{rank} is gone"], []) for rank in range(4096)]
    lines = restorer._decide(views, None)[3]
    assert len(lines) == MAX_PROBLEM_LINES + 1 and lines[0] == "rank 0: tier 'local' could not be listed: /nvme/0 is gone"
    assert lines[-1] == f"(and {4096 - MAX_PROBLEM_LINES} more listing problems on other ranks)"
