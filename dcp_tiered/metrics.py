"""Metrics from checkpoint events: per-tier totals, and a Prometheus exporter (optional extra).

Both consume the event dicts that :class:`~dcp_tiered.tiers.events.EventLog` fans out
(``SaveReport.as_dict()``, promotion reports, restores)::

    from dcp_tiered.metrics import PrometheusExporter
    exporter = PrometheusExporter(tiers=ckpt.tiers)
    exporter.attach(ckpt)                 # subscribes to ckpt.events
    exporter.start_http_server(9108)      # GET http://host:9108/metrics

``prometheus_client`` is imported only when a :class:`PrometheusExporter` is created
(``pip install 'dcp-tiered[metrics]'``).  :class:`TierTotals` needs nothing.

Metric names:

- ``checkpoint_bytes_written_total{tier}``: stored bytes written (saves and promotions)
- ``checkpoint_raw_bytes_total{tier}``: raw (uncompressed, original dtype) bytes those held
- ``checkpoint_duration_seconds{tier,phase}``: histogram; phases ``blocked`` and ``total``
  for saves (tier = the tier written), ``promotion`` for promotions (tier = target)
- ``checkpoint_blocking_seconds``: histogram of the time training was blocked per save
- ``checkpoint_compression_ratio{tier}``: stored / raw of the last checkpoint on the tier
- ``checkpoint_promotion_failures_total{tier}``: failed promotions (tier = target)
- ``checkpoint_storage_cost_usd{tier}``: estimated monthly cost of the tier's retention
- ``checkpoint_saves_total{tier}``, ``checkpoint_save_failures_total``,
  ``checkpoint_restores_total{tier}``, ``checkpoint_restore_failures_total{tier}``
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dcp_tiered.cost import monthly_cost, price_for


@dataclass
class TierTotal:
    """Running totals for one tier."""

    tier: str
    saves: int = 0  # checkpoints committed on this tier (written or promoted)
    written: int = 0  # of those, serialized to this tier directly
    promoted: int = 0  # of those, promoted into this tier
    raw_bytes: int = 0
    stored_bytes: int = 0
    blocked_s: float = 0.0
    save_s: float = 0.0
    promotion_s: float = 0.0
    failures: int = 0
    last_stored_bytes: int = 0
    last_raw_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": round(self.ratio, 4)}


class TierTotals:
    """Accumulate save and promotion events into per-tier totals (thread safe, no dependencies).

    A save counts for the tier it was serialized to (the first of its ``tiers``); a
    promotion's data bytes count for its target, and its ``metadata`` commit counts as a
    checkpoint committed there, holding the raw bytes of the save of that step.
    """

    def __init__(self, tiers: Iterable[Any] = ()) -> None:
        self.tiers: dict[str, TierTotal] = {}
        for t in tiers:
            name = getattr(t, "name", t)
            self.tiers[name] = TierTotal(name)
        self._lock = threading.Lock()
        self._raw_by_step: dict[int, int] = {}
        self._promoted_bytes: dict[tuple[int, str], int] = {}
        self.save_failures = 0
        self.restores: list[dict[str, Any]] = []

    def _tier(self, name: str) -> TierTotal:
        t = self.tiers.get(name)
        if t is None:
            t = self.tiers[name] = TierTotal(name)
        return t

    def observe(self, event: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
        """Fold one event in; return what changed as ``(kind, tier, value)`` tuples (used by exporters)."""
        changes: list[tuple[str, str, Any]] = []
        kind = event.get("event")
        with self._lock:
            if kind == "save":
                tiers = list(event.get("tiers") or [])
                if not tiers:
                    return changes
                t = self._tier(tiers[0])
                if not event.get("ok"):
                    if event.get("ok") is False:
                        self.save_failures += 1
                        t.failures += 1
                        changes.append(("save_failure", t.tier, 1))
                    return changes
                raw, stored = int(event.get("raw_bytes") or 0), int(event.get("stored_bytes") or 0)
                blocked, total = float(event.get("blocked_s") or 0.0), float(event.get("total_s") or 0.0)
                step = event.get("step")
                if isinstance(step, int):
                    self._raw_by_step[step] = raw
                    while len(self._raw_by_step) > 1000:
                        self._raw_by_step.pop(next(iter(self._raw_by_step)))
                t.saves += 1
                t.written += 1
                t.raw_bytes += raw
                t.stored_bytes += stored
                t.blocked_s += blocked
                t.save_s += total
                t.last_raw_bytes, t.last_stored_bytes = raw, stored
                changes += [("written", t.tier, stored), ("raw", t.tier, raw), ("blocked", t.tier, blocked),
                            ("total", t.tier, total), ("commit", t.tier, (stored, raw))]
            elif kind == "promotion":
                target = event.get("target")
                if not target or event.get("kind") not in ("data", "metadata"):
                    return changes
                t = self._tier(target)
                step = event.get("step")
                if not event.get("ok"):
                    t.failures += 1
                    changes.append(("promotion_failure", target, 1))
                    return changes
                n = int(event.get("bytes") or 0)
                secs = float(event.get("seconds") or 0.0)
                t.stored_bytes += n
                t.promotion_s += secs
                key = (step, target)
                changes += [("written", target, n), ("promotion", target, secs)]
                if event.get("kind") == "data":
                    self._promoted_bytes[key] = self._promoted_bytes.get(key, 0) + n
                else:
                    stored = self._promoted_bytes.pop(key, 0) + n
                    raw = self._raw_by_step.get(step, 0) if isinstance(step, int) else 0
                    t.saves += 1
                    t.promoted += 1
                    t.raw_bytes += raw
                    t.last_stored_bytes, t.last_raw_bytes = stored, raw
                    changes += [("raw", target, raw), ("commit", target, (stored, raw))]
            elif kind in ("restore", "restore_failure"):
                self.restores.append(dict(event))
                changes.append((kind, str(event.get("tier")), 1))
        return changes

    def monthly_cost(self, tier: str, keep: int, url: str = "", prices: Mapping[str, float] | None = None) -> float:
        """Estimated monthly cost of keeping ``keep`` checkpoints the size of the tier's last one."""
        t = self.tiers.get(tier)
        if t is None:
            return 0.0
        return monthly_cost(t.last_stored_bytes, price_for(tier, url, prices), keep)


class PrometheusExporter:
    """Expose checkpoint metrics to Prometheus from a private registry.

    Args:
        tiers: the checkpointer's tiers (for retention and prices of the cost gauge).
        prices: USD per GB-month by tier name or kind (see :mod:`dcp_tiered.cost`).
        registry: a ``prometheus_client.CollectorRegistry`` (default: a new private one).
    """

    def __init__(self, tiers: Iterable[Any] = (), *, prices: Mapping[str, float] | None = None, registry: Any = None) -> None:
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
        self.totals = TierTotals(self.tiers)
        self._server: Any = None
        r = self.registry
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.bytes_written = pc.Counter("checkpoint_bytes_written", "Stored bytes written per tier", ["tier"], registry=r)
        self.raw_bytes = pc.Counter("checkpoint_raw_bytes", "Raw (uncompressed) bytes checkpointed per tier", ["tier"], registry=r)
        self.duration = pc.Histogram("checkpoint_duration_seconds", "Checkpoint time per tier and phase",
                                     ["tier", "phase"], buckets=buckets, registry=r)
        self.blocking = pc.Histogram("checkpoint_blocking_seconds", "Time training was blocked per save",
                                     buckets=buckets, registry=r)
        self.ratio = pc.Gauge("checkpoint_compression_ratio", "Stored / raw bytes of the last checkpoint per tier",
                              ["tier"], registry=r)
        self.promotion_failures = pc.Counter("checkpoint_promotion_failures", "Failed promotions per target tier",
                                             ["tier"], registry=r)
        self.cost = pc.Gauge("checkpoint_storage_cost_usd", "Estimated monthly storage cost of the tier's retention (USD)",
                             ["tier"], registry=r)
        self.saves = pc.Counter("checkpoint_saves", "Checkpoints committed per tier", ["tier"], registry=r)
        self.save_failures = pc.Counter("checkpoint_save_failures", "Failed saves", registry=r)
        self.restores = pc.Counter("checkpoint_restores", "Restores per tier", ["tier"], registry=r)
        self.restore_failures = pc.Counter("checkpoint_restore_failures", "Restore candidates skipped per tier",
                                           ["tier"], registry=r)
        self._init_labels()

    def _init_labels(self) -> None:
        for name in self._by_name:  # every tier shows up from the start
            self.totals._tier(name)
            self.bytes_written.labels(name)
            self.raw_bytes.labels(name)
            self.promotion_failures.labels(name)
            self.cost.labels(name)

    def attach(self, checkpointer: Any) -> "PrometheusExporter":
        """Subscribe to a ``TieredCheckpointer``'s events (``checkpointer.events.hooks``)."""
        if not self._by_name:
            self.tiers = list(checkpointer.tiers)
            self._by_name = {t.name: t for t in self.tiers}
            self._init_labels()
        checkpointer.events.hooks.append(self.observe)
        return self

    def observe(self, event: Mapping[str, Any]) -> None:
        """Fold one event dict into the metrics."""
        for kind, tier, value in self.totals.observe(event):
            if kind == "written":
                self.bytes_written.labels(tier).inc(value)
            elif kind == "raw":
                self.raw_bytes.labels(tier).inc(value)
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
                stored, raw = value
                self.saves.labels(tier).inc()
                if raw:
                    self.ratio.labels(tier).set(stored / raw)
                t = self._by_name.get(tier)
                keep = getattr(t, "keep", 1)
                url = getattr(t, "url", "")
                self.cost.labels(tier).set(monthly_cost(stored, price_for(tier, url, self.prices), keep))

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
