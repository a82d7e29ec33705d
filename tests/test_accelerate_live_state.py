"""Accelerate: ``save_state`` before the optimizer ever stepped leaves training as it would be
without the save (the state-dict helper initialised AdamW with a zero-lr step, leaving ``step=1``:
after 5 real steps Adam's step was 6 and the weights differed), bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

from dcp_tiered import Tier, TieredCheckpointer  # noqa: E402
from dcp_tiered.integrations import accelerate as integration  # noqa: E402


def _run(tmp_path, save_first: bool) -> tuple:
    accelerator = Accelerator(cpu=True)
    accelerator.free_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = accelerator.prepare(model, opt)
    if save_first:
        with TieredCheckpointer([Tier("local", str(tmp_path / "tier"))]) as ck:
            assert integration.save_state(accelerator, ck, 0, force=True) is not None
    for step in range(5):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    return ([p.detach().clone() for p in model.parameters()],
            [float(s["step"]) for s in inner.state.values()])


def test_save_state_before_the_first_step_changes_nothing(tmp_path):
    with_save, without = _run(tmp_path / "a", True), _run(tmp_path / "b", False)
    assert with_save[1] == without[1] == [5.0] * len(without[1]), (with_save[1], without[1])
    assert all(torch.equal(a, b) for a, b in zip(with_save[0], without[0]))


def test_a_save_pre_hook_can_write_next_to_the_checkpoint(tmp_path):
    """Accelerate creates ``output_dir`` before it calls the save hooks; the documented hook pattern
    writes a file there (it failed: the directory did not exist yet)."""
    accelerator = Accelerator(cpu=True)
    accelerator.free_memory()
    net = torch.nn.Linear(3, 2)
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def hook(models, weights, output_dir):
        with open(f"{output_dir}/hook.json", "w") as f:
            f.write("{}")

    handle = accelerator.register_save_state_pre_hook(hook)
    try:
        with TieredCheckpointer([Tier("local", str(tmp_path / "tier"))]) as ck:
            assert integration.save_state(accelerator, ck, 3, force=True).ok
        assert (tmp_path / "tier" / "step_000000003" / "hook.json").is_file()
        assert (tmp_path / "tier" / "step_000000003" / ".metadata").is_file()
    finally:
        handle.remove()
