"""Codecs on the same bytes: every codec and zstd level of dcp_tiered against zipnn, plain zstd and lz4.

Run:  .venv/bin/python -m benchmarks.bench_codecs [--random-mib 512] [--repeat 3] [--slow-mib 64]
Smoke run:  .venv/bin/python -m benchmarks.bench_codecs --quick
Before/after on a busy machine (prints only, writes nothing; fastest of --repeat rounds):
      .venv/bin/python -m benchmarks.bench_codecs --compare lz4,zstd:1,zstd:3 --threads 1 --repeat 5 --max-mib 64

Data: real MiniLM weights (fp32 and bf16), Adam moments after real steps on them, and
random-normal fp32.  Each data set is flattened into one buffer and cut into 4 MiB frames
as CompressedWriter cuts tensors.  Our codecs go through dcp_tiered.codecs.FrameCodec with
the byte-group filter the writer picks (filter_for); anchors are zipnn with its defaults,
plain zstd 1 and 3 and plain lz4.frame on the same frames without byte grouping.  Every
decode is checked bit-exact.  Writes the section "codecs" of docs/benchmarks.md and
bench_results/codecs.json.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import lz4.frame
import numpy as np
import torch
import zstandard

from benchmarks.common import (
    adam_state,
    chart_or_note,
    machine_line,
    md_table,
    minilm_weights,
    random_normal,
    save_results,
    timed,
    write_section,
)
from dcp_tiered.codecs import DEFAULT_FRAME_SIZE, FrameCodec, filter_for, frame_bounds

FRAME = DEFAULT_FRAME_SIZE  # what CompressedWriter uses
OUR_SPECS = ("none", "lz4", "zstd:1", "zstd:3", "zstd:6", "zstd:9", "zstd:15", "zstd:19")
OUR_DEFAULT = "zstd:1"
SINGLE_RUN_LEVEL = 6  # zstd levels from here on are measured once (they take seconds per cell)
CAPPED_LEVEL = 15  # zstd levels from here on are measured on a sample of --slow-mib


@dataclass
class Cell:
    """One measured (data set, codec) cell; MB/s are of raw bytes."""

    data: str
    codec: str
    kind: str  # "ours" or "anchor"
    threads: int
    measured_bytes: int
    ratio: float
    ratio_vs_default: float  # ratio / our zstd:1 ratio on the same bytes
    compress_mbs: float
    decompress_mbs: float
    repeats: int


def datasets(random_mib: int) -> dict[str, dict[str, torch.Tensor]]:
    """The data sets, as state dicts of one dtype each."""
    w = minilm_weights()
    return {
        "MiniLM fp32": w,
        "MiniLM bf16": {k: v.bfloat16() for k, v in w.items()},
        "Adam state": adam_state(w),
        f"random-normal fp32 {random_mib} MiB": random_normal(random_mib << 20),
    }


def flat_bytes(sd: dict[str, torch.Tensor]) -> tuple[np.ndarray, torch.dtype]:
    """All tensors of ``sd`` concatenated into one uint8 buffer, and their dtype."""
    dtype = next(iter(sd.values())).dtype
    flat = torch.cat([t.reshape(-1) for t in sd.values()])
    return flat.view(torch.uint8).numpy().copy(), dtype


def sample_frames(raw: np.ndarray, max_bytes: int, itemsize: int) -> np.ndarray:
    """``raw`` itself if it fits in ``max_bytes``, else evenly spaced whole frames totalling at most that.

    Spreading the sample over the buffer keeps every kind of tensor in it (the first bytes of
    MiniLM are all word embeddings)."""
    bounds = frame_bounds(raw.nbytes, FRAME, itemsize)
    keep = max(1, max_bytes // FRAME)
    if max_bytes <= 0 or len(bounds) <= keep:
        return raw
    picks = np.linspace(0, len(bounds) - 1, keep).round().astype(int)
    return np.concatenate([raw[bounds[i][0] : bounds[i][1]] for i in picks])


def touched_like(raw: np.ndarray) -> np.ndarray:
    """A destination buffer whose pages are already touched, like a loaded-into tensor."""
    return np.zeros_like(raw)


Round = Callable[[ThreadPoolExecutor, np.ndarray, np.ndarray], tuple[float, float, int]]


def ours(codec: str, dtype: torch.dtype) -> Round:
    """One compress + decompress round through FrameCodec, frames in parallel as the writer and reader do."""
    itemsize = dtype.itemsize
    # the writer's own choice: byte grouping for floats, none when nothing is compressed
    fc = FrameCodec(codec, filter_for(dtype.is_floating_point, itemsize, codec != "none"), itemsize)

    def run(pool: ThreadPoolExecutor, raw: np.ndarray, out: np.ndarray) -> tuple[float, float, int]:
        bounds = frame_bounds(raw.nbytes, FRAME, itemsize)
        enc: list = []
        tc = timed(lambda: enc.extend(pool.map(lambda b: fc.encode(raw[b[0] : b[1]]), bounds)))
        # what a reader gets back from storage: each frame as one contiguous buffer
        stored = [b"".join(bytes(memoryview(p).cast("B")) for p in e.pieces) for e in enc]
        td = timed(lambda: list(pool.map(lambda i: fc.decode(stored[i], out[bounds[i][0] : bounds[i][1]]), range(len(bounds)))))
        return tc, td, sum(map(len, stored))

    return run


def plain(compress: Callable[[object], bytes], decompress: Callable[[bytes], bytes]) -> Round:
    """One round of a plain block codec on the same 4 MiB frames, no byte grouping."""

    def run(pool: ThreadPoolExecutor, raw: np.ndarray, out: np.ndarray) -> tuple[float, float, int]:
        bounds = frame_bounds(raw.nbytes, FRAME, 1)
        comp: list[bytes] = []
        tc = timed(lambda: comp.extend(pool.map(lambda b: compress(raw[b[0] : b[1]]), bounds)))

        def dec(i: int) -> None:
            s, e = bounds[i]
            out[s:e] = np.frombuffer(decompress(comp[i]), dtype=np.uint8)

        td = timed(lambda: list(pool.map(dec, range(len(bounds)))))
        return tc, td, sum(map(len, comp))

    return run


def plain_zstd(level: int) -> Round:
    local = threading.local()  # zstandard (de)compressor objects must not be shared between threads

    def compress(b: object) -> bytes:
        if not hasattr(local, "c"):
            local.c = zstandard.ZstdCompressor(level=level)
        return local.c.compress(b)

    def decompress(b: bytes) -> bytes:
        if not hasattr(local, "d"):
            local.d = zstandard.ZstdDecompressor()
        return local.d.decompress(b)

    return plain(compress, decompress)


def plain_lz4() -> Round:
    return plain(lambda b: lz4.frame.compress(b), lz4.frame.decompress)


def zipnn_round(dtype: torch.dtype, threads: int) -> Round | None:
    """zipnn on the whole buffer with its defaults (its own chunking), or None if not installed."""
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
    if name is None:
        return None
    z = ZipNN(input_format="byte", bytearray_dtype=name, threads=threads)

    def run(pool: ThreadPoolExecutor, raw: np.ndarray, out: np.ndarray) -> tuple[float, float, int]:
        copy = bytearray(raw.tobytes())  # zipnn modifies its input in place
        comp: list[bytes] = []
        tc = timed(lambda: comp.append(z.compress(copy)))
        td = timed(lambda: out.__setitem__(slice(None), np.frombuffer(z.decompress(comp[0]), dtype=np.uint8)))
        return tc, td, len(comp[0])

    return run


def measure(rnd: Round, raw: np.ndarray, out: np.ndarray, threads: int, repeats: int,
            stat: Callable[[list[float]], float] = statistics.median) -> tuple[float, float, float]:
    """Median (or ``stat``) compress and decompress time over ``repeats`` rounds, each verified bit-exact;
    returns (ratio, c MB/s, d MB/s)."""
    tcs, tds, stored = [], [], 0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            out.fill(0)  # a failed decode must not pass on bytes left from the previous cell
            tc, td, stored = rnd(pool, raw, out)
            assert np.array_equal(out, raw), "decode does not round-trip bit-exactly"
            tcs.append(tc)
            tds.append(td)
    return stored / raw.nbytes, raw.nbytes / stat(tcs) / 1e6, raw.nbytes / stat(tds) / 1e6


def compare(specs: list[str], sets: dict[str, dict[str, torch.Tensor]], threads: int, repeat: int, max_bytes: int) -> None:
    """Print ratio and the fastest of ``repeat`` rounds for our ``specs`` and zipnn on every data set.

    The minimum is the least disturbed round on a shared machine; nothing is written."""
    rows = []
    for name, sd in sets.items():
        raw, dtype = flat_bytes(sd)
        raw = sample_frames(raw, max_bytes, dtype.itemsize)
        out = touched_like(raw)
        for label, rnd in [(s, ours(s, dtype)) for s in specs] + [("zipnn (anchor)", zipnn_round(dtype, threads))]:
            if rnd is not None:
                ratio, c, d = measure(rnd, raw, out, threads, repeat, stat=min)
                rows.append([name, label, f"{raw.nbytes >> 20}", f"{ratio:.4f}", f"{c:.0f}", f"{d:.0f}"])
                print(" | ".join(rows[-1]), flush=True)
    print(md_table(["data", "codec", "MiB", "stored/raw", "compress MB/s", "decompress MB/s"], rows))


def cases(dtype: torch.dtype, threads: int) -> list[tuple[str, str, int, Round | None]]:
    """(label, kind, threads, round) for every codec measured on a data set."""
    out: list[tuple[str, str, int, Round | None]] = [(s, "ours", threads, ours(s, dtype)) for s in OUR_SPECS]
    out.insert(3, (OUR_DEFAULT, "ours", 1, ours(OUR_DEFAULT, dtype)))
    out += [
        ("zipnn (defaults)", "anchor", threads, zipnn_round(dtype, threads)),
        ("plain zstd-1", "anchor", threads, plain_zstd(1)),
        ("plain zstd-3", "anchor", threads, plain_zstd(3)),
        ("plain lz4.frame", "anchor", threads, plain_lz4()),
    ]
    return out


def zstd_level(label: str) -> int:
    return int(label.split(":")[1]) if label.startswith("zstd:") else 0


def run_all(sets: dict[str, dict[str, torch.Tensor]], threads: int, repeat: int, slow_bytes: int, max_bytes: int) -> list[Cell]:
    cells: list[Cell] = []
    for name, sd in sets.items():
        full, dtype = flat_bytes(sd)
        full = sample_frames(full, max_bytes, dtype.itemsize)
        slow = sample_frames(full, slow_bytes, dtype.itemsize)
        buffers = {id(full): (full, touched_like(full))}
        buffers.setdefault(id(slow), (slow, touched_like(slow)))
        default_ratio: dict[int, float] = {}  # our zstd:1 ratio per buffer, for the "same bytes" column
        for buf_id, (raw, out) in buffers.items():
            default_ratio[buf_id] = measure(ours(OUR_DEFAULT, dtype), raw, out, threads, 1)[0]
        for label, kind, n_threads, rnd in cases(dtype, threads):
            if rnd is None:
                continue
            level = zstd_level(label) if kind == "ours" else 0
            raw, out = buffers[id(slow) if level >= CAPPED_LEVEL else id(full)]
            reps = 1 if level >= SINGLE_RUN_LEVEL else repeat
            t0 = time.perf_counter()
            ratio, c, d = measure(rnd, raw, out, n_threads, reps)
            cell = Cell(name, label, kind, n_threads, raw.nbytes, ratio, ratio / default_ratio[id(raw)], c, d, reps)
            cells.append(cell)
            print(f"{name:32s} {label:18s} {n_threads}t {raw.nbytes >> 20:5d} MiB ratio {ratio:.4f} "
                  f"c {c:7.0f} d {d:7.0f} MB/s  ({time.perf_counter() - t0:.1f} s)", flush=True)
        del buffers
    return cells


def codec_table(cells: list[Cell]) -> str:
    rows = [
        [c.data, ("" if c.kind == "ours" else "anchor: ") + c.codec, c.threads, f"{c.measured_bytes / 2**20:.0f}",
         f"{c.ratio:.4f}", f"{c.ratio_vs_default:.3f}", f"{c.compress_mbs:.0f}", f"{c.decompress_mbs:.0f}", c.repeats]
        for c in cells
    ]
    return md_table(["data", "codec", "threads", "MiB measured", "stored/raw", "vs our zstd:1 on same bytes",
                     "compress MB/s", "decompress MB/s", "runs"], rows)


def anchor_rows(cells: list[Cell]) -> list[dict]:
    """Per data set: our default's ratio against zipnn's and plain zstd-3's, with the target verdict."""
    out = []
    for name in dict.fromkeys(c.data for c in cells):
        by = {(c.codec, c.threads): c for c in cells if c.data == name}
        threads = max(t for _, t in by)
        ours_c, zipnn_c, z3 = by.get((OUR_DEFAULT, threads)), by.get(("zipnn (defaults)", threads)), by.get(("plain zstd-3", threads))
        row = {"data": name, "ours": ours_c.ratio, "zipnn": zipnn_c.ratio if zipnn_c else None, "plain_zstd3": z3.ratio}
        if zipnn_c:
            rel = ours_c.ratio / zipnn_c.ratio
            row["vs_zipnn"] = rel
            row["verdict"] = "met" if rel <= 1 else f"missed by {100 * (rel - 1):.2f}%"
        else:
            row["vs_zipnn"], row["verdict"] = None, "zipnn not installed"
        row["vs_zstd3"] = ours_c.ratio / z3.ratio
        out.append(row)
    return out


def anchor_table(rows: list[dict]) -> str:
    fmt = lambda v, p=4: "-" if v is None else f"{v:.{p}f}"
    return md_table(
        ["data", f"ours ({OUR_DEFAULT})", "zipnn", "plain zstd-3", "ours / zipnn", "ours / plain zstd-3",
         "target: ratio no worse than zipnn's"],
        [[r["data"], fmt(r["ours"]), fmt(r["zipnn"]), fmt(r["plain_zstd3"]), fmt(r["vs_zipnn"], 3), fmt(r["vs_zstd3"], 3), r["verdict"]]
         for r in rows],
    )


def draw(cells: list[Cell]):
    """Size vs compress MB/s, one panel per data set; ours as a line over zstd levels, anchors as other markers.

    The y axis is each row's ratio relative to our zstd:1 on the same bytes, so rows measured on a
    sample (the slow levels) sit on the same scale as whole-data rows."""

    def _draw(plt):
        names = list(dict.fromkeys(c.data for c in cells))
        cols = 2
        rows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(12, 4.4 * rows), squeeze=False)
        markers = {"zipnn (defaults)": ("D", "tab:red"), "plain zstd-1": ("s", "tab:green"),
                   "plain zstd-3": ("s", "tab:olive"), "plain lz4.frame": ("^", "tab:purple")}
        for ax, name in zip(axes.flat, names):
            mine = [c for c in cells if c.data == name]
            top = max(c.threads for c in mine)
            levels = [c for c in mine if c.kind == "ours" and c.codec.startswith("zstd") and c.threads == top]
            default = next(c for c in levels if c.codec == OUR_DEFAULT)
            ax.plot([c.compress_mbs for c in levels], [c.ratio_vs_default for c in levels], "-o", color="tab:blue",
                    label=f"ours, zstd levels ({top} threads)")
            for c in mine:
                y = c.ratio_vs_default
                if c.kind == "ours":
                    if c.threads != top:
                        ax.plot(c.compress_mbs, y, "o", mfc="none", color="tab:blue", label=f"ours {c.codec}, {c.threads} thread")
                    elif not c.codec.startswith("zstd"):
                        ax.plot(c.compress_mbs, y, "o", color="tab:cyan")
                    label = c.codec + (f" ({c.threads}t)" if c.threads != top else "")
                    label += "*" if c.measured_bytes < default.measured_bytes else ""
                    ax.annotate(label, (c.compress_mbs, y), textcoords="offset points",
                                xytext=(4, -10 if c.threads != top else 4), fontsize=7)
                else:
                    m, col = markers.get(c.codec, ("x", "k"))
                    ax.plot(c.compress_mbs, y, m, color=col, label=c.codec)
            ax.set_xscale("log")
            ax.set_title(f"{name} (our {OUR_DEFAULT} = {default.ratio:.3f} stored/raw)", fontsize=10)
            ax.set_xlabel("compress MB/s of raw bytes (log)")
            ax.set_ylabel(f"size relative to our {OUR_DEFAULT} on the same bytes")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        fig.suptitle("Lower is smaller, right is faster; * measured on a sample of the data set", fontsize=10)
        return fig

    return _draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random-mib", type=int, default=512, help="size of the random-normal fp32 data set")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per fast cell (median); slow levels run once")
    ap.add_argument("--slow-mib", type=int, default=64, help=f"bytes measured per data set for zstd levels >= {CAPPED_LEVEL}")
    ap.add_argument("--max-mib", type=int, default=0, help="cap every data set (evenly spaced frames); 0 = whole")
    ap.add_argument("--threads", type=int, default=2, help="threads for the parallel cells (the machine's cores)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 32 MiB random, 1 repeat, 32/4 MiB caps")
    ap.add_argument("--compare", metavar="SPECS", help="only our SPECS (comma separated) and zipnn, fastest of "
                    "--repeat rounds, printed; docs and results are not written")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare.split(","), datasets(args.random_mib), args.threads, args.repeat, args.max_mib << 20)
        return
    if args.quick:
        args.random_mib, args.repeat, args.slow_mib, args.max_mib = 32, 1, 4, 32
    cmd = (f".venv/bin/python -m benchmarks.bench_codecs --random-mib {args.random_mib} --repeat {args.repeat} "
           f"--slow-mib {args.slow_mib}" + (f" --max-mib {args.max_mib}" if args.max_mib else "")
           + (f" --threads {args.threads}" if args.threads != 2 else ""))
    t0 = time.perf_counter()
    sets = datasets(args.random_mib)
    cells = run_all(sets, args.threads, args.repeat, args.slow_mib << 20, args.max_mib << 20)
    anchors = anchor_rows(cells)
    save_results("codecs", {"cells": [asdict(c) for c in cells], "ratio_to_anchor": anchors,
                            "args": vars(args), "wall_s": time.perf_counter() - t0})
    chart = chart_or_note("codecs", draw(cells))
    capped = f"at most {args.max_mib} MiB of evenly spaced 4 MiB frames of each data set" if args.max_mib else "each data set whole"
    note = (
        f"Each data set is flattened into one buffer ({capped}) and cut into 4 MiB frames as CompressedWriter cuts "
        f"tensors; frames are compressed and then decompressed in parallel on a pool of {args.threads} threads (one "
        f"row of {OUR_DEFAULT} on 1 thread). Ours goes through `dcp_tiered.codecs.FrameCodec` with the filter the "
        "writer picks (byte grouping with the sign swap for floats; no filter for `none`), incompressible planes "
        "stored raw, and includes the writer's xxh3 frame checksum. Anchors run on the same bytes: zipnn with its "
        f"defaults (its own chunking, {args.threads} threads, whole buffer in one call), plain zstd levels 1 and 3 and "
        "plain `lz4.frame` (default level) on the same 4 MiB frames without byte grouping, same thread pool. "
        "Decompression writes into a preallocated, already touched buffer (as a load into existing tensors does) and "
        "every decode is asserted bit-exact against the input. stored/raw counts frame headers; MB/s are of raw "
        f"bytes; fast cells are the median of {args.repeat} rounds, zstd levels >= {SINGLE_RUN_LEVEL} run once, and "
        f"zstd levels >= {CAPPED_LEVEL} are measured on {args.slow_mib} MiB of evenly spaced 4 MiB frames of each "
        "data set (the MiB measured column says which rows); the column `vs our zstd:1 on same bytes` compares each "
        "row with our default on exactly the bytes that row measured, so sampled rows compare fairly. Random-normal "
        "data compresses uniformly, so its ratio on a sample is that of the whole (the same-bytes column shows it)."
    )
    rel = {r["data"]: r for r in anchors}
    reading = " ".join(
        f"{name}: ours {r['ours']:.3f} vs zipnn {r['zipnn']:.3f} ({r['verdict']})." if r["zipnn"] else ""
        for name, r in rel.items()
    )
    by = {(c.data, c.codec, c.threads): c for c in cells}
    best = {}
    for name in rel:
        mine = [c for c in cells if c.data == name and c.kind == "ours" and c.codec != "none"]
        best[name] = min(mine, key=lambda c: c.ratio_vs_default)
    best_line = "; ".join(f"{n}: {b.codec} at {b.ratio_vs_default:.3f}x of zstd:1's size, {b.compress_mbs:.0f} MB/s"
                          for n, b in best.items())
    z15 = [by.get((n, "zstd:15", args.threads)) for n in rel]
    z15_line = ", ".join(f"{c.compress_mbs:.0f}" for c in z15 if c)
    body = (
        f"## Codecs on the same bytes\n\n`{cmd}` — {machine_line()}.\n\n{note}\n\n"
        + codec_table(cells)
        + "\n\n### Ratio to anchor\n\n"
        + anchor_table(anchors)
        + f"\n\n{chart}\n\n"
        + f"{reading} Smallest of our codecs per data set, relative to {OUR_DEFAULT} on the same bytes: {best_line}. "
        f"zstd:15, which wrapper scripts often recommend, compresses at {z15_line} MB/s on {args.threads} threads "
        "(data sets in table order). Everything here is CPU-bound: compression runs on the "
        f"{args.threads} threads of the pool, and decompression speed is bounded by zstd's entropy decoding plus the "
        "plane interleave into the destination."
    )
    write_section("codecs", body)
    print(codec_table(cells))
    print(anchor_table(anchors))
    print(f"wall {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
