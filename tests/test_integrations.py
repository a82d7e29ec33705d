"""Lightning and Accelerate integrations, with the real packages on CPU, and their examples."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from speed import scaled
import torch

from dcp_tiered import Tier, TieredCheckpointer

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(timeout))


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


class _Tiny(L.LightningModule):
    """A tiny regression module (Adam, StepLR) whose checkpoint hooks add and read one value."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["tiny_extra"] = {"saved_at": self.trainer.global_step}

    def on_load_checkpoint(self, checkpoint) -> None:
        self.loaded_extra = checkpoint.get("tiny_extra")


def _tiny_data(samples: int, batch_size: int):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).cos()), batch_size=batch_size)


def _lightning_fit(max_steps: int, callbacks: list, seed: int = 0, *, batches: int = 4, ckpt_path: str | None = None,
                   precision: bool = False, caught: list | None = None, strategy=None, **trainer_options):
    """Fit a tiny module (Adam, StepLR; ``batches`` batches per epoch); ``precision``: fp16
    AMP with a GradScaler whose scale changes every 2 steps; ``caught`` collects warnings."""
    from lightning.pytorch.plugins import MixedPrecision

    data = _tiny_data(4 * batches, 4)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2))]
    model = _Tiny(seed)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        plugins=plugins if precision else None, **({"strategy": strategy} if strategy else {}),
                        **trainer_options)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    if caught is not None:
        caught.extend(str(w.message) for w in seen)
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
    # the durable tier was due at step 4 (a multiple of its every_steps): promoted before close returned
    assert (tmp_path / "durable" / "step_000000004" / ".metadata").exists()

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


class _Counter(L.Callback):
    """A stateful callback (an int and a tensor), as EarlyStopping or EMA callbacks are."""

    def __init__(self) -> None:
        self.batches, self.loss_sum = 0, torch.zeros(())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        self.loss_sum = self.loss_sum + outputs["loss"].detach().float()

    def state_dict(self) -> dict:
        return {"batches": self.batches, "loss_sum": self.loss_sum.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.batches, self.loss_sum = state["batches"], state["loss_sum"]


class _Probe(L.Callback):
    """Records what ``trainer.save_checkpoint`` would write: after each batch, and on fit start."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.crash_at, self.dumps, self.at_fit_start = crash_at, {}, None

    def _dump(self, trainer) -> dict:
        import copy

        return copy.deepcopy(trainer._checkpoint_connector.dump_checkpoint())

    def on_fit_start(self, trainer, pl_module) -> None:
        self.at_fit_start = self._dump(trainer)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.dumps[trainer.global_step] = self._dump(trainer)
        if trainer.global_step == self.crash_at:
            raise RuntimeError("simulated crash")


def _counting_callback():
    """A TieredCheckpointCallback class counting how often it builds the state dict."""
    from dcp_tiered.integrations.lightning import TieredCheckpointCallback

    class Counting(TieredCheckpointCallback):
        built = 0

        def state(self, trainer, pl_module):
            type(self).built += 1
            return super().state(trainer, pl_module)

    return Counting


def _assert_same(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, (path, a, b)


def test_lightning_resume_restores_everything_save_checkpoint_holds(tmp_path: Path) -> None:
    """Interrupted at step 10, resumed from step 9 (an epoch boundary): the trainer holds exactly
    what ``trainer.save_checkpoint`` held at step 9 (loops, optimizer, scheduler, callback and
    GradScaler states), training on equals an uninterrupted run bit for bit, the state dict was
    built only on the steps that saved, and the last step is saved when training ends."""
    from dcp_tiered.integrations.lightning import TieredCheckpointCallback

    Counting = _counting_callback()
    tiers = [Tier("local", str(tmp_path / "ck"), every_steps=3, keep=3)]  # due at steps 3, 6, 9, 12, 15
    probe = _Probe(crash_at=10)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _lightning_fit(12, [_Counter(), Counting(tiers), probe], batches=3, precision=True)
    assert Counting.built == 3  # steps 3, 6, 9: never on the 7 steps where nothing was due
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000000003", "step_000000006", "step_000000009"]
    assert probe.dumps[9]["MixedPrecision"]["scale"] != 2.0**8  # the GradScaler state did change

    Counting.built = 0
    counter, cb, probe2 = _Counter(), Counting(tiers), _Probe()
    resumed, trainer = _lightning_fit(12, [counter, cb, probe2], seed=7, batches=3, precision=True)
    assert cb.restored_step == 9 and trainer.global_step == 12
    want, got = probe.dumps[9], probe2.at_fit_start
    for key in ("state_dict", "loops", "callbacks", "optimizer_states", "lr_schedulers", "MixedPrecision",
                "epoch", "global_step", "tiny_extra"):
        _assert_same(want[key], got[key], key)
    assert resumed.loaded_extra == {"saved_at": 9}  # the module's on_save/on_load_checkpoint hooks ran
    assert Counting.built == 1  # step 12: due, and the end of training (saved once)
    assert (tmp_path / "ck" / "step_000000012" / ".metadata").exists()

    straight, straight_trainer = _lightning_fit(12, [_Counter()], batches=3, precision=True)
    assert _same_params(resumed, straight)
    assert trainer.precision_plugin.state_dict() == straight_trainer.precision_plugin.state_dict()
    assert counter.batches == 12

    # the step saved at the end resumes like any other, exactly
    cb3 = TieredCheckpointCallback(tiers)
    resumed3, t3 = _lightning_fit(15, [cb3], seed=3, batches=3, precision=True)
    assert cb3.restored_step == 12 and t3.global_step == 15
    straight3, _ = _lightning_fit(15, [], batches=3, precision=True)
    assert _same_params(resumed3, straight3)


def test_lightning_gradient_accumulation_saves_after_optimizer_steps_only(tmp_path: Path) -> None:
    """With accumulate_grad_batches=2 the callback sees each global step on two batches: it
    offers each step once, never step 0 (before any optimizer step)."""
    Counting = _counting_callback()
    _lightning_fit(3, [Counting([Tier("local", str(tmp_path / "ck"), every_steps=1, keep=10)])],
                   accumulate_grad_batches=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000000001", "step_000000002", "step_000000003"]
    assert Counting.built == 3


def test_lightning_save_on_train_end_can_be_turned_off(tmp_path: Path) -> None:
    from dcp_tiered.integrations.lightning import TieredCheckpointCallback

    tiers = [Tier("local", str(tmp_path / "ck"), every_steps=4, keep=3)]
    _lightning_fit(6, [TieredCheckpointCallback(tiers, save_on_train_end=False)])
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000000004"]  # not the last step, 6
    _lightning_fit(6, [TieredCheckpointCallback([Tier("local", str(tmp_path / "ck2"), every_steps=4, keep=3)])])
    assert sorted(p.name for p in (tmp_path / "ck2").iterdir()) == ["step_000000004", "step_000000006"]


@pytest.mark.parametrize("after_setup", [False, True], ids=["restore-before-fit-start", "restore-after-setup"])
def test_lightning_ckpt_path_wins_over_the_tiered_restore(tmp_path: Path, after_setup: bool) -> None:
    """``fit(ckpt_path=...)``: Lightning restores that checkpoint alone (weights, optimizer,
    loops); the callback warns and does not restore its own newer checkpoint.  Also with a
    strategy that restores ``ckpt_path`` only after ``on_fit_start`` (as FSDP does)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from dcp_tiered.integrations.lightning import TieredCheckpointCallback

    class RestoresAfterSetup(SingleDeviceStrategy):
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

    def strategy():
        return RestoresAfterSetup(device=torch.device("cpu")) if after_setup else None

    tiers = [Tier("local", str(tmp_path / "ck"), every_steps=1, keep=2)]
    _lightning_fit(8, [TieredCheckpointCallback(tiers)])  # the tiers hold step 8
    _, t = _lightning_fit(3, [])
    t.save_checkpoint(tmp_path / "step3.ckpt")

    caught: list[str] = []
    cb = TieredCheckpointCallback(tiers)
    model, trainer = _lightning_fit(6, [cb], seed=9, ckpt_path=str(tmp_path / "step3.ckpt"), caught=caught,
                                    strategy=strategy())
    assert any("ckpt_path" in w and "tiered restore" in w for w in caught), caught
    assert cb.restored_step is None and trainer.global_step == 6
    reference, _ = _lightning_fit(6, [], seed=9, ckpt_path=str(tmp_path / "step3.ckpt"), strategy=strategy())
    assert _same_params(model, reference)  # not the weights of the tiered step 8
    assert (tmp_path / "ck" / "step_000000006").exists()  # and it keeps saving on its schedule


_DDP_SCRIPT = """
import hashlib, json, sys, warnings
sys.path.insert(0, {tests!r})
import lightning as L
from dcp_tiered import Tier
from dcp_tiered.integrations.lightning import TieredCheckpointCallback
from test_integrations import _Tiny, _tiny_data

warnings.filterwarnings("ignore")


def fit(name, root, max_steps, seed, tiered):
    cb = TieredCheckpointCallback([Tier("local", root, every_steps=2, keep=3)], broadcast=tiered == "broadcast")
    model = _Tiny(seed)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb] if tiered != "0" else [])
    trainer.fit(model, _tiny_data(16, 2))  # 4 batches per rank and epoch
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print("@@RESULT@@" + json.dumps({{"run": name, "rank": trainer.global_rank, "restored": cb.restored_step,
                                     "step": trainer.global_step, "digest": digest}}), flush=True)


if __name__ == "__main__":
    # each argument one fit, "name:root:max_steps:seed:tiered" (tiered "0", "1" or "broadcast"), one after the
    # other on the same 2 DDP ranks (the second Trainer finds their process group set up)
    for arg in sys.argv[1:]:
        name, root, max_steps, seed, tiered = arg.split(":")
        fit(name, root, int(max_steps), int(seed), tiered)
"""


def test_lightning_ddp_two_ranks_resume_exactly(tmp_path: Path) -> None:
    """Lightning DDP on 2 gloo ranks: both ranks save together, restore the same step (each
    reading, or with broadcast=True one reading for both), and the resumed run ends with the
    weights of an uninterrupted one."""
    import json
    import re

    script = tmp_path / "ddp_fit.py"
    script.write_text(_DDP_SCRIPT.format(tests=str(ROOT / "tests")))

    def start(*fits: tuple[str, str, int, int, str]) -> list[subprocess.Popen]:
        """Both ranks of one DDP job, started here as torchrun would (LOCAL_RANK set: Lightning launches
        nothing), so that they import at once instead of rank 1 only once rank 0's fit began."""
        with socket.socket() as s:  # its own rendezvous port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [f"{name}:{tmp_path / root}:{max_steps}:{seed}:{tiered}" for name, root, max_steps, seed, tiered in fits]
        return [subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank)))
                for rank in range(2)]

    def result(procs: list[subprocess.Popen], *names: str) -> dict[str, list[dict]]:
        outs = []
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=scaled(600)))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise
        stdout, stderr = "".join(o for o, _ in outs), "".join(e for _, e in outs)
        assert [p.returncode for p in procs] == [0, 0], stdout[-2000:] + stderr[-4000:]
        out = [json.loads(m) for m in re.findall(r"@@RESULT@@(\{[^{}]*\})", stdout)]
        by_run = {run: [o for o in out if o["run"] == run] for run in names}
        assert all(sorted(o["rank"] for o in r) == [0, 1] for r in by_run.values()), stdout[-2000:] + stderr[-2000:]
        return by_run

    # One DDP job (2 ranks) per pair of fits, one after the other in it: the uninterrupted run and the
    # first one, then in a new job (a restart: processes that never saw the first run) both resumes.
    runs = result(start(("straight", "unused", 8, 0, "0"), ("first", "ck", 4, 0, "1")), "straight", "first")
    first, straight = runs["first"], runs["straight"]
    assert all(o["restored"] is None for o in first)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000000002", "step_000000004"]
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    # the second with broadcast=True: one rank reads, the other receives
    runs = result(start(("resumed", "ck", 8, 5, "1"), ("broadcast", "ck2", 8, 5, "broadcast")), "resumed", "broadcast")
    resumed, broadcast = runs["resumed"], runs["broadcast"]
    assert all(o["restored"] == 4 and o["step"] == 8 for o in resumed + broadcast), (resumed, broadcast)
    assert len({o["digest"] for o in straight}) == 1
    assert {o["digest"] for o in resumed} == {o["digest"] for o in broadcast} == {o["digest"] for o in straight}


def test_lightning_example_runs() -> None:
    # crash at 11: the newest save, 10, is a multiple of every_steps and an epoch end (exact resume)
    r = _run(["examples/lightning_example.py", "--steps", "12", "--crash-at", "11"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "restored step 10; finished at step 12; weights equal to an uninterrupted run: True" in r.stdout, r.stdout


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
        _train(accelerator, model, opt, sched, range(1, 7), ckpt)  # saves 2, 4, 6
        want_params = [p.detach().clone() for p in model.parameters()]
        want_opt = opt.optimizer.state_dict()
        want_sched = sched.scheduler.state_dict()

    with TieredAccelerator(accelerator, tiers) as ta:
        model, opt, sched = _prepared(accelerator, 42)
        extra = {"seen": -1}
        assert ta.load_state(extra=extra) == 6
        assert extra == {"seen": 6}
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want_params))
        got_opt = opt.optimizer.state_dict()
        for k, st in want_opt["state"].items():
            for name, v in st.items():
                assert torch.equal(v, got_opt["state"][k][name]), (k, name)
        assert got_opt["param_groups"][0]["lr"] == want_opt["param_groups"][0]["lr"]
        assert sched.scheduler.state_dict() == want_sched
        _train(accelerator, model, opt, sched, range(7, 9), None)

    straight = _prepared(accelerator, 0)
    _train(accelerator, *straight, range(1, 9), None)
    assert _same_params(model, straight[0])


def test_accelerate_builds_the_state_only_when_a_save_is_due(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    import dcp_tiered.integrations.accelerate as integration

    built: list[int] = []
    real = integration.state_dict
    monkeypatch.setattr(integration, "state_dict", lambda acc, extra=None: built.append(1) or real(acc, extra))
    extras: list[int] = []
    accelerator = Accelerator(cpu=True)
    model, opt, sched = _prepared(accelerator, 0)
    with TieredCheckpointer([Tier("local", str(tmp_path / "ck"), every_steps=2, keep=5)]) as ckpt:
        for step in range(1, 7):
            integration.save_state(accelerator, ckpt, step, extra={"n": step})
    assert len(built) == 3  # steps 2, 4, 6
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000000002", "step_000000004", "step_000000006"]
    # extra as a callable: built only when due as well
    with TieredCheckpointer([Tier("local", str(tmp_path / "ck2"), every_steps=2, keep=5)]) as ckpt:
        for step in range(1, 7):
            integration.save_state(accelerator, ckpt, step, extra=lambda: extras.append(1) or {"n": len(extras)})
        extra = {"n": 0}
        assert integration.load_state(accelerator, ckpt, extra=extra) == 6 and extra == {"n": 3}
    assert len(extras) == 3


def test_accelerate_example_runs() -> None:
    r = _run(["examples/accelerate_example.py", "--steps", "9", "--crash-at", "5"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "restored step 4" in r.stdout and "weights equal to an uninterrupted run: True" in r.stdout, r.stdout
