"""The TieredCheckpointer restore contract and per-step API: ``due``/``maybe_save`` with a
callable state, step and option checks, ``Stateful`` state, ``RestoreError``, a collective
restore that survives SIGKILLs mid-promotion with ``keep=1``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcp_tiered import ConfigError, Tier, TieredCheckpointer


def two_tiers(root: Path, **kw) -> list[Tier]:
    return [Tier("local", str(root / "local"), every_steps=kw.get("local_every", 2), keep=2, codec="lz4"),
            Tier("shared", str(root / "shared"), every_steps=kw.get("shared_every", 4), keep=1, codec="zstd")]


def small_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(8, 4, generator=g)}, "optim": {"m": torch.randn(8, generator=g)}}


# -- due / maybe_save --------------------------------------------------------------------


def test_due_decides_once_and_maybe_save_reuses_it(tmp_path: Path) -> None:
    ck = TieredCheckpointer(two_tiers(tmp_path))
    calls = []

    def build() -> dict:
        calls.append(1)
        return small_state()

    assert ck.due(0) is True
    assert ck.due(0) is True  # cached: asking again does not decide again (the first save stays due)
    report = ck.maybe_save(0, build)
    assert report is not None and report.tiers == ["local", "shared"] and calls == [1]
    assert ck.due(1) is False
    assert ck.maybe_save(1, build) is None and calls == [1]  # the callable is not called when nothing is due
    assert ck.maybe_save(2, build) is not None and calls == [1, 1]  # without due(): decided by maybe_save
    ck.close()


def test_maybe_save_reuses_a_due_decision_made_before_its_time(tmp_path: Path) -> None:
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    ck = TieredCheckpointer([Tier("local", str(tmp_path / "l"), every="10s", keep=1)], clock=clock)
    assert ck.maybe_save(0, small_state()) is not None
    clock.t = 5.0
    assert ck.due(1) is False
    clock.t = 20.0  # the schedule would now say due: the decision of due(1) holds for step 1
    assert ck.maybe_save(1, small_state()) is None
    assert ck.maybe_save(2, small_state()) is not None
    ck.close()


@pytest.mark.parametrize("step", [-5, 1.0, "3", True, None])
def test_bad_steps_are_refused(tmp_path: Path, step) -> None:
    ck = TieredCheckpointer(two_tiers(tmp_path))
    with pytest.raises(ConfigError, match="step"):
        ck.maybe_save(step, small_state())
    with pytest.raises(ConfigError, match="step"):
        ck.due(step)
    ck.close()
    assert not (tmp_path / "local").exists() or not any((tmp_path / "local").iterdir())


def test_optimizer_keys_as_a_string_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="optimizer_keys") as info:
        TieredCheckpointer(two_tiers(tmp_path), optimizer_keys="optim")
    assert len(str(info.value)) < 200
