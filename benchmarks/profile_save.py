"""Profile one ``dcp.save`` through ``CompressedWriter``: wall time, the calling thread's CPU,
and the share of it spent inside the data file's write calls (the page-cache copy).

    .venv/bin/python -m benchmarks.profile_save --state minilm-bf16 --repeat 5
    .venv/bin/python -m benchmarks.profile_save --state small --items 20000 --repeat 3 --cprofile 25
    .venv/bin/python -m benchmarks.profile_save --state random --mb 512 --threads 2 --repeat 3

Prints one JSON line per state (the minimum over ``--repeat`` runs of each figure) and, with
``--cprofile N``, the N functions with the most cumulative time of one more run.  Writes
nothing but its temporary checkpoints (removed).  Timings on a shared machine: compare runs
made side by side, never absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedWriter
from dcp_tiered.storage import local as local_storage


def make_state(kind: str, items: int, mb: int) -> dict[str, torch.Tensor]:
    """``minilm-bf16`` (real weights, as bench_storage makes them), ``small`` (``items`` tensors of
    256..4096 fp32 values) or ``random`` (``mb`` MiB of N(0, 0.02) fp32 in 16 MiB tensors)."""
    g = torch.Generator().manual_seed(0)
    if kind == "minilm-bf16":
        from benchmarks.common import minilm_weights

        return {k: v.bfloat16() for k, v in minilm_weights().items()}
    if kind == "small":
        return {f"layer{i // 10}.p{i % 10}": torch.randn(256 << (i % 5), generator=g) * 0.02 for i in range(items)}
    n = (mb << 20) // 4
    chunk = 4 << 20
    return {f"w{i}": torch.randn(min(chunk, n - s), generator=g) * 0.02 for i, s in enumerate(range(0, n, chunk))}


class _WriteClock:
    """Counts the CPU time (``time.thread_time``) and wall time the calling thread spends in data-file writes."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.calls = 0

    def wrap(self, f: Any) -> Any:
        clock = self

        class Timed:
            def __getattr__(self, name: str) -> Any:
                return getattr(f, name)

            def _timed(self, fn: Any, arg: Any) -> Any:
                c, w = time.thread_time(), time.perf_counter()
                try:
                    return fn(arg)
                finally:
                    clock.cpu += time.thread_time() - c
                    clock.wall += time.perf_counter() - w
                    clock.calls += 1

            def write(self, data: Any) -> Any:
                return self._timed(f.write, data)

        if hasattr(f, "writev"):
            Timed.writev = lambda self, pieces: self._timed(f.writev, pieces)  # type: ignore[attr-defined]
        return Timed()


@contextlib.contextmanager
def timed_methods(times: dict[str, float]) -> Iterator[None]:
    """Add the calling thread's CPU time in ``CompressedWriter.write_data`` and ``finish`` to ``times``
    (the rest of the save is DCP's planning and its per-key wrappers)."""
    saved = {name: getattr(CompressedWriter, name) for name in ("write_data", "finish")}

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            c = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                times[f"{name}_cpu_s"] = times.get(f"{name}_cpu_s", 0.0) + time.thread_time() - c
        return run

    for name, fn in saved.items():
        setattr(CompressedWriter, name, timed(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(CompressedWriter, name, fn)


@contextlib.contextmanager
def timed_writes(clock: _WriteClock) -> Iterator[None]:
    real = local_storage.LocalStorage._open_write

    @contextlib.contextmanager
    def opened(self: Any, name: str, durable: bool) -> Iterator[Any]:
        with real(self, name, durable) as f:
            yield clock.wrap(f)

    local_storage.LocalStorage._open_write = opened  # type: ignore[method-assign]
    try:
        yield
    finally:
        local_storage.LocalStorage._open_write = real  # type: ignore[method-assign]


def one_save(state: dict, root: str, threads: int, codec: str) -> dict[str, float]:
    path = tempfile.mkdtemp(dir=root)
    clock = _WriteClock()
    times: dict[str, float] = {}
    try:
        with timed_writes(clock), timed_methods(times):
            c0, w0 = time.thread_time(), time.perf_counter()
            r0 = time.process_time()
            dcp.save(state, storage_writer=CompressedWriter(path, codec=codec, threads=threads, overwrite=True), no_dist=True)
            wall, cpu, proc = time.perf_counter() - w0, time.thread_time() - c0, time.process_time() - r0
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {"wall_s": wall, "main_cpu_s": cpu, "process_cpu_s": proc, "main_write_cpu_s": clock.cpu,
            "main_write_wall_s": clock.wall, "write_calls": clock.calls, **times}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", choices=["minilm-bf16", "small", "random"], action="append")
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--codec", default="zstd")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N functions of one profiled save")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="profile_save_")
    os.makedirs(root, exist_ok=True)
    try:
        for kind in args.state or ["minilm-bf16"]:
            state = make_state(kind, args.items, args.mb)
            one_save(state, root, args.threads, args.codec)  # warm-up: imports, page cache, allocator
            runs = [one_save(state, root, args.threads, args.codec) for _ in range(args.repeat)]
            best = {k: round(min(r[k] for r in runs), 4) for k in runs[0]}
            raw = sum(t.numel() * t.element_size() for t in state.values())
            print(json.dumps({"state": kind, "tensors": len(state), "raw_mb": round(raw / 1e6, 1), "threads": args.threads,
                              "codec": args.codec, "repeat": args.repeat, "min": best}))
            if args.cprofile:
                prof = cProfile.Profile()
                prof.enable()
                one_save(state, root, args.threads, args.codec)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.cprofile)
                out.write("\n-- by own time --\n")
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.cprofile)
                print(out.getvalue())
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
