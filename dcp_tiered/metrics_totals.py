"""Per-tier totals of checkpoint events, without any dependency (re-exported by :mod:`dcp_tiered.metrics`).

:class:`TierTotals` folds the event dicts of :class:`~dcp_tiered.tiers.events.EventLog` (saves,
promotions, replications, restores) into one :class:`TierTotal` per tier; the Prometheus exporter
and the ``train`` summary read them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from dcp_tiered.cost import kept_bytes, monthly_cost, price_for

#: How many committed checkpoint sizes a tier's totals remember (newest steps), for the cost.
SIZES_REMEMBERED = 1000


@dataclass
class TierTotal:
    """Running totals for one tier."""

    tier: str
    saves: int = 0  # checkpoints committed on this tier (written or promoted)
    written: int = 0  # of those, serialized to this tier directly
    promoted: int = 0  # of those, promoted into this tier
    raw_bytes: int = 0  # of the committed checkpoints, from their records
    stored_bytes: int = 0  # the same checkpoints' items as stored
    written_bytes: int = 0  # everything written to the tier (promoted data files and .metadata too)
    blocked_s: float = 0.0
    save_s: float = 0.0
    promotion_s: float = 0.0
    failures: int = 0
    replicated_bytes: int = 0  # sent to the clique's peers by peer replication (``Tier(replicas=F)``)
    replication_failures: int = 0
    last_stored_bytes: int = 0
    last_raw_bytes: int = 0
    last_step: int | None = None  # the newest step committed on the tier
    last_success_s: float | None = None  # Unix time of the last commit on the tier
    #: stored bytes of each committed checkpoint by step (the newest SIZES_REMEMBERED), for the cost
    sizes: dict[int, int] = field(default_factory=dict, repr=False)
    #: of those, the steps known to lack the optimizer state (``optimizer_every``)
    partial: set[int] = field(default_factory=set, repr=False)

    @property
    def ratio(self) -> float:
        """Stored / raw bytes over the checkpoints committed on the tier (lower is better)."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    def kept_bytes(self, keep: int) -> int:
        """Stored bytes of ``keep`` kept checkpoints: the newest ones' real sizes (see :func:`~dcp_tiered.cost.kept_bytes`)."""
        steps = sorted(self.sizes, reverse=True)
        full = [s not in self.partial for s in steps] if self.partial else None
        return kept_bytes([self.sizes[s] for s in steps], keep, full)

    def _committed(self, step: Any, stored: int, now: float, partial: bool = False) -> None:
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            self.sizes[step] = stored
            if partial:
                self.partial.add(step)
            while len(self.sizes) > SIZES_REMEMBERED:
                self.partial.discard(min(self.sizes))
                del self.sizes[min(self.sizes)]
            self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.last_success_s = now

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sizes", "partial")}
        return {**d, "ratio": round(self.ratio, 4)}


class TierTotals:
    """Accumulate save, promotion and replication events into per-tier totals (thread safe, no dependencies).

    A save counts for the tier it was serialized to (the first of its ``tiers``); a promotion's
    data bytes are written to its target, and its ``metadata`` commit counts as a checkpoint
    committed there, with the raw and stored bytes the commit read from its own records.  A
    ``replication`` event adds its ``sent_bytes`` to the replicated tier (or counts a failure).
    ``clock`` gives the Unix time of a commit (``time.time``).
    """

    def __init__(self, tiers: Iterable[Any] = (), clock: Callable[[], float] = time.time) -> None:
        self.tiers: dict[str, TierTotal] = {}
        for t in tiers:
            name = getattr(t, "name", t)
            self.tiers[name] = TierTotal(name)
        self.clock = clock
        self._lock = threading.Lock()
        self.save_failures = 0
        self.restores: list[dict[str, Any]] = []
        self._partial: set[int] = set()  # steps saved without the optimizer state: so are their promotions

    def _tier(self, name: str) -> TierTotal:
        t = self.tiers.get(name)
        if t is None:
            t = self.tiers[name] = TierTotal(name)
        return t

    def observe(self, event: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
        """Fold one event in; return what changed as ``(kind, tier, value)`` tuples (used by exporters).

        A checkpoint committed on a tier gives ``("commit", tier, (stored, raw, step, unix_time))``."""
        kind = event.get("event")
        with self._lock:
            if kind == "save":
                return self._save(event)
            if kind == "promotion":
                return self._promotion(event)
            if kind == "replication":
                return self._replication(event)
            if kind in ("restore", "restore_failure"):
                self.restores.append(dict(event))
                return [(kind, str(event.get("tier")), 1)]
        return []

    def _save(self, event: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
        tiers = list(event.get("tiers") or [])
        if not tiers:
            return []
        t = self._tier(tiers[0])
        if not event.get("ok"):
            if event.get("ok") is False:
                self.save_failures += 1
                t.failures += 1
                return [("save_failure", t.tier, 1)]
            return []  # an async save in flight
        raw, stored = int(event.get("raw_bytes") or 0), int(event.get("stored_bytes") or 0)
        if not stored:  # sizes unknown (a rank whose writer did not commit the records): kept out of the ratio
            raw = 0
        blocked, total = float(event.get("blocked_s") or 0.0), float(event.get("total_s") or 0.0)
        t.saves += 1
        t.written += 1
        t.raw_bytes += raw
        t.stored_bytes += stored
        t.written_bytes += stored
        t.blocked_s += blocked
        t.save_s += total
        t.last_raw_bytes, t.last_stored_bytes = raw, stored
        now = self.clock()
        if event.get("optimizer") is False and isinstance(event.get("step"), int):
            self._partial = {s for s in self._partial if s > event["step"] - SIZES_REMEMBERED} | {event["step"]}  # bounded
        t._committed(event.get("step"), stored, now, event.get("step") in self._partial)
        return [("written", t.tier, stored), ("raw", t.tier, raw), ("stored", t.tier, stored),
                ("blocked", t.tier, blocked), ("total", t.tier, total),
                ("commit", t.tier, (stored, raw, t.last_step, now))]

    def _promotion(self, event: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
        target = event.get("target")
        if not target or event.get("kind") not in ("data", "metadata"):
            return []
        t = self._tier(target)
        if not event.get("ok"):
            t.failures += 1
            return [("promotion_failure", target, 1)]
        n, secs = int(event.get("bytes") or 0), float(event.get("seconds") or 0.0)
        t.written_bytes += n
        t.promotion_s += secs
        changes: list[tuple[str, str, Any]] = [("written", target, n), ("promotion", target, secs)]
        if event.get("kind") == "metadata":
            # the sizes of the whole checkpoint, read from the records the commit wrote
            raw, stored = int(event.get("raw_bytes") or 0), int(event.get("stored_bytes") or 0)
            t.saves += 1
            t.promoted += 1
            t.raw_bytes += raw
            t.stored_bytes += stored
            t.last_stored_bytes, t.last_raw_bytes = stored, raw
            now = self.clock()
            t._committed(event.get("step"), stored, now, event.get("step") in self._partial)
            changes += [("raw", target, raw), ("stored", target, stored),
                        ("commit", target, (stored, raw, t.last_step, now))]
        return changes

    def _replication(self, event: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
        """A step's peer replication ended on this rank: ``sent_bytes`` went to its clique, or it failed."""
        if not event.get("tier"):
            return []
        t = self._tier(str(event["tier"]))
        n = int(event.get("sent_bytes") or 0)  # a failed replication counts what it had sent
        t.replicated_bytes += n
        out = [("replicated", t.tier, n)]
        if not event.get("ok"):
            t.replication_failures += 1
            out.append(("replication_failure", t.tier, 1))
        return out

    def seed(self, listing: Iterable[Any], committed_at: Mapping[tuple[str, int], float] | None = None,
             optimizer_keys: Sequence[str] = (), newest_sizes: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Learn what the tiers already hold (after a restart), from a tier listing (``CheckpointInfo``:
        ``tier``, ``step``, ``committed``, ``size_bytes``, ``keys``): committed checkpoints' sizes (partial
        if ``keys`` lack ``optimizer_keys``), and per tier the newest step, its commit time from
        ``committed_at[(tier, step)]``, its ``(stored, raw)`` bytes from ``newest_sizes[tier]``.
        Never overrides what events already reported."""
        with self._lock:
            newest: dict[str, int] = {}
            for info in listing:
                if not info.committed or info.step < 0:
                    continue
                t = self._tier(info.tier)
                t.sizes.setdefault(info.step, int(info.size_bytes))
                if optimizer_keys and info.keys is not None and not info.has_prefix(optimizer_keys):
                    t.partial.add(info.step)
                newest[info.tier] = max(newest.get(info.tier, -1), info.step)
            for name, step in newest.items():
                if (t := self.tiers[name]).last_step is None:
                    t.last_step, t.last_success_s = step, (committed_at or {}).get((name, step))
                    t.last_stored_bytes, t.last_raw_bytes = (newest_sizes or {}).get(name, (0, 0))

    def monthly_cost(self, tier: str, keep: int, url: str = "", prices: Mapping[str, float] | None = None) -> float:
        """Estimated monthly cost of keeping ``keep`` checkpoints on ``tier``: the real sizes of the newest
        ones committed there (projected to ``keep`` with their mean while fewer exist)."""
        t = self.tiers.get(tier)
        if t is None:
            return 0.0
        return monthly_cost(t.kept_bytes(keep), price_for(tier, url, prices))
