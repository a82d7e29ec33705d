"""Pins: the steps of each tier this process is using, which retention must never delete.

One registry per checkpointer, held by its promoter and read by retention: a save being written,
a restore reading its candidates and a replication sending or receiving a step pin it through
``Promoter.set_writing``.  Pins are counted, so one user releasing its pin never releases another's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class StepMarks:
    """Steps this process knows about, per tier (thread safe).

    ``own``: steps this process wrote or deleted; their leftovers need no grace period.
    ``pinned``: steps a save of this process is writing now, or that a restore reads; never deleted.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._own: dict[str, set[int]] = {}
        self._saved: dict[str, int] = {}  # tier -> the step this process committed there last
        self._pinned: dict[str, dict[int, int]] = {}  # tier -> step -> pins

    def mark_own(self, tier_name: str, step: int) -> None:
        with self._lock:
            self._own.setdefault(tier_name, set()).add(step)

    def mark_saved(self, tier_name: str, step: int) -> None:
        """Note that this process committed ``step`` to ``tier_name`` last: retention keeps it (:meth:`last_saved`)."""
        with self._lock:
            self._saved[tier_name] = step

    def last_saved(self, tier_name: str) -> "int | None":
        """The step this process committed to ``tier_name`` last (None: none yet), which no retention deletes:
        after a resume from an older step, newer steps of another run must not outrank this run's newest save."""
        with self._lock:
            return self._saved.get(tier_name)

    def pin(self, tier_names: Iterable[str], step: int, pinned: bool) -> None:
        """Pin (or release one pin of) ``step``: pins are counted, so a restore ending never releases
        the pin of a save or a replication of the same step."""
        with self._lock:
            for name in tier_names:
                counts = self._pinned.setdefault(name, {})
                left = counts.get(step, 0) + (1 if pinned else -1)
                if left > 0:
                    counts[step] = left
                else:
                    counts.pop(step, None)

    def own(self, tier_name: str) -> set[int]:
        with self._lock:
            return set(self._own.get(tier_name, ()))

    def pinned(self, tier_name: str) -> set[int]:
        with self._lock:
            return set(self._pinned.get(tier_name, ()))
