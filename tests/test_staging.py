"""The async save's stager (``tiers/save/staging.py``): a copy of the state at the call, made into
buffers kept from the last save of the same structure, with nothing of it shared with the live state."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.staging import StagingOptions

from dcp_tiered.tiers.save.staging import KeepStaged


def _stager() -> KeepStaged:
    return KeepStaged(StagingOptions(False, False, False, False))


def _leaves(obj, out=None) -> list:
    out = [] if out is None else out
    if isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, out)
    else:
        out.append(obj)
    return out


def _state(seed: float = 0.0) -> dict:
    model = torch.nn.Linear(6, 3)
    with torch.no_grad():
        model.weight.fill_(seed)
    return {"model": model.state_dict(),  # an OrderedDict of detached tensors
            "optim": {"state": {0: {"step": torch.tensor(seed), "exp_avg": torch.full((3, 6), seed)}},
                      "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999), "name": None}]},
            "view": torch.arange(20.0).view(4, 5)[:, 1:3],  # not contiguous
            "extra": {"epoch": 3, "tag": "run", "flags": [True, b"x"], "dtype": torch.float32}}


def test_a_staged_state_equals_the_state_at_the_call_and_shares_nothing_with_it() -> None:
    live = _state(1.0)
    stager = _stager()
    staged = stager.stage(live)
    assert stager.staged is staged
    assert type(staged["model"]) is OrderedDict and list(staged["model"]) == list(live["model"])
    for got, want in zip(_leaves(staged), _leaves(live), strict=True):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want) and got.dtype == want.dtype and not got.requires_grad
            assert got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
        else:
            assert got == want
    assert staged["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert staged["optim"]["param_groups"] is not live["optim"]["param_groups"]
    live["model"]["weight"].add_(5.0)
    live["optim"]["param_groups"][0]["lr"] = 7.0
    assert torch.equal(staged["model"]["weight"], torch.full((3, 6), 1.0))
    assert staged["optim"]["param_groups"][0]["lr"] == 0.1


def test_the_next_save_of_the_same_structure_reuses_the_buffers_with_the_new_values() -> None:
    stager = _stager()
    first = stager.stage(_state(1.0))
    ptrs = [t.data_ptr() for t in _leaves(first) if isinstance(t, torch.Tensor)]
    second = stager.stage(_state(2.0))
    assert [t.data_ptr() for t in _leaves(second) if isinstance(t, torch.Tensor)] == ptrs
    assert torch.equal(second["model"]["weight"], torch.full((3, 6), 2.0))
    assert torch.equal(second["optim"]["state"][0]["step"], torch.tensor(2.0))


@pytest.mark.parametrize("change", ["new key", "shape", "dtype", "container"])
def test_a_changed_structure_is_staged_afresh(change: str) -> None:
    stager = _stager()
    stager.stage(_state(1.0))
    live = _state(2.0)
    if change == "new key":
        live["extra"]["more"] = torch.ones(2)
    elif change == "shape":
        live["optim"]["state"][0]["exp_avg"] = torch.full((4, 6), 2.0)
    elif change == "dtype":
        live["model"]["bias"] = live["model"]["bias"].to(torch.float64)
    else:
        live["extra"]["flags"] = tuple(live["extra"]["flags"])
    staged = stager.stage(live)
    for got, want in zip(_leaves(staged), _leaves(live), strict=True):
        assert torch.equal(got, want) and got.dtype == want.dtype if isinstance(want, torch.Tensor) else got == want
    assert type(staged["extra"]["flags"]) is type(live["extra"]["flags"])


class Custom:
    def __init__(self, v: torch.Tensor) -> None:
        self.v = v


def test_anything_else_goes_through_dcp_s_own_stager_with_the_same_guarantees() -> None:
    """A leaf of another type (an object, a tensor subclass): DCP's ``DefaultStager`` deep-copies it."""
    live = {"obj": Custom(torch.ones(3)), "w": torch.zeros(2)}
    staged = _stager().stage(live)
    live["obj"].v.add_(1.0)
    live["w"].add_(1.0)
    assert torch.equal(staged["obj"].v, torch.ones(3)) and torch.equal(staged["w"], torch.zeros(2))


@settings(max_examples=60, deadline=None)
@given(st.recursive(
    st.one_of(st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=3), st.none(),
              st.builds(lambda n, d: torch.arange(n).to(d), st.integers(0, 6),
                        st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool]))),
    lambda children: st.one_of(st.lists(children, max_size=3), st.tuples(children, children),
                               st.dictionaries(st.text(max_size=2), children, max_size=3)),
    max_leaves=12))
def test_any_tree_of_containers_tensors_and_values_stages_to_an_equal_copy(tree) -> None:
    stager = _stager()
    for _ in range(2):  # the second stage reuses the first's buffers
        staged = stager.stage({"t": tree})
        got, want = _leaves(staged), _leaves({"t": tree})
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if isinstance(w, torch.Tensor):
                assert torch.equal(g, w) and g.dtype == w.dtype
                assert w.numel() == 0 or g.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
            else:
                assert g == w


def test_tied_weights_share_one_buffer_as_with_dcp_s_stager() -> None:
    w = torch.randn(4, 3)
    live = {"embed": w, "lm_head": w, "view": w[1:], "model": torch.nn.Linear(3, 4).state_dict()}
    live["model"]["alias"] = live["model"]["weight"]  # two keys, one tensor object
    staged = _stager().stage(live)
    assert staged["embed"] is staged["lm_head"]
    assert staged["model"]["alias"] is staged["model"]["weight"]
    assert torch.equal(staged["view"], w[1:]) and staged["view"] is not staged["embed"]


def test_saves_with_and_without_the_optimizer_reuse_each_other_s_buffers() -> None:
    """``optimizer_every``: the structure alternates; the model's buffers serve both, the optimizer's stay."""
    stager = _stager()
    full = _state(1.0)
    light = {k: v for k, v in full.items() if k != "optim"}

    def ptrs(staged) -> set:
        return {t.data_ptr() for t in _leaves(staged) if isinstance(t, torch.Tensor)}

    a = ptrs(stager.stage(full))
    b = ptrs(stager.stage(light))
    c = ptrs(stager.stage(full))
    assert b < a and c == a


def test_a_save_under_inference_mode_leaves_buffers_that_later_saves_can_fill() -> None:
    stager = _stager()
    w = torch.randn(5)
    with torch.inference_mode():
        first = stager.stage({"w": w * 1})
    assert not first["w"].is_inference()
    later = stager.stage({"w": w})
    assert torch.equal(later["w"], w)


def test_dcp_s_stager_is_closed_once_the_fast_path_serves_again(monkeypatch) -> None:
    """DCP's stager caches a copy of every storage it staged: it is closed (and dropped) as soon as the
    fast path stages again, so the host never holds both copies."""
    from torch.distributed.checkpoint.staging import DefaultStager

    closed = []
    close = DefaultStager.close
    monkeypatch.setattr(DefaultStager, "close", lambda self: (closed.append(self), close(self)))
    stager = _stager()
    slow = stager.stage({"obj": Custom(torch.ones(8)), "w": torch.zeros(8)})
    assert isinstance(slow["obj"], Custom) and not closed
    stager.stage({"w": torch.zeros(8)})
    assert len(closed) == 1


@pytest.fixture(params=["this torch", "torch 2.11"])
def dcp_stager_once(request, monkeypatch):
    """DCP's stager as this torch has it, and as torch 2.11 has it: a ``DefaultStager`` that closes its copier
    at the end of every stage (pytorch/pytorch#183413), so that its second stage raises ``KeyError``."""
    from torch.distributed.checkpoint import _state_dict_stager

    import dcp_tiered.tiers.save.staging as staging

    if request.param == "torch 2.11":
        stage = _state_dict_stager.StateDictStager.stage

        def stage_then_close(self, *args, **kwargs):
            try:
                return stage(self, *args, **kwargs)
            finally:
                self.close()

        monkeypatch.setattr(_state_dict_stager.StateDictStager, "stage", stage_then_close)
    staging.default_stager_reusable.cache_clear()
    yield request.param
    staging.default_stager_reusable.cache_clear()


def test_a_state_for_dcp_s_stager_stages_on_every_save_even_where_dcp_s_cannot_be_reused(dcp_stager_once) -> None:
    """A DTensor or object state goes through DCP's ``DefaultStager`` on every async save: where torch's stages
    only once, each save gets a new one; either way each save holds the state at its call."""
    stager = _stager()
    live = {"obj": Custom(torch.zeros(4)), "w": torch.zeros(2)}
    for value in range(3):
        live["obj"].v.fill_(value)
        staged = stager.stage(live)
        live["obj"].v.add_(10.0)
        assert torch.equal(staged["obj"].v, torch.full((4,), float(value)))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_tensors_are_staged_into_kept_pinned_host_buffers() -> None:
    """CUDA state takes the fast path: one pinned host buffer per tensor, kept for the next save, filled in
    stream order (work queued before the call is in the copy, the training's next steps are not)."""
    stager = KeepStaged(StagingOptions(True, False, False, False))
    side = torch.cuda.Stream()
    live = {"w": torch.zeros((1 << 20) + 1, device="cuda"), "b": torch.zeros(3, 5, device="cuda")[:, 1:4],
            "step": torch.tensor(1.0), "lr": 0.1}
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        live["w"].fill_(2.0)  # queued on the stream current at the save
        staged = stager.stage(live)
        live["w"].fill_(5.0)  # the next step: not in the staged copy
    assert stager._fallback is None
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned() and bool((staged["w"] == 2.0).all())
    assert staged["b"].shape == (3, 3) and torch.equal(staged["b"], live["b"].cpu())
    torch.cuda.current_stream().wait_stream(side)
    again = stager.stage(live)
    assert again["w"].data_ptr() == staged["w"].data_ptr() and bool((again["w"] == 5.0).all())

