"""The pure cost model: stored bytes x price per GB-month x checkpoints kept."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_tiered.cost import (
    DEFAULT_PRICES,
    GB,
    TierUsage,
    cost_from_listing,
    estimate,
    kept_bytes,
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


def test_kept_bytes_sums_real_sizes_and_projects_missing_ones_at_their_mean() -> None:
    assert kept_bytes([5, 1, 1, 5, 1], 3) == 7  # the newest three, each at its own size
    assert kept_bytes([6, 2], 4) == 8 + 2 * 4  # two more, at the mean (4)
    assert kept_bytes([], 3) == 0 and kept_bytes([9], 0) == 0
    with pytest.raises(ValueError):
        kept_bytes([-1], 1)


@given(st.lists(st.integers(0, 10**12), max_size=30), st.integers(0, 40))
def test_kept_bytes_is_the_exact_sum_when_the_tier_holds_keep_or_more(sizes: list[int], keep: int) -> None:
    got = kept_bytes(sizes, keep)
    if len(sizes) >= keep:
        assert got == sum(sizes[:keep])
    elif sizes:
        assert min(sizes) * keep - 1 <= got <= max(sizes) * keep + 1


def test_cost_from_listing_prices_each_kept_checkpoint_at_its_own_size() -> None:
    """optimizer_every=3: full checkpoints are 5x the model-only ones; keep x newest would be off 5x."""
    tiers = [SimpleNamespace(name="durable", keep=3, url="s3://b/run"), SimpleNamespace(name="local", keep=2, url="/nvme")]
    full, small = 5 * GB, GB
    listing = [SimpleNamespace(tier="durable", step=s, committed=True, size_bytes=full if s % 3 == 0 else small)
               for s in (3, 4, 5, 6)]
    listing += [SimpleNamespace(tier="durable", step=7, committed=False, size_bytes=full),  # not committed: not kept
                {"tier": "local", "step": 6, "committed": True, "size_bytes": full}]  # `ls --json` rows work too
    report = cost_from_listing(tiers, listing, fp32={("durable", 6): 20 * GB})
    durable, local = report.tiers
    assert durable.kept_bytes == full + small + small  # steps 6, 5, 4
    assert durable.monthly_usd == pytest.approx((5 + 1 + 1) * 0.023)
    assert durable.stored_bytes == full  # the newest, as before
    assert durable.fp32_kept_bytes == 20 * GB + 2 * small  # fp32 where known, else the stored size
    assert local.kept_bytes == 2 * full  # one held, one more projected at its size
    assert report.as_dict()["tiers"][0]["kept_bytes"] == full + 2 * small
    # without per-checkpoint sizes the model is unchanged: keep x the one size
    assert estimate([TierUsage("durable", small, small, 3, "s3://b")]).tiers[0].kept_bytes == 3 * small


def test_the_cost_model_needs_no_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; from dcp_tiered.cost import cost_from_listing; "
            "print(cost_from_listing([], []).monthly_usd)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr
