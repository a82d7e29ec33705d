"""Starting gloo process groups for multi-rank tests: one start runs several checks, each rank
records ``ok`` or its traceback per check, and a hang becomes a failure instead of a stuck run.

The ranks fork from the tests' forkserver (:mod:`forked`), which imported torch, DCP and dcp_tiered
once per test process; each rank takes the caller's current environment and working directory, as a
spawned one would."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import torch.distributed as dist
import forked
import torch.multiprocessing as mp
from speed import scaled

def rank_context():
    """The forkserver context every multi-rank test starts its ranks from (torch and dcp_tiered preloaded)."""
    return forked.context()


def _entry(rank: int, fn, world_size: int, store: str, args: tuple, pg_timeout: float, env: dict, cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the forkserver's at its start
    os.chdir(cwd)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # the async process executor's daemons meet here
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, tmp: Path, *args, timeout: float = 240.0, pg_timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (file:// store under ``tmp``).

    ``timeout`` and ``pg_timeout`` are quiet-machine seconds: both are :func:`speed.scaled` here."""
    timeout, pg_timeout = scaled(timeout), scaled(pg_timeout)
    store = tmp / f"store_{world_size}_{time.monotonic_ns()}"
    rank_context()
    ctx = mp.start_processes(_entry, args=(fn, world_size, str(store), args, pg_timeout, dict(os.environ), os.getcwd()),
                             nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(scaled(5))


def run_ranks_recording(fn, world_size: int, tmp: Path, data: str, out: Path, *args, timeout: float = 240.0
                        ) -> tuple[Path, str | None]:
    """:func:`run_ranks` of ``fn(rank, world_size, data, str(out), *args)`` into a fresh records folder
    ``out``; returns it and the spawn's traceback (None if it ran), which every check lacking a record reports."""
    out.mkdir()
    try:
        run_ranks(fn, world_size, tmp, data, str(out), *args, timeout=timeout)
        return out, None
    except BaseException:  # noqa: BLE001 - reported by every check that lacks a record
        return out, traceback.format_exc()


def record(out: Path, check: str, rank: int, fn) -> None:
    """Run one check on this rank, record ``ok`` or the traceback, then re-sync the ranks."""
    try:
        fn()
        status = "ok"
    except BaseException:  # noqa: BLE001 - CheckpointException is a BaseException
        status = traceback.format_exc()
    (out / f"{check}.rank{rank}").write_text(status)
    dist.barrier()


def read_records(out: Path, check: str, world_size: int, spawn_error: str | None) -> None:
    """Assert every rank recorded ``ok`` for ``check``."""
    problems = []
    for r in range(world_size):
        f = out / f"{check}.rank{r}"
        if not f.exists():
            problems.append(f"rank {r}: no record (the ranks crashed or hung)\n{spawn_error or ''}")
        elif (s := f.read_text()) != "ok":
            problems.append(f"rank {r}:\n{s}")
    assert not problems, "\n".join(problems)
