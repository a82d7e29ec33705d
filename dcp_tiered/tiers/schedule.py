"""``SaveSchedule``: which tiers a save at a step goes to, and the saves already made.

The one place the due-tier decision is made: ``TieredCheckpointer`` decides here (and
shares the coordinator's answer when the schedules read the wall clock), and a standalone
``TieredWriter`` without ``due=`` decides here too.  The rules themselves are the pure
functions of :mod:`dcp_tiered.tiers.policy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from dcp_tiered.tiers.policy import Schedule, TierHistory, due_tiers, record_save, step_period
from dcp_tiered.tiers.config import Tier


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
