"""Save/load and codec benchmark of CompressedWriter against stock DCP and zipnn.

Run:  .venv/bin/python -m benchmarks.bench_storage [--random-mib 512] [--repeat 3]

Writes the sections "codecs" and "storage" of docs/benchmarks.md.  Everything is measured
side by side in one run, on real MiniLM weights (fp32 and bf16), Adam state after real
steps, and random-normal fp32.  Throughputs are MB/s of raw (original dtype) state.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import zstandard

from benchmarks.common import (
    adam_state,
    dir_bytes,
    drop_page_cache,
    fresh_dir,
    machine_line,
    md_table,
    minilm_weights,
    nbytes,
    random_normal,
    timed,
    write_section,
)
from dcp_tiered import CompressedReader, CompressedWriter, DowncastSavePlanner
from dcp_tiered.codecs import FrameCodec, filter_for, frame_bounds


def datasets(random_mib: int) -> dict[str, dict[str, torch.Tensor]]:
    w = minilm_weights()
    return {
        "MiniLM fp32": w,
        "MiniLM bf16": {k: v.bfloat16() for k, v in w.items()},
        "Adam state": adam_state(w),
        f"random-normal fp32 {random_mib} MiB": random_normal(random_mib << 20),
    }


def flat_bytes(sd: dict[str, torch.Tensor]) -> tuple[np.ndarray, torch.dtype]:
    dtype = next(iter(sd.values())).dtype
    flat = torch.cat([t.reshape(-1) for t in sd.values()])
    return flat.view(torch.uint8).numpy().copy(), dtype


def bench_codec_ours(raw: np.ndarray, dtype: torch.dtype, codec: str, threads: int) -> tuple[float, float, float]:
    fc = FrameCodec(codec, filter_for(dtype.is_floating_point, dtype.itemsize), dtype.itemsize)
    bounds = frame_bounds(raw.nbytes, 4 << 20, dtype.itemsize)
    with ThreadPoolExecutor(threads) as pool:
        enc = []
        tc = timed(lambda: enc.extend(pool.map(lambda b: fc.encode(raw[b[0] : b[1]]), bounds)))
        stored = [b"".join(bytes(memoryview(p).cast("B")) for p in e.pieces) for e in enc]
        out = np.empty_like(raw)
        td = timed(lambda: list(pool.map(lambda i: fc.decode(stored[i], out[bounds[i][0] : bounds[i][1]]), range(len(bounds)))))
    assert np.array_equal(out, raw)
    return sum(len(s) for s in stored) / raw.nbytes, raw.nbytes / tc / 1e6, raw.nbytes / td / 1e6


def bench_codec_zstd_plain(raw: np.ndarray, level: int) -> tuple[float, float, float]:
    c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    chunks = [raw[i : i + (4 << 20)] for i in range(0, raw.nbytes, 4 << 20)]
    comp: list[bytes] = []
    tc = timed(lambda: comp.extend(c.compress(x) for x in chunks))
    td = timed(lambda: [d.decompress(x) for x in comp])
    return sum(map(len, comp)) / raw.nbytes, raw.nbytes / tc / 1e6, raw.nbytes / td / 1e6


def bench_codec_zipnn(raw: np.ndarray, dtype: torch.dtype, threads: int) -> tuple[float, float, float] | None:
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
    if name is None:
        return None
    z = ZipNN(input_format="byte", bytearray_dtype=name, threads=threads)
    data = raw.tobytes()
    copy = bytearray(data)  # zipnn modifies its input in place
    comp: list[bytes] = []
    tc = timed(lambda: comp.append(z.compress(copy)))
    out: list[bytes] = []
    td = timed(lambda: out.append(z.decompress(comp[0])))
    assert bytes(out[0]) == data, "zipnn round trip differs"
    return len(comp[0]) / raw.nbytes, raw.nbytes / tc / 1e6, raw.nbytes / td / 1e6


def codec_section(sets: dict[str, dict[str, torch.Tensor]]) -> tuple[str, dict]:
    rows, anchors = [], {}
    for name, sd in sets.items():
        raw, dtype = flat_bytes(sd)
        cases = [
            ("dcp_tiered zstd:1 (1 thread)", lambda: bench_codec_ours(raw, dtype, "zstd", 1)),
            ("dcp_tiered zstd:1 (2 threads)", lambda: bench_codec_ours(raw, dtype, "zstd", 2)),
            ("dcp_tiered lz4 (2 threads)", lambda: bench_codec_ours(raw, dtype, "lz4", 2)),
            ("plain zstd-3, no grouping (1 thread)", lambda: bench_codec_zstd_plain(raw, 3)),
            ("zipnn (2 threads)", lambda: bench_codec_zipnn(raw, dtype, 2)),
        ]
        for label, fn in cases:
            res = fn()
            if res is None:
                continue
            ratio, c, d = res
            rows.append([name, label, f"{ratio:.3f}", f"{c:.0f}", f"{d:.0f}"])
            anchors[(name, label)] = ratio
    return md_table(["data", "codec", "stored/raw", "compress MB/s", "decompress MB/s"], rows), anchors


def writers(base: str):
    from torch.distributed.checkpoint._extension import ZStandard

    return [
        ("CompressedWriter (defaults: zstd:1)", lambda p: (CompressedWriter(p), None), lambda p: CompressedReader(p)),
        ("CompressedWriter lz4", lambda p: (CompressedWriter(p, codec="lz4"), None), lambda p: CompressedReader(p)),
        ("CompressedWriter + bf16 planner (optimizer state too)",
         lambda p: (CompressedWriter(p), DowncastSavePlanner(torch.bfloat16, exclude=())), lambda p: CompressedReader(p)),
        ("stock FileSystemWriter, 1 thread", lambda p: (dcp.FileSystemWriter(p, thread_count=1), None), lambda p: dcp.FileSystemReader(p)),
        ("stock FileSystemWriter, 2 threads", lambda p: (dcp.FileSystemWriter(p, thread_count=2), None), lambda p: dcp.FileSystemReader(p)),
        ("stock + DCP zstd extension, 2 threads", lambda p: (dcp.FileSystemWriter(p, thread_count=2, _extensions=[ZStandard()]), None), lambda p: dcp.FileSystemReader(p)),
    ]


def storage_section(sets: dict[str, dict[str, torch.Tensor]], base: str, repeat: int) -> tuple[str, dict, bool]:
    rows, results = [], {}
    cold = True
    for name, sd in sets.items():
        raw = nbytes(sd)
        for label, mk_writer, mk_reader in writers(base):
            saves, loads, warm, stored = [], [], [], 0
            for r in range(repeat):
                path = fresh_dir(base, f"ckpt{r}")
                writer, planner = mk_writer(path)
                saves.append(timed(lambda: dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)))
                stored = dir_bytes(path)
                out = {k: torch.empty_like(v) for k, v in sd.items()}
                cold = drop_page_cache() and cold
                loads.append(timed(lambda: dcp.load(out, storage_reader=mk_reader(path), no_dist=True)))
                warm.append(timed(lambda: dcp.load(out, storage_reader=mk_reader(path), no_dist=True)))
                if planner is None:
                    assert all(torch.equal(out[k], sd[k]) for k in sd), f"{label} changed values"
            s = raw / statistics.median(saves) / 1e6
            lo, lw = raw / statistics.median(loads) / 1e6, raw / statistics.median(warm) / 1e6
            results[(name, label)] = (s, lo, stored / raw, lw)
            rows.append([name, label, f"{s:.0f}", f"{lo:.0f}", f"{lw:.0f}", f"{stored / raw:.3f}"])
    table = md_table(["data", "writer", "save MB/s", "load MB/s (cold cache)", "load MB/s (warm cache)", "stored/raw"], rows)
    return table, results, cold


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--random-mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir on /tmp's disk)")
    args = ap.parse_args()
    sets = datasets(args.random_mib)
    cmd = f".venv/bin/python -m benchmarks.bench_storage --random-mib {args.random_mib} --repeat {args.repeat}"
    codec_table, ratios = codec_section(sets)
    write_section(
        "codecs",
        f"## Codecs on the same bytes\n\n`{cmd}` — {machine_line()}.\n\n"
        "Whole data set as one buffer, 4 MiB frames for dcp_tiered and plain zstd; ratio = stored/raw; MB/s of raw bytes.\n\n"
        + codec_table,
    )
    base = args.dir or tempfile.mkdtemp(prefix="dcp-tiered-bench-", dir="/var/tmp")
    table, res, cold = storage_section(sets, base, args.repeat)
    lines = []
    for name in sets:
        ours = res[(name, "CompressedWriter (defaults: zstd:1)")]
        stock = res[(name, "stock FileSystemWriter, 2 threads")]
        ext = res[(name, "stock + DCP zstd extension, 2 threads")]
        zipnn = ratios.get((name, "zipnn (2 threads)"))
        lines.append(
            [name, f"{ours[2]:.3f}" + (f" vs zipnn {zipnn:.3f}" if zipnn else ""),
             f"{ours[0] / stock[0]:.2f}x", f"{ours[0] / ext[0]:.2f}x", f"{ours[1] / stock[1]:.2f}x", f"{ours[1]:.0f} / {ours[3]:.0f}"]
        )
    summary = md_table(
        ["data", "ratio (target ≤ zipnn)", "save vs stock 2 thr (target ≥1x)", "save vs stock+zstd (target ≥2x)",
         "load vs stock 2 thr (cold)", "load MB/s cold / warm (target ≥1000)"],
        lines,
    )
    write_section(
        "storage",
        f"## Whole save and load on local disk\n\n`{cmd}` — {machine_line()}.\n\n"
        f"`dcp.save`/`dcp.load` with `no_dist=True`, median of {args.repeat}; data files fsynced by every writer; "
        f"each load runs {'after dropping the page cache (cold), then again (warm)' if cold else 'twice; dropping the page cache was not permitted, so both are warm'}. "
        "MB/s of raw state in its original dtype; stored/raw against the original dtype's size.\n\n"
        + table
        + "\n\n### Against the targets\n\n"
        + summary,
    )
    print(table)
    print(summary)


if __name__ == "__main__":
    main()
