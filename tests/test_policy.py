"""Pure scheduling and retention policies (dcp_tiered.tiers.policy): no I/O, no clocks.

Readable example tests first, then Hypothesis properties that check the rules exhaustively
against small reference models written from the docstrings and docs/architecture.md ("Retention").
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered.tiers.policy import (
    HOUR,
    CheckpointFacts,
    Schedule,
    TierHistory,
    due_tiers,
    includes_optimizer,
    is_due,
    record_save,
    restore_order,
    retention_victims,
    step_period,
)
from dcp_tiered.tiers.policy import SaveSchedule
from dcp_tiered.tiers.config import Tier

PROPS = settings(max_examples=300, deadline=None)
SIM = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------- strategies

schedules = st.builds(
    Schedule,
    every=st.none() | st.sampled_from([1.0, 30.0, 60.0, 300.0, 900.0, 3600.0]) | st.floats(0.001, 7200.0),
    every_steps=st.none() | st.integers(1, 50),
    max_per_hour=st.none() | st.integers(1, 10),
)

# Time between calls: mostly short (so the hourly cap bites), sometimes long.
time_deltas = st.one_of(
    st.integers(0, 120).map(float),
    st.floats(0.0, 600.0, allow_nan=False, allow_infinity=False),
    st.integers(0, 5000).map(float),
)


def _simulate(schedule: Schedule, moves: list[tuple[int, float]], start_step: int = 0, start_time: float = 1e6):
    """Drive one tier with a fake clock; return the list of (step, time) saves and the per-call decisions."""
    history = TierHistory()
    step, now = start_step, start_time
    saves: list[tuple[int, float]] = []
    decisions: list[tuple[int, float, bool, list[tuple[int, float]]]] = []
    for dstep, dt in moves:
        step += dstep
        now += dt
        due = is_due(schedule, history, step, now)
        decisions.append((step, now, due, list(saves)))
        if due:
            history = record_save(history, step, now)
            saves.append((step, now))
    return saves, decisions


def _reference_due(schedule: Schedule, saves: list[tuple[int, float]], step: int, now: float) -> bool:
    """The rule of ``is_due`` computed from the full, unpruned save log."""
    if schedule.every_steps is not None and step % schedule.every_steps != 0:
        return False  # step schedules: the multiples of every_steps only
    if not saves:
        return True
    last_step, last_time = saves[-1]
    if step <= last_step:
        return False
    if schedule.max_per_hour is not None and sum(1 for _, t in saves if now - t < HOUR) >= schedule.max_per_hour:
        return False
    if schedule.every is not None and now - last_time < schedule.every:
        return False
    return True


# --------------------------------------------------------------------------- is_due: examples


def test_never_saved_tier_is_due():
    assert is_due(Schedule(), TierHistory(), 0, 0.0)
    assert is_due(Schedule(every=300.0, max_per_hour=1), TierHistory(), 7, 123.0)
    # by steps: only at a multiple, even before the first save (step 0 is one)
    assert not is_due(Schedule(every=300.0, every_steps=500, max_per_hour=1), TierHistory(), 7, 123.0)
    assert is_due(Schedule(every=300.0, every_steps=500, max_per_hour=1), TierHistory(), 1000, 123.0)
    assert is_due(Schedule(every_steps=5), TierHistory(), 0, 0.0)


def test_tier_without_schedule_is_due_on_every_new_step():
    h = record_save(TierHistory(), 10, 100.0)
    assert is_due(Schedule(), h, 11, 100.0)
    assert not is_due(Schedule(), h, 10, 200.0)


def test_step_not_after_last_step_is_never_due():
    h = record_save(TierHistory(), 100, 0.0)
    for step in (0, 99, 100):
        assert not is_due(Schedule(), h, step, 1e9)


def test_every_steps_only():
    h = record_save(TierHistory(), 100, 0.0)
    s = Schedule(every_steps=50)
    assert not is_due(s, h, 149, 1e9)
    assert is_due(s, h, 150, 0.0)


def test_every_steps_is_at_multiples_like_lightning_hf_torchtitan():
    s = Schedule(every_steps=5)
    assert [k for k in range(1, 21) if is_due(s, TierHistory(), k, 0.0)] == [5, 10, 15, 20]
    # the last save off the grid (a forced save at 7) does not shift the grid: next is 10, not 12
    h = record_save(TierHistory(), 7, 0.0)
    assert [k for k in range(8, 16) if is_due(s, h, k, 0.0)] == [10, 15]


def test_every_seconds_only():
    h = record_save(TierHistory(), 100, 1000.0)
    s = Schedule(every=300.0)
    assert not is_due(s, h, 10_000, 1299.9)
    assert is_due(s, h, 101, 1300.0)


def test_every_and_every_steps_a_multiple_once_the_time_elapsed():
    h = record_save(TierHistory(), 100, 1000.0)
    s = Schedule(every=300.0, every_steps=50)
    assert not is_due(s, h, 150, 1299.0)  # a multiple, time not elapsed
    assert not is_due(s, h, 149, 5000.0)  # time elapsed, not a multiple
    assert not is_due(s, h, 151, 5000.0)
    assert is_due(s, h, 150, 1300.0)  # both
    assert is_due(s, h, 200, 5000.0)  # the first multiple after the time elapsed


def test_max_per_hour_one_with_a_save_wanted_every_ten_minutes():
    s = Schedule(every=600.0, max_per_hour=1)
    saves, _ = _simulate(s, [(10, 600.0)] * 24, start_time=0.0)  # 4 hours, a call every 10 minutes
    assert [t for _, t in saves] == [600.0, 4200.0, 7800.0, 11400.0]


def test_max_per_hour_counts_the_rolling_hour_not_the_clock_hour():
    s = Schedule(max_per_hour=2)
    h = record_save(record_save(TierHistory(), 1, 3500.0), 2, 3599.0)
    assert not is_due(s, h, 3, 3700.0)  # both saves are within the last hour
    assert not is_due(s, h, 3, 7099.0)  # the one at 3599 still is
    assert is_due(s, h, 3, 7100.0)  # 3500 has aged out
    # A save exactly one hour old no longer counts.
    assert is_due(Schedule(max_per_hour=1), record_save(TierHistory(), 1, 0.0), 2, HOUR)
    assert not is_due(Schedule(max_per_hour=1), record_save(TierHistory(), 1, 0.0), 2, HOUR - 0.001)


def test_record_save_prunes_times_older_than_an_hour():
    h = TierHistory()
    for i, t in enumerate([0.0, 100.0, 1000.0, 3650.0, 3700.0]):
        h = record_save(h, i, t)
    assert h.last_step == 4 and h.last_time == 3700.0
    assert h.recent_times == (1000.0, 3650.0, 3700.0)


def test_due_tiers_example_keeps_tier_order():
    fast, medium, slow = Schedule(), Schedule(every_steps=100), Schedule(every=3600.0, max_per_hour=1)
    hist = [record_save(TierHistory(), 100, 0.0)] * 3
    assert due_tiers([fast, medium, slow], hist, 150, 60.0) == [0]
    assert due_tiers([fast, medium, slow], hist, 201, 60.0) == [0]
    assert due_tiers([fast, medium, slow], hist, 200, 60.0) == [0, 1]
    assert due_tiers([fast, medium, slow], hist, 200, 3600.0) == [0, 1, 2]
    assert due_tiers([slow, fast], [TierHistory(), hist[0]], 50, 0.0) == [0]
    assert due_tiers([], [], 1, 0.0) == []


# --------------------------------------------------------------------------- is_due: properties


@PROPS
@given(schedules, st.integers(-(10**9), 10**9), st.floats(-1e12, 1e12, allow_nan=False))
def test_prop_never_saved_is_due(schedule, step, now):
    # Due at once without steps; with every_steps at the first multiple.
    n = schedule.every_steps
    assert is_due(schedule, TierHistory(), step, now) == (n is None or step % n == 0)


@PROPS
@given(
    schedules,
    st.integers(0, 10**6),
    st.floats(0, 1e9, allow_nan=False),
    st.integers(0, 10**6),
    st.floats(0, 1e10, allow_nan=False),
)
def test_prop_step_not_after_last_is_never_due(schedule, last_step, last_time, back, now):
    h = record_save(TierHistory(), last_step, last_time)
    assert not is_due(schedule, h, last_step - back, now)


@PROPS
@given(
    st.floats(0.001, 1e5),
    st.integers(1, 1000),
    st.integers(1, 2000),
    st.floats(0.0, 2e5, allow_nan=False),
)
def test_prop_both_every_and_every_steps_a_multiple_and_the_time(every, every_steps, dstep, dt):
    h = record_save(TierHistory(), 1000, 5e6)
    due = is_due(Schedule(every=every, every_steps=every_steps), h, 1000 + dstep, 5e6 + dt)
    assert due == ((1000 + dstep) % every_steps == 0 and (5e6 + dt) - 5e6 >= every)


@SIM
@given(schedules, st.lists(st.tuples(st.integers(1, 20), time_deltas), min_size=1, max_size=300))
def test_prop_long_run_respects_schedule_and_hourly_cap(schedule, moves):
    saves, decisions = _simulate(schedule, moves)

    # The first call at a multiple of every_steps (any call without it) saves: a never-saved tier is due.
    first = next((d for d in decisions if schedule.every_steps is None or d[0] % schedule.every_steps == 0), None)
    assert (saves[0] if saves else None) == (first[:2] if first else None)

    # Every save is at a multiple of every_steps; consecutive saves are at least `every` seconds apart.
    for (s1, t1), (s2, t2) in zip(saves, saves[1:]):
        assert s2 > s1
        if schedule.every is not None:
            assert t2 - t1 >= schedule.every
    if schedule.every_steps is not None:
        assert all(s % schedule.every_steps == 0 for s, _ in saves)

    # No rolling hour [t, t + 3600) ever holds more than max_per_hour saves.
    if schedule.max_per_hour is not None:
        times = [t for _, t in saves]
        for i, start in enumerate(times):
            in_window = sum(1 for t in times[i:] if t - start < HOUR)
            assert in_window <= schedule.max_per_hour, (start, times)

    # And it is not over-conservative: each decision matches the rule over the full log
    # (which also checks that record_save's pruning of recent times loses nothing needed).
    for step, now, due, before in decisions:
        assert due == _reference_due(schedule, before, step, now), (step, now, before)


@SIM
@given(st.integers(1, 6), st.lists(st.tuples(st.just(1), st.integers(0, 900).map(float)), min_size=1, max_size=300))
def test_prop_hourly_cap_alone_is_exact(cap, moves):
    # Only the cap: a save happens exactly when fewer than `cap` saves lie in the last hour.
    schedule = Schedule(max_per_hour=cap)
    saves, decisions = _simulate(schedule, moves)
    times = [t for _, t in saves]
    for i, start in enumerate(times):
        assert sum(1 for t in times[i:] if t - start < HOUR) <= cap
    for step, now, due, before in decisions:
        assert due == (sum(1 for _, t in before if now - t < HOUR) < cap)


@SIM
@given(schedules, st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30).map(float)), min_size=1, max_size=200))
def test_prop_repeated_or_stalled_steps_never_double_save(schedule, moves):
    # Steps may repeat (dstep = 0): a step is saved at most once.
    saves, _ = _simulate(schedule, moves)
    steps = [s for s, _ in saves]
    assert steps == sorted(set(steps))


@PROPS
@given(
    st.lists(st.tuples(schedules, st.booleans(), st.integers(0, 200), st.floats(0, 1e4, allow_nan=False)), max_size=8),
    st.integers(0, 400),
    st.floats(0, 2e4, allow_nan=False),
)
def test_prop_due_tiers_preserves_tier_order(tiers, step, now):
    scheds = [s for s, _, _, _ in tiers]
    hists = [record_save(TierHistory(), ls, lt) if saved else TierHistory() for _, saved, ls, lt in tiers]
    got = due_tiers(scheds, hists, step, now)
    assert got == [i for i in range(len(tiers)) if is_due(scheds[i], hists[i], step, now)]
    assert got == sorted(got)


# --------------------------------------------------------------------------- restarts: saves stay on the multiples


def _run_with_restarts(n: int, moves: list[tuple[int, bool, int]], end: int) -> tuple[list[int], list[list[int]], set]:
    """Steps 1.. ``end`` (advancing by ``dstep``) on a tier saved every ``n`` steps, with crashes.

    A crash starts a fresh ``SaveSchedule`` restored from one of the saves made so far (``pick``
    chooses which: the newest, or an older one when a newer is corrupt; an odd ``pick`` restores
    it from another tier, so this one counts as not holding it), and training resumes at the step
    after it.  Returns every saved step, the saves of each run and every step offered."""
    tier = Tier("t", "/t", every_steps=n)
    sched, saved, runs, step, offered, moves_left = SaveSchedule([tier]), [], [[]], 0, set(), list(moves)
    while step < end:
        dstep, crash, pick = moves_left.pop(0) if moves_left else (1, False, 0)
        if crash and saved:
            k = sorted(set(saved))[-1 - pick % len(set(saved))]
            sched = SaveSchedule([tier])
            sched.restored(k, 0.0, [0] if pick % 2 == 0 else [])
            runs.append([])
            step = k
            continue
        step += dstep
        offered.add(step)
        if sched.decide(step, 0.0):
            saved.append(step)
            runs[-1].append(step)
    return saved, runs, offered


@SIM
@given(
    st.integers(1, 12),
    st.lists(st.tuples(st.integers(1, 3), st.booleans(), st.integers(0, 3)), max_size=150),
    st.integers(1, 120),
)
def test_prop_saves_with_restarts_are_exactly_the_multiples(n, moves, end):
    saved, runs, offered = _run_with_restarts(n, moves, end)
    # Exactly the multiples among the steps offered: never off the grid (not even right after a
    # restore), and no multiple missed.
    assert set(saved) == {s for s in offered if s % n == 0}
    for run in runs:
        assert run == sorted(set(run))  # each run saves a step at most once, in order
    if all(d == 1 for d, _, _ in moves):  # every step offered: the multiples of n up to the last step
        assert set(saved) == set(range(n, max(offered) + 1, n))


def test_restart_after_restore_waits_for_the_next_multiple():
    saved, runs, _ = _run_with_restarts(5, [(1, False, 0)] * 12 + [(1, True, 0)], 20)  # crash after step 12
    assert runs == [[5, 10], [15, 20]] and saved == [5, 10, 15, 20]


# --------------------------------------------------------------------------- includes_optimizer


def test_includes_optimizer_examples():
    assert [includes_optimizer(i, 3) for i in range(7)] == [True, False, False, True, False, False, True]
    assert all(includes_optimizer(i, 1) for i in range(20))
    # step schedules: the multiples of optimizer_every * every_steps, whatever the save count
    assert [s for s in range(0, 40, 5) if includes_optimizer(7, 3, s, 5)] == [0, 15, 30]
    assert step_period([Schedule(every_steps=10), Schedule(every=60.0, every_steps=2), Schedule()]) == 10
    assert step_period([Schedule(every=60.0)]) is None


@PROPS
@given(st.integers(1, 5), st.integers(0, 10_000))
def test_prop_includes_optimizer(n, i):
    assert includes_optimizer(i, n) == (i % n == 0)
    assert includes_optimizer(0, n)  # the first save always carries optimizer state
    # Exactly one save in each block of n consecutive saves carries it.
    assert sum(includes_optimizer(j, n) for j in range(i, i + n)) == 1


# --------------------------------------------------------------------------- restore_order


def test_restore_order_example():
    cands = [(100, 2), (200, 1), (100, 0), (200, 0), (50, 0), (200, 2)]
    assert restore_order(cands) == [(200, 0), (200, 1), (200, 2), (100, 0), (100, 2), (50, 0)]
    assert restore_order([]) == []
    assert restore_order(iter([(1, 1), (1, 0)])) == [(1, 0), (1, 1)]


@PROPS
@given(st.lists(st.tuples(st.integers(-5, 10**7), st.integers(0, 5)), max_size=40))
def test_prop_restore_order(cands):
    got = restore_order(cands)
    assert sorted(got) == sorted(cands)  # a permutation
    for (s1, t1), (s2, t2) in zip(got, got[1:]):
        assert s1 > s2 or (s1 == s2 and t1 <= t2)


# --------------------------------------------------------------------------- retention: examples


def C(step, busy=False):  # noqa: N802 - reads like data
    return CheckpointFacts(step, committed=True, busy=busy)


def U(step, busy=False):  # noqa: N802
    return CheckpointFacts(step, committed=False, busy=busy)


def test_retention_keeps_the_newest_n():
    found = [C(100), C(200), C(300), C(400), C(500)]
    assert retention_victims(found, keep=2) == [100, 200, 300]
    assert retention_victims(found, keep=5) == []
    assert retention_victims(found, keep=9) == []
    assert retention_victims([], keep=2) == []


def test_retention_keep_zero_or_negative_is_keep_one():
    found = [C(1), C(2), C(3)]
    assert retention_victims(found, keep=0) == [1, 2]
    assert retention_victims(found, keep=-4) == [1, 2]
    assert retention_victims([C(7)], keep=0) == []


def test_retention_never_touches_a_save_in_progress():
    # 600 is being written (uncommitted, newer than every committed one): never deleted,
    # even when not marked busy.
    found = [C(100), C(200), C(300), U(600)]
    assert retention_victims(found, keep=1) == [100, 200]
    # With nothing committed, nothing uncommitted is deleted either.
    assert retention_victims([U(1), U(2)], keep=1) == []


def test_retention_deletes_old_uncommitted_leftovers():
    found = [U(50), C(100), U(150, busy=True), U(250), C(300)]
    assert retention_victims(found, keep=2) == [50, 250]


def test_retention_skips_busy_and_protected():
    found = [C(100, busy=True), C(200), C(300), C(400)]
    assert retention_victims(found, keep=1, protect=[200]) == [300]
    assert retention_victims(found, keep=1, protect=iter([300])) == [200]


# --------------------------------------------------------------------------- retention: properties


@st.composite
def retention_cases(draw):
    steps = draw(st.lists(st.integers(0, 500), unique=True, max_size=25))
    found = [
        CheckpointFacts(s, committed=draw(st.booleans()), busy=draw(st.sampled_from([False, False, False, True])))
        for s in steps
    ]
    keep = draw(st.integers(-3, 12))
    protect = draw(st.lists(st.sampled_from(steps) if steps else st.integers(0, 500), max_size=4))
    protect += draw(st.lists(st.integers(0, 500), max_size=2))  # may name absent steps
    order = draw(st.permutations(found))
    return order, keep, protect


def _expected_victims(found, keep, protect):
    """Reference model of the documented rule."""
    keep = max(1, keep)
    committed = sorted((f for f in found if f.committed), key=lambda f: -f.step)
    newest = committed[0].step if committed else None
    kept = {f.step for f in committed[:keep]}
    out = []
    for f in found:
        if f.busy or f.step in protect or f.step in kept:
            continue
        if f.committed or (newest is not None and f.step < newest):
            out.append(f.step)
    return sorted(out)


@PROPS
@given(retention_cases())
def test_prop_retention_safety(case):
    found, keep, protect = case
    victims = retention_victims(found, keep, protect)
    by_step = {f.step: f for f in found}
    committed = sorted((f.step for f in found if f.committed), reverse=True)
    newest = committed[0] if committed else None

    assert victims == sorted(set(victims))
    assert set(victims) <= set(by_step)
    # Never the newest committed, never one of the `keep` newest committed (keep <= 0 acts as 1).
    assert newest not in victims
    assert not set(committed[: max(1, keep)]) & set(victims)
    # At least min(keep, #committed) committed checkpoints remain.
    remaining = [s for s in committed if s not in victims]
    assert len(remaining) >= min(max(1, keep), len(committed))
    # Never busy, never protected.
    for s in victims:
        assert not by_step[s].busy
        assert s not in protect
    # Never an uncommitted step that is not older than the newest committed one.
    for s in victims:
        if not by_step[s].committed:
            assert newest is not None and s < newest


@PROPS
@given(retention_cases())
def test_prop_retention_liveness(case):
    found, keep, protect = case
    victims = set(retention_victims(found, keep, protect))
    committed = sorted((f.step for f in found if f.committed), reverse=True)
    newest = committed[0] if committed else None
    # Old uncommitted leftovers that are not busy or protected are cleaned up.
    for f in found:
        if not f.committed and not f.busy and f.step not in protect and newest is not None and f.step < newest:
            assert f.step in victims
    # Exactly the committed ones beyond the `keep` newest (not busy or protected) go.
    busy_or_protected = {f.step for f in found if f.busy} | set(protect)
    expected_committed = set(committed[max(1, keep):]) - busy_or_protected
    assert victims & set(committed) == expected_committed
    # Whole decision equals the reference model, regardless of input order.
    assert sorted(victims) == _expected_victims(found, keep, set(protect))


@PROPS
@given(st.integers(1, 10), st.integers(0, 20), st.lists(st.integers(0, 10_000), unique=True, min_size=1, max_size=30))
def test_prop_retention_m_committed_keep_n(keep, extra, steps):
    # Plain case: M committed, nothing busy or protected -> exactly the M - N oldest go.
    found = [C(s) for s in steps]
    victims = retention_victims(found, keep)
    m = len(steps)
    assert victims == sorted(steps)[: max(0, m - keep)]
    # keep <= 0 behaves like keep = 1.
    assert retention_victims(found, -extra) == retention_victims(found, 1)


@PROPS
@given(retention_cases())
def test_prop_retention_is_idempotent(case):
    # Deleting the victims and asking again deletes nothing more.
    found, keep, protect = case
    victims = set(retention_victims(found, keep, protect))
    rest = [f for f in found if f.step not in victims]
    assert retention_victims(rest, keep, protect) == []


def test_via_fastest_routes_slow_tier_saves_through_the_fastest_tier() -> None:
    schedules = [Schedule(every=300.0), Schedule(every=1800.0)]
    # local saved 100 s ago (not due), shared saved 2000 s ago (due)
    histories = [TierHistory(10, 900.0, (900.0,)), TierHistory(1, -1000.0, (-1000.0,))]
    assert due_tiers(schedules, histories, 11, 1000.0) == [1]
    assert due_tiers(schedules, histories, 11, 1000.0, via_fastest=True) == [0, 1]
    # nothing due stays nothing due; a step the fastest tier already holds is not rewritten
    assert due_tiers(schedules, [histories[0], TierHistory(10, 900.0, (900.0,))], 11, 1000.0, via_fastest=True) == []
    assert due_tiers(schedules, histories, 10, 1000.0, via_fastest=True) == [1]
