"""Training-loop overhead of TieredCheckpointer, async on and off.

Run:  .venv/bin/python -m benchmarks.bench_tiers [--steps 40] [--hidden 1024]

A real training loop (an MLP language-model-sized stack with Adam, CPU) saves through the
three-tier setup of the design, scaled from minutes to seconds (local every 2 s, shared
every 6 s, durable every 12 s with codecs lz4 / zstd / zstd:3).  Reports the time blocked
in ``maybe_save`` as a percent of step time, and compares the blocked time per save with
one plain copy of the state dict to host memory.  Writes the section "tiers" of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    chart_or_note,
    machine_line,
    md_table,
    save_results,
    write_section,
)
from dcp_tiered import Tier, TieredCheckpointer


def build(hidden: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    model = torch.nn.Sequential(*blocks)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def state_of(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def copy_time(sd: dict) -> float:
    """One plain copy of every tensor of the state dict to (fresh) host memory."""
    tensors = [t for part in sd.values() for t in _tensors(part)]
    t0 = time.perf_counter()
    for t in tensors:
        t.clone()
    return time.perf_counter() - t0


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def run(root: Path, async_save: bool, steps: int, hidden: int, layers: int) -> dict:
    model, opt = build(hidden, layers)
    tiers = [
        Tier("local", str(root / "local"), every=2, keep=2, codec="lz4"),
        Tier("shared", str(root / "shared"), every=6, keep=2, codec="zstd"),
        Tier("durable", str(root / "durable"), every=12, keep=2, codec="zstd:3"),
    ]
    ckpt = TieredCheckpointer(tiers, async_save=async_save, optimizer_every=1)
    x = torch.randn(32, hidden)
    blocked, waited, step_times, saves = [], [], [], 0
    t_start = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        report = ckpt.maybe_save(step, state_of(model, opt))
        t2 = time.perf_counter()
        step_times.append(t1 - t0)
        if report is not None:
            saves += 1
            blocked.append(t2 - t1)
            waited.append(report.waited_s)
    t_loop = time.perf_counter() - t_start
    ckpt.close()
    sd = state_of(model, opt)
    raw = sum(t.numel() * t.element_size() for t in _tensors(sd))
    copies = [copy_time(sd) for _ in range(3)]
    return {
        "async": async_save,
        "saves": saves,
        "state_mb": raw / 1e6,
        "step_s": statistics.median(step_times),
        "blocked_total": sum(blocked),
        "blocked_pct": 100 * sum(blocked) / sum(step_times),
        "blocked_per_save": statistics.median(blocked) if blocked else 0.0,
        "staging_per_save": statistics.median([b - w for b, w in zip(blocked, waited)]) if blocked else 0.0,
        "waited_total": sum(waited),
        "copy_s": statistics.median(copies),
        "loop_s": t_loop,
        "promotions": len([r for r in ckpt.promoter.reports if r.kind == "metadata"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a small smoke run (20 steps of a small model)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.hidden, args.layers = 20, 256, 2
    rows, results = [], []
    for async_save in (False, True):
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            r = run(Path(d), async_save, args.steps, args.hidden, args.layers)
        results.append(r)
        rows.append([
            "async" if r["async"] else "sync", f"{r['state_mb']:.0f}", r["saves"], r["promotions"], f"{r['step_s'] * 1000:.0f}",
            f"{r['blocked_per_save'] * 1000:.0f}", f"{r['staging_per_save'] * 1000:.0f}", f"{r['waited_total']:.2f}",
            f"{r['blocked_pct']:.1f}%", f"{r['copy_s'] * 1000:.0f}",
            f"{r['staging_per_save'] / r['copy_s']:.2f}x",
        ])
    cmd = f".venv/bin/python -m benchmarks.bench_tiers --steps {args.steps} --hidden {args.hidden} --layers {args.layers}"
    save_results("tiers", results)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        labels = ["async" if r["async"] else "sync" for r in results]
        ax.bar(labels, [r["blocked_per_save"] * 1000 for r in results], label="blocked per save")
        ax.bar(labels, [r["staging_per_save"] * 1000 for r in results], label="of which own save")
        ax.axhline(results[-1]["copy_s"] * 1000, color="k", ls="--", label="one host copy")
        ax.set_ylabel("ms (median)")
        ax.set_title("TieredCheckpointer.maybe_save: time the loop waits")
        ax.legend()
        return fig

    chart = chart_or_note("tiers", draw)
    table = md_table(
        ["mode", "state MB", "saves", "promotions", "step ms (median)", "blocked ms per save (median)",
         "of which own save ms (median)", "waiting for the previous save, s total", "blocked / step time",
         "one host copy ms", "own save / copy (target < 2x async)"],
        rows,
    )
    write_section(
        "tiers",
        f"## TieredCheckpointer overhead in a training loop\n\n`{cmd}` — {machine_line()}.\n\n"
        "Three tiers scaled to seconds (local lz4 every 2 s, shared zstd every 6 s, durable zstd:3 every 12 s, "
        "all on local disk), model and Adam state saved every time, promotions in the background. "
        "Blocked = time inside `maybe_save` on steps that saved; the percentage is over the steps' compute time.\n\n"
        + table + "\n\n" + chart,
    )
    print(table)


if __name__ == "__main__":
    main()
