"""`dcp-tiered train`, `demo` and `bench` run end to end through the real entry point, in subprocesses
(the longest CLI runs; the other commands are in test_cli.py, whose helpers these use)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from speed import scaled

from test_cli import CLI, _env, cli, cli_parallel, ok, one_line_error


def test_bench_table_json_and_chart(tmp_path: Path) -> None:
    chart = tmp_path / "bench.png"
    res = json.loads(ok(cli("bench", "--model", "tiny", "--codecs", "none,lz4,zstd:1", "--chart", chart, "--json")).stdout)
    labels = [r["label"] for r in res["results"]]
    assert labels == ["stock", "none", "lz4", "zstd:1"]
    by = {r["label"]: r for r in res["results"]}
    assert by["zstd:1"]["stored_bytes"] < by["none"]["stored_bytes"] and by["zstd:1"]["ratio"] < 1
    assert all(r["save_mb_s"] and r["load_mb_s"] for r in res["results"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res["chart"] is None and "matplotlib" in res["chart_note"]
    else:
        assert res["chart"] == str(chart) and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def test_train_with_s3_durable_tier_metrics_event_log_and_resume(tmp_path: Path, s3_bucket: tuple, moto_server) -> None:
    bucket, options = s3_bucket
    durable = f"{bucket}/run"
    port = _free_port()
    events, summary = tmp_path / "events.jsonl", tmp_path / "summary.json"
    # one layer: the restore and promotions through the S3 server cost per item (a request each)
    args = ["train", "--steps", "30", "--d-model", "32", "--layers", "1", "--vocab", "128", "--seq-len", "16", "--log-every", "0",
            "--local-path", tmp_path / "local", "--durable-path", durable, "--s3-endpoint-url", moto_server.endpoint_url,
            "--checkpoint-every-steps", "5", "--durable-every-steps", "10", "--async-checkpoint", "--compression", "zstd",
            "--metrics-port", port, "--metrics-addr", "127.0.0.1", "--metrics-linger-s", "60",
            "--event-log", events, "--summary-json", summary]
    proc = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    lines = []
    try:
        deadline = time.monotonic() + scaled(120)
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("metrics: serving"):
                break
        assert lines and lines[-1].startswith("metrics: serving"), "".join(lines) + proc.stderr.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=scaled(10)) as resp:
            metrics = resp.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(scaled(30))
    out = "".join(lines)
    assert f"metrics: http://127.0.0.1:{port}/metrics" in out
    s = json.loads(summary.read_text())
    tiers = {t["tier"]: t for t in s["tiers"]}
    assert tiers["local"]["written"] == 6 and tiers["durable"]["promoted"] == 3  # steps 5..30 / 10, 20, 30
    assert tiers["durable"]["stored_bytes"] > 0 and tiers["durable"]["raw_bytes"] > tiers["durable"]["stored_bytes"]
    assert tiers["durable"]["monthly_usd"] > 0 and tiers["durable"]["price_gb_month"] == 0.023
    assert 0 <= tiers["local"]["blocked_pct"] < 100 and s["save_failures"] == 0
    assert 'checkpoint_saves_total{tier="durable"} 3.0' in metrics
    assert 'checkpoint_bytes_written_total{tier="local"}' in metrics and "checkpoint_blocking_seconds_count 6.0" in metrics
    ev = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["step"] for e in ev if e["event"] == "save"] == [5, 10, 15, 20, 25, 30]  # the multiples
    assert {e["step"] for e in ev if e["event"] == "promotion" and e["kind"] == "metadata" and e["ok"]} == {10, 20, 30}

    import s3fs

    fs = s3fs.S3FileSystem(**options)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(durable.removeprefix("s3://")))
    assert names == ["step_000000010", "step_000000020", "step_000000030"]

    # resume from the s3 tier alone, in a new process; listing and verifying it too
    resumed, ls_s3 = cli_parallel(
        ["train", "--steps", "33", "--d-model", "32", "--layers", "1", "--vocab", "128", "--seq-len", "16", "--log-every", "0",
         "--durable-path", durable, "--s3-endpoint-url", moto_server.endpoint_url, "--durable-every-steps", "10",
         "--compression", "zstd", "--resume", "--json"],
        ["verify", f"{durable}/step_000000030", "--s3-endpoint-url", moto_server.endpoint_url])
    ok(resumed)
    assert "restored step 30 from tier durable" in resumed.stdout
    s2 = json.loads(resumed.stdout[resumed.stdout.index("{"):])
    assert s2["start_step"] == 30 and s2["trained_steps"] == 3
    assert "OK" in ok(ls_s3).stdout



def test_demo_end_to_end(tmp_path: Path) -> None:
    res = cli("demo", "--quick", "--dir", tmp_path / "demo", "--json", timeout=300)
    ok(res)
    out = json.loads(res.stdout)
    assert out["ok"] and out["resume_bit_exact"]
    assert 0 < out["resumed_from"] <= out["crash_step"]
    assert {v["tier"] for v in out["verified"] if v["ok"]} == {"local", "shared", "durable"}
    s = out["summary"]
    assert s["start_step"] == out["resumed_from"] and s["resume_check"]["equal"]
    assert {t["tier"] for t in s["tiers"]} == {"local", "shared", "durable"}
    # blocked: staging plus the wait for the previous save in flight (waited_s), never the background writing
    events = [json.loads(ln) for ln in (tmp_path / "demo" / "events.jsonl").read_text().splitlines()]
    assert all(0 <= e["waited_s"] <= e["blocked_s"] for e in events if e.get("event") == "save" and e.get("ok"))
    local = next(t for t in s["tiers"] if t["tier"] == "local")
    assert 0 <= local["waited_s"] <= local["blocked_s"] + 1e-3
    assert "simulating a crash" in res.stderr and "bit for bit" in res.stderr
    # a non-demo, non-empty folder is refused
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert "not empty" in one_line_error(cli("demo", "--dir", other), 2)
    assert (other / "keep.txt").exists()



def test_bench_path_on_s3_measures_save_load_ratio_and_cleans_up(moto_server, s3_bucket: tuple, tmp_path: Path) -> None:
    bucket, options = s3_bucket
    res = ok(cli("bench", "--model", "tiny", "--path", f"{bucket}/x", "--s3-endpoint-url", moto_server.endpoint_url,
                 "--codec", "lz4,zstd:1", "--json", "--no-chart"))
    out = json.loads(res.stdout)
    assert out["where"] == f"{bucket}/x" and [r["label"] for r in out["results"]] == ["stock", "lz4", "zstd:1"]
    for r in out["results"]:
        assert r["stored_bytes"] > 0 and r["save_s"] > 0 and r["load_s"] > 0 and r["ratio"] > 0
    by = {r["label"]: r for r in out["results"]}
    assert by["zstd:1"]["ratio"] < 1 and by["zstd:1"]["stored_bytes"] < by["stock"]["stored_bytes"]
    assert out["peak_rss_bytes"] >= out["peak_rss_before_runs_bytes"] > 0
    assert res.stderr.strip() == ""  # no progress bar when stderr is no terminal
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    assert fs.find(bucket.removeprefix("s3://")) == []  # everything it wrote is deleted
    # a local path: same, and the folder is left as it was
    local = tmp_path / "scratch"
    local.mkdir()
    out = json.loads(ok(cli("bench", "--model", "tiny", "--path", local, "--codec", "lz4", "--no-stock", "--json",
                            "--no-chart")).stdout)
    assert out["results"][0]["stored_bytes"] > 0 and list(local.iterdir()) == []



def test_train_saves_the_last_step_between_multiples(tmp_path: Path) -> None:
    """Saves fall on multiples of N; the run's last step (7, not a multiple of 5) is saved at close."""
    ok(cli("train", "--steps", "7", "--d-model", "16", "--vocab", "64", "--seq-len", "8", "--log-every", "0",
           "--local-path", tmp_path / "local", "--checkpoint-every-steps", "5", "--keep-local", "3"))
    assert sorted(p.name for p in (tmp_path / "local").iterdir() if p.name.startswith("step_")) == \
        ["step_000000005", "step_000000007"]



def test_bench_path_errors_are_not_masked_by_cleanup(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    flags = ["--model", "tiny", "--codec", "lz4", "--no-stock", "--no-chart", "--json"]
    on_file, under_file, missing = cli_parallel(["bench", "--path", a_file, *flags],
                                                ["bench", "--path", a_file / "sub", *flags],
                                                ["bench", "--path", tmp_path / "new" / "dir", *flags])
    assert "not a directory" in one_line_error(on_file, 2)
    line = one_line_error(under_file, under_file.returncode)
    assert under_file.returncode != 0 and "delete" not in line and "dcp-tiered-bench" in line, line  # the write failed
    ok(missing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # what bench created is gone



def test_bench_cleanup_logs_instead_of_masking_and_ignores_nothing_to_delete(caplog: pytest.LogCaptureFixture) -> None:
    from dcp_tiered.cli.bench import removed_after
    from dcp_tiered.errors import MissingFileError, StorageError

    class Where:
        url = "s3://bucket/x"

        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def remove_tree(self) -> None:
            raise self.exc

    with pytest.raises(ValueError, match="the real cause"), caplog.at_level("WARNING"):
        with removed_after(Where(StorageError("delete failed"))):
            raise ValueError("the real cause")
    assert "could not delete s3://bucket/x" in caplog.text
    with removed_after(Where(MissingFileError("nothing there"))):
        pass  # nothing was written: no error
    with pytest.raises(StorageError):  # with no error in flight a failed delete is reported
        with removed_after(Where(StorageError("delete failed"))):
            pass
