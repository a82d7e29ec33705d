"""Whole-checkpoint save and load on local disk: CompressedWriter against stock DCP, with peak memory.

Run:  .venv/bin/python -m benchmarks.bench_storage [--sizes-gb 0.5,2] [--scaling-gb 0.25,0.5,1,2]
      [--repeat 3] [--repeat-large 1] [--small | --no-small] [--dir DIR] [--quick]

Writes the sections "storage", "limits" and "scaling" of docs/benchmarks.md and the results
"storage" and "scaling".  The state dicts are model + optimizer state built from real MiniLM
fp32 weights and their Adam moments, repeated under distinct key names up to the target size,
plus (``--small``) the real MiniLM weights alone in fp32 and bf16.  Every save and every load
runs in a fresh process (benchmarks/isolate.py) that reports its peak RSS above the state dict.
The per-process shard rows (16-256 MiB per process on 1 and 2 gloo ranks) are benchmarks/bench_shards.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.common import (
    adam_state,
    chart_or_note,
    dir_bytes,
    drop_page_cache,
    fresh_dir,
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
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    main()
