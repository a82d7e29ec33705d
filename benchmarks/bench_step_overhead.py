"""Per-step cost of the Lightning callback and the Accelerate helper when no tier is due.

Run:  .venv/bin/python -m benchmarks.bench_step_overhead [--steps 100] [--hidden 256] [--layers 4]

A training loop calls the integration on every step; on most steps no tier is due.  This
times, on one process (CPU):

- Lightning: ``TieredCheckpointCallback.on_train_batch_end`` inside a real ``trainer.fit``
  (an MLP with Adam and a StepLR scheduler), on the steps where nothing was saved;
- Accelerate: ``save_state(accelerator, ckpt, step)`` after ``accelerator.prepare``;

each with tiers scheduled by steps and by wall-clock time (one save at the first step, then
nothing due), and, for comparison, the time to build the state dict once (what every step
cost when the integrations built it unconditionally).  Target: < 0.1 ms per step with
nothing due.  Writes the section "step_overhead" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import machine_line, md_table, save_results, write_section
from dcp_tiered import Tier, TieredCheckpointer

TARGET_MS = 0.1


def mlp(hidden: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    return torch.nn.Sequential(*blocks)


def tier_sets(root: Path) -> dict[str, list[Tier]]:
    return {
        "every_steps": [Tier("local", str(root / "s1"), every_steps=10**9, keep=1),
                        Tier("shared", str(root / "s2"), every_steps=10**9, keep=1)],
        "every (clock)": [Tier("local", str(root / "c1"), every="1h", keep=1),
                          Tier("shared", str(root / "c2"), every="6h", keep=1)],
    }


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def p99_ms(seconds: list[float]) -> float:
    return sorted(seconds)[int(0.99 * (len(seconds) - 1))] * 1e3


def bench_lightning(tiers: list[Tier], steps: int, hidden: int, layers: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from dcp_tiered.integrations.lightning import TieredCheckpointCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(hidden, layers)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-4)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=10)}

    class Timed(TieredCheckpointCallback):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.idle: list[float] = []
            self.build: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            saved_before = self._last_saved
            t0 = time.perf_counter()
            super().on_train_batch_end(trainer, pl_module, *args)
            dt = time.perf_counter() - t0
            if self._last_saved == saved_before:
                self.idle.append(dt)

        def on_train_end(self, trainer, pl_module) -> None:
            for _ in range(5):  # what every step cost when the state dict was built unconditionally
                t0 = time.perf_counter()
                self.state(trainer, pl_module)
                self.build.append(time.perf_counter() - t0)
            super().on_train_end(trainer, pl_module)

    data = DataLoader(TensorDataset(torch.randn(steps * 2, hidden)), batch_size=2)
    cb = Timed(tiers, save_on_train_end=False)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), data)
    return {"idle_steps": len(cb.idle), "idle_ms": median_ms(cb.idle), "idle_p99_ms": p99_ms(cb.idle),
            "build_ms": median_ms(cb.build)}


def bench_accelerate(tiers: list[Tier], steps: int, hidden: int, layers: int) -> dict:
    from accelerate import Accelerator

    from dcp_tiered.integrations.accelerate import save_state, state_dict

    accelerator = Accelerator(cpu=True)
    accelerator.free_memory()
    model = mlp(hidden, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt, sched = accelerator.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=10))
    accelerator.backward(model(torch.randn(2, hidden)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    idle: list[float] = []
    with TieredCheckpointer(tiers) as ckpt:
        save_state(accelerator, ckpt, 0)  # the first save; afterwards nothing is due
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            report = save_state(accelerator, ckpt, step)
            dt = time.perf_counter() - t0
            if report is None:
                idle.append(dt)
    build = []
    for _ in range(5):
        t0 = time.perf_counter()
        state_dict(accelerator)
        build.append(time.perf_counter() - t0)
    return {"idle_steps": len(idle), "idle_ms": median_ms(idle), "idle_p99_ms": p99_ms(idle), "build_ms": median_ms(build)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--no-doc", action="store_true", help="print only; do not write docs/benchmarks.md")
    args = ap.parse_args()
    cmd = (f".venv/bin/python -m benchmarks.bench_step_overhead --steps {args.steps} --hidden {args.hidden} "
           f"--layers {args.layers}")
    params = sum(p.numel() for p in mlp(args.hidden, args.layers).parameters())
    rows, data = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, bench in (("Lightning callback", bench_lightning), ("Accelerate save_state", bench_accelerate)):
            for label, tiers in tier_sets(Path(tmp) / name.split()[0]).items():
                r = bench(tiers, args.steps, args.hidden, args.layers)
                data.append({"integration": name, "tiers": label, **r})
                verdict = "met" if r["idle_ms"] < TARGET_MS else "**missed**"
                rows.append([name, label, r["idle_steps"], f"{r['idle_ms']:.4f}", f"{r['idle_p99_ms']:.4f}", verdict,
                             f"{r['build_ms']:.1f}"])
    table = md_table(["integration", "tier schedules", "steps with nothing due", "ms per step (median)",
                      "ms per step (p99)", f"target < {TARGET_MS} ms", "building the state dict, ms (avoided)"], rows)
    print(table)
    if args.no_doc:
        return
    save_results("step_overhead", {"params": params, "rows": data})
    write_section(
        "step_overhead",
        f"## Integrations: per-step cost when nothing is due\n\n`{cmd}` — {machine_line()}.\n\n"
        f"An MLP of {params / 1e6:.1f} M parameters with Adam and StepLR, one process, tiers on local disk "
        "that are never due after the first save (every_steps=10**9: only step 0, if offered; every=1h: the first step). Measured: the time inside "
        "`TieredCheckpointCallback.on_train_batch_end` during a real `trainer.fit`, and inside Accelerate "
        "`save_state(accelerator, ckpt, step)`, on the steps where nothing was saved. The last column is the "
        "time to build the model + optimizer (+ trainer) state dict once: what every step cost before the "
        "integrations built it only when a tier is due (`maybe_save` with a callable state). The p99 column "
        f"includes preemption by other processes (load average {os.getloadavg()[0]:.1f} at the end of the run).\n\n"
        + table,
    )


if __name__ == "__main__":
    main()
