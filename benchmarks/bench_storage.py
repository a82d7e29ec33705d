"""Whole-checkpoint save and load on local disk: CompressedWriter against stock DCP, with peak memory.

Run:  .venv/bin/python -m benchmarks.bench_storage [--sizes-gb 0.5,2] [--scaling-gb 0.25,0.5,1,2]
      [--repeat 3] [--repeat-large 1] [--small | --no-small] [--dir DIR] [--quick]

Writes the sections "storage", "limits" and "scaling" of docs/benchmarks.md and the results
"storage" and "scaling".  The state dicts are model + optimizer state built from real MiniLM
fp32 weights and their Adam moments, repeated under distinct key names up to the target size,
plus (``--small``) the real MiniLM weights alone in fp32 and bf16.  Every save and every load
runs in a fresh process (benchmarks/isolate.py) that reports its peak RSS above the state dict.

      .venv/bin/python -m benchmarks.bench_storage --shards [--shard-mib 16,64,256] [--shard-ranks 1,2]
      [--shard-repeat 5] [--shard-profile-runs 3] [--no-shard-warmup]

runs only the per-process shard rows and writes the section "shards" (and the result "shards"): each
process saves and cold-loads its own shard of one real state (MiniLM fp32 with every key, ``DTensor``
``Shard(0)`` over gloo ranks on 127.0.0.1), ``CompressedWriter`` zstd:1 against stock with the same
threads, fresh processes per save and load, interleaved rounds, a bound per row and a phase profile.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import multiprocessing
import os
import pstats
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.bench_s3 import free_port
from benchmarks.common import (
    adam_state,
    chart_or_note,
    dir_bytes,
    drop_file_cache,
    drop_page_cache,
    every_key_state,
    fresh_dir,
    load_results,
    local_shard,
    machine_line,
    md_table,
    minilm_weights,
    nbytes,
    save_results,
    timed,
    write_section,
)
from benchmarks.isolate import run_isolated
from dcp_tiered import CompressedReader, CompressedWriter, DowncastSavePlanner

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

GB = 1e9
OURS = "CompressedWriter (defaults)"
OURS_BF16 = "CompressedWriter + bf16 planner"
STOCK1 = "stock FileSystemWriter, 1 thread"
STOCK2 = "stock FileSystemWriter, 2 threads"
STOCK_ZSTD = "stock + DCP zstd extension, 2 threads"
WRITERS = [OURS, OURS_BF16, STOCK1, STOCK2, STOCK_ZSTD]

# A data set is (kind, target bytes): "model+adam" is cut to the target size, the MiniLM sets are whole.
Spec = tuple[str, int]


# -- state construction (runs inside the child processes) ---------------------------------


def make_base(path: Path) -> None:
    """Save real MiniLM fp32 weights ("w/<key>") and their Adam moments ("m/<key>.exp_avg[_sq]") once."""
    w = minilm_weights()
    base = {f"w/{k}": v for k, v in w.items()} | {f"m/{k}": v for k, v in adam_state(w).items()}
    torch.save(base, path)


def layout(spec: Spec, base: dict[str, torch.Tensor]) -> list[tuple[str, str, int, int | None]]:
    """(key, base key, copy number, leading rows or None for all) of every tensor of the data set ``spec``.

    The last group (a weight and its two moments) is cut to its leading rows where taking it
    whole would overshoot the target size, so sizes land within one row of the target.
    """
    kind, target = spec
    names = [k[2:] for k in base if k.startswith("w/")]
    if kind.startswith("minilm"):
        return [(k, f"w/{k}", 0, None) for k in names]
    out, total, copy = [], 0, 0
    while total < target:
        for k in names:
            group = [(f"model.{copy}.{k}", f"w/{k}"), (f"optim.{copy}.{k}.exp_avg", f"m/{k}.exp_avg"),
                     (f"optim.{copy}.{k}.exp_avg_sq", f"m/{k}.exp_avg_sq")]
            size = 3 * base[f"w/{k}"].nbytes
            rows = None
            if total + size > target and base[f"w/{k}"].dim() > 1:
                per_row = size // base[f"w/{k}"].shape[0]
                rows = -(-(target - total) // per_row)
                size = rows * per_row
            out += [(key, src, copy, rows) for key, src in group]
            total += size
            if total >= target:
                break
        copy += 1
    return out


def expected(spec: Spec, base: dict[str, torch.Tensor], src: str, rows: int | None = None) -> torch.Tensor:
    t = base[src] if rows is None else base[src][:rows].clone()
    return t.bfloat16() if spec[0] == "minilm bf16" else t


def build_state(spec: Spec, base_file: str) -> dict[str, torch.Tensor]:
    """The data set ``spec`` as real, distinct tensors (copy 0 shares the base tensors)."""
    base = torch.load(base_file, weights_only=True)
    state = {}
    for key, src, copy, rows in layout(spec, base):
        t = expected(spec, base, src, rows)
        state[key] = t.clone() if copy and rows is None else t
    return state


# -- writers ---------------------------------------------------------------------------------


def make_writer(label: str, path: str) -> tuple[Any, Any]:
    from torch.distributed.checkpoint._extension import ZStandard

    return {
        OURS: lambda: (CompressedWriter(path), None),
        OURS_BF16: lambda: (CompressedWriter(path), DowncastSavePlanner(torch.bfloat16)),
        STOCK1: lambda: (dcp.FileSystemWriter(path, thread_count=1), None),
        STOCK2: lambda: (dcp.FileSystemWriter(path, thread_count=2), None),
        STOCK_ZSTD: lambda: (dcp.FileSystemWriter(path, thread_count=2, _extensions=[ZStandard()]), None),
    }[label]()


def make_reader(label: str, path: str) -> Any:
    return CompressedReader(path) if label.startswith("CompressedWriter") else dcp.FileSystemReader(path)


# -- child-process steps (setup builds, measure is what gets timed and memory-tracked) ------


def setup_save(spec: Spec, base_file: str, label: str, path: str) -> dict:
    return {"state": build_state(spec, base_file), "label": label, "path": path}


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process, all of its threads, so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure_save(b: dict) -> dict:
    writer, planner = make_writer(b["label"], b["path"])
    cpu0 = cpu_seconds()
    secs = timed(lambda: dcp.save(b["state"], storage_writer=writer, planner=planner, no_dist=True))
    out = {"save_s": secs, "save_cpu_s": cpu_seconds() - cpu0, "stored": dir_bytes(b["path"]), "raw": nbytes(b["state"]), "codec": getattr(writer, "codec", None)}
    if planner is not None:
        keys = planner.report.downcast
        out["downcast_keys"] = len(keys)
        out["downcast_raw"] = sum(b["state"][k].nbytes for k in keys)
        out["keys"] = len(b["state"])
    return out


def setup_load(spec: Spec, base_file: str, label: str, path: str, cold: bool) -> dict:
    """Zero-filled destinations (touched, like a live model's tensors), then drop the cache if cold."""
    base = torch.load(base_file, weights_only=True)
    plan = layout(spec, base)
    dst = {key: torch.empty_like(expected(spec, base, src, rows)).fill_(0) for key, src, _, rows in plan}
    dropped = drop_page_cache() if cold else False
    return {"spec": spec, "base": base, "plan": plan, "dst": dst, "label": label, "path": path, "dropped": dropped}


def measure_load(b: dict) -> dict:
    secs = timed(lambda: dcp.load(b["dst"], storage_reader=make_reader(b["label"], b["path"]), no_dist=True))
    return {"load_s": secs, "dropped": b["dropped"]}


def check_load(b: dict) -> None:
    """Every loaded tensor equals the saved one (weights rounded through bf16 under the bf16 planner)."""
    for key, src, _, rows in b["plan"]:
        want = expected(b["spec"], b["base"], src, rows)
        if b["label"] == OURS_BF16 and not key.startswith("optim."):  # the planner leaves optimizer state alone
            want = want.bfloat16().to(want.dtype)
        assert torch.equal(b["dst"][key], want), f"{b['label']}: {key} differs after load"


def measure_load_checked(b: dict) -> dict:
    out = measure_load(b)
    check_load(b)
    return out


def setup_state(spec: Spec, base_file: str, *extra: Any) -> dict:
    return {"state": build_state(spec, base_file), "extra": extra}


def write_fsync(path: str, sd: dict[str, torch.Tensor]) -> None:
    """Write every tensor's bytes, in order, into one file and fsync it."""
    with open(path, "wb") as f:
        f.writelines(memoryview(t.view(torch.uint8).numpy()) for t in sd.values())
        f.flush()
        os.fsync(f.fileno())


def read_into(path: str, buf: torch.Tensor) -> None:
    view, pos = memoryview(buf.numpy()), 0
    with open(path, "rb", buffering=0) as f:
        while pos < len(view):
            n = f.readinto(view[pos:])
            assert n, "short file"
            pos += n


def copy_time(sd: dict[str, torch.Tensor]) -> float:
    """One copy_ of every tensor into preallocated, touched tensors (freed on return)."""
    dst = {k: torch.empty_like(v).fill_(0) for k, v in sd.items()}
    return timed(lambda: [dst[k].copy_(v) for k, v in sd.items()])


def disk_times(path: str, sd: dict[str, torch.Tensor], repeat: int) -> tuple[list[float], list[float], bool]:
    """``repeat`` x (write + fsync, drop the page cache, read back into a touched buffer)."""
    buf = torch.empty(nbytes(sd), dtype=torch.uint8).fill_(0)
    write_s, read_s, dropped = [], [], True
    for _ in range(repeat):
        write_s.append(timed(lambda: write_fsync(path, sd)))
        dropped = drop_page_cache() and dropped
        read_s.append(timed(lambda: read_into(path, buf)))
        os.unlink(path)
    return write_s, read_s, dropped


def measure_limits(b: dict) -> dict:
    """Disk write (write + fsync of the state's bytes into one file), cold disk read of that file,
    and one memory copy of the state dict (copy_ into preallocated tensors, and clone)."""
    sd, (path, repeat) = b["state"], b["extra"]
    write_s, read_s, dropped = disk_times(path, sd, repeat)
    copy_s = copy_time(sd)
    clone_s = timed(lambda: {k: v.clone() for k, v in sd.items()})
    return {"raw": nbytes(sd), "write_s": write_s, "read_s": read_s, "dropped": dropped, "copy_s": copy_s, "clone_s": clone_s}


def measure_scaling(b: dict) -> dict:
    """One save per writer of the same state, each into a fresh directory deleted afterwards."""
    sd, (base_dir,) = b["state"], b["extra"]
    out = {"raw": nbytes(sd)}
    for label in WRITERS:
        path = fresh_dir(base_dir, "scaling")
        writer, planner = make_writer(label, str(path))
        save = lambda w=writer, p=planner: dcp.save(sd, storage_writer=w, planner=p, no_dist=True)
        out[label] = {"save_s": timed(save),
                      "stored": dir_bytes(path)}
        shutil.rmtree(path)
    return out


# -- the run (parent process) -------------------------------------------------------------


def check_real_disk(path: str) -> None:
    """Refuse memory-backed filesystems: the point is to measure a disk."""
    best, fstype = "", "?"
    with open("/proc/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    for mnt, typ in mounts:
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, typ
    if fstype in ("tmpfs", "ramfs"):
        raise SystemExit(f"{path} is on {fstype} (memory), not a disk; pass --dir on a real disk")


def set_name(spec: Spec, raw: int) -> str:
    return spec[0].replace("minilm", "MiniLM") if spec[0].startswith("minilm") else f"model+Adam {raw / GB:.2f} GB"


def mbps(nbytes_: float, secs: float) -> float:
    return nbytes_ / secs / 1e6


def bench_set(spec: Spec, base_file: str, base_dir: str, repeat: int, disk_repeat: int) -> tuple[dict, dict]:
    """Limits, then every writer: ``repeat`` x (save, cold load, warm load), each in a fresh process."""
    lim = run_isolated(setup_state, measure_limits, spec, base_file, os.path.join(base_dir, "disk.bin"), disk_repeat).result
    res = {}
    for label in WRITERS:
        runs = []
        for _ in range(repeat):
            path = str(fresh_dir(base_dir, "ckpt"))
            s = run_isolated(setup_save, measure_save, spec, base_file, label, path)
            cold = run_isolated(setup_load, measure_load_checked, spec, base_file, label, path, True)
            warm = run_isolated(setup_load, measure_load, spec, base_file, label, path, False)
            shutil.rmtree(path)
            runs.append({**s.result, "save_peak": s.peak_rss_above_baseline, "load_cold_s": cold.result["load_s"],
                         "dropped": cold.result["dropped"], "load_cold_peak": cold.peak_rss_above_baseline,
                         "load_warm_s": warm.result["load_s"], "load_warm_peak": warm.peak_rss_above_baseline})
        med = {k: statistics.median(r[k] for r in runs) for k in ("save_s", "save_cpu_s", "load_cold_s", "load_warm_s")}
        peaks = {k: max(r[k] for r in runs) for k in ("save_peak", "load_cold_peak", "load_warm_peak")}
        res[label] = {**runs[0], **med, **peaks, "repeats": repeat, "dropped": all(r["dropped"] for r in runs)}
        print(f"  {label}: save {med['save_s']:.2f}s load {med['load_cold_s']:.2f}s/{med['load_warm_s']:.2f}s "
              f"stored/raw {runs[0]['stored'] / runs[0]['raw']:.3f}", flush=True)
    return lim, res


def verdict(value: float, target: float) -> str:
    return "met" if value >= target else f"missed by {(1 - value / target) * 100:.0f}%"


def fit_mbps(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of seconds vs bytes as MB/s, and the intercept in seconds."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my / mx
    return 1 / slope / 1e6 if slope > 0 else float("nan"), my - slope * mx


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", default="0.5,2", help="model+Adam state sizes for the storage/limits tables")
    ap.add_argument("--scaling-gb", default="0.25,0.5,1,2", help="state sizes for the scaling section")
    ap.add_argument("--repeat", type=int, default=3, help="repeats (median) for sets under 1 GB")
    ap.add_argument("--repeat-large", type=int, default=1, help="repeats for sets of 1 GB or more")
    ap.add_argument("--disk-repeat", type=int, default=3, help="repeats (median) of the raw disk write/read measurement")
    ap.add_argument("--small", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the real MiniLM weights alone (fp32, bf16)")
    ap.add_argument("--dir", default=None, help="checkpoint directory on a real disk (default: a temp dir in /var/tmp)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.15 GB, scaling 0.15/0.3 GB, 1 repeat, no small sets")
    ap.add_argument("--shards", action="store_true",
                    help="run only the per-process shard rows (section 'shards'): saves and cold loads of --shard-mib "
                         "per process on --shard-ranks ranks, ours against stock, --shard-repeat interleaved rounds")
    ap.add_argument("--shard-mib", default="16,64,256", help="MiB per process of the shard rows")
    ap.add_argument("--shard-ranks", default="1,2", help="rank counts of the shard rows (gloo on 127.0.0.1 above 1)")
    ap.add_argument("--shard-repeat", type=int, default=5, help="interleaved rounds of the shard rows (median, range)")
    ap.add_argument("--shard-profile-runs", type=int, default=3,
                    help="fresh-process runs (median) per writer and rank count of the phase profile")
    ap.add_argument("--shard-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="an untimed tiny save and load in each fresh process before the timed one")
    ap.add_argument("--shard-render", action="store_true",
                    help="write the section 'shards' again from the numbers its last run saved (docs/bench_results/shards.json)")
    args = ap.parse_args(argv)
    if args.shard_render:
        saved = load_results("shards")
        if saved is None:
            raise SystemExit("no docs/bench_results/shards.json to render: run with --shards first")
        write_shards(saved["data"])
        return
    if args.shards:
        shard_main(args)
        return
    if args.quick:
        args.sizes_gb, args.scaling_gb, args.repeat, args.repeat_large, args.small = "0.15", "0.15,0.3", 1, 1, False
    sizes = [float(x) for x in args.sizes_gb.split(",") if x]
    scaling = [float(x) for x in args.scaling_gb.split(",") if x]
    cmd = (".venv/bin/python -m benchmarks.bench_storage" + (" --quick" if args.quick else
           f" --sizes-gb {args.sizes_gb} --scaling-gb {args.scaling_gb} --repeat {args.repeat} "
           f"--repeat-large {args.repeat_large} --disk-repeat {args.disk_repeat}" + ("" if args.small else " --no-small")))
    head = f"`{cmd}` — {machine_line()}."

    t_start = time.perf_counter()
    base_dir = tempfile.mkdtemp(prefix="dcp-tiered-bench-", dir=args.dir or "/var/tmp")
    check_real_disk(os.path.realpath(base_dir))
    try:
        base_file = os.path.join(base_dir, "base.pt")
        make_base(Path(base_file))
        specs: list[Spec] = ([("minilm fp32", 0), ("minilm bf16", 0)] if args.small else []) + [
            ("model+adam", int(g * GB)) for g in sizes
        ]
        sets = []
        for spec in specs:
            repeat = args.repeat_large if spec[1] >= GB else args.repeat
            print(f"{spec} x{repeat} at {time.perf_counter() - t_start:.0f} s", flush=True)
            lim, res = bench_set(spec, base_file, base_dir, repeat, args.disk_repeat)
            sets.append({"name": set_name(spec, lim["raw"]), "raw": lim["raw"], "repeat": repeat, "limits": lim, "writers": res})
        scal = []
        for g in scaling:
            print(f"scaling {g} GB at {time.perf_counter() - t_start:.0f} s", flush=True)
            scal.append(run_isolated(setup_state, measure_scaling, ("model+adam", int(g * GB)), base_file, base_dir).result)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    runtime = time.perf_counter() - t_start

    # ---- storage ----
    rows = []
    for s in sets:
        for label, r in s["writers"].items():
            rows.append([s["name"], label, f"{mbps(r['raw'], r['save_s']):.0f}", f"{mbps(r['raw'], r['load_cold_s']):.0f}",
                         f"{mbps(r['raw'], r['load_warm_s']):.0f}", f"{r['stored'] / 1e6:.0f}", f"{r['stored'] / r['raw']:.3f}",
                         f"{r['save_cpu_s'] / (r['raw'] / GB):.2f}",
                         f"{r['save_peak'] / 1e6:.0f}", f"{r['load_cold_peak'] / 1e6:.0f}", f"{r['load_warm_peak'] / 1e6:.0f}"])
    table = md_table(["data", "writer", "save MB/s", "load MB/s cold", "load MB/s warm", "stored MB", "stored/raw",
                      "save CPU core-s per GB", "save peak MB", "load peak MB cold", "load peak MB warm"], rows)
    bf16 = [(s["name"], s["writers"][OURS_BF16]) for s in sets]
    bf16_note = "; ".join(f"{n}: {r['downcast_keys']} of {r['keys']} tensors, {r['downcast_raw'] / r['raw'] * 100:.0f}% of the raw bytes"
                          for n, r in bf16)
    cold_ok = all(r["dropped"] for s in sets for r in s["writers"].values())
    codec = sets[0]["writers"][OURS]["codec"]

    # ---- limits ----
    lrows, frows = [], []
    for s in sets:
        lim = s["limits"]
        ws, rs = sorted(mbps(lim["raw"], t) for t in lim["write_s"]), sorted(mbps(lim["raw"], t) for t in lim["read_s"])
        disk_w, disk_r = statistics.median(ws), statistics.median(rs)
        s["disk_write_mbps"], s["disk_read_mbps"] = disk_w, disk_r
        lrows.append([s["name"], f"{lim['raw'] / 1e6:.0f}", f"{disk_w:.0f} ({ws[0]:.0f}–{ws[-1]:.0f})",
                      f"{disk_r:.0f} ({rs[0]:.0f}–{rs[-1]:.0f})" + ("" if lim["dropped"] else " (warm: drop not permitted)"),
                      f"{mbps(lim['raw'], lim['copy_s']):.0f}", f"{mbps(lim['raw'], lim['clone_s']):.0f}"])
        for label, r in s["writers"].items():
            fw = mbps(r["stored"], r["save_s"]) / disk_w
            fr = mbps(r["stored"], r["load_cold_s"]) / disk_r
            r["disk_frac_save"], r["disk_frac_load"] = fw, fr
            frows.append([s["name"], label, f"{mbps(r['stored'], r['save_s']):.0f}", f"{fw:.2f}",
                          f"{mbps(r['stored'], r['load_cold_s']):.0f}", f"{fr:.2f}"])
    ltable = md_table(["data", "size MB", "disk write MB/s (write+fsync), median (range)", "disk read MB/s (cold), median (range)",
                       "memory copy_ MB/s (preallocated)", "memory clone MB/s (fresh)"], lrows)
    ftable = md_table(["data", "writer", "save MB/s of stored bytes", "÷ disk write (target ≥ 0.9)",
                       "load MB/s of stored bytes (cold)", "÷ disk read"], frows)

    # ---- against the targets ----
    trows = []
    for s in sets:
        w = s["writers"]
        for label in (OURS, OURS_BF16):
            r = w[label]
            vs2 = w[STOCK2]["save_s"] / r["save_s"]
            vsz = w[STOCK_ZSTD]["save_s"] / r["save_s"]
            vsl = w[STOCK2]["load_cold_s"] / r["load_cold_s"]
            trows.append([s["name"], label, f"{vs2:.2f}x — {verdict(vs2, 1)}", f"{vsz:.2f}x — {verdict(vsz, 2)}",
                          f"{vsl:.2f}x — {verdict(vsl, 1)}", f"{r['disk_frac_save']:.2f} — {verdict(r['disk_frac_save'], 0.9)}",
                          f"{r['disk_frac_load']:.2f} — {verdict(r['disk_frac_load'], 0.9)}"])
    summary = md_table(["data", "writer", "save vs stock 2 thr (≥ 1x)", "save vs stock+zstd (≥ 2x)",
                        "load vs stock 2 thr, cold (≥ 1x)", "save ÷ disk write, stored bytes (≥ 0.9)",
                        "load ÷ disk read, stored bytes (≥ 0.9)"], trows)

    def draw_bars(plt):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
        width = 0.8 / len(WRITERS)
        for ax, key, title in ((axes[0], "save_s", "save"), (axes[1], "load_cold_s", "load (cold cache)")):
            for i, label in enumerate(WRITERS):
                vals = [mbps(s["raw"], s["writers"][label][key]) for s in sets]
                ax.bar([j + i * width for j in range(len(sets))], vals, width, label=label)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], [s["name"] for s in sets], fontsize=8)
            ax.set_ylabel("MB/s of raw state")
            ax.set_title(title)
        axes[0].legend(fontsize=7)
        return fig

    bars = chart_or_note("storage", draw_bars)
    timing_note = (f"median of {args.repeat} repeats for sets under 1 GB, {args.repeat_large} for 1 GB and more"
                   if args.repeat > 1 or args.repeat_large > 1 else "one run each")
    write_section(
        "storage",
        f"## Whole save and load on local disk\n\n{head}\n\n"
        "Data: model + optimizer state built from the real MiniLM fp32 weights (22.7M parameters) and their Adam "
        "moments (`exp_avg`, `exp_avg_sq` after 5 real steps), that same set repeated under distinct key names "
        "(`model.<copy>.*`, `optim.<copy>.*`) until the target size — so the bytes are real but repeat every "
        "~273 MB, the last weight cut to its leading rows to hit the size (frames are compressed independently, so repetition does not help any codec here)"
        + ("; plus the real MiniLM weights alone in fp32 and in bf16" if args.small else "") + ". "
        "Each `dcp.save` / `dcp.load` (`no_dist=True`) runs in a fresh process (forked from a clean forkserver, benchmarks/isolate.py) that first builds its state "
        "dict (for loads: zero-filled, already-touched destination tensors of the original dtypes); the time is of "
        "the `dcp.save`/`dcp.load` call only, " + timing_note + ". Cold loads run right after "
        + ("dropping the page cache" if cold_ok else "an attempt to drop the page cache that was NOT permitted (so they are warm)")
        + ", warm loads in another fresh process right after. MB/s are of raw state in its original dtype. "
        f"Peak MB = peak RSS of that process above its RSS right after building the state dict, from a thread "
        "sampling RSS every 2 ms and the kernel's exact `ru_maxrss` high-water mark whenever it rose during the "
        "call (benchmarks/isolate.py). Every writer fsyncs its data files: stock `FileSystemWriter` with its "
        f"default `sync_files=True`, `CompressedWriter` (codec `{codec}`) with its default `sync_files=True` "
        "(fsync before close, `.metadata` written last via temp file + fsync + rename). The stock zstd "
        "writer is `FileSystemWriter(thread_count=2, _extensions=[ZStandard()])`. The bf16 planner is "
        "`DowncastSavePlanner(torch.bfloat16)` with its default exclusions, so only the weights are stored in "
        f"bf16 and the Adam moments stay fp32 ({bf16_note}); stored/raw is against the fp32 size.\n\n"
        + table + "\n\n### Against the targets\n\n" + summary + "\n\n" + bars + "\n\n"
        + reading(sets),
    )
    write_section(
        "limits",
        f"## What the machine allows (limits for the save/load numbers)\n\n{head}\n\n"
        "Measured in the same run as the storage section, in a fresh process per data set, on the same state "
        "dict: disk write = the state's bytes written into one file from memory plus `fsync`; disk read = that "
        "file read back into a preallocated, touched buffer after dropping the page cache; memory copy = one "
        "`copy_` of every tensor into preallocated touched tensors, and one `clone` (fresh allocation). "
        "Then each writer's throughput on the bytes it actually stores, as a fraction of the disk bandwidth: "
        "a writer at ≥ 0.9 is within 10% of disk-bound; below that, CPU (compression, copies) or Python bounds it. "
        f"Disk write and read: median of {args.disk_repeat} (range in parentheses) — this virtual disk varies run to run, "
        "so a fraction above 1 means the writer met a faster moment of the disk, not that it beat the disk.\n\n"
        + ltable + "\n\n" + ftable + "\n\n" + limits_reading(sets),
    )

    # ---- scaling ----
    srows, fits = [], []
    for label in WRITERS:
        xs = [sc["raw"] for sc in scal]
        ys = [sc[label]["save_s"] for sc in scal]
        srows.append([label] + [f"{y:.2f}" for y in ys])
        if len(xs) >= 2:
            rate, icpt = fit_mbps(xs, ys)
            fits.append([label, f"{rate:.0f}", f"{icpt:.2f}"])
    stable = md_table(["writer"] + [f"{sc['raw'] / GB:.2f} GB (s)" for sc in scal], srows)
    ftab = md_table(["writer", "fitted MB/s (slope)", "intercept s"], fits) if fits else ""

    def draw_scaling(plt):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label in WRITERS:
            ax.plot([sc["raw"] / GB for sc in scal], [sc[label]["save_s"] for sc in scal], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state size (GB of raw state)")
        ax.set_ylabel("save time (s)")
        ax.legend(fontsize=7)
        return fig

    write_section(
        "scaling",
        f"## Save time against state size\n\n{head}\n\n"
        "One `dcp.save` per writer and size, same state construction as the storage section (MiniLM weights + "
        "Adam moments repeated to the size), all writers of one size in one fresh process, one after another, "
        "checkpoint deleted after each; fsync on. Fitted MB/s = 1 / least-squares slope of seconds against "
        "bytes; the intercept is the fixed cost per save.\n\n"
        + stable + "\n\n" + ftab + "\n\n" + chart_or_note("scaling", draw_scaling) + "\n\n" + scaling_reading(scal, fits),
    )
    save_results("storage", {"sets": sets, "runtime_s": runtime})
    save_results("scaling", scal)
    print(table, "\n\n", summary, "\n\n", ltable, "\n\n", ftable, "\n\n", stable, "\n\n", ftab, sep="")
    print(f"total {runtime:.0f} s")


def reading(sets: list[dict]) -> str:
    """A few sentences from the measured numbers: who wins save and load, and memory."""
    big = max(sets, key=lambda s: s["raw"])
    w = big["writers"]
    best_save = max(WRITERS, key=lambda lb: w[lb]["raw"] / w[lb]["save_s"])
    best_load = max(WRITERS, key=lambda lb: w[lb]["raw"] / w[lb]["load_cold_s"])
    ours, stock = w[OURS], w[STOCK2]
    return (
        f"On {big['name']}, the fastest save is {best_save} and the fastest cold load {best_load}. "
        f"CompressedWriter stores {ours['stored'] / ours['raw']:.3f} of the raw bytes and saves at "
        f"{stock['save_s'] / ours['save_s']:.2f}x the stock 2-thread writer, loading cold at "
        f"{stock['load_cold_s'] / ours['load_cold_s']:.2f}x. "
        + (f"It writes its stored bytes at {ours['disk_frac_save']:.2f} of the measured disk rate, so the disk is not "
           f"what bounds its save; the CPU work (compression, on {os.cpu_count()} cores shared with the writes) is the likely bound. "
           if ours["disk_frac_save"] < 0.9 else
           f"It writes its stored bytes at {ours['disk_frac_save']:.2f} of the measured disk rate: disk-bound. ")
        + cpu_reading(w)
        + f"Peak extra memory: CompressedWriter {ours['save_peak'] / 1e6:.0f} MB on save and "
        f"{ours['load_cold_peak'] / 1e6:.0f} MB on load, stock {stock['save_peak'] / 1e6:.0f} / "
        f"{stock['load_cold_peak'] / 1e6:.0f} MB, for {big['raw'] / 1e6:.0f} MB of state."
    )


def cpu_reading(w: dict) -> str:
    """CPU core-seconds per GB saved, ours against stock with DCP's zstd extension."""
    per_gb = {lb: w[lb]["save_cpu_s"] / (w[lb]["raw"] / GB) for lb in (OURS, STOCK_ZSTD, STOCK2)}
    return (f"CPU per GB saved (user + system core-seconds of the saving process): CompressedWriter "
            f"{per_gb[OURS]:.2f}, {STOCK_ZSTD} {per_gb[STOCK_ZSTD]:.2f} ({per_gb[STOCK_ZSTD] / per_gb[OURS]:.1f}x ours), "
            f"stock uncompressed {per_gb[STOCK2]:.2f}. ")


def limits_reading(sets: list[dict]) -> str:
    big = max(sets, key=lambda s: s["raw"])
    ours = big["writers"][OURS]
    return (
        f"On {big['name']}, the disk took {big['disk_write_mbps']:.0f} MB/s write+fsync and gave "
        f"{big['disk_read_mbps']:.0f} MB/s cold read; CompressedWriter wrote its stored bytes at "
        f"{ours['disk_frac_save']:.2f} and read them at {ours['disk_frac_load']:.2f} of those."
    )


def scaling_reading(scal: list[dict], fits: list[list[str]]) -> str:
    """How well a straight line fits each writer's save times, from the numbers."""
    if not fits:
        return "Only one size was run, so no slope is fitted."
    if len(scal) < 3:
        return "Two sizes only: the line goes through both points, so linearity is not tested."
    xs = [sc["raw"] for sc in scal]
    worst = []
    for label in WRITERS:
        ys = [sc[label]["save_s"] for sc in scal]
        rate, icpt = fit_mbps(xs, ys)
        dev = max(abs(icpt + x / (rate * 1e6) - y) / y for x, y in zip(xs, ys))
        worst.append(f"{label} {dev * 100:.0f}%")
    return ("Largest deviation of a measured time from the fitted line: " + ", ".join(worst) + ". The slope is each "
            "writer's sustained rate and the intercept its fixed cost per save (planning, metadata, fsync); "
            "single runs on a virtual disk, so expect ~10% noise per point.")


# -- per-process shards: 16-256 MiB per process, 1 process and N gloo ranks (section "shards") -----

SHARD_OURS = "CompressedWriter zstd:1"
SHARD_STOCK = "stock FileSystemWriter"
SHARD_WRITERS = (SHARD_OURS, SHARD_STOCK)
MIB = 1 << 20
SAVE_PHASES = ("set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data", "finish")
LOAD_PHASES = ("read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan", "read_data")
PLAN_PHASES = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan")


def shard_threads(world: int) -> int:
    """Threads per rank for both writers: the cores this process may use, divided by the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // world)


def shard_state(mib: int, world: int, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """Rank ``rank``'s ``Shard(0)`` rows of one real state of ``world`` x ``mib`` MiB (MiniLM fp32 weights, every
    key kept, see :func:`every_key_state`), and the (shape, stride) of each whole tensor."""
    full = every_key_state(minilm_weights(), world * mib * MIB)
    return {k: local_shard(v, rank, world) for k, v in full.items()}, {k: (v.shape, v.stride()) for k, v in full.items()}


def as_state(local: dict[str, torch.Tensor], shapes: dict[str, tuple], world: int) -> dict[str, Any]:
    """The state to save or load: the local tensors for one process, ``DTensor``s on a 1-D CPU mesh for several ranks."""
    if world == 1:
        return local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    return {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shapes[k][0], stride=shapes[k][1])
            for k, t in local.items()}


def shard_io(label: str, op: str, path: str, threads: int) -> Any:
    """The storage writer or reader of ``label``; the stock reader has no thread option (reads on the calling thread)."""
    if label == SHARD_OURS:
        return CompressedWriter(path, codec="zstd:1", threads=threads) if op == "save" else CompressedReader(path, threads=threads)
    return dcp.FileSystemWriter(path, thread_count=threads) if op == "save" else dcp.FileSystemReader(path)


@contextlib.contextmanager
def phase_clock(objs: dict[str, tuple[Any, tuple[str, ...]]], ms: dict[str, float]) -> Iterator[None]:
    """Add the wall ms of each named method call (``<prefix>.<method>``, returned futures waited for) and of
    every ``os.fsync``/``os.fdatasync`` (``fsync``, with the count as ``fsync calls``) to ``ms``."""
    saved = {"fsync": os.fsync, "fdatasync": os.fdatasync}

    def clock(name: str, fn: Any) -> Any:
        @functools.wraps(fn)  # DCP inspects some methods' signatures
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
                if hasattr(out, "wait"):
                    out.wait()
                return out
            finally:
                ms[name] = ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
                if name == "fsync":
                    ms["fsync calls"] = ms.get("fsync calls", 0) + 1
        return run

    for prefix, (obj, names) in objs.items():
        for n in names:
            setattr(obj, n, clock(f"{prefix}.{n}", getattr(obj, n)))
    os.fsync, os.fdatasync = clock("fsync", os.fsync), clock("fsync", os.fdatasync)
    try:
        yield
    finally:
        os.fsync, os.fdatasync = saved["fsync"], saved["fdatasync"]


def shard_worker(rank: int, world: int, port: int, op: str, label: str, path: str, mib: int, threads: int,
                 out: str, profile: str, warmup: bool) -> None:
    """One rank of one save or load (fresh process): build the shard, ``warmup`` an untimed save and load of a tiny
    state with the same writer (imports, thread pools, first collectives: what a job pays once, not per save), then
    time ``dcp.save``/``dcp.load`` from a barrier to a barrier; a load checks every loaded tensor.  ``profile``
    "phases" also times DCP's calls into the writer/reader and planner, "cprofile" the functions' own time."""
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )

    torch.set_num_threads(threads)
    if world > 1:
        import datetime

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        local, shapes = shard_state(mib, world, rank)
        state = as_state(local if op == "save" else {k: torch.empty_like(v).fill_(0) for k, v in local.items()}, shapes, world)
        if warmup:
            tiny = as_state({"warm": torch.arange(8.0) + rank}, {"warm": (torch.Size([8 * world]), (1,))}, world)
            dcp.save(tiny, storage_writer=shard_io(label, "save", path + ".warm", threads), no_dist=world == 1)
            dcp.load(tiny, storage_reader=shard_io(label, "load", path + ".warm", threads), no_dist=world == 1)
            if world > 1:
                torch.distributed.barrier()
            if rank == 0:
                shutil.rmtree(path + ".warm")
        planner = DefaultSavePlanner() if op == "save" else DefaultLoadPlanner()
        ms: dict[str, float] = {}
        prof = cProfile.Profile() if profile == "cprofile" else None

        def call() -> None:
            t0 = time.perf_counter()
            io = shard_io(label, op, path, threads)
            ms["constructor"] = (time.perf_counter() - t0) * 1e3
            clocks = {"storage": (io, SAVE_PHASES if op == "save" else LOAD_PHASES), "planner": (planner, PLAN_PHASES)}
            with phase_clock(clocks if profile == "phases" else {}, ms) if profile == "phases" else contextlib.nullcontext():
                if op == "save":
                    dcp.save(state, storage_writer=io, planner=planner, no_dist=world == 1)
                else:
                    dcp.load(state, storage_reader=io, planner=planner, no_dist=world == 1)

        if world > 1:
            torch.distributed.barrier()
        busy0, cpu0, t0 = machine_jiffies(), cpu_seconds(), time.perf_counter()
        if prof is not None:
            prof.runcall(call)
        else:
            call()
        if world > 1:
            torch.distributed.barrier()
        secs, cpu, busy1 = time.perf_counter() - t0, cpu_seconds() - cpu0, machine_jiffies()
        if op == "load":
            for k, v in local.items():
                got = state[k].to_local() if world > 1 else state[k]
                assert torch.equal(got, v), f"{label}, {world} ranks, rank {rank}: {k} differs after load"
        top = []
        if prof is not None:
            stats = pstats.Stats(prof)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:10]  # by own time
            top = [[f"{Path(f).name}:{line}({fn})", n, round(tt * 1e3, 1)] for (f, line, fn), (_c, n, tt, _ct, _cl) in rows]
        busy = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
        Path(out).write_text(json.dumps({"s": secs, "cpu_s": cpu, "busy": busy, "ms": ms, "top": top}))
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def run_ranks(world: int, op: str, label: str, path: str, mib: int, warmup: bool, profile: str = "") -> dict:
    """One save or load by ``world`` fresh processes (gloo on loopback when more than one); the slowest rank's
    time, all ranks' CPU seconds, and rank 0's phases."""
    ctx = multiprocessing.get_context("forkserver")
    port = free_port()
    outs = [f"{path}.rank{r}.json" for r in range(world)]
    procs = [ctx.Process(target=shard_worker, args=(r, world, port, op, label, path, mib, shard_threads(world), outs[r], profile, warmup))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        for p in procs:
            p.kill()
        raise RuntimeError(f"{op} by {label}, {world} ranks, {mib} MiB: rank exit codes {bad}")
    res = [json.loads(Path(o).read_text()) for o in outs]
    for o in outs:
        os.unlink(o)
    return {"s": max(r["s"] for r in res), "cpu_s": sum(r["cpu_s"] for r in res), "busy": res[0]["busy"],
            "ms": res[0]["ms"], "top": res[0]["top"]}


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, all processes (``/proc/stat``; nice'd work is busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # idle and iowait are not busy


def disk_rates(path: str, mib: int) -> tuple[float, float, int | None]:
    """Write + fsync ``mib`` MiB of real weights into one file, evict it as the checkpoints are, read it back:
    (write MB/s, cold read MB/s, bytes still resident after the eviction)."""
    sd = every_key_state(minilm_weights(), mib * MIB)
    w = timed(lambda: write_fsync(path, sd))
    left = drop_file_cache(path)
    buf = torch.empty(nbytes(sd), dtype=torch.uint8).fill_(0)
    r = timed(lambda: read_into(path, buf))
    os.unlink(path)
    return mbps(nbytes(sd), w), mbps(nbytes(sd), r), left


def spread(xs: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}–{max(xs):{fmt}})"


def separated(ours: list[float], stock: list[float]) -> str:
    """Whether the two writers' ranges of times overlap (with 5+ repeats, no overlap is a clear difference)."""
    if max(ours) < min(stock):
        return "ours faster in every round"
    if max(stock) < min(ours):
        return "stock faster in every round"
    return "ranges overlap"


def shard_bound(op: str, t: float, cpu_s: float, stored: int, disk_mbps: float, fixed_s: float, cores: int,
                busy: float) -> str:
    """The largest of three shares of the row's median time: disk (its stored bytes at the measured disk rate),
    CPU (its core-seconds over wall x cores) and the fixed per-call cost (intercept of time against size); where
    none reaches 0.8 while the whole machine was at least 0.9 busy, the bound is the cores other work took."""
    shares = {f"disk {'write + fsync' if op == 'save' else 'read'}": stored / (disk_mbps * 1e6) / t,
              f"CPU ({'compression' if op == 'save' else 'decompression'} + copies)": cpu_s / (t * cores),
              "fixed per-call cost": max(0.0, fixed_s) / t}
    name = max(shares, key=shares.get)
    if shares[name] < 0.8 and busy >= 0.9:
        name = "CPU shared with other work"
    elif name.startswith("disk") and shares[name] > 1.0:
        # Faster than the disk's own reference run: the disk varied between the two, so its rate cannot be
        # called the bound; say so rather than name it.
        name = "unexplained: the disk ran faster than its reference run, so no share bounds it"
    short = {k.split(" (")[0]: v for k, v in shares.items()}
    return name + " (" + ", ".join(f"{k} {v:.2f}" for k, v in short.items()) + f", machine busy {busy:.2f})"


def shard_main(args: argparse.Namespace) -> dict:
    """Run the shard rows and write the section "shards" (and docs/bench_results/shards.json)."""
    sizes = [int(x) for x in args.shard_mib.split(",") if x]
    worlds = [int(x) for x in args.shard_ranks.split(",") if x]
    cmd = (f".venv/bin/python -m benchmarks.bench_storage --shards --shard-mib {args.shard_mib} "
           f"--shard-ranks {args.shard_ranks} --shard-repeat {args.shard_repeat}"
           + ("" if args.shard_profile_runs == 3 else f" --shard-profile-runs {args.shard_profile_runs}")
           + ("" if args.shard_warmup else " --no-shard-warmup"))
    cores = len(os.sched_getaffinity(0))
    load0 = os.getloadavg()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "dcp_tiered", "benchmarks.bench_storage"])
    t_start = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="dcp-tiered-shards-", dir=args.dir or "/var/tmp"))
    check_real_disk(os.path.realpath(base))
    runs: dict[tuple[int, int, str], list[dict]] = {}
    disk: dict[int, list[tuple[float, float, int | None]]] = {m: [] for m in sizes}
    profile: dict[str, dict] = {}
    try:
        # profile first: runs x (save, cold load) per writer at the smallest size, then one cProfile of ours
        for rnd in range(args.shard_profile_runs):
            for world in worlds:
                for label in SHARD_WRITERS[:: 1 if rnd % 2 == 0 else -1]:
                    path = str(base / "profile")
                    s = run_ranks(world, "save", label, path, sizes[0], args.shard_warmup, "phases")
                    drop_file_cache(path)
                    ld = run_ranks(world, "load", label, path, sizes[0], args.shard_warmup, "phases")
                    shutil.rmtree(path)
                    profile.setdefault((world, label), {"save": [], "load": []})
                    profile[(world, label)]["save"].append(s)
                    profile[(world, label)]["load"].append(ld)
        path = str(base / "profile")
        top_save = run_ranks(1, "save", SHARD_OURS, path, sizes[0], args.shard_warmup, "cprofile")["top"]
        drop_file_cache(path)
        top_load = run_ranks(1, "load", SHARD_OURS, path, sizes[0], args.shard_warmup, "cprofile")["top"]
        shutil.rmtree(path)
        print(f"profile done at {time.perf_counter() - t_start:.0f} s", flush=True)
        for rnd in range(args.shard_repeat):
            order = SHARD_WRITERS if rnd % 2 == 0 else SHARD_WRITERS[::-1]  # ours first, then stock first, ...
            for mib in sizes:
                disk[mib].append(disk_rates(str(base / "disk.bin"), mib))
                for world in worlds:
                    for label in order:
                        path = str(base / "ckpt")
                        s = run_ranks(world, "save", label, path, mib, args.shard_warmup)
                        stored = dir_bytes(path)
                        left = drop_file_cache(path)
                        ld = run_ranks(world, "load", label, path, mib, args.shard_warmup)
                        shutil.rmtree(path)
                        runs.setdefault((mib, world, label), []).append(
                            {"save_s": s["s"], "save_cpu_s": s["cpu_s"], "load_s": ld["s"], "load_cpu_s": ld["cpu_s"],
                             "save_busy": s["busy"], "load_busy": ld["busy"],
                             "stored": stored, "resident_after_drop": left})
            print(f"round {rnd + 1}/{args.shard_repeat} done at {time.perf_counter() - t_start:.0f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    runtime = time.perf_counter() - t_start
    load1 = os.getloadavg()
    return write_shards({
        "args": {"cmd": cmd, "cores": cores, "repeat": args.shard_repeat, "warmup": args.shard_warmup},
        "machine": machine_line(), "runtime_s": runtime, "loadavg": [load0, load1], "disk": disk,
        "runs": [{"mib": m, "ranks": w, "writer": lb, "rounds": rs} for (m, w, lb), rs in runs.items()],
        "profile": [[w, lb, p] for (w, lb), p in profile.items()], "top_save": top_save, "top_load": top_load})


def paired(ours: list[float], stock: list[float]) -> str:
    """Round by round (the writers ran side by side in each): the median of stock ÷ ours, and how often ours won."""
    ratios = [b / a for a, b in zip(ours, stock)]
    return f"paired {statistics.median(ratios):.2f}x, ours faster in {sum(r > 1 for r in ratios)}/{len(ratios)} rounds"


def write_shards(raw: dict) -> dict:
    """The section "shards" from one run's raw numbers (as :func:`shard_main` measured them, or as saved in
    docs/bench_results/shards.json): one row per size x ranks, ratios, verdicts and bounds; then the profile."""
    a = raw["args"]
    cmd, cores, load0, load1, runtime = a["cmd"], a["cores"], *raw["loadavg"], raw["runtime_s"]
    args = argparse.Namespace(shard_repeat=a["repeat"], shard_warmup=a["warmup"])
    runs = {(r["mib"], r["ranks"], r["writer"]): r["rounds"] for r in raw["runs"]}
    sizes, worlds = sorted({k[0] for k in runs}), sorted({k[1] for k in runs})
    disk = {int(m): v for m, v in raw["disk"].items()}
    profile = {(w, lb): p for w, lb, p in raw["profile"]}
    top_save, top_load = raw["top_save"], raw["top_load"]
    med = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "resident_after_drop"} for key, rs in runs.items()}
    disk_w = {m: statistics.median(d[0] for d in disk[m]) for m in sizes}
    disk_r = {m: statistics.median(d[1] for d in disk[m]) for m in sizes}
    fixed: dict[tuple[int, str, str], float] = {}
    for world in worlds:
        for label in SHARD_WRITERS:
            for op in ("save", "load"):
                xs = [m * MIB * world for m in sizes]
                ys = [med[(m, world, label)][f"{op}_s"] for m in sizes]
                fixed[(world, label, op)] = fit_mbps(xs, ys)[1] if len(sizes) > 1 else 0.0
    rows, verdicts = [], []
    for mib in sizes:
        for world in worlds:
            size = world * mib * MIB
            cells = {}
            for label in SHARD_WRITERS:
                rs, m = runs[(mib, world, label)], med[(mib, world, label)]
                cells[label] = m
                for op in ("save", "load"):
                    rate = disk_w[mib] if op == "save" else disk_r[mib]
                    m[f"{op}_bound"] = shard_bound(op, m[f"{op}_s"], m[f"{op}_cpu_s"], m["stored"], rate,
                                                   fixed[(world, label, op)], cores, m[f"{op}_busy"])
                rows.append([f"{mib} MiB", world, label, shard_threads(world), spread([r["save_s"] for r in rs]),
                             f"{m['save_cpu_s'] / (size / GB):.2f}", m["save_bound"], spread([r["load_s"] for r in rs]),
                             f"{m['load_cpu_s'] / (size / GB):.2f}", m["load_bound"], f"{m['stored'] / size:.3f}"])
            o, st = cells[SHARD_OURS], cells[SHARD_STOCK]
            sv, lv = st["save_s"] / o["save_s"], st["load_s"] / o["load_s"]
            times = {op: ([r[f"{op}_s"] for r in runs[(mib, world, SHARD_OURS)]],
                          [r[f"{op}_s"] for r in runs[(mib, world, SHARD_STOCK)]]) for op in ("save", "load")}
            sep = {op: f"{paired(*times[op])}; {separated(*times[op])}" for op in times}
            miss = [f"{op}: {o[f'{op}_bound']}; stock's: {st[f'{op}_bound']}" for op, v in (("save", sv), ("load", lv))
                    if v < 1.0]
            verdicts.append([f"{mib} MiB", world, f"{sv:.2f}x ({sep['save']})", f"{lv:.2f}x ({sep['load']})",
                             "met" if sv >= 1.0 and lv >= 1.0 else "missed — ours bound by " + "; ".join(miss)])
    table = md_table(["per process", "ranks", "writer", "threads per rank", "save s, median (min–max)",
                      "save CPU core-s per GB", "save bound (shares of its time)", "cold load s, median (min–max)",
                      "load CPU core-s per GB", "load bound (shares of its time)", "stored/raw"], rows)
    vtable = md_table(["per process", "ranks", "save: stock ÷ ours", "cold load: stock ÷ ours",
                       "verdict (save ≥ 1.0x and cold load ≥ 1.0x)"], verdicts)
    drows = [[f"{m} MiB", spread([d[0] for d in disk[m]], ".0f"), spread([d[1] for d in disk[m]], ".0f")] for m in sizes]
    dtable = md_table(["size", "disk write + fsync MB/s, median (min–max)", "cold read MB/s, median (min–max)"], drows)
    ftable = md_table(["ranks", "writer", "save fixed ms", "load fixed ms"],
                      [[w, lb, f"{fixed[(w, lb, 'save')] * 1e3:.0f}", f"{fixed[(w, lb, 'load')] * 1e3:.0f}"]
                       for w in worlds for lb in SHARD_WRITERS])
    ptable, fixed_top = profile_table(profile)
    profile_runs = len(next(iter(profile.values()))["save"]) if profile else 0
    met = sum(v[-1] == "met" for v in verdicts)
    unsettled = sum(c.endswith("ranges overlap)") for v in verdicts for c in v[2:4])
    busy = statistics.median(r[f"{op}_busy"] for rs in runs.values() for r in rs for op in ("save", "load"))
    reading_ = (f"Rows meeting the bar: {met} of {len(verdicts)}. The machine was {busy:.2f} busy (median over all calls, all "
                f"processes), and in {unsettled} of the {2 * len(verdicts)} comparisons the rounds' ranges overlap: "
                + ("these verdicts are those of a noisy shared machine, not of the quiet side-by-side run the bar asks for; "
                   "the paired counts say which differences held round after round." if unsettled else
                   "every comparison is separated round by round."))
    resid = [r["resident_after_drop"] for rs in runs.values() for r in rs]
    resid_note = ("`fincore` was not available, so what stayed resident is unknown" if None in resid else
                  f"`fincore` found at most {max(resid) / 1e6:.2f} MB of a checkpoint still resident after it")
    top = "\n".join(f"- save: `{f}` {n} calls, {ms} ms" for f, n, ms in top_save[:6]) + "\n" + \
          "\n".join(f"- load: `{f}` {n} calls, {ms} ms" for f, n, ms in top_load[:6])
    warm_note = (" and makes an untimed save and load of an 8-element state with the same writer (imports, thread pools, "
                 "the first collectives: costs a training job pays once, not per checkpoint)" if args.shard_warmup else
                 " (no warm-up: first-call costs such as lazy imports and thread pools are in the time)")
    body = f"""## Per-process shards: 16–256 MiB per process, 1 process and 2 gloo ranks

`{cmd}` — {raw["machine"]}. Runtime {runtime / 60:.1f} min. Load average {load0[0]:.1f} before the benchmark's own
processes started ({"other work was running, so times are noisy" if load0[0] >= 0.5 else "no other work to speak of"}),
{load1[0]:.1f} at the end (its own processes included); the rounds are interleaved so that both writers meet the same noise.

Each row saves, then loads, one real state: the MiniLM fp32 weights with *every* key kept, each tensor cut to the same
fraction of its leading rows (repeated whole under new keys above 91 MB), so a row holds the {len(every_key_state(minilm_weights(), sizes[0] * MIB))}+
tensors of a model shard like an FSDP rank does. With several ranks the state is ranks x the size, every tensor a
`DTensor` sharded `Shard(0)` on a 1-D CPU mesh (gloo over a TCP store on 127.0.0.1, spawned processes), so each
rank saves and loads its own shard of the per-process size. Writers: `CompressedWriter(codec="zstd:1", threads=T)`
/ `CompressedReader(threads=T)` against stock `FileSystemWriter(thread_count=T)` / `FileSystemReader` (which has no
thread option in this torch: it reads on the calling thread), with the *same* T = {cores} cores ÷ ranks for both;
both fsync their data files (stock's default `sync_files=True`). Every save and every load runs in fresh processes
(forked from a forkserver that imported torch once); a process first builds its shard (loads: zero-filled
destinations){warm_note}, then the time runs from a barrier before `dcp.save`/`dcp.load` (constructing the writer/reader
included: `CompressedReader` reads `.metadata` there) to a barrier after it, so it is the slowest rank's. Every load
compares every tensor with what was saved (all equal). Cold loads: after the save, each checkpoint file is fsynced
and evicted with `posix_fadvise(POSIX_FADV_DONTNEED)` (no root needed, and it leaves other work's cache alone);
{resid_note}. The disk is a virtual disk, so its host may still cache blocks that this guest evicted.
{args.shard_repeat} rounds; each round runs every row, ours first in odd rounds and stock first in even ones.
CPU core-s per GB = user + system CPU of all ranks' processes during the call, per GB of raw state (all ranks).

Ratios are **stock time ÷ our time, so above 1 means ours is faster**; the bar is save ≥ 1.0x and cold load ≥ 1.0x,
judged on the ratio of the medians. "paired" is the median of the per-round ratios (both writers ran back to back in
each round, so a slow moment of the machine hits both), with the rounds ours won; "ranges overlap" means the slowest
and fastest of the {args.shard_repeat} rounds do not separate the writers.

{vtable}

{reading_}

{table}

The bound of a row is the largest of three shares of its median time: the disk (its stored bytes at the disk rate
measured at that size in the same rounds: write + fsync of one file for saves, cold read for loads), the CPU
(core-seconds ÷ (time x {cores} cores)) and the fixed per-call cost (the intercept of a least-squares line of the
row's time against its size, over the sizes); where none reaches 0.8 while the whole machine was at least 0.9 busy
(all processes, from `/proc/stat` across rank 0's call, median of the rounds), the bound named is the CPU that other
work held; where the disk share is above 1 (the row wrote or read faster than the disk's reference run in the same
rounds, so the disk's rate varied) no bound is named. A missed row names stock's bound beside ours. Shares overlap
(fixed costs spend CPU too), so read them as a ranking.

{dtable}

Fixed cost per call (intercept of time against bytes over {", ".join(f"{m}" for m in sizes)} MiB):

{ftable}

### Where the time of one {sizes[0]} MiB save and load goes

Median of {profile_runs} fresh-process runs per writer and rank count (interleaved), ms, on rank 0 (the coordinator); each DCP
call into the storage writer/reader and the planner timed on its own (futures waited for), `fsync` = all
`os.fsync`/`os.fdatasync` calls inside them, "DCP glue" = the rest of `dcp.save`/`dcp.load` (with several ranks:
its collectives and the wait for the other rank).

{ptable}

{fixed_top}

Most own time in one `cProfile`d run of ours ({sizes[0]} MiB; cProfile slows Python code, so these are a ranking):

{top}
"""
    write_section("shards", body)
    data = {**raw, "runs": [{**r, "median": med[(r["mib"], r["ranks"], r["writer"])]} for r in raw["runs"]],
            "fixed_s": [[w, lb, op, v] for (w, lb, op), v in fixed.items()]}
    save_results("shards", data, machine=raw["machine"])
    print(vtable, "\n\n", table, "\n\n", dtable, "\n\n", ftable, "\n\n", ptable, sep="")
    print(f"total {runtime:.0f} s")
    return data


def profile_table(profile: dict) -> tuple[str, str]:
    """Median ms per phase of save and load, ours beside stock for each rank count, and a sentence naming our
    largest phases."""
    cols = sorted(profile)  # (ranks, writer)
    rows, ours = [], []
    for op in ("save", "load"):
        names = sorted({n for c in cols for r in profile[c][op] for n in r["ms"]} - {"fsync calls"})
        total = {c: statistics.median(r["s"] * 1e3 for r in profile[c][op]) for c in cols}
        meds = {c: {n: statistics.median(r["ms"].get(n, 0.0) for r in profile[c][op]) for n in names} for c in cols}
        calls = {c: statistics.median(r["ms"].get("fsync calls", 0) for r in profile[c][op]) for c in cols}
        for n in names:
            label = n if n != "fsync" else "fsync (inside the above; calls: " + ", ".join(f"{calls[c]:.0f}" for c in cols) + ")"
            rows.append([op, label] + [f"{meds[c][n]:.1f}" for c in cols])
        glue = {c: total[c] - sum(v for n, v in meds[c].items() if n != "fsync") for c in cols}
        rows.append([op, "DCP glue (the rest)"] + [f"{glue[c]:.1f}" for c in cols])
        rows.append([op, "**total** (barrier to barrier)"] + [f"{total[c]:.1f}" for c in cols])
        for c in cols:
            if c[1] == SHARD_OURS:  # write_data / read_data carry the bytes; the rest is fixed per call
                ours += [(f"{op} {n} ({c[0]} rank{'s' if c[0] > 1 else ''})", meds[c][n]) for n in names
                         if n not in ("storage.write_data", "storage.read_data")]
                ours.append((f"{op} DCP glue ({c[0]} rank{'s' if c[0] > 1 else ''})", glue[c]))
    top = sorted(ours, key=lambda x: -x[1])[:8]
    heads = [f"{'ours' if lb == SHARD_OURS else 'stock'} ms, {w} rank{'s' if w > 1 else ''}" for w, lb in cols]
    return (md_table(["op", "phase"] + heads, rows),
            "Our largest fixed costs at this size (every phase but `write_data`/`read_data`, which carry the bytes; "
            "fsync is inside `write_data` and `finish`): " + ", ".join(f"{n} {v:.0f} ms" for n, v in top) + ".")


if __name__ == "__main__":
    main()
