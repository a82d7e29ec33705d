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


def _prepared_with_scheduler(accelerator):
    accelerator.free_memory()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return accelerator.prepare(net, opt, sched)


def _train(accelerator, model, opt, sched, steps: int) -> None:
    for step in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        sched.step()


def _live(model, opt, sched) -> dict:
    import copy
    import random

    import numpy as np

    inner = getattr(opt, "optimizer", opt)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "optim": copy.deepcopy(inner.state_dict()),
            "sched": copy.deepcopy(getattr(sched, "scheduler", sched).state_dict()),
            "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _same(a, b) -> bool:
    import numpy as np

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _rewrite(step_dir, key: str, value) -> None:
    """Replace one part of a committed checkpoint, as the library stores it (checksums valid)."""
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedWriter
    from dcp_tiered.inspect.conversion import load_any

    sd = load_any(step_dir)
    *path, last = key.split(".")
    holder = sd
    for part in path:
        holder = holder[int(part)] if isinstance(holder, list) else holder[part]
    holder[int(last) if isinstance(holder, list) else last] = value
    dcp.save(sd, storage_writer=CompressedWriter(str(step_dir), overwrite=True), no_dist=True)


_RNG_LEN = torch.get_rng_state().numel()
_CORRUPT = {
    "scheduler-deep-json": ("scheduler", "[" * 100_000 + "]" * 100_000),
    "scheduler-not-json": ("scheduler", "{not json"),
    "scheduler-wrong-type": ("scheduler", '[{"step_size": "two"}]'),
    "scheduler-count": ("scheduler", "[]"),
    "scheduler-not-a-string": ("scheduler", 7),
    "rng-not-a-dict": ("rng_0", ("garbage",)),
    "rng-short-python-state": ("rng_0", ({"python": (3, torch.zeros(5, dtype=torch.int64), None)},)),
    "rng-short-torch-state": ("rng_0", ({"torch": torch.zeros(3, dtype=torch.uint8)},)),
    "rng-step-not-int": ("rng_0", ({"step": "x", "torch": torch.zeros(_RNG_LEN, dtype=torch.uint8)},)),
    "rng-bad-numpy": ("rng_0", ({"numpy": ("MT19937", torch.zeros(624, dtype=torch.int64), 1 << 40, 0, 0.0)},)),
    "optimizer-lr-type": ("optim.0.param_groups.0.lr", "fast"),
}


def test_a_corrupt_part_fails_the_load_and_leaves_the_live_state_as_it_was(tmp_path):
    """Issue 23 item 11: a corrupt ``rng_N`` or scheduler entry raised ValueError/RecursionError
    after the model weights were overwritten; now nothing is restored and the error names the part."""
    import shutil

    from dcp_tiered.errors import DcpTieredError

    accelerator = Accelerator(cpu=True)
    model, opt, sched = _prepared_with_scheduler(accelerator)
    _train(accelerator, model, opt, sched, 2)
    pristine = tmp_path / "pristine"
    with TieredCheckpointer([Tier("local", str(pristine))]) as ck:
        assert integration.save_state(accelerator, ck, 1, force=True).ok
    _train(accelerator, model, opt, sched, 1)  # the live state differs from the checkpoint's
    before = _live(model, opt, sched)
    for case, (key, value) in _CORRUPT.items():
        root = tmp_path / case
        shutil.copytree(pristine, root)
        _rewrite(root / "step_000000001", key, value)
        with TieredCheckpointer([Tier("local", str(root))]) as ck, pytest.raises(DcpTieredError) as failed:
            integration.load_state(accelerator, ck)
        message = str(failed.value)
        assert key.partition(".")[0] in message and f"{case}/step_000000001/__0_0.distcp" in message, (case, message)
        assert _same(_live(model, opt, sched), before), case


def _flip(step_dir, key: str) -> None:
    """Damage the stored bytes of item ``key`` (its checksum no longer matches)."""
    from dcp_tiered import CompressedReader

    md = CompressedReader(str(step_dir)).read_metadata()
    rec = next(r for i, r in md.storage_data.items() if i.fqn == key)
    path = step_dir / rec["file"]
    data = bytearray(path.read_bytes())
    data[rec["offset"] + rec["length"] // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_frame_fails_the_load_and_leaves_a_fresh_start_as_it_was(tmp_path):
    """Resuming at start-up (a fresh, never-stepped AdamW): a damaged item, a tensor (every candidate
    fails) or this process's random states, leaves every live object as it was, the optimizer stateless."""
    import shutil

    from dcp_tiered.errors import DcpTieredError

    accelerator = Accelerator(cpu=True)
    model, opt, sched = _prepared_with_scheduler(accelerator)
    _train(accelerator, model, opt, sched, 2)
    with TieredCheckpointer([Tier("local", str(tmp_path / "pristine"))]) as ck:
        assert integration.save_state(accelerator, ck, 1, force=True).ok
    fresh = Accelerator(cpu=True)
    model, opt, sched = _prepared_with_scheduler(fresh)
    before = _live(model, opt, sched)
    for key in ("model.2.bias", "rng_0"):
        shutil.copytree(tmp_path / "pristine", tmp_path / key)
        _flip(tmp_path / key / "step_000000001", key)
        with TieredCheckpointer([Tier("local", str(tmp_path / key))]) as ck, pytest.raises(DcpTieredError) as failed:
            integration.load_state(fresh, ck)
        assert "step_000000001" in str(failed.value), failed.value
        assert not getattr(opt, "optimizer", opt).state, key
        assert _same(_live(model, opt, sched), before), key


def test_multistep_milestones_survive_a_resume(tmp_path):
    """The scheduler states travel as JSON, which turned MultiStepLR's ``Counter`` of milestones into
    string keys: after a resume the learning rate never decayed again."""
    def run(resume: bool) -> list[float]:
        accelerator = Accelerator(cpu=True)
        accelerator.free_memory()
        net = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.1)
        _model, opt, sched = accelerator.prepare(net, opt, sched)
        lrs = []
        with TieredCheckpointer([Tier("local", str(tmp_path / f"tier{resume}"))]) as ck:
            for step in range(6):
                if resume and step == 1:
                    integration.save_state(accelerator, ck, step, force=True)
                    assert integration.load_state(accelerator, ck) == step
                opt.step()
                sched.step()
                lrs.append(getattr(opt, "optimizer", opt).param_groups[0]["lr"])
        return lrs

    assert run(True) == run(False)
