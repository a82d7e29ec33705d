"""Metrics from checkpoint events: per-tier totals, and a Prometheus exporter (optional extra).

Both consume the event dicts that :class:`~dcp_tiered.tiers.events.EventLog` fans out
(``SaveReport.as_dict()``, promotion reports, restores)::

    from dcp_tiered.metrics import PrometheusExporter
    exporter = PrometheusExporter(tiers=ckpt.tiers)
    exporter.attach(ckpt)                 # subscribes to ckpt.events
    exporter.start_http_server(9108)      # GET http://host:9108/metrics

``prometheus_client`` is imported only when a :class:`PrometheusExporter` is created
(``pip install 'dcp-tiered[metrics]'``).  :class:`TierTotals` needs nothing.

Sizes come from each checkpoint's own records: a save's from what its writer committed, a
promotion's from the records of the ``.metadata`` it committed on the target, so a promotion
resumed after a restart reports its true sizes and raw/stored always describe the same items.

Metric names (Prometheus conventions: base units, ``_total`` on counters):

- ``checkpoint_bytes_written_total{tier}``: bytes written to the tier (save items, promoted data
  files and ``.metadata``)
- ``checkpoint_raw_bytes_total{tier}``: raw bytes (uncompressed, original dtype) of the
  checkpoints committed on the tier
- ``checkpoint_stored_bytes_total{tier}``: the same checkpoints' items as stored
- ``checkpoint_compression_ratio{tier}``: **stored / raw** bytes of the last checkpoint committed on
  the tier (lower is better: 0.25 means a quarter of the raw size; 1 or more means no gain)
- ``checkpoint_last_success_timestamp_seconds{tier}``: Unix time of the last checkpoint committed
  on the tier (a save or a promotion's commit); for a tier with nothing committed, the time the
  exporter was created, so a stale alert fires for a tier that never commits
- ``checkpoint_last_step{tier}``: the newest step committed on the tier (a resumed promotion of an
  older step does not lower it)
- ``checkpoint_save_interval_seconds{tier}``: the tier's ``every`` (only tiers that set it)
- ``checkpoint_stale_after_seconds{tier}``: no commit for that long is stale (the alert rules): the
  exporter's ``stale_after``, else twice the tier's ``every``
- ``checkpoint_duration_seconds{tier,phase}``: histogram; phases ``blocked`` and ``total``
  for saves (tier = the tier written), ``promotion`` for promotions (tier = target)
- ``checkpoint_blocking_seconds``: histogram of the time training was blocked per save
- ``checkpoint_promotion_failures_total{tier}``: failed promotions (tier = target)
- ``checkpoint_storage_cost_usd{tier}``: estimated monthly cost of the tier's retention: the
  real sizes of the newest ``keep`` checkpoints, plus the newest full one retention keeps beyond
  them with ``optimizer_every`` (see :func:`dcp_tiered.cost.kept_bytes`)
- ``checkpoint_saves_total{tier}``, ``checkpoint_save_failures_total``,
  ``checkpoint_restores_total{tier}``, ``checkpoint_restore_failures_total{tier}``

After a restart, :meth:`PrometheusExporter.attach` reads the tiers' listing once, and the newest
checkpoint's ``.metadata`` of each tier, so the last step, last success time, compression ratio
and the kept sizes are known before the first new commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from dcp_tiered.cost import kept_bytes, monthly_cost, price_for

log = logging.getLogger(__name__)

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
    """Accumulate save and promotion events into per-tier totals (thread safe, no dependencies).

    A save counts for the tier it was serialized to (the first of its ``tiers``); a promotion's
    data bytes are written to its target, and its ``metadata`` commit counts as a checkpoint
    committed there, with the raw and stored bytes the commit read from its own records.
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


class PrometheusExporter:
    """Expose checkpoint metrics to Prometheus from a private registry.

    Args:
        tiers: the checkpointer's tiers (for retention, intervals and prices of the gauges).
        prices: USD per GB-month by tier name or kind (see :mod:`dcp_tiered.cost`).
        registry: a ``prometheus_client.CollectorRegistry`` (default: a new private one).
        clock: Unix time of a commit (``time.time``).
        stale_after: ``checkpoint_stale_after_seconds``, seconds without a commit that are stale: one number
            or ``{tier: seconds}``; a tier not named gets twice its ``every`` (none for ``every_steps`` alone).
    """

    def __init__(self, tiers: Iterable[Any] = (), *, prices: Mapping[str, float] | None = None, registry: Any = None,
                 clock: Callable[[], float] = time.time, stale_after: float | Mapping[str, float] | None = None) -> None:
        try:
            import prometheus_client as pc
        except ImportError as exc:
            from dcp_tiered.errors import ConfigError

            raise ConfigError("Prometheus metrics need prometheus_client: pip install 'dcp-tiered[metrics]'") from exc
        self._pc = pc
        self.tiers = list(tiers)
        self._by_name = {getattr(t, "name", str(t)): t for t in self.tiers}
        self.prices = dict(prices or {})
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        self.totals = TierTotals(self.tiers, clock=clock)
        self.stale_after = stale_after
        self._started = clock()
        self._server: Any = None
        self._define(pc, self.registry)
        self._init_labels()

    def _define(self, pc: Any, r: Any) -> None:
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        # prometheus_client appends _total to counter names: checkpoint_bytes_written -> checkpoint_bytes_written_total
        self.bytes_written = pc.Counter("checkpoint_bytes_written", "Bytes written to the tier (save items, promoted "
                                        "data files and .metadata)", ["tier"], registry=r)
        self.raw_bytes = pc.Counter("checkpoint_raw_bytes", "Raw bytes (uncompressed, original dtype) of the checkpoints "
                                    "committed on the tier, from their records", ["tier"], registry=r)
        self.stored_bytes = pc.Counter("checkpoint_stored_bytes", "Stored bytes of the items of the checkpoints "
                                       "committed on the tier, from their records", ["tier"], registry=r)
        self.duration = pc.Histogram("checkpoint_duration_seconds", "Checkpoint time per tier and phase",
                                     ["tier", "phase"], buckets=buckets, registry=r)
        self.blocking = pc.Histogram("checkpoint_blocking_seconds", "Time training was blocked per save",
                                     buckets=buckets, registry=r)
        self.ratio = pc.Gauge("checkpoint_compression_ratio", "Stored bytes / raw bytes of the last checkpoint committed "
                              "on the tier (lower is better: 0.25 = a quarter of the raw size)", ["tier"], registry=r)
        self.last_success = pc.Gauge("checkpoint_last_success_timestamp_seconds", "Unix time of the last checkpoint "
                                     "committed on the tier (save or promotion)", ["tier"], registry=r)
        self.last_step = pc.Gauge("checkpoint_last_step", "Newest step committed on the tier", ["tier"],
                                  registry=r)
        self.interval = pc.Gauge("checkpoint_save_interval_seconds", "The tier's configured save interval (every)",
                                 ["tier"], registry=r)
        self.stale = pc.Gauge("checkpoint_stale_after_seconds", "No commit on the tier for this long is stale "
                              "(stale_after, else twice the tier's every)", ["tier"], registry=r)
        self.promotion_failures = pc.Counter("checkpoint_promotion_failures", "Failed promotions per target tier",
                                             ["tier"], registry=r)
        self.cost = pc.Gauge("checkpoint_storage_cost_usd", "Estimated monthly storage cost of the tier's retention "
                             "(USD): the real sizes of the kept checkpoints", ["tier"], registry=r)
        self.saves = pc.Counter("checkpoint_saves", "Checkpoints committed per tier", ["tier"], registry=r)
        self.save_failures = pc.Counter("checkpoint_save_failures", "Failed saves", registry=r)
        self.restores = pc.Counter("checkpoint_restores", "Restores per tier", ["tier"], registry=r)
        self.restore_failures = pc.Counter("checkpoint_restore_failures", "Restore candidates skipped per tier",
                                           ["tier"], registry=r)

    def _init_labels(self) -> None:
        for name, t in self._by_name.items():  # every tier shows up from the start
            self.totals._tier(name)
            for metric in (self.bytes_written, self.raw_bytes, self.stored_bytes, self.promotion_failures, self.cost,
                           self.saves):
                metric.labels(name)
            every = getattr(t, "every", None)
            if every:
                self.interval.labels(name).set(float(every))
            given = self.stale_after.get(name) if isinstance(self.stale_after, Mapping) else self.stale_after
            if given or every:
                self.stale.labels(name).set(float(given or 2 * every))
            self.last_success.labels(name).set(self._started)  # until a commit: a tier never committing goes stale

    def attach(self, checkpointer: Any, *, scan: bool = True) -> "PrometheusExporter":
        """Subscribe to a ``TieredCheckpointer``'s events (``checkpointer.events.hooks``).

        With ``scan`` (default) the tiers are listed once first (file names and sizes; every
        ``.metadata`` only with ``optimizer_every`` > 1, to tell the checkpoints holding the optimizer),
        and each tier's newest ``.metadata`` is read, so that after a restart the last step, last
        success time, compression ratio and the kept checkpoints' sizes are known before the first new
        commit.  A tier that cannot be listed is skipped with a warning."""
        if not self._by_name:  # tiers from the checkpointer
            self.tiers = list(checkpointer.tiers)
            self._by_name = {t.name: t for t in self.tiers}
            self._init_labels()
        if scan:
            self._scan(checkpointer)
        checkpointer.events.hooks.append(self.observe)
        return self

    def _scan(self, checkpointer: Any) -> None:
        from dcp_tiered.errors import DcpTieredError
        from dcp_tiered.tiers.catalog import METADATA_FILE, list_tier, tier_storage

        rank, node = getattr(checkpointer, "rank", 0), getattr(checkpointer, "node", 0)
        opts = getattr(checkpointer, "options", None)
        keys = tuple(opts.optimizer_keys) if opts is not None and opts.optimizer_every > 1 else ()
        for index, tier in enumerate(checkpointer.tiers):
            if rank != 0 and not getattr(tier, "node_local", False):
                continue  # rank 0 reports the shared tiers (it commits there)
            try:
                listing = [i for i in list_tier(tier, index, rank, node, with_metadata=bool(keys)) if i.committed]
                when, sizes = {}, {}
                if listing:  # the newest commit's time (its .metadata's modification time) and sizes
                    now = self.totals.clock()
                    newest = tier_storage(tier, rank, node).child(listing[0].name)
                    ages = newest.file_ages(now)
                    if METADATA_FILE in ages:
                        when[(tier.name, listing[0].step)] = now - ages[METADATA_FILE]
                    sizes = {tier.name: _sizes_of(newest)}
            except DcpTieredError as exc:
                log.warning("metrics: cannot list tier %s (%s): %s", tier.name, tier.url, exc)
                continue
            self.totals.seed(listing, when, keys, sizes)
        for name, t in self.totals.tiers.items():
            if t.last_step is not None:
                self.last_step.labels(name).set(t.last_step)
            if t.last_success_s is not None:
                self.last_success.labels(name).set(t.last_success_s)
            if t.last_raw_bytes:
                self.ratio.labels(name).set(t.last_stored_bytes / t.last_raw_bytes)
            self._set_cost(name)

    def _set_cost(self, tier: str) -> None:
        t = self._by_name.get(tier)
        self.cost.labels(tier).set(self.totals.monthly_cost(tier, getattr(t, "keep", 1), getattr(t, "url", ""),
                                                            self.prices))

    def observe(self, event: Mapping[str, Any]) -> None:
        """Fold one event dict into the metrics."""
        for kind, tier, value in self.totals.observe(event):
            if kind == "written":
                self.bytes_written.labels(tier).inc(value)
            elif kind == "raw":
                self.raw_bytes.labels(tier).inc(value)
            elif kind == "stored":
                self.stored_bytes.labels(tier).inc(value)
            elif kind == "blocked":
                self.blocking.observe(value)
                self.duration.labels(tier, "blocked").observe(value)
            elif kind == "total":
                self.duration.labels(tier, "total").observe(value)
            elif kind == "promotion":
                self.duration.labels(tier, "promotion").observe(value)
            elif kind == "promotion_failure":
                self.promotion_failures.labels(tier).inc()
            elif kind == "save_failure":
                self.save_failures.inc()
            elif kind == "restore":
                self.restores.labels(tier).inc()
            elif kind == "restore_failure":
                self.restore_failures.labels(tier).inc()
            elif kind == "commit":
                self._commit(tier, *value)

    def _commit(self, tier: str, stored: int, raw: int, step: int | None, when: float) -> None:
        self.saves.labels(tier).inc()
        if raw:
            self.ratio.labels(tier).set(stored / raw)
        self.last_success.labels(tier).set(when)
        if step is not None:
            self.last_step.labels(tier).set(step)
        self._set_cost(tier)

    def render(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return self._pc.generate_latest(self.registry)

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; return the port."""
        result = self._pc.start_http_server(port, addr=addr, registry=self.registry)
        self._server = result
        if isinstance(result, tuple):
            return int(result[0].server_port)
        return port

    def close(self) -> None:
        """Stop the HTTP server if this exporter started one."""
        if isinstance(self._server, tuple):
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
        self._server = None


def _sizes_of(storage: Any) -> tuple[int, int]:
    """``(stored, raw)`` bytes of the checkpoint in ``storage`` from its records (``(0, 0)`` if unreadable)."""
    from dcp_tiered.dcp.metadata_io import load_metadata
    from dcp_tiered.dcp.save_stats import stats_from_records
    from dcp_tiered.errors import DcpTieredError

    try:
        stats = stats_from_records((i.fqn, r) for i, r in load_metadata(storage).storage_data.items())
    except (DcpTieredError, TypeError, ValueError) as exc:
        log.warning("metrics: sizes of %s unreadable: %s", storage.url, exc)
        return 0, 0
    return (stats.stored_bytes, stats.raw_bytes) if stats.stored_bytes else (0, 0)
