"""Accelerate + TieredCheckpointer: train, "crash", resume from the newest checkpoint.

    python examples/accelerate_example.py [--dir DIR] [--steps 12] [--crash-at 7]
    accelerate launch --cpu --num_processes 2 examples/accelerate_example.py --dir /shared/ckpt

Trains a tiny model with ``Accelerator``; ``save_state`` is called every step and hands the
prepared model, optimizer and scheduler to a ``TieredCheckpointer`` when a tier is due
(every 2 steps; on the other steps nothing is built).  The run stops at ``--crash-at``; a fresh process state (new model with other
initial weights, new optimizer) resumes with ``load_state`` and finishes; the final
weights are compared with an uninterrupted run.  Needs ``pip install dcp-tiered[accelerate]``.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from accelerate import Accelerator

from dcp_tiered import Tier, TieredCheckpointer
from dcp_tiered.integrations.accelerate import load_state, save_state


def prepared(accelerator: Accelerator, seed: int):
    # A new "process": forget what this accelerator prepared before (save_state saves
    # everything registered with it).
    accelerator.free_memory()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return accelerator.prepare(model, opt, sched)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train(accelerator, model, opt, sched, start: int, stop: int, ckpt: TieredCheckpointer | None) -> None:
    for step in range(start, stop + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if ckpt is not None:
            # called every step; the state dict (and extra) is built only when a tier is due
            save_state(accelerator, ckpt, step, extra=lambda: {"last_loss": float(loss)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--crash-at", type=int, default=7)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    accelerator = Accelerator(cpu=True)
    root = args.dir or tempfile.mkdtemp(prefix="dcp_tiered_accelerate_")
    tiers = [Tier("local", f"{root}/local", every_steps=2, keep=2, codec="lz4")]

    with TieredCheckpointer(tiers) as ckpt:  # created after Accelerator(): it sees the process group
        model, opt, sched = prepared(accelerator, seed=0)
        train(accelerator, model, opt, sched, 1, args.crash_at, ckpt)

    with TieredCheckpointer(tiers) as ckpt:
        model, opt, sched = prepared(accelerator, seed=123)  # other initial weights: restore must overwrite them
        extra = {"last_loss": 0.0}
        start = load_state(accelerator, ckpt, extra=extra)
        train(accelerator, model, opt, sched, (start or 0) + 1, args.steps, ckpt)

    ref_model, ref_opt, ref_sched = prepared(accelerator, seed=0)
    train(accelerator, ref_model, ref_opt, ref_sched, 1, args.steps, None)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    if accelerator.is_main_process:
        print(f"restored step {start} (loss then {extra['last_loss']:.4f}); finished at step {args.steps}; "
              f"weights equal to an uninterrupted run: {same}")
        print(f"checkpoints under {root}")


if __name__ == "__main__":
    main()
