"""Accelerate integration, as ``accelerator.save_state``/``load_state`` behave: the registered
save/load hooks, random states per process, and ``ProjectConfiguration`` (real accelerate, CPU)."""

from __future__ import annotations

import io
import logging
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from dcp_tiered import CompressedReader, ConfigError, Tier, TieredCheckpointer  # noqa: E402
from dcp_tiered.integrations import accelerate as integration  # noqa: E402
from dcp_tiered.integrations._common import rng_state, set_rng_state  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from gloo_ranks import read_records, record, run_ranks_recording  # noqa: E402


def _prepared(accelerator, seed: int = 0):
    accelerator.free_memory()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, opt)


def _draws() -> tuple:
    """The next numbers of every generator the integration saves."""
    return random.random(), float(np.random.rand()), torch.randn(3).tolist()


def test_save_and_load_hooks_are_called_with_the_documented_arguments(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, _ = _prepared(accelerator)
    calls: list[tuple] = []

    def save_hook(models, weights, output_dir):
        assert models is accelerator._models  # the accelerator's own list, as accelerate passes it
        assert [sorted(w) for w in weights] == [sorted(model.state_dict())]
        calls.append(("save", output_dir))
        weights[0] = {k: torch.full_like(v, 7.0) for k, v in weights[0].items()}  # what is left is saved

    def load_hook(models, input_dir):
        assert models == accelerator._models and models is not accelerator._models
        calls.append(("load", input_dir))

    handles = [accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(load_hook)]
    tiers = [Tier("fast", str(tmp_path / "fast"), every_steps=2, keep=3), Tier("slow", str(tmp_path / "slow"), keep=3)]
    with TieredCheckpointer(tiers, via_fastest=False) as ck:
        integration.save_state(accelerator, ck, 4)  # both tiers due: written on the fastest first
        integration.save_state(accelerator, ck, 5)  # only the slow tier (not through the fast one)
        assert calls == [("save", str(tmp_path / "fast" / "step_000000004")),
                         ("save", str(tmp_path / "slow" / "step_000000005"))]
        ck.wait()
        assert integration.load_state(accelerator, ck) == 5
    assert calls[-1] == ("load", str(tmp_path / "slow" / "step_000000005"))
    assert all(torch.equal(p, torch.full_like(p, 7.0)) for p in model.parameters())  # the hook's weights

    # a load hook that takes a model out of the list loads it itself: it is left alone here
    for h in handles:
        h.remove()
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.pop())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    with TieredCheckpointer(tiers) as ck:
        assert integration.load_state(accelerator, ck) == 5
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


def test_save_hooks_run_only_when_a_save_is_due(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    _prepared(accelerator)
    seen: list[str] = []
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: seen.append(output_dir))
    with TieredCheckpointer([Tier("local", str(tmp_path), every_steps=10, keep=2)]) as ck:
        for step in range(10, 25):
            integration.save_state(accelerator, ck, step)
    assert len(seen) == 2 and all(os.path.basename(d).startswith("step_") for d in seen)


def test_random_states_are_restored_as_after_the_save(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    _prepared(accelerator)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    accelerator.step = 3
    with TieredCheckpointer([Tier("local", str(tmp_path), keep=2)]) as ck:
        integration.save_state(accelerator, ck, 1)
        want = _draws()
        for _ in range(5):
            _draws()
        accelerator.step = 99
        assert integration.load_state(accelerator, ck) == 1
        assert _draws() == want
        assert accelerator.step == 3  # accelerate's gradient-accumulation counter, saved with the random states


def test_random_states_load_with_weights_only() -> None:
    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    want = _draws()
    _draws()
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True))  # no safe_globals: tensors and builtins only
    assert _draws() == want


def test_project_configuration_naming_total_limit_and_iteration(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=config)
    model, _ = _prepared(accelerator)
    for _ in range(4):
        assert integration.save_state(accelerator) is not None  # a save per call, as accelerator.save_state
    assert config.iteration == 4
    ck = integration.project_checkpointer(accelerator)
    assert integration.project_checkpointer(accelerator) is ck  # one per accelerator
    ck.wait()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000000002", "step_000000003"]

    config.iteration = 0
    assert integration.load_state(accelerator) == 3
    assert config.iteration == 4  # the next save continues the numbering
    with integration.TieredAccelerator(accelerator) as ta:  # the same project checkpointer
        assert ta.checkpointer is ck
        ta.save_state()
    assert config.iteration == 5
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000000003", "step_000000004"]


def test_without_checkpointer_or_automatic_naming_is_a_config_error(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    _prepared(accelerator)
    with pytest.raises(ConfigError, match="automatic_checkpoint_naming"):
        integration.save_state(accelerator)


def _rank_worker(rank: int, world_size: int, root: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    out_p = Path(out)

    def check() -> None:
        accelerator = Accelerator(cpu=True)
        assert accelerator.num_processes == world_size and accelerator.process_index == rank
        _prepared(accelerator)
        random.seed(10 + rank)
        np.random.seed(20 + rank)
        torch.manual_seed(30 + rank)
        with TieredCheckpointer([Tier("shared", root, keep=2)]) as ck:
            integration.save_state(accelerator, ck, 1)
            want = _draws()
            (out_p / f"draws.rank{rank}").write_text(repr(want))
            for _ in range(3):
                _draws()
            assert integration.load_state(accelerator, ck) == 1
            assert _draws() == want

    record(out_p, "rng", rank, check)


def test_random_states_per_process_with_two_gloo_ranks_and_a_world_size_change(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ck"
    out, err = run_ranks_recording(_rank_worker, 2, tmp_path, str(root), tmp_path / "out", timeout=400)
    read_records(out, "rng", 2, err)
    draws = [eval((out / f"draws.rank{r}").read_text()) for r in range(2)]
    assert draws[0] != draws[1]  # each process got its own random states back
    keys = CompressedReader(str(root / "step_000000001")).read_metadata().state_dict_metadata
    assert {"rng_0", "rng_1"} <= set(keys)  # one entry per process, none deduplicated away

    # one process restores a checkpoint of two: process 0's states, and a warning
    accelerator = Accelerator(cpu=True)
    _prepared(accelerator)
    with caplog.at_level(logging.WARNING), TieredCheckpointer([Tier("shared", str(root), keep=2)]) as ck:
        assert integration.load_state(accelerator, ck) == 1
        assert _draws() == draws[0]
    assert "saved by 2 process(es) and is restored on 1" in caplog.text


def _scaled_accelerator() -> tuple[Accelerator, torch.nn.Module]:
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    model, _opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # what mixed_precision="fp16" sets up on GPU
    return acc, model


def test_the_grad_scaler_is_saved_and_restored(tmp_path: Path) -> None:
    """Review 14h: accelerator.save_state writes scaler.pt; ours dropped it, so the loss scale restarted
    at its initial value after a resume."""
    acc, _ = _scaled_accelerator()
    acc.scaler.scale(torch.ones(1))
    acc.scaler.update(new_scale=8.0)
    with TieredCheckpointer([Tier("local", str(tmp_path))]) as ck:
        integration.save_state(acc, ck, 1)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with TieredCheckpointer([Tier("local", str(tmp_path))]) as ck:
        assert integration.load_state(acc, ck) == 1
    assert acc.scaler.get_scale() == 8.0


def test_a_checkpoint_without_scaler_state_restores_with_a_warning(tmp_path: Path, caplog) -> None:
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    model, _opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with TieredCheckpointer([Tier("local", str(tmp_path))]) as ck:
        integration.save_state(acc, ck, 1)  # no scaler: nothing saved for it
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with caplog.at_level(logging.WARNING), TieredCheckpointer([Tier("local", str(tmp_path))]) as ck:
        assert integration.load_state(acc, ck) == 1
    assert acc.scaler.get_scale() == 1024.0 and "no GradScaler state" in caplog.text
