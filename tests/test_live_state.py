"""Neither a save nor a restore that finds nothing may change the live training state.

The DCP tutorial's ``AppState.state_dict()`` calls ``get_state_dict(model, optimizer)``, which
initialises an optimizer that has not stepped yet with a zero-lr step: AdamW then holds
``step=1``, so the run after ``start = ckpt.restore(state) or 0`` on an empty tier, or after a
save before the first step, differed from the same run without the library (bias corrections,
hence every weight).  Checked bit for bit against a run without the library.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dcp_tiered import Tier, TieredCheckpointer


class AppState(Stateful):
    """The DCP tutorial's wrapper (``torch.distributed.checkpoint`` recipe)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _train(tmp_path, steps: int, *, restore: bool, save_first: bool, async_save: bool = False) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = {"app": AppState(model, optim)}
    ckpt = None
    if restore or save_first:
        ckpt = TieredCheckpointer([Tier("local", str(tmp_path / "tier"), every_steps=1000)], async_save=async_save)
    start = 0
    if restore:
        assert ckpt.restore(state) is None  # nothing to restore
    if save_first:
        ckpt.save_now(0, state)  # before the optimizer ever stepped
        ckpt.wait()
    for step in range(start, steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    if ckpt is not None:
        ckpt.close()
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for i, s in
             enumerate(optim.state.values())})


def _same(a: tuple, b: tuple) -> None:
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma), "weights differ"
    assert oa.keys() == ob.keys()
    for i in oa:
        assert oa[i].keys() == ob[i].keys()
        for k in oa[i]:
            va, vb = oa[i][k], ob[i][k]
            assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb, f"optimizer state {i}.{k}: {va} != {vb}"


def test_a_restore_that_finds_nothing_leaves_the_run_as_without_the_library(tmp_path):
    _same(_train(tmp_path / "a", 5, restore=True, save_first=False), _train(tmp_path / "b", 5, restore=False, save_first=False))


def test_a_save_before_the_first_step_leaves_the_run_as_without_the_library(tmp_path):
    _same(_train(tmp_path / "a", 5, restore=False, save_first=True), _train(tmp_path / "b", 5, restore=False, save_first=False))


def test_an_async_save_before_the_first_step_leaves_the_run_as_without_the_library(tmp_path):
    _same(_train(tmp_path / "a", 5, restore=False, save_first=True, async_save=True),
          _train(tmp_path / "b", 5, restore=False, save_first=False))


def test_a_save_before_the_first_step_restores_into_a_fresh_run(tmp_path):
    """What the save holds is still restorable (DCP initialised the optimizer's state for it)."""
    _train(tmp_path / "a", 0, restore=False, save_first=True)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with TieredCheckpointer([Tier("local", str(tmp_path / "a" / "tier"))]) as ckpt:
        assert ckpt.restore({"app": AppState(model, optim)}) == 0
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
