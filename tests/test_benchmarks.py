"""The benchmarks' own arithmetic: projection, target verdicts, and how sections are written."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest


def test_projection_divides_the_checkpoint_over_ranks_and_takes_the_slower_of_cpu_and_link() -> None:
    from benchmarks.bench_projection import CodecSpeed, project

    args = argparse.Namespace(ckpt_tb=1.0, ranks=4000, ranks_per_node=8, cores_per_rank=4, local_gbps=5.0,
                              shared_gbps=500.0, object_gbps=200.0, d2h_gbps=20.0, local_codec="lz4",
                              shared_codec="zstd:1", durable_codec="zstd:1", local_keep=2, shared_keep=3, durable_keep=24)
    speeds = {"lz4": CodecSpeed("lz4", 0.9, 300.0), "zstd:1": CodecSpeed("zstd:1", 0.8, 100.0)}
    rows, summary = project(args, speeds)
    local, shared, durable = rows
    assert summary["per_rank_bytes"] == pytest.approx(250e6)
    assert local["stored_per_rank"] == pytest.approx(225e6)
    assert local["write_s"] == pytest.approx(225e6 * 8 / 5e9)  # 8 ranks share a node's NVMe
    assert shared["compress_s"] == pytest.approx(250e6 / (100e6 * 4))
    assert shared["write_s"] == pytest.approx(200e6 * 4000 / 500e9)
    for r in rows:
        assert r["save_s"] == max(r["compress_s"], r["write_s"])
        assert r["save_s_serial"] == pytest.approx(r["compress_s"] + r["write_s"])
    # cost: 0.8 TB kept 24 times at $0.023 per GiB-month
    assert durable["monthly_usd"] == pytest.approx(0.8e12 * 24 / 2**30 * 0.023, rel=1e-6)
    assert durable["plain_monthly_usd"] > durable["monthly_usd"]


@pytest.mark.parametrize("value,target,higher,expected", [
    (1.2, 1.0, True, "met"), (0.8, 1.0, True, "**missed by 20%**"), (0.9996, 1.0, True, "**missed by 0.04%**"),
    (0.5, 1.0, False, "met"), (1.0004, 1.0, False, "**missed by 0.04%**"), (0.23, 0.02, False, "**missed: 11.5x the target**"),
])
def test_verdicts_say_by_how_much_a_target_is_missed(value: float, target: float, higher: bool, expected: str) -> None:
    from benchmarks.bench_summary import verdict

    assert verdict(value, target, higher) == expected


# ``python -m benchmarks.bench_replication --quick --write``, except that its 5 runs of 4 ranks fork from
# one forkserver that imported torch and the benchmark once, instead of spawning 20 interpreters that
# each import them again (about 2 minutes of CPU on 2 cores); the benchmark's code is otherwise as it runs.
_BENCH_REPLICATION_QUICK = """
import multiprocessing, sys, types
import torch.multiprocessing
import benchmarks.bench_replication as bench
multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "dcp_tiered",
                                                                  "benchmarks.bench_replication"])
start = torch.multiprocessing.start_processes
bench.mp = types.SimpleNamespace(start_processes=lambda *a, **k: start(*a, **{**k, "start_method": "forkserver"}))
sys.argv = ["benchmarks.bench_replication", "--quick", "--write"]
bench.main()
"""


def test_replication_bench_restores_a_lost_node_from_peers_at_tiny_size(tmp_path: Path) -> None:
    """bench_replication --quick: after node 1's local directory is deleted, B (replicas=2) restores from
    ``local`` through node 0's replicas, reading only the listing from shared; A reads all from shared."""
    import json
    import os
    import subprocess
    import sys

    from speed import scaled

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DCP_TIERED_BENCH_DOC": str(tmp_path / "benchmarks.md"),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _BENCH_REPLICATION_QUICK], cwd=root,
                          env=env, capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench_results" / "replication.json").read_text())["data"]
    restores = {r["scenario"]: r for r in data["restores"]}
    saves = {s["scenario"]: s for s in data["saves"]}
    assert all(r["exact"] and r["failures"] == 0 for r in restores.values()), restores
    assert restores["A"]["tiers"] == ["shared"] and restores["A"]["fetched_bytes"] == 0
    assert restores["B"]["tiers"] == ["local"] and restores["C"]["tiers"] == ["local"]
    # node 1's own files from node 0's replicas, and node 0's files it held as replicas before
    assert restores["B"]["fetched_bytes"] == sum(saves["A"]["local_bytes"]) > 0
    assert restores["B"]["shared_bytes"] < restores["A"]["shared_bytes"] / 100  # the listing only
    assert saves["A"]["sent_bytes"] == 0 and saves["B"]["sent_bytes"] * 2 == sum(saves["B"]["local_bytes"])
    section = (tmp_path / "benchmarks.md").read_text()
    assert "<!-- bench:replication:start -->" in section and "python -m benchmarks.bench_replication --quick" in section


def test_a_section_is_replaced_in_place_and_others_are_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DCP_TIERED_BENCH_DOC", str(tmp_path / "b.md"))
    import benchmarks.common as common

    common = importlib.reload(common)
    try:
        common.write_section("a", "## A\n1")
        common.write_section("b", "## B\n2")
        common.write_section("a", "## A\n3")
        text = (tmp_path / "b.md").read_text()
        assert "## A\n3" in text and "## A\n1" not in text and "## B\n2" in text
        assert text.index("## A") < text.index("## B")
        common.save_results("x", {"n": 1})
        assert common.load_results("x")["data"] == {"n": 1}
    finally:
        monkeypatch.delenv("DCP_TIERED_BENCH_DOC")
        importlib.reload(common)


def test_summary_rows_for_the_save_speed_targets() -> None:
    """lz4 against zstd:1, ``.metadata`` bytes against stock, and CPU per GB against stock + zstd."""
    from benchmarks.bench_summary import lz4_rows, records_rows, storage_rows

    cell = {"kind": "ours", "threads": 2, "data": "w"}
    codecs = {"data": {"cells": [{**cell, "codec": "lz4", "compress_mbs": 1500.0},
                                 {**cell, "codec": "zstd:1", "compress_mbs": 1000.0},
                                 {**cell, "codec": "lz4", "threads": 1, "compress_mbs": 1.0}]}}
    assert lz4_rows(codecs) == [["lz4 encode ≥ 1.5x zstd:1 (2 threads): w", "1500 vs 1000 MB/s", "1.50x", "met"]]
    records = {"data": {"sizes": [{"data": "t", "ours, format 3": 80.0, "stock FileSystemWriter": 200.0}]}}
    assert records_rows(records)[0][2:] == ["0.40", "met"]
    w = {"save_s": 1.0, "load_cold_s": 1.0, "stored": 5e8}
    sets = [{"name": "s", "raw": 2e9, "disk_write_mbps": 1000.0, "disk_read_mbps": 1000.0,
             "writers": {"CompressedWriter (defaults)": {**w, "save_cpu_s": 6.0, "disk_frac_save": 1, "disk_frac_load": 1},
                         "stock FileSystemWriter, 2 threads": dict(w),
                         "stock + DCP zstd extension, 2 threads": {**w, "save_cpu_s": 4.0}}}]
    cpu = [r for r in storage_rows({"data": {"sets": sets}}, None) if r[0].startswith("CPU core-seconds")]
    assert cpu == [["CPU core-seconds per GB saved ≤ stock + DCP zstd's: s", "3.00 vs 2.00 core-s/GB", "1.50",
                    "**missed by 50%**"]]


def test_summary_rows_for_the_shard_sizes_name_the_bound_of_a_miss() -> None:
    """One save row and one cold-load row per shard size and rank count, stock ÷ ours against 1.0x; a miss
    carries the bound the shard run named for ours."""
    from benchmarks.bench_shards import SHARD_OURS, SHARD_STOCK
    from benchmarks.bench_summary import shard_rows

    def median(save_s: float, load_s: float) -> dict:
        return {"save_s": save_s, "load_s": load_s, "save_bound": "disk write + fsync (x)", "load_bound": "CPU (y)"}

    runs = [{"mib": 16, "ranks": 2, "writer": SHARD_OURS, "median": median(1.0, 2.0)},
            {"mib": 16, "ranks": 2, "writer": SHARD_STOCK, "median": median(1.5, 1.0)}]
    save, load = shard_rows({"data": {"runs": runs}})
    assert save[2:] == ["1.50x", "met"] and "16 MiB per process, 2 ranks" in save[0]
    assert load[2] == "0.50x" and load[3].startswith("**missed") and load[3].endswith("; bound: CPU (y)")
    assert shard_rows(None)[0][2].startswith("not run")


def test_gpu_bench_runs_its_cases_on_cpu_tensors_and_refuses_to_record_them(tmp_path: Path) -> None:
    """``bench_gpu`` (meant for a GPU machine) runs the same code on CPU tensors: every case measured (each
    a save, which takes CPU time), every writer's checkpoint loaded back bit for bit, and ``--write``
    refused off a GPU (its numbers would say nothing)."""
    import pytest

    from benchmarks import bench_gpu

    (result,) = bench_gpu.main(["--device", "cpu", "--quick", "--dir", str(tmp_path)])
    assert result["verified"] == ["stock", "ours", "tiered"]
    for key, _label in bench_gpu.CASES:
        m = result[key]
        assert m["cpu_s"] > 0 and m["blocked_s"] > 0, (key, m)
    assert "blocked / copy" in bench_gpu.table([result])
    if not __import__("torch").cuda.is_available():
        with pytest.raises(SystemExit, match="GPU"):
            bench_gpu.main(["--device", "cpu", "--quick", "--dir", str(tmp_path), "--write"])

def test_gpu_bench_renders_a_recorded_run_with_its_weights_and_notes(tmp_path: Path, monkeypatch) -> None:
    """``--extract-weights`` writes MiniLM's tensors but the word embeddings (what travels to a GPU machine);
    ``--render`` rewrites the section from the raw results of a recorded run, the notes a paragraph of their
    own below the table (naming the weights file and a stager that could not be reused)."""
    from benchmarks import bench_gpu, common

    monkeypatch.setattr(common, "DOC", tmp_path / "benchmarks.md")
    monkeypatch.setattr(common, "RESULTS", tmp_path / "bench_results")
    weights = tmp_path / "w.safetensors"
    assert bench_gpu.main(["--extract-weights", str(weights)]) == []
    from safetensors.torch import load_file

    kept = load_file(str(weights))
    assert kept and not any("word_embeddings" in k for k in kept)
    (result,) = bench_gpu.main(["--device", "cpu", "--quick", "--dir", str(tmp_path), "--weights", str(weights)])
    result.update(stager_reused=False, device_name="A GPU", cmd="the command --write", threads=2,
                  weights=bench_gpu.weights_info(str(weights)))  # what --write records with a GPU run
    common.save_results("gpu", [result], machine="a machine line")
    bench_gpu.main(["--render"])
    section = (tmp_path / "benchmarks.md").read_text()
    assert "## CUDA state (A GPU)" in section and "a machine line" in section and "`the command --write`" in section
    table_end = section.index("| one device -> pinned copy |")
    after = section[section.index("\n", table_end):]
    assert after.startswith("\n\n") and "Each case runs once" in after and str(weights) in after
    assert "pytorch/pytorch#183413" in after and "new pinned stager per save" in section


def test_scale_bench_quick_writes_its_tables_with_positive_finite_ratios(tmp_path: Path, monkeypatch) -> None:
    """bench_scale --quick (Llama-70B's one-layer slice at N=8 and 16, in this process): the section is
    written, and every ours ÷ stock ratio of CPU and of bytes is a positive finite number."""
    import math

    from benchmarks import bench_scale, common

    monkeypatch.setattr(common, "DOC", tmp_path / "benchmarks.md")
    monkeypatch.setattr(common, "RESULTS", tmp_path / "bench_results")
    out = bench_scale.main(["--quick", "--models", "70b"])
    text = (tmp_path / "benchmarks.md").read_text()
    assert "<!-- bench:scale:start -->" in text and "`.venv/bin/python -m benchmarks.bench_scale --quick --models 70b`" in text
    assert list(out["models"]) == ["Llama-70B"]
    for name, model in out["models"].items():
        assert f"### {name}: 1 of " in text
        rows = model["rows"]
        assert [r["N"] for r in rows] == [8, 16] and rows[1]["records"] > rows[0]["records"] > 0
        for row in rows:
            assert row["refused"] is None and row["restore_decodes"] == 1 and row["budget_answer"] == "fits", row
            ratios = [bench_scale.ratio(row, ours, stock) for _c, ours, stock, _b in bench_scale.CPU_STEPS if stock]
            ratios += [row[f"ours.{k}"] / row[f"stock.{k}"] for k in ("gather_bytes", "bcast_bytes", "file_bytes")]
            assert all(r is not None and math.isfinite(r) and r > 0 for r in ratios), (name, row["N"], ratios)
        assert all(math.isfinite(e["overall"]) for e in model["exponents"].values())
    assert "| Llama-70B | the full model's save commits (within the readers' limits) | fits at every N | met |" in text


def test_every_key_state_keeps_all_keys_of_its_base_at_any_size() -> None:
    """A shard-like state: every base key at every size (cut to leading rows), whole copies above the base's size."""
    import torch

    from benchmarks.common import every_key_state, nbytes

    base = {"emb": torch.arange(4000.0).reshape(1000, 4), "bias": torch.arange(16.0)}  # 16,064 bytes
    small = every_key_state(base, 4000)
    assert set(small) == {"rep0.emb", "rep0.bias"} and 4000 <= nbytes(small) < 4000 + 4 * 4 + 4
    assert torch.equal(small["rep0.emb"], base["emb"][: small["rep0.emb"].shape[0]])
    big = every_key_state(base, 2 * nbytes(base) + 100)
    assert set(big) == {f"rep{r}.{k}" for r in range(3) for k in base}
    assert torch.equal(big["rep1.emb"], base["emb"]) and big["rep1.emb"].data_ptr() != base["emb"].data_ptr()


def test_shard_bench_at_tiny_sizes_writes_its_section(monkeypatch, tmp_path: Path) -> None:
    """bench_shards at 1 MiB per process, 1 process and 2 gloo ranks, one round: every save and
    cold load runs in fresh processes (a load that differs fails its rank), and the section has one verdict row
    per size and rank count, with positive finite ratios, a named bound and the 2-rank phase profile."""
    import json
    import math

    from benchmarks import bench_shards, common

    monkeypatch.setattr(common, "DOC", tmp_path / "benchmarks.md")
    monkeypatch.setattr(common, "RESULTS", tmp_path / "bench_results")
    bench_shards.main(["--mib", "1", "--ranks", "1,2", "--repeat", "1", "--profile-runs", "1"])
    text = (tmp_path / "benchmarks.md").read_text()
    assert "<!-- bench:shards:start -->" in text
    assert "`.venv/bin/python -m benchmarks.bench_shards --mib 1 --ranks 1,2 --repeat 1 --profile-runs 1`" in text \
        and "Median of 1 fresh-process runs" in text
    assert "stock time ÷ our time, so above 1 means ours is faster" in text and "Load average " in text
    for ranks in (1, 2):
        assert f"| 1 MiB | {ranks} | " in text
    assert "ours ms, 2 ranks" in text and "storage.finish" in text and "Rows meeting the bar: " in text
    saved = json.loads((tmp_path / "bench_results" / "shards.json").read_text())
    monkeypatch.setattr(common, "machine_line", lambda: "a later machine")
    bench_shards.main(["--render"])  # the section again, from the numbers the run saved
    assert (tmp_path / "benchmarks.md").read_text() == text
    assert json.loads((tmp_path / "bench_results" / "shards.json").read_text())["machine"] == saved["machine"]
    data = json.loads((tmp_path / "bench_results" / "shards.json").read_text())["data"]
    assert len(data["runs"]) == 1 * 2 * 2
    for run in data["runs"]:
        m = run["median"]
        assert all(math.isfinite(m[k]) and m[k] > 0 for k in ("save_s", "load_s", "save_cpu_s", "load_cpu_s")), run
        assert m["save_bound"].split(" (")[0].split(":")[0] in {"disk write + fsync", "CPU", "fixed per-call cost",
                                                                "CPU shared with other work", "unexplained"}
        if run["writer"] == bench_shards.SHARD_OURS:
            assert m["stored"] < run["mib"] * run["ranks"] << 20  # zstd:1 stores less than the raw fp32 bytes


def test_a_shard_row_faster_than_the_disk_reference_names_no_disk_bound() -> None:
    """The bound is the largest share of the row's time; a disk share above 1 means the disk's reference run was
    slower than the row itself, so the disk is not named as the bound."""
    from benchmarks.bench_shards import shard_bound

    # 100 MB stored in 1 s at a 125 MB/s reference: disk share 0.8, above the CPU's 0.5.
    assert shard_bound("save", 1.0, 1.0, 100_000_000, 125.0, 0.0, 2, 0.5).startswith("disk write + fsync (")
    # The same bytes at a 50 MB/s reference: share 2.0, the disk varied.
    assert shard_bound("save", 1.0, 1.0, 100_000_000, 50.0, 0.0, 2, 0.5).startswith("unexplained: ")
    assert shard_bound("load", 1.0, 1.8, 10_000_000, 500.0, 0.0, 2, 0.95).startswith("CPU (decompression")


def test_the_summary_has_a_cuda_row_whether_or_not_bench_gpu_ran() -> None:
    from benchmarks.bench_summary import gpu_rows

    assert gpu_rows(None)[0][3] == "not run"
    ran = {"data": [{"mib": 256, "copy": {"wall_s": 0.1}, "tiered_async": {"blocked_s": 0.15},
                     "async_ours": {"blocked_s": 0.3}}]}
    (tiered, ours) = gpu_rows(ran)
    assert tiered[2:] == ["1.50x", "met"] and ours[2] == "3.00x" and ours[3].startswith("**missed")
