"""DowncastSavePlanner: 16-bit storage with range guards, original dtypes back on load."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from dcp_tiered import CompressedReader, CompressedWriter, ConfigError, DowncastSavePlanner
from dcp_tiered.dcp.planners import downcast_problem


def train_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g) * 0.05,
            "b64": torch.randn(16, generator=g, dtype=torch.float64),
            "h": torch.randn(8, generator=g).half(),
            "steps": torch.arange(5),
            "mask": torch.rand(6, generator=g) > 0.5,
        },
        "optim": {"state": {"0": {"exp_avg": torch.randn(64, generator=g) * 1e-3, "exp_avg_sq": torch.rand(64, generator=g) * 1e-10}}},
        "epoch": 3,
    }


def zeros_like(sd: dict) -> dict:
    return {k: zeros_like(v) if isinstance(v, dict) else (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def stored_dtypes(path) -> dict[str, str]:
    md = CompressedReader(path).read_metadata()
    return {i.fqn: r["dtype"] for i, r in md.storage_data.items() if r["kind"] == "tensor"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("writer", ["compressed-zstd", "compressed-lz4", "stock", "stock-read-by-ours"])
def test_downcast_round_trip_restores_original_dtypes(tmp_path, dtype: torch.dtype, writer: str) -> None:
    sd = train_state()
    path = tmp_path / "ckpt"
    planner = DowncastSavePlanner(dtype)
    if writer == "stock":
        w, r = dcp.FileSystemWriter(path), lambda: dcp.FileSystemReader(path)
    elif writer == "stock-read-by-ours":  # the README: our readers read stock checkpoints, downcast ones too
        w, r = dcp.FileSystemWriter(path), lambda: CompressedReader(path)
    else:
        w, r = CompressedWriter(path, codec=writer.split("-")[1]), lambda: CompressedReader(path)
    dcp.save(sd, storage_writer=w, planner=planner, no_dist=True)
    out = zeros_like(sd)
    dcp.load(out, storage_reader=r(), no_dist=True)
    m, o = out["model"], sd["model"]
    assert m["w"].dtype == torch.float32 and m["b64"].dtype == torch.float64
    assert torch.equal(m["w"], o["w"].to(dtype).float())
    assert torch.equal(m["b64"], o["b64"].to(dtype).double())
    # already 16-bit, ints and bools: untouched
    for k in ("h", "steps", "mask"):
        assert torch.equal(m[k], o[k])
    # optimizer state is left alone by default
    assert torch.equal(out["optim"]["state"]["0"]["exp_avg_sq"], sd["optim"]["state"]["0"]["exp_avg_sq"])
    assert sorted(planner.report.downcast) == ["model.b64", "model.w"]
    if not writer.startswith("stock"):
        dt = stored_dtypes(path)
        expect = str(dtype).removeprefix("torch.")
        assert dt["model.w"] == expect and dt["model.b64"] == expect
        assert dt["model.steps"] == "int64" and dt["optim.state.0.exp_avg"] == "float32"


def test_empty_state_dict_load_gets_original_dtypes(tmp_path) -> None:
    sd = train_state()
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "c"), planner=DowncastSavePlanner(torch.bfloat16), no_dist=True)
    empty: dict = {}
    _load_state_dict(empty, storage_reader=CompressedReader(tmp_path / "c"), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert empty["model"]["w"].dtype == torch.float32
    assert empty["model"]["b64"].dtype == torch.float64
    assert torch.equal(empty["model"]["w"], sd["model"]["w"].bfloat16().float())
    assert empty["epoch"] == 3


def test_exclude_empty_downcasts_optimizer_state_with_fp16_guard(tmp_path) -> None:
    sd = train_state()
    planner = DowncastSavePlanner(torch.float16, exclude=())
    writer = CompressedWriter(tmp_path / "c")
    dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
    # exp_avg (1e-3 scale) fits float16; exp_avg_sq (1e-10) would flush to zero: kept
    assert "optim.state.0.exp_avg" in planner.report.downcast
    assert "optim.state.0.exp_avg_sq" in planner.report.kept
    assert "underflow" in planner.report.kept["optim.state.0.exp_avg_sq"]
    out = zeros_like(sd)
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(out["optim"]["state"]["0"]["exp_avg_sq"], sd["optim"]["state"]["0"]["exp_avg_sq"])
    assert writer.last_stats is not None and "optim.state.0.exp_avg" in writer.last_stats.downcast


def test_fp16_overflow_is_kept_and_reported(tmp_path) -> None:
    sd = {"big": torch.tensor([1.0, 70000.0, -3.0]), "ok": torch.tensor([1.0, 65504.0])}
    planner = DowncastSavePlanner(torch.float16)
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "c"), planner=planner, no_dist=True)
    assert "overflow" in planner.report.kept["big"]
    assert planner.report.downcast == ["ok"]
    out = {"big": torch.zeros(3), "ok": torch.zeros(2)}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["ok"], sd["ok"])


def test_nan_and_inf_are_preserved_not_overflow(tmp_path) -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.5, -0.0])
    planner = DowncastSavePlanner(torch.float16)
    dcp.save({"x": x}, storage_writer=CompressedWriter(tmp_path / "c"), planner=planner, no_dist=True)
    assert planner.report.downcast == ["x"] and not planner.report.kept
    out = {"x": torch.zeros(5)}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "c"), no_dist=True)
    assert torch.isnan(out["x"][0]) and out["x"][1] == float("inf") and out["x"][2] == -float("inf")
    assert torch.equal(out["x"][3:], x[3:])


def test_include_exclude_patterns_and_unmatched_report(tmp_path) -> None:
    sd = {"enc": {"w": torch.randn(4)}, "dec": {"w": torch.randn(4)}, "head": torch.randn(4)}
    planner = DowncastSavePlanner(torch.bfloat16, include=["enc.*", "head", "nope.*"], exclude=["*.bias"])
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "c"), planner=planner, no_dist=True)
    assert sorted(planner.report.downcast) == ["enc.w", "head"]
    assert planner.report.unmatched_patterns == ["nope.*", "*.bias"]
    assert stored_dtypes(tmp_path / "c")["dec.w"] == "float32"


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.float32, "bf16"])
def test_unsupported_target_dtype_is_rejected_at_construction(dtype) -> None:
    with pytest.raises(ConfigError) as err:
        DowncastSavePlanner(dtype)
    assert isinstance(err.value, ValueError)


def test_async_save_with_downcast(tmp_path) -> None:
    sd = train_state()
    fut = dcp.async_save(sd, storage_writer=CompressedWriter(tmp_path / "c"), planner=DowncastSavePlanner(torch.bfloat16), no_dist=True)
    fut.result()
    out = zeros_like(sd)
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(out["model"]["w"], sd["model"]["w"].bfloat16().float())


def test_downcast_halves_stored_bytes(tmp_path) -> None:
    sd = {"w": torch.randn(256, 256) * 0.02}
    plain, down = CompressedWriter(tmp_path / "a"), CompressedWriter(tmp_path / "b")
    dcp.save(sd, storage_writer=plain, no_dist=True)
    dcp.save(sd, storage_writer=down, planner=DowncastSavePlanner(torch.bfloat16), no_dist=True)
    assert down.last_stats.raw_bytes == plain.last_stats.raw_bytes == 256 * 256 * 4
    assert down.last_stats.stored_bytes < 0.6 * plain.last_stats.stored_bytes


def test_a_value_past_the_targets_range_keeps_the_tensor_for_bfloat16_too(tmp_path) -> None:
    """bfloat16's max is about 3.39e38: fp32 3.4e38 and fp64 1e300 would become inf, fp64 1e-300 would become 0."""
    sd = {"f32_big": torch.tensor([1.0, 3.4e38]), "f64_big": torch.tensor([1.0, 1e300], dtype=torch.float64),
          "f64_tiny": torch.tensor([1.0, 1e-300], dtype=torch.float64), "ok": torch.tensor([1.0, 3.3e38, float("inf")])}
    planner = DowncastSavePlanner(torch.bfloat16)
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "c"), planner=planner, no_dist=True)
    assert planner.report.downcast == ["ok"]
    assert "overflow" in planner.report.kept["f32_big"] and "overflow" in planner.report.kept["f64_big"]
    assert "underflow" in planner.report.kept["f64_tiny"] and "bfloat16" in planner.report.kept["f64_big"]
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "c"), no_dist=True)
    for k in ("f32_big", "f64_big", "f64_tiny"):
        assert torch.equal(out[k], sd[k]), k
    assert stored_dtypes(tmp_path / "c")["ok"] == "bfloat16"


@pytest.mark.parametrize("dst", ["ck", "state.pt"])
def test_convert_dtype_keeps_what_the_target_cannot_hold_and_says_so(tmp_path, dst: str) -> None:
    """``convert --dtype bf16`` to this package's format and to a ``torch.save`` file: the same rule, optimizer
    state left alone, what was kept listed."""
    from dcp_tiered.inspect import convert, load_any

    sd = {"model": {"w": torch.ones(4), "big": torch.tensor([1.0, 3.4e38]), "far": torch.tensor([1e300], dtype=torch.float64)},
          "optim": {"exp_avg": torch.full((3,), 0.5)}}
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "src"), no_dist=True)
    res = convert(tmp_path / "src", tmp_path / dst, dtype=torch.bfloat16)
    assert sorted(res.saved["kept"]) == ["model.big", "model.far"] and "overflow" in res.saved["kept"]["model.big"]
    back = torch.load(tmp_path / dst, weights_only=True) if dst.endswith(".pt") else None
    if back is not None:
        assert back["model"]["w"].dtype == torch.bfloat16 and back["optim"]["exp_avg"].dtype == torch.float32
        assert back["model"]["big"].dtype == torch.float32 and back["model"]["far"].dtype == torch.float64
    else:
        assert stored_dtypes(tmp_path / dst)["model.big"] == "float32" and stored_dtypes(tmp_path / dst)["model.w"] == "bfloat16"
    loaded = load_any(tmp_path / dst)
    assert torch.equal(loaded["model"]["big"], sd["model"]["big"]) and torch.equal(loaded["model"]["far"], sd["model"]["far"])


def test_the_range_check_reads_a_tensor_in_chunks_and_a_strided_one_too() -> None:
    """A tensor longer than one chunk, and a transposed (non-contiguous) one, with the one bad value in the last chunk."""
    from dcp_tiered.dcp.planners import RANGE_CHUNK

    x = torch.zeros(RANGE_CHUNK * 2 + 5)
    assert downcast_problem(x, torch.float16) is None
    x[-1] = 1e5
    assert "overflow" in downcast_problem(x, torch.float16)
    y = torch.ones(RANGE_CHUNK // 512 + 3, 1024, dtype=torch.float64)
    y[-1, -1] = 1e300
    assert not y.t().is_contiguous() and "overflow" in downcast_problem(y.t(), torch.bfloat16)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([torch.float32, torch.float64]), st.sampled_from([torch.bfloat16, torch.float16]),
       st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=200))
def test_the_downcast_guard_never_lets_damage_through(src: torch.dtype, dtype: torch.dtype, values: list[float]) -> None:
    """For either target and either source: a tensor the guard passes has no finite value that becomes inf and no
    nonzero value that becomes 0 (tolerance 0); one with a finite value past the target's max is refused."""
    x = torch.tensor(values, dtype=torch.float64).to(src)  # fp64 values past fp32's range become inf: not finite
    problem = downcast_problem(x, dtype, underflow_tolerance=0.0)
    h = x.to(dtype).to(src)
    finite = torch.isfinite(x)
    overflow = bool((torch.isinf(h) & finite).any())
    flushed = bool(((h == 0) & (x != 0) & finite).any())
    if problem is None:
        assert not overflow and not flushed
    if bool((x[finite].abs() > torch.finfo(dtype).max).any()):
        assert problem is not None and "overflow" in problem
    assert torch.equal(torch.isnan(h), torch.isnan(x))  # NaN stays NaN, Inf stays Inf
