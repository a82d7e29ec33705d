"""Metrics: per-tier totals from events, the Prometheus exporter over HTTP, the JSON-lines event log."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
