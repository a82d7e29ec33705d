"""Lightning + TieredCheckpointer: train, "crash", resume from the newest checkpoint.

    python examples/lightning_example.py [--dir DIR] [--steps 12] [--crash-at 5]

A tiny regression model is trained with a ``TieredCheckpointCallback`` (a fast local tier
every 5 steps, a compressed "durable" tier every 10 steps, at multiples of N; the durable copies are promoted in
the background).  The first fit crashes (an exception) at ``--crash-at``; the second fit,
with a fresh model, resumes from the newest checkpoint (weights, optimizer, scheduler, loops
and callback states), finishes, and saves its last step when training ends.  Its final
weights are compared with an uninterrupted run.  Needs ``pip install dcp-tiered[lightning]``.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

from dcp_tiered import Tier
from dcp_tiered.integrations.lightning import TieredCheckpointCallback

BATCHES_PER_EPOCH = 5


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)}


class CrashAt(L.Callback):
    """Simulates a crash after the given step (after the checkpoint callback ran for it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES_PER_EPOCH * 4, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)


def fit(max_steps: int, callbacks: list) -> tuple[Regressor, L.Trainer]:
    model = Regressor()
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, data())
    return model, trainer


def tiers(root: str) -> list[Tier]:
    return [Tier("local", f"{root}/local", every_steps=5, keep=2, codec="lz4"),
            Tier("durable", f"{root}/durable", every_steps=10, keep=3, codec="zstd")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--crash-at", type=int, default=5, help="steps of the first, interrupted run")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    root = args.dir or tempfile.mkdtemp(prefix="dcp_tiered_lightning_")

    try:
        fit(args.steps, [TieredCheckpointCallback(tiers(root)), CrashAt(args.crash_at)])
    except RuntimeError as exc:
        print(exc)
    cb = TieredCheckpointCallback(tiers(root))  # save_on_train_end=True: the last step is saved too
    resumed, trainer = fit(args.steps, [cb])
    reference, _ = fit(args.steps, [])
    same = all(torch.equal(a, b) for a, b in zip(resumed.parameters(), reference.parameters()))
    print(f"restored step {cb.restored_step}; finished at step {trainer.global_step}; "
          f"weights equal to an uninterrupted run: {same}")
    local = sorted(p.name for p in Path(root, "local").iterdir() if p.name.startswith("step_"))
    print(f"checkpoints under {root}; local tier: {local}")


if __name__ == "__main__":
    main()
