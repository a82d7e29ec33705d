"""Lightning and Accelerate integrations, with the real packages on CPU, and their examples."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dcp_tiered import Tier, TieredCheckpointer

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_import_dcp_tiered_never_imports_frameworks() -> None:
    code = (
        "import sys, dcp_tiered\n"
        "from dcp_tiered import TieredCheckpointer, CompressedReader, CompressedWriter\n"
        "import dcp_tiered.dcp.broadcast, dcp_tiered.integrations, dcp_tiered.tiers.checkpointer\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'accelerate'))\n"
        "assert not bad, bad\n"
    )
    r = _run(["-c", code])
    assert r.returncode == 0, r.stderr


# -- Lightning -----------------------------------------------------------------------------------

L = pytest.importorskip("lightning")
pytest.importorskip("accelerate")


def _lightning_fit(max_steps: int, callbacks: list, seed: int = 0):
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}

    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).cos()), batch_size=4)  # 4 batches per epoch
    model = Tiny()
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return model, trainer


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_lightning_callback_saves_and_restores(tmp_path: Path) -> None:
    from dcp_tiered.integrations.lightning import TieredCheckpointCallback

    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=2, codec="lz4"),
             Tier("durable", str(tmp_path / "durable"), every_steps=4, keep=2)]
    reference, _ = _lightning_fit(4, [])
    cb = TieredCheckpointCallback(tiers, async_save=True)
    first, t1 = _lightning_fit(4, [cb])
    assert cb.restored_step is None and cb.checkpointer is None  # closed at fit end
    # nothing to restore: the callback left training untouched (same weights as without it)
    assert _same_params(first, reference)
    saved = sorted(p.name for p in (tmp_path / "local").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_000000003", "step_000000004"]
    # the durable tier was due at step 1 (and would be again at step 5): promoted before close returned
    assert (tmp_path / "durable" / "step_000000001" / ".metadata").exists()

    # a new module (other initial weights) resumes at step 4: max_steps=4 leaves nothing to train
    cb2 = TieredCheckpointCallback(tiers)
    second, t2 = _lightning_fit(4, [cb2], seed=99)
    assert cb2.restored_step == 4 and t2.global_step == 4
    assert _same_params(second, first)
    o1, o2 = t1.optimizers[0].state_dict(), t2.optimizers[0].state_dict()
    for k, st in o1["state"].items():
        for name, v in st.items():
            assert torch.equal(v, o2["state"][k][name]), (k, name)
    assert t2.lr_scheduler_configs[0].scheduler.state_dict() == t1.lr_scheduler_configs[0].scheduler.state_dict()

    # resuming at an epoch boundary and training on equals an uninterrupted run, bit for bit
    cb3 = TieredCheckpointCallback(tiers)
    resumed, t3 = _lightning_fit(7, [cb3], seed=5)
    straight, _ = _lightning_fit(7, [])
    assert cb3.restored_step == 4 and t3.global_step == 7
    assert _same_params(resumed, straight)


def test_lightning_example_runs() -> None:
    r = _run(["examples/lightning_example.py", "--steps", "8", "--crash-at", "5"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "restored step 5; finished at step 8; weights equal to an uninterrupted run: True" in r.stdout, r.stdout


# -- Accelerate ------------------------------------------------------------------------------------


def _prepared(accelerator, seed: int):
    accelerator.free_memory()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return accelerator.prepare(model, opt, sched)


def _train(accelerator, model, opt, sched, steps: range, ckpt=None) -> None:
    from dcp_tiered.integrations.accelerate import save_state

    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(3, 5, generator=g)
        accelerator.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        if ckpt is not None:
            save_state(accelerator, ckpt, step, extra={"seen": step})


def test_accelerate_save_and_load_state(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from dcp_tiered.integrations.accelerate import TieredAccelerator, load_state

    accelerator = Accelerator(cpu=True)
    tiers = [Tier("local", str(tmp_path / "ck"), every_steps=2, keep=2)]
    with TieredCheckpointer(tiers) as ckpt:
        model, opt, sched = _prepared(accelerator, 0)
        assert load_state(accelerator, ckpt) is None
        assert not opt.optimizer.state  # nothing restored: the optimizer was left as it was
        _train(accelerator, model, opt, sched, range(1, 6), ckpt)  # saves 1, 3, 5
        want_params = [p.detach().clone() for p in model.parameters()]
        want_opt = opt.optimizer.state_dict()
        want_sched = sched.scheduler.state_dict()

    with TieredAccelerator(accelerator, tiers) as ta:
        model, opt, sched = _prepared(accelerator, 42)
        extra = {"seen": -1}
        assert ta.load_state(extra=extra) == 5
        assert extra == {"seen": 5}
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want_params))
        got_opt = opt.optimizer.state_dict()
        for k, st in want_opt["state"].items():
            for name, v in st.items():
                assert torch.equal(v, got_opt["state"][k][name]), (k, name)
        assert got_opt["param_groups"][0]["lr"] == want_opt["param_groups"][0]["lr"]
        assert sched.scheduler.state_dict() == want_sched
        _train(accelerator, model, opt, sched, range(6, 9), None)

    straight = _prepared(accelerator, 0)
    _train(accelerator, *straight, range(1, 9), None)
    assert _same_params(model, straight[0])


def test_accelerate_example_runs() -> None:
    r = _run(["examples/accelerate_example.py", "--steps", "9", "--crash-at", "5"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "restored step 5" in r.stdout and "weights equal to an uninterrupted run: True" in r.stdout, r.stdout
