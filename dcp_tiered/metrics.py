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
- ``checkpoint_replication_bytes_total{tier}``: bytes this process sent to its clique's peers by peer
  replication of the node-local tier (``Tier(replicas=F)``: its files x ``F - 1`` per save)
- ``checkpoint_replication_failures_total{tier}``: failed replications of a step on the tier
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
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dcp_tiered.errors import ConfigError, DcpTieredError
from dcp_tiered.names import METADATA_FILE
from dcp_tiered.metrics_totals import SIZES_REMEMBERED, TierTotal, TierTotals  # noqa: F401 - public here too

log = logging.getLogger(__name__)

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
        self.replication_bytes = pc.Counter("checkpoint_replication_bytes", "Bytes sent to the clique's peers by "
                                            "peer replication of the tier", ["tier"], registry=r)
        self.replication_failures = pc.Counter("checkpoint_replication_failures", "Failed replications of a step "
                                               "on the tier", ["tier"], registry=r)
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
            if getattr(t, "replicas", 1) > 1:  # only tiers that replicate
                self.replication_bytes.labels(name)
                self.replication_failures.labels(name)
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
        from dcp_tiered.tiers.catalog import list_tier
        from dcp_tiered.tiers.topology import tier_storage

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
            elif kind == "replicated":
                self.replication_bytes.labels(tier).inc(value)
            elif kind == "replication_failure":
                self.replication_failures.labels(tier).inc()
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

    try:
        stats = stats_from_records((i.fqn, r) for i, r in load_metadata(storage).storage_data.items())
    except (DcpTieredError, TypeError, ValueError) as exc:
        log.warning("metrics: sizes of %s unreadable: %s", storage.url, exc)
        return 0, 0
    return (stats.stored_bytes, stats.raw_bytes) if stats.stored_bytes else (0, 0)
