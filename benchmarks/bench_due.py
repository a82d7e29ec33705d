"""Per-step cost of ``TieredCheckpointer.maybe_save`` / ``due`` when nothing is due.

Run:  .venv/bin/python -m benchmarks.bench_due [--steps 200000] [--ranks 2]

A training loop calls ``maybe_save(step, state)`` every step; on most steps no tier is due.
This times that call (with a callable state that would be expensive to build, and with a
ready mapping) and ``due(step)`` alone, on one process, after a first save so the schedules
have a history.  Prints microseconds per call (median of 5 runs); the target is < 100 us.
With ``--ranks N`` the same runs on N gloo ranks: step schedules decide without any
collective; wall-clock schedules need one small broadcast per step (the coordinator's clock).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dcp_tiered import Tier, TieredCheckpointer


def per_call_us(fn, steps: int, start: int) -> float:
    t0 = time.perf_counter()
    for s in range(start, start + steps):
        fn(s)
    return (time.perf_counter() - t0) / steps * 1e6


def _rank(rank: int, world: int, store: str, steps: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        run(steps, prefix=f"rank {rank}: " if rank == 0 else None)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--ranks", type=int, default=1)
    args = ap.parse_args()
    if args.ranks > 1:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_rank, args=(args.ranks, f"{tmp}/store", args.steps), nprocs=args.ranks,
                               start_method="spawn")
        return
    run(args.steps, prefix="")


def run(steps: int, prefix: str | None) -> None:
    sd = {"model": {"w": torch.zeros(4)}}
    built = []

    def build() -> dict:
        built.append(1)
        return sd

    with tempfile.TemporaryDirectory() as tmp:
        import torch.distributed as dist

        if dist.is_initialized():  # every rank needs the same tier paths
            paths = [tmp]
            dist.broadcast_object_list(paths, src=0)
            tmp = paths[0]
        results = {}
        for label, tiers in {
            "every_steps (step schedules)": [Tier("local", str(Path(tmp) / "a"), every_steps=10**9, keep=1),
                                             Tier("shared", str(Path(tmp) / "b"), every_steps=10**9, keep=1)],
            "every (wall-clock schedules)": [Tier("local", str(Path(tmp) / "c"), every="1h", keep=1),
                                             Tier("shared", str(Path(tmp) / "d"), every="6h", keep=1, max_per_hour=2)],
        }.items():
            ck = TieredCheckpointer(tiers)
            ck.maybe_save(0, sd)  # the first save: afterwards nothing is due for a long time
            start = 1
            for name, fn in {"maybe_save(step, callable)": lambda s: ck.maybe_save(s, build),
                             "maybe_save(step, mapping)": lambda s: ck.maybe_save(s, sd),
                             "due(step)": ck.due,
                             "loop baseline (no call)": lambda s: None}.items():
                runs = []
                for _ in range(5):
                    runs.append(per_call_us(fn, steps, start))
                    start += steps
                results[(label, name)] = statistics.median(runs)
            ck.close()
        assert not built, "the state callable was called although nothing was due"
        if prefix is None:
            return
        for (label, name), us in results.items():
            print(f"{prefix}{label:30s} {name:28s} {us:8.3f} us/call")


if __name__ == "__main__":
    main()
