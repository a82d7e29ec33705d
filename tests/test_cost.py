"""The pure cost model: stored bytes x price per GB-month x checkpoints kept."""

from __future__ import annotations

import pytest

from dcp_tiered.cost import (
    DEFAULT_PRICES,
    GB,
    TierUsage,
    estimate,
    format_usd,
    monthly_cost,
    parse_prices,
    price_for,
    tier_kind,
)


def test_monthly_cost_is_bytes_times_price_times_kept() -> None:
    assert monthly_cost(GB, 0.023, 1) == pytest.approx(0.023)
    assert monthly_cost(10 * GB, 0.023, 24) == pytest.approx(10 * 0.023 * 24)
    assert monthly_cost(GB // 2, 0.1, 4) == pytest.approx(0.2)
    assert monthly_cost(0, 0.023, 24) == 0
    with pytest.raises(ValueError):
        monthly_cost(-1, 0.023, 1)


def test_tier_kinds_and_default_prices() -> None:
    assert tier_kind("durable", "s3://bucket/run") == "object"
    assert tier_kind("whatever", "gs://bucket/run") == "object"
    assert tier_kind("durable", "/mnt/archive") == "object"  # a durable tier is priced as object storage
    assert tier_kind("shared", "/fsx/run") == "shared"
    assert tier_kind("ckpt", "/mnt/lustre/run") == "shared"
    assert tier_kind("local", "/nvme/ckpt") == "local"
    assert price_for("durable", "s3://b/r") == DEFAULT_PRICES["object"] == 0.023
    assert price_for("local", "/nvme") == DEFAULT_PRICES["local"]
    # per tier name beats per kind beats the default
    assert price_for("durable", "s3://b/r", {"object": 0.0125}) == 0.0125
    assert price_for("durable", "s3://b/r", {"object": 0.0125, "durable": 0.004}) == 0.004


def test_estimate_and_saving_against_fp32() -> None:
    usages = [
        TierUsage("local", stored_bytes=6 * GB, fp32_bytes=10 * GB, keep=2, url="/nvme/ckpt"),
        TierUsage("durable", stored_bytes=4 * GB, fp32_bytes=10 * GB, keep=24, url="s3://b/run"),
    ]
    report = estimate(usages, {"local": 0.1})
    local, durable = report.tiers
    assert local.monthly_usd == pytest.approx(6 * 0.1 * 2)
    assert local.fp32_monthly_usd == pytest.approx(10 * 0.1 * 2)
    assert durable.price_gb_month == 0.023
    assert durable.monthly_usd == pytest.approx(4 * 0.023 * 24)
    assert durable.saving_usd == pytest.approx(6 * 0.023 * 24)
    assert durable.saving_fraction == pytest.approx(0.6)
    assert report.monthly_usd == pytest.approx(local.monthly_usd + durable.monthly_usd)
    assert report.saving_usd == pytest.approx(report.fp32_monthly_usd - report.monthly_usd)
    d = report.as_dict()
    assert d["tiers"][1]["tier"] == "durable" and d["tiers"][1]["keep"] == 24
    assert d["tiers"][1]["saving_fraction"] == 0.6


def test_parse_prices_and_format() -> None:
    assert parse_prices(["durable=0.02", "object = 0.021"]) == {"durable": 0.02, "object": 0.021}
    for bad in (["durable"], ["durable=abc"], ["=0.1"], ["x=-1"]):
        with pytest.raises(ValueError, match="TIER=USD"):
            parse_prices(bad)
    assert format_usd(0) == "$0"
    assert format_usd(1234.567) == "$1,234.57"
    assert format_usd(0.04213) == "$0.0421"
    assert format_usd(0.00002) == "$2.00e-05"
