"""Where we stand against the targets: one table read from the other benchmarks' raw results.

Run:  .venv/bin/python -m benchmarks.bench_summary   (after the others; scripts/bench.sh runs it last)

Writes the section "summary" of docs/benchmarks.md from docs/bench_results/*.json, so every
figure in it is one measured by a benchmark section below it; a benchmark that has not run
is reported as such.  Measures nothing itself.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.bench_shards import SHARD_OURS, SHARD_STOCK
from benchmarks.common import load_results, md_table, write_section

OURS = "CompressedWriter (defaults)"
STOCK = "stock FileSystemWriter, 2 threads"
STOCK_ZSTD = "stock + DCP zstd extension, 2 threads"


def verdict(value: float, target: float, higher_is_better: bool = True) -> str:
    """``met`` or ``missed by N%`` of the target."""
    ok = value >= target if higher_is_better else value <= target
    if ok:
        return "met"
    if not higher_is_better and value > 2 * target:
        return f"**missed: {value / target:.1f}x the target**"
    short = (target - value) / target if higher_is_better else (value - target) / target
    return f"**missed by {short * 100:.0f}%**" if short >= 0.005 else f"**missed by {short * 100:.2f}%**"


def codec_rows(codecs: dict | None) -> list[list[str]]:
    if codecs is None:
        return [["ratio no worse than zipnn's", "—", "not run (`bench_codecs`)", ""]]
    rows = []
    for a in codecs["data"]["ratio_to_anchor"]:
        rows.append([f"stored/raw ≤ zipnn's: {a['data']}", f"{a['ours']:.4f} vs {a['zipnn']:.4f}",
                     f"{a['vs_zipnn']:.4f}", verdict(a["vs_zipnn"], 1.0, higher_is_better=False)])
    return rows


def lz4_rows(codecs: dict | None) -> list[list[str]]:
    """lz4's encode speed against zstd:1's, both ours on 2 threads, per data set."""
    if codecs is None:
        return []
    cells = {(c["data"], c["codec"]): c for c in codecs["data"]["cells"] if c["kind"] == "ours" and c["threads"] == 2}
    rows = []
    for data in sorted({d for d, _c in cells}):
        lz4, zstd = cells.get((data, "lz4")), cells.get((data, "zstd:1"))
        if lz4 and zstd:
            x = lz4["compress_mbs"] / zstd["compress_mbs"]
            rows.append([f"lz4 encode ≥ 1.5x zstd:1 (2 threads): {data}",
                         f"{lz4['compress_mbs']:.0f} vs {zstd['compress_mbs']:.0f} MB/s", f"{x:.2f}x", verdict(x, 1.5)])
    return rows


def records_rows(records: dict | None) -> list[list[str]]:
    """``.metadata`` bytes per tensor, ours against stock's."""
    if records is None:
        return [[".metadata bytes per tensor ≤ stock's", "—", "not run (`bench_records`)", ""]]
    rows = []
    for s in records["data"]["sizes"]:
        ours, stock = s["ours, format 3"], s["stock FileSystemWriter"]
        rows.append([f".metadata bytes per tensor ≤ stock's: {s['data']}", f"{ours:.1f} vs {stock:.1f}",
                     f"{ours / stock:.2f}", verdict(ours / stock, 1.0, higher_is_better=False)])
    return rows


def _codec_mbs(codecs: dict | None, what: str) -> float | None:
    """Our default codec's 2-thread ``compress``/``decompress`` MB/s on real weights and Adam state (harmonic mean)."""
    if codecs is None:
        return None
    speeds = [c[f"{what}_mbs"] for c in codecs["data"]["cells"]
              if c["kind"] == "ours" and c["codec"] == "zstd:1" and c["threads"] > 1
              and c["data"] in ("MiniLM fp32", "Adam state")]
    return statistics.harmonic_mean(speeds) if speeds else None


def _bound(total_s: float, parts: dict[str, float]) -> str:
    """Name the largest share of ``total_s``: the parts given, and the rest as fixed per-call costs."""
    parts = {**parts, "fixed costs (planning, metadata, copies)": max(0.0, total_s - sum(parts.values()))}
    return ("bound: " + max(parts, key=parts.get) + " — "
            + ", ".join(f"{k.split(' (')[0]} {v:.2f} s" for k, v in parts.items()) + f" of {total_s:.2f} s")


def storage_rows(storage: dict | None, codecs: dict | None) -> list[list[str]]:
    if storage is None:
        return [["save/load against stock", "—", "not run (`bench_storage`)", ""]]
    comp, decomp = _codec_mbs(codecs, "compress"), _codec_mbs(codecs, "decompress")
    rows = []
    for s in storage["data"]["sets"]:
        w = s["writers"]
        if OURS not in w or STOCK not in w:
            continue
        ours, stock, zstd = w[OURS], w[STOCK], w.get(STOCK_ZSTD)
        raw = s["raw"]
        disk_w = s["disk_write_mbps"] * 1e6
        cpu = {"CPU (compression, 2 threads)": raw / (comp * 1e6)} if comp else {}
        bound = _bound(ours["save_s"], {**cpu, "disk (writing the stored bytes)": ours["stored"] / disk_w})
        dcpu = {"CPU (decompression, 2 threads)": raw / (decomp * 1e6)} if decomp else {}
        load_bound = _bound(ours["load_cold_s"], {**dcpu, "disk (reading the stored bytes)": ours["stored"] / (s["disk_read_mbps"] * 1e6)})
        x = stock["save_s"] / ours["save_s"]
        rows.append([f"save ≥ stock `FileSystemWriter` (2 threads): {s['name']}", f"{raw / ours['save_s'] / 1e6:.0f} vs "
                     f"{raw / stock['save_s'] / 1e6:.0f} MB/s", f"{x:.2f}x", verdict(x, 1.0) + ("" if x >= 1 else f"; {bound}")])
        if zstd:
            xz = zstd["save_s"] / ours["save_s"]
            rows.append([f"save ≥ 2x stock + DCP zstd: {s['name']}", f"{raw / ours['save_s'] / 1e6:.0f} vs "
                         f"{raw / zstd['save_s'] / 1e6:.0f} MB/s", f"{xz:.2f}x", verdict(xz, 2.0) + ("" if xz >= 2 else f"; {bound}")])
        if zstd and "save_cpu_s" in ours:
            gb = raw / 1e9
            ours_cpu, zstd_cpu = ours["save_cpu_s"] / gb, zstd["save_cpu_s"] / gb
            rows.append([f"CPU core-seconds per GB saved ≤ stock + DCP zstd's: {s['name']}",
                         f"{ours_cpu:.2f} vs {zstd_cpu:.2f} core-s/GB", f"{ours_cpu / zstd_cpu:.2f}",
                         verdict(ours_cpu / zstd_cpu, 1.0, higher_is_better=False)])
        xl = stock["load_cold_s"] / ours["load_cold_s"]
        want = 1.5 if raw >= 0.5e9 else 1.0  # issue 15: 1.5x stock on 0.5 GB and more
        rows.append([f"load ≥ {want:g}x stock (cold cache): {s['name']}", f"{raw / ours['load_cold_s'] / 1e6:.0f} vs "
                     f"{raw / stock['load_cold_s'] / 1e6:.0f} MB/s", f"{xl:.2f}x",
                     verdict(xl, want) + ("" if xl >= want else f"; {load_bound}")])
        rows.append([f"save within 10% of disk write bandwidth on stored bytes: {s['name']}",
                     f"{ours['stored'] / ours['save_s'] / 1e6:.0f} vs {s['disk_write_mbps']:.0f} MB/s",
                     f"{ours['disk_frac_save']:.2f}", verdict(ours["disk_frac_save"], 0.9) + ("" if ours["disk_frac_save"] >= 0.9 else f"; {bound}")])
        rows.append([f"load within 10% of disk read bandwidth on stored bytes: {s['name']}",
                     f"{ours['stored'] / ours['load_cold_s'] / 1e6:.0f} vs {s['disk_read_mbps']:.0f} MB/s",
                     f"{ours['disk_frac_load']:.2f}", verdict(ours["disk_frac_load"], 0.9)
                     + ("" if ours["disk_frac_load"] >= 0.9 else f"; {load_bound}")])
    return rows


def scaling_rows(scaling: dict | None) -> list[list[str]]:
    """The same save comparison from the scaling run (one save per size, minutes after the storage section)."""
    if scaling is None:
        return []
    rows = []
    for point in scaling["data"]:
        if OURS in point and STOCK in point:
            ours, stock = point[OURS]["save_s"], point[STOCK]["save_s"]
            x = stock / ours
            rows.append([f"save ≥ stock `FileSystemWriter` (2 threads), scaling run: {point['raw'] / 1e9:.2f} GB",
                         f"{ours:.2f} vs {stock:.2f} s", f"{x:.2f}x", verdict(x, 1.0)])
    return rows


def shard_rows(shards: dict | None) -> list[list[str]]:
    """Save and cold load against stock at the per-process shard sizes (bench_shards), bar 1.0x;
    a missed row carries the bound that run named for ours."""
    if shards is None:
        return [["shard sizes", "—", "not run (`bench_shards`)", ""]]
    med = {(run["mib"], run["ranks"], run["writer"]): run["median"] for run in shards["data"]["runs"]}
    rows = []
    for mib, ranks in sorted({(m, r) for m, r, _ in med}):
        ours, stock = med.get((mib, ranks, SHARD_OURS)), med.get((mib, ranks, SHARD_STOCK))
        if ours is None or stock is None:
            continue
        for op, what in (("save", "save ≥ stock `FileSystemWriter`"), ("load", "cold load ≥ stock `FileSystemReader`")):
            x = stock[f"{op}_s"] / ours[f"{op}_s"]
            rows.append([f"{what} (same threads), shard of {mib} MiB per process, {ranks} rank{'s' if ranks > 1 else ''}",
                         f"{ours[f'{op}_s']:.3f} vs {stock[f'{op}_s']:.3f} s", f"{x:.2f}x",
                         verdict(x, 1.0) + ("" if x >= 1.0 else f"; bound: {ours[f'{op}_bound']}")])
    return rows


def s3_rows(s3: dict | None) -> list[list[str]]:
    if s3 is None:
        return [["S3 bytes", "—", "not run (`bench_s3`)", ""]]
    by = {r["writer"]: r for r in s3["data"]}
    ours = next((r for w, r in by.items() if w.startswith("CompressedWriter (defaults")), None)
    stock = next((r for w, r in by.items() if w.startswith("stock FsspecWriter")), None)
    if not ours or not stock:
        return []
    up = ours["save_traffic"]["up"] / stock["save_traffic"]["up"]
    return [["S3 (moto): bytes uploaded vs stock `FsspecWriter`",
             f"{ours['save_traffic']['up'] / 1e6:.0f} vs {stock['save_traffic']['up'] / 1e6:.0f} MB", f"{up:.3f}",
             "(no target)"],
            ["S3 (moto): save time vs stock `FsspecWriter`", f"{ours['save_s']:.2f} vs {stock['save_s']:.2f} s",
             f"{stock['save_s'] / ours['save_s']:.2f}x", "(no target)"]]


def async_rows(asy: dict | None) -> list[list[str]]:
    if asy is None:
        return [["async blocked time", "—", "not run (`bench_async`)", ""]]
    rows = []
    for size in asy["data"]:
        by = {r["mode"]: r for r in size["rows"]}
        copy = next((r["blocked_s"] for m, r in by.items() if m.startswith("memory copy: copy_")), None)
        for mode in ("TieredCheckpointer(async_save=True).maybe_save", "dcp.async_save, CompressedWriter, reused stager"):
            if mode in by and copy:
                x = by[mode]["blocked_s"] / copy
                rows.append([f"blocked < 2x one memory copy: `{mode}`, {size['mib']} MiB",
                             f"{by[mode]['blocked_s'] * 1000:.0f} vs {copy * 1000:.0f} ms", f"{x:.2f}x", verdict(x, 2.0, False)])
    return rows


def goodput_rows(good: dict | None, mtbf_model_s: float = 3600.0) -> list[list[str]]:
    if good is None:
        return [["goodput under failures", "—", "not run (`bench_goodput`)", ""]]
    d = good["data"]
    rows = []
    for name, c in d["configs"].items():
        f, free = c["failures"], c["free"]
        rows.append([f"goodput > 95% at MTBF {d['mtbf_s']:g} s (measured): {name} ({c['description']})",
                     f"{f['goodput'] * 100:.1f}% ({f['failures']} failures, {f['steps_lost']} steps recomputed)",
                     f"{f['goodput']:.3f}", verdict(f["goodput"], 0.95)])
        # the same measured costs at a realistic failure rate: each failure costs a restart plus the
        # recomputed steps, and every step pays the failure-free per-step overhead
        per_failure = (f["restart_s"] + f["steps_lost"] * d["step_s"] + f["lost_at_kill_s"]) / max(1, f["failures"])
        modelled = (1 - per_failure / mtbf_model_s) / (1 + free["overhead"])
        rows.append([f"goodput > 95% modelled at MTBF {mtbf_model_s / 3600:g} h from the measured costs: {name}",
                     f"{modelled * 100:.1f}% ({per_failure:.1f} s lost per failure, +{free['overhead'] * 100:.1f}% per step)",
                     f"{modelled:.3f}", verdict(modelled, 0.95)])
        rows.append([f"time blocked in saves < 2% of training time (failure-free): {name}",
                     f"{free['blocked_pct']:.1f}% of compute", f"{free['blocked_pct'] / 100:.3f}",
                     verdict(free["blocked_pct"] / 100, 0.02, False)])
        rows.append([f"all checkpoint overhead < 2% (blocked + slower steps from background work, failure-free): {name}",
                     f"+{free['overhead'] * 100:.1f}% per step vs no checkpoints", f"{free['overhead']:.3f}",
                     verdict(free["overhead"], 0.02, False)])
    return rows


def gpu_rows(gpu: dict | None) -> list[list[str]]:
    """Blocked time of async saves of CUDA state against one device-to-pinned copy (``bench_gpu``), or one
    row saying it has not run on a GPU."""
    if not gpu:
        return [["blocked < 2x one memory copy, CUDA state (`bench_gpu`)", "not run: no GPU machine yet", "-",
                 "not run"]]
    rows = []
    for r in gpu["data"]:
        copy = r["copy"]["wall_s"]
        for key in ("tiered_async", "async_ours"):
            ratio = r[key]["blocked_s"] / copy
            rows.append([f"blocked < 2x one memory copy, CUDA state: {key}, {r['mib']} MiB",
                         f"{r[key]['blocked_s'] * 1e3:.0f} vs {copy * 1e3:.0f} ms", f"{ratio:.2f}x",
                         verdict(ratio, 2.0, False)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="accepted for scripts/bench.sh; the same as without")
    ap.parse_args()
    codecs, storage, shards = load_results("codecs"), load_results("storage"), load_results("shards")
    rows = (codec_rows(codecs) + lz4_rows(codecs) + records_rows(load_results("records"))
            + storage_rows(storage, codecs) + scaling_rows(load_results("scaling")) + shard_rows(shards)
            + s3_rows(load_results("s3"))
            + async_rows(load_results("async")) + gpu_rows(load_results("gpu")) + goodput_rows(load_results("goodput")))
    machines = sorted({r["machine"] for r in (codecs, storage, shards) if r})
    body = (
        "## Where we stand against the targets\n\n"
        "`.venv/bin/python -m benchmarks.bench_summary` — read from the raw results of the sections below "
        f"({'; '.join(machines) or 'no results yet'}).\n\n"
        "Ratio to anchor: ours ÷ anchor for stored/raw (lower is better, target ≤ 1), anchor's time ÷ ours for "
        "speed (higher is better). Each missed row names what bounds it, from the same run's numbers: for the "
        "storage rows, the call's time split serially into compression or decompression at the codec table's "
        "2-thread speed, disk time of the stored bytes at the limits table's bandwidth, and the rest (fixed costs per "
        "call); for the shard rows, the phase shares the shard section measures (they overlap, so they need not add "
        "up to 1). Compression and the writes share the machine's cores, so every core more per rank shortens the "
        "compression share (see the projection). The CUDA rows come from `bench_gpu` on a machine with a GPU. "
        "The goodput rows model a realistic failure rate from "
        "the measured per-failure cost and per-step overhead, as `G = (1 - lost per failure / MTBF) / (1 + overhead)`; "
        "they are labelled as modelled. The same save comparison is listed twice, from the storage section "
        "(median of repeats) and from the scaling run minutes later (one save each): where they disagree, this "
        "virtual disk's drift is larger than the difference between the writers.\n\n"
        + md_table(["target", "measured (ours vs anchor)", "ratio to anchor", "verdict"], rows)
    )
    write_section("summary", body)
    print(body)


if __name__ == "__main__":
    main()
