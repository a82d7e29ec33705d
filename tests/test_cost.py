"""The pure cost model: stored bytes x price per GB-month x checkpoints kept."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from speed import scaled
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
    assert durable.fp32_kept_bytes == 3 * 20 * GB  # keep x the newest full checkpoint's fp32 size
    assert local.kept_bytes == 2 * full  # one held, one more projected at its size
    assert report.as_dict()["tiers"][0]["kept_bytes"] == full + 2 * small
    # without per-checkpoint sizes the model is unchanged: keep x the one size
    assert estimate([TierUsage("durable", small, small, 3, "s3://b")]).tiers[0].kept_bytes == 3 * small


def test_the_cost_model_needs_no_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; from dcp_tiered.cost import cost_from_listing; "
            "print(cost_from_listing([], []).monthly_usd)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr


def test_kept_bytes_counts_the_newest_full_checkpoint_retention_keeps_beyond_keep() -> None:
    """optimizer_every: retention keeps the newest ``keep`` plus the newest full one; both are priced."""
    assert kept_bytes([1, 1, 1, 5, 1, 5], 2, full=[False, False, False, True, False, True]) == 1 + 1 + 5
    assert kept_bytes([5, 1, 1, 5], 2, full=[True, False, False, True]) == 5 + 1  # a full one among the newest
    assert kept_bytes([1, 1], 3, full=[False, False]) == 3  # none full held: projection only


def _saved_tier(tmp_path, optimizer_every: int = 4):
    import torch

    from dcp_tiered import Tier, TieredCheckpointer

    d = tmp_path / "local"
    ck = TieredCheckpointer([Tier("local", str(d), every_steps=5, keep=2)], optimizer_every=optimizer_every,
                            optimizer_keys=["optim"])
    g = torch.Generator().manual_seed(0)
    model, optim = torch.randn(50_000, generator=g), torch.randn(100_000, generator=g)
    for s in range(1, 36):
        ck.maybe_save(s, {"model": {"w": model}, "optim": {"m": optim}})
    ck.close()
    (tmp_path / "t.yaml").write_text(f"tiers:\n  - name: local\n    url: {d}\n    keep: 2\n"
                                      f"optimizer_every: {optimizer_every}\noptimizer_keys: [optim]\n")
    return d


def _cost_json(args: list, env: dict | None = None) -> dict:
    import json
    import os

    env = dict(os.environ, PYTHONPATH=os.getcwd(), **(env or {}))
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=scaled(300))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout) if "--json" in args else {"text": out.stdout}


def test_cli_cost_prices_what_retention_keeps_with_optimizer_every(tmp_path) -> None:
    """optimizer_every=4, keep=2: the tier holds 2 model-only checkpoints plus the newest full one
    (retention keeps it); `cost` used to price only the newest 2 (review 14h)."""
    import json

    from forked import start_cli

    d = _saved_tier(tmp_path)
    on_disk = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    # both runs at once, forked from the tests' forkserver (torch imported once: this test needs torch)
    runs = [start_cli("cost", *args, "--json") for args in (["--tiers", tmp_path / "t.yaml"], ["--local-path", d, "--keep-local", "2"])]
    by_yaml, by_flags = (r.communicate(scaled(300)) for r in runs)
    assert by_yaml.returncode == 0 and by_flags.returncode == 0, by_yaml.stderr + by_flags.stderr
    tier = json.loads(by_yaml.stdout)["tiers"][0]
    assert tier["kept_bytes"] >= 0.9 * on_disk, (tier["kept_bytes"], on_disk)
    # without the YAML's optimizer_every, the model-only checkpoints are told apart by their keys
    flags = json.loads(by_flags.stdout)
    assert flags["tiers"][0]["kept_bytes"] == tier["kept_bytes"]
    # the fp32 baseline is the full checkpoint's (model + optimizer: 150k floats), not the model-only newest
    assert tier["fp32_bytes"] >= 150_000 * 4 and tier["fp32_kept_bytes"] == 2 * tier["fp32_bytes"]


def test_cli_cost_without_torch_says_fp32_is_unknown(tmp_path) -> None:
    """Without torch the fp32 size cannot be read: null in JSON, "-" in the table, not fp32 = stored."""
    d = _saved_tier(tmp_path, optimizer_every=1)
    boot = ("import sys; sys.modules['torch'] = None; sys.argv = ['dcp-tiered'] + sys.argv[1:]; "
            "from dcp_tiered.cli.__main__ import main; sys.exit(main())")
    out = _cost_json(["-c", boot, "cost", "--local-path", str(d), "--keep-local", "2", "--json"])
    t = out["tiers"][0]
    assert t["kept_bytes"] > 0 and (t["fp32_bytes"], t["fp32_monthly_usd"], t["saving_usd"]) == (None, None, None)
    assert out["fp32_monthly_usd"] is None
    text = _cost_json(["-c", boot, "cost", "--local-path", str(d), "--keep-local", "2"])["text"]
    assert "unknown without torch" in text and " - " in text
