"""Child process of tests/test_lightning_io.py: train a small Lightning model with a checkpoint plugin.

``python tests/lightning_io_script.py '{"dir": ..., "io": "compressed"|"torch", "max_steps": 12,
"kill_at": 7 | null, "ckpt_path": "last" | null, "out": FILE, "devices": 1, "resume_to": null}'``: trains with
``ModelCheckpoint(every_n_train_steps=3, save_last=True, save_top_k=-1)``; ``kill_at`` SIGKILLs the
process at the end of that step, ``kill_in_save: n`` inside the n-th save of last.ckpt; at the end the final weights and optimizer state go to ``out``.
``{"runs": [args, ...]}`` does several runs one after the other in this process.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

HIDDEN = 256


class Net(L.LightningModule):
    def __init__(self, hidden: int = HIDDEN, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()  # hyper_parameters: an AttributeDict in the checkpoint
        self.net = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)}


def data(n: int = 24) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=False)


class KillAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_in_save(n: int) -> None:
    """SIGKILL the process in the n-th save of last.ckpt, with its data written and nothing committed."""
    from dcp_tiered.dcp.writer import CompressedWriter

    finish, count = CompressedWriter.finish, [0]

    def killing_finish(self, *args, **kwargs):
        if "last.ckpt" in self.storage.url:
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return finish(self, *args, **kwargs)

    CompressedWriter.finish = killing_finish


def make_io(kind: str):
    if kind == "torch":
        return None
    from dcp_tiered.integrations.lightning import AsyncCompressedCheckpointIO, CompressedCheckpointIO

    return AsyncCompressedCheckpointIO() if kind == "async" else CompressedCheckpointIO()


def trainer(dirpath: str, max_steps: int, kind: str, extra=(), devices: int = 1) -> L.Trainer:
    io = make_io(kind)
    ddp = {"strategy": "ddp", "num_nodes": 1} if devices > 1 else {}
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=devices, **ddp, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, deterministic=True, num_sanity_val_steps=0, limit_val_batches=0,
                     callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=3, save_last=True, save_top_k=-1),
                                *extra],
                     plugins=[io] if io is not None else None)


def main(args: dict) -> None:
    if "runs" in args:  # several runs in one process: one Lightning import
        for run in args["runs"]:
            main(run)
        return
    torch.set_num_threads(1)
    if args.get("kill_in_save"):
        kill_in_save(args["kill_in_save"])
    L.seed_everything(0, verbose=False)
    model = Net()
    extra = [KillAt(args["kill_at"])] if args.get("kill_at") else []
    tr = trainer(args["dir"], args["max_steps"], args["io"], extra, args.get("devices", 1))
    tr.fit(model, data(), ckpt_path=args.get("ckpt_path"))
    if args.get("resume_to"):  # a second fit in the same processes (DDP: no second launch), a fresh model
        model = Net()
        tr = trainer(args["dir"], args["resume_to"], args["io"], (), args.get("devices", 1))
        tr.fit(model, data(), ckpt_path="last")
    if tr.global_rank != 0:
        return
    torch.save({"model": model.state_dict(), "optim": tr.optimizers[0].state_dict(), "step": tr.global_step},
               args["out"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
