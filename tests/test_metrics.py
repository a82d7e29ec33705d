"""Metrics: per-tier totals from events, the Prometheus exporter over HTTP, the JSON-lines event log."""

from __future__ import annotations

import json
import re
import subprocess
import time
import sys
import urllib.request
from pathlib import Path

import pytest
from speed import scaled
import torch

from dcp_tiered.metrics import PrometheusExporter, TierTotals
from dcp_tiered.tiers import Tier, TieredCheckpointer


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.zeros(64)},
            "optim": {"m": torch.randn(256, 64, generator=g) * 1e-3}}


def _sample(text: str, name: str, **labels: str) -> float:
    """Value of one sample in the Prometheus text format (labels must match exactly)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if got == labels:
            return float(m.group(4))
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def test_tier_totals_fold_saves_and_promotions() -> None:
    totals = TierTotals(["local", "durable"])
    totals.observe({"event": "save", "step": 10, "tiers": ["local", "durable"], "ok": True, "raw_bytes": 1000,
                    "stored_bytes": 400, "blocked_s": 0.5, "total_s": 2.0})
    totals.observe({"event": "promotion", "step": 10, "source": "local", "target": "durable", "kind": "data",
                    "bytes": 380, "seconds": 1.0, "ok": True})
    totals.observe({"event": "promotion", "step": 10, "source": "local", "target": "durable", "kind": "metadata",
                    "bytes": 20, "seconds": 0.1, "ok": True, "raw_bytes": 1000, "stored_bytes": 370})
    totals.observe({"event": "promotion", "step": 12, "source": "local", "target": "durable", "kind": "data",
                    "bytes": 0, "seconds": 3.0, "ok": False, "error": "boom"})
    totals.observe({"event": "save", "step": 12, "tiers": ["local"], "ok": False, "error": "disk full"})
    totals.observe({"event": "save", "step": 13, "tiers": ["local"], "ok": None})  # async, in flight: ignored
    local, durable = totals.tiers["local"], totals.tiers["durable"]
    assert (local.saves, local.written, local.raw_bytes, local.stored_bytes) == (1, 1, 1000, 400)
    assert local.blocked_s == 0.5 and local.ratio == 0.4 and local.failures == 1
    # a commit's sizes are the ones it read from its own records (not the data files copied plus .metadata)
    assert (durable.saves, durable.promoted, durable.raw_bytes, durable.stored_bytes) == (1, 1, 1000, 370)
    assert durable.written_bytes == 400 and durable.last_stored_bytes == 370 and durable.failures == 1
    assert (durable.last_step, local.last_step) == (10, 10)
    assert totals.save_failures == 1
    assert totals.monthly_cost("durable", keep=24) == pytest.approx(370 / 2**30 * 0.023 * 24)


def test_prometheus_exporter_over_http_and_event_log(tmp_path: Path) -> None:
    tiers = [Tier("local", str(tmp_path / "local"), codec="lz4", keep=2),
             Tier("durable", str(tmp_path / "durable"), codec="zstd", keep=3)]
    log = tmp_path / "events.jsonl"
    ckpt = TieredCheckpointer(tiers, event_log=log)
    exporter = PrometheusExporter(prices={"durable": 0.05}).attach(ckpt)
    port = exporter.start_http_server(0, "127.0.0.1")
    try:
        state = _state()
        r1 = ckpt.maybe_save(1, state, force=True)
        state["model"]["w"].add_(1.0)
        r2 = ckpt.maybe_save(2, state, force=True)
        ckpt.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=scaled(10)) as resp:
            text = resp.read().decode()
    finally:
        exporter.close()
    assert r1 is not None and r2 is not None
    stored = r1.stored_bytes + r2.stored_bytes
    raw = r1.raw_bytes + r2.raw_bytes
    assert _sample(text, "checkpoint_bytes_written_total", tier="local") == stored
    assert _sample(text, "checkpoint_raw_bytes_total", tier="local") == raw
    assert _sample(text, "checkpoint_bytes_written_total", tier="durable") > 0  # promoted (and re-encoded)
    assert _sample(text, "checkpoint_raw_bytes_total", tier="durable") == raw
    assert _sample(text, "checkpoint_compression_ratio", tier="local") == pytest.approx(r2.stored_bytes / r2.raw_bytes)
    assert 0 < _sample(text, "checkpoint_compression_ratio", tier="durable") <= 1
    assert _sample(text, "checkpoint_blocking_seconds_count") == 2
    assert _sample(text, "checkpoint_duration_seconds_count", tier="local", phase="total") == 2
    assert _sample(text, "checkpoint_duration_seconds_count", tier="durable", phase="promotion") >= 2
    assert _sample(text, "checkpoint_promotion_failures_total", tier="durable") == 0
    assert _sample(text, "checkpoint_saves_total", tier="durable") == 2
    local_cost = _sample(text, "checkpoint_storage_cost_usd", tier="local")
    assert local_cost == pytest.approx((r1.stored_bytes + r2.stored_bytes) / 2**30 * 0.08)  # keep=2: both, real sizes
    durable_cost = _sample(text, "checkpoint_storage_cost_usd", tier="durable")
    durable = list(exporter.totals.tiers["durable"].sizes.values())
    assert len(durable) == 2 and durable_cost == pytest.approx(sum(durable) * 1.5 / 2**30 * 0.05)  # keep=3: 2 + their mean

    events = [json.loads(line) for line in log.read_text().splitlines()]
    saves = [e for e in events if e["event"] == "save"]
    promotions = [e for e in events if e["event"] == "promotion"]
    assert [e["step"] for e in saves] == [1, 2] and all(e["ok"] for e in saves)
    assert saves[0]["tiers"] == ["local", "durable"] and saves[0]["stored_bytes"] == r1.stored_bytes
    assert {(e["step"], e["kind"], e["target"]) for e in promotions} >= {(1, "data", "durable"), (1, "metadata", "durable"),
                                                                         (2, "data", "durable"), (2, "metadata", "durable")}
    assert all(e["ok"] for e in promotions)


def test_promotion_failures_and_restores_are_counted() -> None:
    exporter = PrometheusExporter(["local", "durable"])
    exporter.observe({"event": "promotion", "step": 3, "source": "local", "target": "durable", "kind": "data",
                      "bytes": 0, "seconds": 1.0, "ok": False, "error": "StorageError: unreachable"})
    exporter.observe({"event": "restore_failure", "step": 3, "tier": "local", "error": "checksum mismatch"})
    exporter.observe({"event": "restore", "step": 2, "tier": "durable", "seconds": 0.1})
    exporter.observe({"event": "something-new"})  # unknown events are ignored
    text = exporter.render().decode()
    assert _sample(text, "checkpoint_promotion_failures_total", tier="durable") == 1
    assert _sample(text, "checkpoint_restore_failures_total", tier="local") == 1
    assert _sample(text, "checkpoint_restores_total", tier="durable") == 1
    # two exporters never share a registry
    assert "checkpoint_promotion_failures_total{tier=\"durable\"} 0.0" in PrometheusExporter(["durable"]).render().decode()


def test_missing_prometheus_client_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_tiered.errors import ConfigError

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigError, match=r"pip install 'dcp-tiered\[metrics\]'"):
        PrometheusExporter()
    TierTotals()  # needs nothing


def test_import_dcp_tiered_stays_light() -> None:
    code = ("import sys, dcp_tiered, dcp_tiered.metrics, dcp_tiered.cost; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'prometheus_client', 'matplotlib') "
            "or m.startswith('dcp_tiered.cli')]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 0, out.stdout + out.stderr


def _families(text: str) -> dict:
    """``{sample name: {labels tuple: value}}`` of a scrape, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_after_a_restart_resumed_promotions_report_true_sizes_and_the_alert_gauges(tmp_path: Path) -> None:
    """A child saves steps 1 and 2 whose promotions hang, and is SIGKILLed. A new checkpointer with the
    exporter attached resumes them and saves step 3: every tier's ratio (stored/raw) is at most 1, and
    the last-step / last-success gauges say step 3 (before that, the local tier's step 2, from the listing)."""
    from tests.isolated import run_isolated

    names = ("local", "shared", "durable")
    code = f"""
        import os, signal, threading, torch
        import dcp_tiered.tiers.promote.promoter as promotion
        from dcp_tiered.tiers import Tier, TieredCheckpointer
        promotion.copy_with_fragment = lambda *a, **k: threading.Event().wait()  # promotions never finish
        tiers = [Tier(n, os.path.join({str(tmp_path)!r}, n), codec="zstd", keep=3) for n in {names!r}]
        ckpt = TieredCheckpointer(tiers, async_save=False)
        g = torch.Generator().manual_seed(0)
        state = {{"model": {{"w": torch.randn(256, 64, generator=g)}}, "optim": {{"m": torch.randn(256, 64, generator=g)}}}}
        for step in (1, 2):
            assert ckpt.maybe_save(step, state, force=True).ok
        emit("saved")
        os.kill(os.getpid(), signal.SIGKILL)
    """
    child = run_isolated(code, timeout=240)
    assert child.result == "saved" and child.returncode == -9, child.describe()
    assert not (tmp_path / "shared" / "step_000000001" / ".metadata").exists()  # nothing got promoted

    tiers = [Tier(n, str(tmp_path / n), codec="zstd", keep=3) for n in names]
    ckpt = TieredCheckpointer(tiers, async_save=False)  # resume_promotions=True is the default
    t0 = time.time()
    exporter = PrometheusExporter(tiers).attach(ckpt)
    seeded = _families(exporter.render().decode())
    assert seeded["checkpoint_last_step"] == {(("tier", "local"),): 2.0}  # read from the listing at attach
    assert seeded["checkpoint_last_success_timestamp_seconds"][(("tier", "local"),)] <= t0
    try:
        assert ckpt.maybe_save(3, _state(3), force=True).ok  # resumes the promotions of steps 1 and 2 first
        ckpt.wait(timeout=scaled(180))
    finally:
        ckpt.close()
    metrics = _families(exporter.render().decode())
    for name in names:
        label = (("tier", name),)
        totals = exporter.totals.tiers[name]
        assert totals.raw_bytes > 0 and 0 < totals.ratio <= 1, (name, totals)  # what `dcp-tiered train` prints
        assert metrics["checkpoint_raw_bytes_total"][label] == totals.raw_bytes
        assert metrics["checkpoint_stored_bytes_total"][label] == totals.stored_bytes
        assert 0 < metrics["checkpoint_compression_ratio"][label] <= 1, name
        assert metrics["checkpoint_last_step"][label] == 3.0, name
        assert t0 <= metrics["checkpoint_last_success_timestamp_seconds"][label] <= time.time(), name
    # the two resumed commits and step 3's, each with its own checkpoint's sizes
    assert metrics["checkpoint_saves_total"][(("tier", "durable"),)] == 3
    assert sorted(exporter.totals.tiers["durable"].sizes) == [1, 2, 3]


def _busy_exporter(tmp_path: Path) -> PrometheusExporter:
    """An exporter that saw a save, a promotion and a failure: every metric family has samples."""
    tiers = [Tier("local", str(tmp_path / "local"), every="5m"), Tier("durable", str(tmp_path / "durable"), every="1h")]
    exporter = PrometheusExporter(tiers, clock=lambda: 1_700_000_000.0)
    exporter.observe({"event": "save", "step": 7, "tiers": ["local", "durable"], "ok": True, "raw_bytes": 1000,
                      "stored_bytes": 400, "blocked_s": 0.5, "total_s": 2.0})
    exporter.observe({"event": "save", "step": 8, "tiers": ["local"], "ok": False, "error": "disk full"})
    for kind, n in (("data", 380), ("metadata", 20)):
        exporter.observe({"event": "promotion", "step": 7, "source": "local", "target": "durable", "kind": kind,
                          "bytes": n, "seconds": 1.0, "ok": True, "raw_bytes": 1000, "stored_bytes": 350})
    exporter.observe({"event": "promotion", "step": 8, "source": "local", "target": "durable", "kind": "data",
                      "bytes": 0, "seconds": 1.0, "ok": False, "error": "unreachable"})
    exporter.observe({"event": "replication", "tier": "local", "step": 7, "ok": True, "clique": [0, 2],
                      "sent_bytes": 400, "seconds": 0.5})
    exporter.observe({"event": "replication", "tier": "local", "step": 8, "ok": False, "error": "peer gone"})
    return exporter


def test_metric_names_follow_prometheus_conventions(tmp_path: Path) -> None:
    """Base units, ``_total`` on counters, the seed's bytes-written name kept, the ratio's direction in its HELP."""
    from prometheus_client.parser import text_string_to_metric_families

    text = _busy_exporter(tmp_path).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():
        assert family.name.startswith("checkpoint_"), family.name
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {family.name + "_total", family.name + "_created"}
        assert not re.search(r"_(kb|mb|gb|kib|mib|gib|ms|minutes|hours)(_|$)", family.name), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
    metrics = _families(text)
    durable, local = (("tier", "durable"),), (("tier", "local"),)
    assert metrics["checkpoint_bytes_written_total"] == {local: 400.0, durable: 400.0}  # the seed's name, pinned
    assert metrics["checkpoint_raw_bytes_total"] == {local: 1000.0, durable: 1000.0}
    assert metrics["checkpoint_stored_bytes_total"] == {local: 400.0, durable: 350.0}
    assert metrics["checkpoint_compression_ratio"] == {local: 0.4, durable: 0.35}
    assert "Stored bytes / raw bytes" in families["checkpoint_compression_ratio"].documentation
    assert metrics["checkpoint_last_step"] == {local: 7.0, durable: 7.0}
    assert metrics["checkpoint_last_success_timestamp_seconds"] == {local: 1.7e9, durable: 1.7e9}
    assert metrics["checkpoint_save_interval_seconds"] == {local: 300.0, durable: 3600.0}
    assert metrics["checkpoint_promotion_failures_total"] == {local: 0.0, durable: 1.0}
    assert metrics["checkpoint_replication_bytes_total"] == {local: 400.0}
    assert metrics["checkpoint_replication_failures_total"] == {local: 1.0}


def test_replication_events_count_bytes_sent_and_failures(tmp_path: Path) -> None:
    """Issue 16: the bytes a rank sent to its clique's peers, and failed replications, per tier; a tier with
    replicas shows both series from the start, a tier without has none."""
    tiers = [Tier("local", str(tmp_path / "{node}"), replicas=2), Tier("shared", str(tmp_path / "shared"))]
    exporter = PrometheusExporter(tiers)
    start = _families(exporter.render().decode())
    assert start["checkpoint_replication_bytes_total"] == {(("tier", "local"),): 0.0}
    assert start["checkpoint_replication_failures_total"] == {(("tier", "local"),): 0.0}
    for step, ok in ((1, True), (2, True), (3, False)):
        exporter.observe({"event": "replication", "tier": "local", "step": step, "ok": ok,
                          **({"sent_bytes": 1000 * step} if ok else {"error": "peer gone"})})
    after = _families(exporter.render().decode())
    assert after["checkpoint_replication_bytes_total"] == {(("tier", "local"),): 3000.0}
    assert after["checkpoint_replication_failures_total"] == {(("tier", "local"),): 1.0}
    local = exporter.totals.tiers["local"]
    assert (local.replicated_bytes, local.replication_failures, local.saves, local.written_bytes) == (3000, 1, 0, 0)


def test_last_step_is_the_newest_committed_even_when_an_older_promotion_resumes_later() -> None:
    totals = TierTotals(["durable"], clock=iter([10.0, 20.0]).__next__)
    for step in (9, 4):
        totals.observe({"event": "promotion", "step": step, "source": "local", "target": "durable", "kind": "metadata",
                        "bytes": 10, "ok": True, "raw_bytes": 100, "stored_bytes": 50})
    durable = totals.tiers["durable"]
    assert (durable.last_step, durable.last_success_s, sorted(durable.sizes)) == (9, 20.0, [4, 9])


def test_cost_sums_the_real_size_of_each_kept_checkpoint() -> None:
    """With optimizer_every the kept checkpoints differ in size: each is priced at its own size."""
    totals = TierTotals(["local"])
    for step, stored in ((1, 1000), (2, 200), (3, 200), (4, 1000), (5, 200)):
        totals.observe({"event": "save", "step": step, "tiers": ["local"], "ok": True, "raw_bytes": 3000,
                        "stored_bytes": stored})
    assert totals.tiers["local"].kept_bytes(3) == 200 + 1000 + 200  # the newest three, not 3 x 200
    assert totals.monthly_cost("local", keep=3, prices={"local": 1.0}) == pytest.approx(1400 / 2**30)
    assert totals.tiers["local"].kept_bytes(8) == 2600 + 3 * 520  # projected: 3 more at the mean


def _expr_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bcheckpoint_[a-z_]+", expr))


def test_prometheus_alert_rules_parse_and_use_exported_metrics(tmp_path: Path) -> None:
    import yaml

    doc = yaml.safe_load((Path(__file__).parent.parent / "docs" / "prometheus" / "alerts.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    by_name = {r["alert"]: r for r in rules}
    assert {"CheckpointTierStale", "CheckpointPromotionFailures"} <= set(by_name)
    stale = by_name["CheckpointTierStale"]["expr"]
    assert _expr_metrics(stale) == {"checkpoint_last_success_timestamp_seconds", "checkpoint_stale_after_seconds"}
    down = by_name["CheckpointExporterDown"]["expr"]  # the stale rule needs the series: a vanished exporter has none
    assert 'absent(up{job="dcp-tiered"})' in down and 'up{job="dcp-tiered"} == 0' in down
    assert _expr_metrics(by_name["CheckpointPromotionFailures"]["expr"]) == {"checkpoint_promotion_failures_total"}
    exported = set(_families(_busy_exporter(tmp_path).render().decode()))
    for rule in rules:
        assert rule["labels"]["severity"] and rule["annotations"]["summary"]
        missing = _expr_metrics(rule["expr"]) - exported
        assert not missing, (rule["alert"], missing)


def test_grafana_dashboard_is_json_over_exported_metrics(tmp_path: Path) -> None:
    dash = json.loads((Path(__file__).parent.parent / "docs" / "grafana" / "dcp-tiered.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set().union(*map(_expr_metrics, exprs))
    exported = set(_families(_busy_exporter(tmp_path).render().decode()))
    assert used and not used - exported, used - exported
    for needed in ("checkpoint_compression_ratio", "checkpoint_bytes_written_total",
                   "checkpoint_last_success_timestamp_seconds", "checkpoint_last_step",
                   "checkpoint_promotion_failures_total", "checkpoint_blocking_seconds_bucket",
                   "checkpoint_replication_bytes_total"):
        assert needed in used, needed
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_a_save_without_known_stored_size_stays_out_of_the_ratio() -> None:
    """A rank whose writer did not commit the records reports no stored size: its raw size must not drag the ratio."""
    totals = TierTotals(["local"])
    totals.observe({"event": "save", "step": 1, "tiers": ["local"], "ok": True, "raw_bytes": 1000, "stored_bytes": 0})
    totals.observe({"event": "save", "step": 2, "tiers": ["local"], "ok": True, "raw_bytes": 1000, "stored_bytes": 600})
    local = totals.tiers["local"]
    assert (local.saves, local.raw_bytes, local.stored_bytes, local.ratio, local.last_step) == (2, 1000, 600, 0.6, 2)


def test_stale_alert_series_exist_for_tiers_that_never_committed(tmp_path: Path) -> None:
    """Review 14h: a tier that never commits had no last-success series, so the stale alert could
    never fire for it; a step-only tier had no interval at all.  Now: the exporter's start stands in,
    and the stale time is twice ``every`` or the exporter's ``stale_after``."""
    ck = TieredCheckpointer([Tier("local", str(tmp_path / "a"), every_steps=1),
                             Tier("durable", str(tmp_path / "b"), every=60)])
    try:
        text = PrometheusExporter(clock=lambda: 1000.0, stale_after={"local": 900}).attach(ck).render().decode()
    finally:
        ck.close()
    assert _sample(text, "checkpoint_last_success_timestamp_seconds", tier="durable") == 1000.0
    assert _sample(text, "checkpoint_last_success_timestamp_seconds", tier="local") == 1000.0
    assert _sample(text, "checkpoint_stale_after_seconds", tier="durable") == 120.0  # 2 x every
    assert _sample(text, "checkpoint_stale_after_seconds", tier="local") == 900.0
    one = PrometheusExporter([Tier("local", str(tmp_path / "a"), every_steps=1)], stale_after=60).render().decode()
    assert _sample(one, "checkpoint_stale_after_seconds", tier="local") == 60.0


def test_compression_ratio_is_there_after_a_restart_before_any_new_commit(tmp_path: Path) -> None:
    """Review 14h: after a restart the ratio was absent until each tier committed again (an hour
    for every=1h); attach's scan now reads the newest checkpoint's records."""
    tiers = [Tier("local", str(tmp_path / "l"), every_steps=1), Tier("durable", str(tmp_path / "d"), every_steps=2)]
    with TieredCheckpointer(tiers, async_save=False) as ck:
        ck.maybe_save(2, _state())
    with TieredCheckpointer(tiers) as ck:
        text = PrometheusExporter().attach(ck).render().decode()
    for tier in ("local", "durable"):
        assert 0 < _sample(text, "checkpoint_compression_ratio", tier=tier) <= 1.0


def test_cost_gauge_counts_the_full_checkpoint_retention_keeps_with_optimizer_every(tmp_path: Path) -> None:
    """optimizer_every=4, keep=2: retention keeps the two newest (model-only) and the newest full one."""
    totals = TierTotals(["local"])
    for step in range(1, 7):
        full = step % 4 == 0
        totals.observe({"event": "save", "step": step, "tiers": ["local"], "ok": True, "optimizer": full,
                        "raw_bytes": 3000, "stored_bytes": 1000 if full else 200})
    totals.observe({"event": "promotion", "kind": "metadata", "step": 4, "source": "local", "target": "durable",
                    "ok": True, "bytes": 10, "raw_bytes": 3000, "stored_bytes": 1000})
    totals.observe({"event": "promotion", "kind": "metadata", "step": 6, "source": "local", "target": "durable",
                    "ok": True, "bytes": 10, "raw_bytes": 3000, "stored_bytes": 200})
    assert totals.tiers["local"].kept_bytes(2) == 200 + 200 + 1000  # steps 6, 5 and the full 4
    assert totals.tiers["durable"].kept_bytes(1) == 200 + 1000
    # after a restart the scan tells the full checkpoints from their keys
    d = tmp_path / "local"
    tiers = [Tier("local", str(d), every_steps=1, keep=2)]
    g = torch.Generator().manual_seed(0)
    sd = {"model": {"w": torch.randn(20_000, generator=g)}, "optim": {"m": torch.randn(80_000, generator=g)}}
    with TieredCheckpointer(tiers, async_save=False, optimizer_every=4, optimizer_keys=["optim"]) as ck:
        for step in range(1, 7):
            ck.maybe_save(step, sd)
    on_disk = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    with TieredCheckpointer(tiers, optimizer_every=4, optimizer_keys=["optim"]) as ck:
        exporter = PrometheusExporter(prices={"local": 1.0}).attach(ck)
    assert exporter.totals.tiers["local"].kept_bytes(2) >= 0.9 * on_disk
