"""Pure scheduling and retention policies over plain values (no I/O, no clocks).

Every function here takes the facts (step, wall time, previous saves, checkpoints found)
and returns a decision, so the rules are tested exhaustively without storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rules take plain values; SaveSchedule reads a Tier's schedule fields only
    from dcp_tiered.tiers.config import Tier

HOUR = 3600.0


@dataclass(frozen=True)
class Schedule:
    """The scheduling fields of a tier."""

    every: float | None = None
    every_steps: int | None = None
    max_per_hour: int | None = None


@dataclass(frozen=True)
class TierHistory:
    """Saves already made to a tier: the last one and the wall times of recent ones."""

    last_step: int | None = None
    last_time: float | None = None
    recent_times: tuple[float, ...] = ()


def is_due(schedule: Schedule, history: TierHistory, step: int, now: float) -> bool:
    """Whether a tier with ``schedule`` is due at ``step`` / ``now``.

    ``every_steps=N``: due at the multiples of N only (``step % N == 0``, step 0 included),
    as Lightning's ``every_n_train_steps``, HF's ``save_steps`` and torchtitan's ``interval``,
    so saves line up across restarts and tiers.  ``every``: due once that many seconds have
    passed since the last save (a tier never saved, or whose last save time is unknown, is
    due).  Both set: a multiple of N at which ``every`` has also elapsed.  A step at or
    before the last saved step is never due; ``max_per_hour`` caps saves in any rolling hour.
    """
    if history.last_step is not None and step <= history.last_step:
        return False
    if schedule.every_steps is not None and step % schedule.every_steps:
        return False
    if schedule.max_per_hour is not None:
        in_hour = sum(1 for t in history.recent_times if now - t < HOUR)
        if in_hour >= schedule.max_per_hour:
            return False
    if schedule.every is not None and history.last_time is not None and now - history.last_time < schedule.every:
        return False
    return True


def due_tiers(
    schedules: Sequence[Schedule], histories: Sequence[TierHistory], step: int, now: float, via_fastest: bool = False
) -> list[int]:
    """Indexes of the due tiers, in tier order (fastest first).

    With ``via_fastest``, a save due on a slower tier also goes to the fastest tier, so the
    state is written once to fast storage and the slower tiers get background copies.
    """
    due = [i for i, (s, h) in enumerate(zip(schedules, histories)) if is_due(s, h, step, now)]
    if via_fastest and due and due[0] != 0 and (histories[0].last_step is None or step > histories[0].last_step):
        due.insert(0, 0)
    return due


def record_save(history: TierHistory, step: int, now: float) -> TierHistory:
    """The history after a save at ``step`` / ``now`` (recent times pruned to one hour)."""
    recent = tuple(t for t in history.recent_times if now - t < HOUR) + (now,)
    return TierHistory(step, now, recent)


def includes_optimizer(save_index: int, optimizer_every: int, step: int | None = None,
                       every_steps: int | None = None) -> bool:
    """Whether a save carries optimizer state, with ``optimizer_every=K``.

    Step schedules (``every_steps=N``, the smallest N of the tiers scheduled by steps alone):
    the saves at multiples of K*N, so full checkpoints line up across restarts like the saves
    themselves.  Otherwise every Kth save of this process (``save_index`` 0-based: the first
    save after a start or a restore is full).
    """
    if optimizer_every <= 1:
        return True
    if every_steps is not None and step is not None:
        return step % (optimizer_every * every_steps) == 0
    return save_index % optimizer_every == 0


def step_period(schedules: Iterable[Schedule]) -> int | None:
    """The smallest ``every_steps`` of the schedules by steps alone (no ``every``), or None."""
    return min((s.every_steps for s in schedules if s.every_steps is not None and s.every is None), default=None)


@dataclass(frozen=True)
class CheckpointFacts:
    """What retention needs to know about one checkpoint directory of a tier."""

    step: int
    committed: bool
    busy: bool = False  # being written, or being read by a promotion
    full: bool = True  # holds every key a resume needs (e.g. the optimizer state)
    age: float | None = None  # seconds since its newest file was written, when known


def retention_victims(
    found: Iterable[CheckpointFacts], keep: int, protect: Iterable[int] = (), leftover_grace: float = 0.0
) -> list[int]:
    """Steps to delete so that ``keep`` committed checkpoints remain.

    Never deletes: the newest committed checkpoint, any of the ``keep`` newest committed
    ones, the newest committed one that is ``full`` (so a resume with optimizer state stays
    possible when only every Nth save holds it), a busy one, or a protected step.
    Uncommitted leftovers are deleted only when they are older than the newest committed
    checkpoint, not busy, and untouched for ``leftover_grace`` seconds (another process may
    be writing them; with a positive grace an unknown age counts as young).
    """
    keep = max(1, keep)
    facts = sorted(found, key=lambda f: f.step, reverse=True)
    protected = set(protect)
    committed = [f for f in facts if f.committed]
    newest_committed = committed[0].step if committed else None
    kept = {f.step for f in committed[:keep]}
    newest_full = next((f.step for f in committed if f.full), None)
    if newest_full is not None:
        kept.add(newest_full)
    victims = []
    for f in facts:
        if f.busy or f.step in protected or f.step in kept:
            continue
        if f.committed:
            victims.append(f.step)
        elif newest_committed is not None and f.step < newest_committed:
            old_enough = leftover_grace <= 0 or (f.age is not None and f.age >= leftover_grace)
            if old_enough:
                victims.append(f.step)
    return sorted(victims)


def restore_order(candidates: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Order ``(step, tier_index)`` candidates: newest step first, then fastest tier."""
    return sorted(candidates, key=lambda c: (-c[0], c[1]))


class SaveSchedule:
    """The schedules of ``tiers`` (fastest first) and the history of saves made to each.

    ``via_fastest``: a save due only on slower tiers also goes to the fastest one (see
    :func:`~dcp_tiered.tiers.policy.due_tiers`).
    """

    def __init__(self, tiers: Sequence[Tier], via_fastest: bool = False) -> None:
        self.names = [t.name for t in tiers]
        self.via_fastest = via_fastest
        self.schedules = [Schedule(t.every, t.every_steps, t.max_per_hour) for t in tiers]
        self.histories = {t.name: TierHistory() for t in tiers}
        #: Whether a decision reads the wall clock (then ranks must share one decision).
        self.clock_based = any(t.every is not None or t.max_per_hour is not None for t in tiers)
        #: The smallest ``every_steps`` of the tiers scheduled by steps alone (None: none is);
        #: ``optimizer_every`` counts in multiples of it.
        self.step_period = step_period(self.schedules)

    def due(self, step: int, now: float) -> list[int]:
        """Indexes of the tiers due at ``step`` / ``now``, fastest first (nothing is recorded)."""
        return due_tiers(self.schedules, [self.histories[n] for n in self.names], step, now, self.via_fastest)

    def record(self, indexes: Iterable[int], step: int, now: float) -> tuple[str, ...]:
        """Record a save at ``step`` / ``now`` to the tiers at ``indexes``; return their names."""
        names = tuple(self.names[i] for i in sorted(set(indexes)))
        for n in names:
            self.histories[n] = record_save(self.histories[n], step, now)
        return names

    def record_all(self, step: int, now: float, new: bool = False) -> tuple[str, ...]:
        """Record a save at ``step`` / ``now`` to every tier (with ``new``: to those whose last
        save is not ``step`` already); return their names."""
        idx = [i for i, n in enumerate(self.names) if not new or self.histories[n].last_step != step]
        return self.record(idx, step, now)

    def decide(self, step: int, now: float, *, fallback: bool = False,
               agree: Callable[[list[int]], list[int]] | None = None) -> tuple[str, ...]:
        """The names of the tiers a save at ``step`` / ``now`` goes to, recorded as saved.

        ``agree`` turns this process's answer into the one every rank uses (the coordinator's);
        it is called only when the answer reads the wall clock, so that schedules by steps alone
        need no collective.  With ``fallback`` the fastest tier is used when none is due.
        """
        idx = self.due(step, now)
        if agree is not None and self.clock_based:
            idx = agree(idx)
        return self.record(idx or ([0] if fallback else []), step, now)

    def restored(self, step: int, now: float, indexes: Iterable[int]) -> None:
        """After a restore of ``step``: the tiers at ``indexes`` count as saved at ``step`` / ``now``.

        Nothing becomes due at once: a tier by steps saves next at the next multiple of its
        ``every_steps`` after ``step``; a tier by time holding ``step`` waits ``every`` from
        ``now`` (one that does not hold it has no known last save time and is due)."""
        for i in set(indexes):
            self.histories[self.names[i]] = TierHistory(step, now, ())
