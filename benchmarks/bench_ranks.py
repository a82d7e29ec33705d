"""Multi-rank saves and loads with gloo on this one machine: 1, 2 and 4 ranks, CompressedWriter vs stock.

Run:  .venv/bin/python -m benchmarks.bench_ranks [--mib 512] [--ranks 1,2,4] [--repeat 3]   (smoke run: --quick)

One state of ``--mib`` MiB of real data (MiniLM fp32 weights and Adam moments after real steps, repeated to
size, as in bench_s3) is sharded over the ranks: every tensor is a ``DTensor`` with ``Shard(0)`` on a 1-D CPU
``DeviceMesh``, and each rank holds only its own shard.  For each world size, gloo ranks are spawned (TCP
store on 127.0.0.1) and save it with ``CompressedWriter`` (defaults, ``threads = max(1, cores // ranks)``) and
with stock ``FileSystemWriter(thread_count=1)``, then load it back with ``CompressedReader`` (same threads) /
``FileSystemReader`` into sharded templates and compare every shard bit for bit.  Writes the section "ranks"
of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from benchmarks.bench_s3 import free_port, real_state
from benchmarks.common import (
    chart_or_note,
    dir_bytes,
    drop_page_cache,
    local_shard,
    machine_line,
    md_table,
    nbytes,
    save_results,
    write_section,
)
from dcp_tiered import CompressedReader, CompressedWriter

WRITERS = ("CompressedWriter (defaults: zstd:1)", "stock FileSystemWriter (1 thread)")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _worker(rank: int, world: int, port: int, state_file: str, base: str, repeat: int, threads: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", LOCAL_WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.load(state_file, mmap=True, weights_only=True)
        shards = {k: local_shard(v, rank, world) for k, v in full.items()}

        def sharded(local: dict[str, torch.Tensor]) -> dict[str, DTensor]:
            return {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=full[k].shape,
                                          stride=full[k].stride()) for k, t in local.items()}

        state = sharded(shards)
        makers = {
            WRITERS[0]: (lambda p: CompressedWriter(p, threads=threads), lambda p: CompressedReader(p, threads=threads)),
            WRITERS[1]: (lambda p: dcp.FileSystemWriter(p, thread_count=1), lambda p: dcp.FileSystemReader(p)),
        }
        results: dict[str, dict] = {}
        for w, (label, (mk_writer, mk_reader)) in enumerate(makers.items()):
            # untimed warm-up: thread pools, codec imports and the first collectives of this writer
            tiny = {"warm": DTensor.from_local(torch.randn(1024), mesh, [Shard(0)], run_check=False,
                                               shape=torch.Size([1024 * world]), stride=(1,))}
            warm = Path(base) / f"ws{world}_w{w}_warm"
            dcp.save(tiny, storage_writer=mk_writer(warm))
            dcp.load(tiny, storage_reader=mk_reader(warm))
            dist.barrier()
            saves, loads, stored, cold = [], [], 0, True
            for r in range(repeat):
                path = Path(base) / f"ws{world}_w{w}_r{r}"
                dist.barrier()
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=mk_writer(path))
                dist.barrier()
                saves.append(time.perf_counter() - t0)
                if rank == 0:
                    stored = dir_bytes(path)
                    cold = drop_page_cache() and cold
                target = sharded({k: torch.empty_like(v) for k, v in shards.items()})
                dist.barrier()
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=mk_reader(path))
                dist.barrier()
                loads.append(time.perf_counter() - t0)
                equal = torch.tensor(int(all(torch.equal(target[k].to_local(), shards[k]) for k in shards)))
                dist.all_reduce(equal, op=dist.ReduceOp.MIN)
                if not equal.item():
                    raise AssertionError(f"{label}, {world} ranks: loaded shards differ")
                del target
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path)
            results[label] = {"saves": saves, "loads": loads, "stored": stored, "cold": cold}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_world(world: int, state_file: Path, base: Path, repeat: int) -> tuple[dict, int]:
    threads = max(1, cores() // world)
    out = base / f"out_{world}.json"
    mp.start_processes(_worker, args=(world, free_port(), str(state_file), str(base), repeat, threads, str(out)),
                       nprocs=world, join=True, start_method="spawn")
    return json.loads(out.read_text()), threads


def draw(rows: list[dict]):
    def fig(plt):
        f, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, kind in zip(axes, ("save", "load")):
            for label in WRITERS:
                pts = [(r["ranks"], r[f"{kind}_mbps"]) for r in rows if r["writer"] == label]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            ax.set_xlabel("ranks (one machine)")
            ax.set_ylabel("MB/s of raw state, all ranks")
            ax.set_xticks(sorted({r["ranks"] for r in rows}))
            ax.set_title(kind)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
        return f

    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="total state size in MiB (split over the ranks)")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir under /var/tmp)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 MiB, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.repeat = 64, 1
    worlds = [int(r) for r in args.ranks.split(",")]
    cmd = f".venv/bin/python -m benchmarks.bench_ranks --mib {args.mib} --ranks {args.ranks} --repeat {args.repeat}"
    state = real_state(args.mib << 20)
    raw = nbytes(state)
    rows: list[dict] = []
    cold = True
    base = Path(tempfile.mkdtemp(prefix="dcp-tiered-ranks-", dir=args.dir or "/var/tmp"))
    try:
        state_file = base / "state.pt"
        torch.save(state, state_file)  # ranks map it and copy out only their shards
        del state
        for world in worlds:
            res, threads = run_world(world, state_file, base, args.repeat)
            for label in WRITERS:
                r = res[label]
                cold = cold and r["cold"]
                rows.append({"ranks": world, "writer": label, "threads": threads if label == WRITERS[0] else 1,
                             "save_s": statistics.median(r["saves"]), "load_s": statistics.median(r["loads"]),
                             "stored": r["stored"], "raw": raw, "saves": r["saves"], "loads": r["loads"]})
                rows[-1]["save_mbps"] = raw / rows[-1]["save_s"] / 1e6
                rows[-1]["load_mbps"] = raw / rows[-1]["load_s"] / 1e6
                print(rows[-1], flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    save_results("ranks", rows)
    one = {r["writer"]: r for r in rows if r["ranks"] == min(worlds)}
    table = md_table(
        ["ranks", "writer", "threads per rank", "save s", "save MB/s (all ranks)", f"save speed-up vs {min(worlds)}",
         "load s", "load MB/s (all ranks)", f"load speed-up vs {min(worlds)}", "stored/raw"],
        [[r["ranks"], r["writer"], r["threads"], f"{r['save_s']:.2f}", f"{r['save_mbps']:.0f}",
          f"{r['save_mbps'] / one[r['writer']]['save_mbps']:.2f}x", f"{r['load_s']:.2f}", f"{r['load_mbps']:.0f}",
          f"{r['load_mbps'] / one[r['writer']]['load_mbps']:.2f}x", f"{r['stored'] / raw:.3f}"] for r in rows],
    )
    chart = chart_or_note("ranks", draw(rows))
    n = cores()
    by = {(r["ranks"], r["writer"]): r for r in rows}

    def per_ranks(fn) -> str:
        return ", ".join(f"{w} rank{'s' if w > 1 else ''} {fn(w)}" for w in worlds)

    ours_vs_stock = per_ranks(lambda w: f"{by[(w, WRITERS[0])]['save_mbps'] / by[(w, WRITERS[1])]['save_mbps']:.2f}x")
    lo, hi = min(worlds), max(worlds)
    scaling = "; ".join(
        f"{label.split(' (')[0]} saves at {by[(lo, label)]['save_mbps']:.0f} MB/s on {lo} and "
        f"{by[(hi, label)]['save_mbps']:.0f} MB/s on {hi} ranks, loads at {by[(lo, label)]['load_mbps']:.0f} and "
        f"{by[(hi, label)]['load_mbps']:.0f} MB/s"
        for label in WRITERS
    )
    oversub = ", more processes than cores" if hi > n else ""
    body = f"""## Several ranks on one machine (gloo)

`{cmd}` — {machine_line()}.

{raw / 1e6:.0f} MB of real state in total (MiniLM fp32 weights and Adam moments after real steps, repeated to
size), every tensor a `DTensor` sharded `Shard(0)` over a 1-D CPU `DeviceMesh`, so each rank holds and writes
only its shard (1/N of the bytes). Ranks are spawned processes joined by gloo over a TCP store on 127.0.0.1,
all on this machine's {n} cores. `CompressedWriter` runs with its defaults (zstd:1) and `threads = max(1, {n} //
ranks)` per rank (`CompressedReader` the same); stock `FileSystemWriter` with `thread_count=1` per rank. Both
fsync their data files. Time runs from a barrier before `dcp.save` / `dcp.load` to a barrier after it, so it is
the slowest rank's; each load {'runs after dropping the page cache (cold)' if cold else 'runs warm (the page cache could not be dropped)'}
and every loaded shard is compared bit for bit (all equal). Medians of {args.repeat}; MB/s are of the whole raw
state, all ranks together; speed-up is against {min(worlds)} rank{'s' if min(worlds) > 1 else ''} with the same writer.

{table}

{chart}

{scaling}. `CompressedWriter`'s save throughput relative to stock: {ours_vs_stock}. More ranks on one
machine add no cores: {n} cores serve all {hi} ranks ({max(1, n // hi)} compression thread{'s' if n // hi > 1 else ''} each{oversub}), so `CompressedWriter`, which spends its time compressing, is
bound by those {n} cores whatever the rank count; more ranks can only overlap one rank's file writes and fsyncs
with another's compression. Stock DCP only copies bytes, so it depends on the one disk and the page cache.
"""
    write_section("ranks", body)
    print(table)


if __name__ == "__main__":
    main()
