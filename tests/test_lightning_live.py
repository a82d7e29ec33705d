"""The Lightning plugin never deletes a checkpoint directory that a save is writing or a load is reading.

Under Lightning's own ``AsyncCheckpointIO`` a save runs in a thread while ``ModelCheckpoint`` goes on:
a top-k removal of the same name, or a second save of ``last.ckpt``, used to delete the hidden
``.partial`` directory of the save in flight.  A load reading ``last.ckpt`` while it is saved again
used to lose its files to the swap (stock's one-file replace keeps an open reader working).
"""

from __future__ import annotations

import threading

import pytest
import torch
from speed import scaled

pytest.importorskip("lightning")
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from dcp_tiered.dcp.writer import CompressedWriter  # noqa: E402
from dcp_tiered.dcp.reader import CompressedReader  # noqa: E402
from dcp_tiered.integrations.lightning import CompressedCheckpointIO  # noqa: E402


def _ckpt(value: float) -> dict:
    return {"state_dict": {"w": torch.full((256,), value)}, "epoch": int(value), "global_step": int(value)}


def _paused(monkeypatch, cls, name: str):
    """Make ``cls.name`` stop, once, until released: the first call waits on ``release`` after ``started``."""
    started, release = threading.Event(), threading.Event()
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        if not started.is_set():
            started.set()
            assert release.wait(scaled(60)), "never released"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return started, release


def test_a_removal_of_the_same_name_spares_the_save_in_flight(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "epoch=1.ckpt")
    io = AsyncCheckpointIO(CompressedCheckpointIO())
    started, release = _paused(monkeypatch, CompressedWriter, "finish")
    io.save_checkpoint(_ckpt(1.0), path)  # in Lightning's thread, paused before its commit
    assert started.wait(scaled(60))
    io.remove_checkpoint(path)  # top-k drops the name meanwhile (drains nothing: Lightning's wrapper forwards it)
    release.set()
    io.teardown()  # raises the save thread's error, if any
    assert torch.equal(CompressedCheckpointIO().load_checkpoint(path)["state_dict"]["w"], torch.full((256,), 1.0))


def test_a_second_save_of_the_name_spares_the_first_in_flight(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "last.ckpt")
    plugin = CompressedCheckpointIO()
    started, release = _paused(monkeypatch, CompressedWriter, "finish")
    first = threading.Thread(target=plugin.save_checkpoint, args=(_ckpt(1.0), path))
    errors: list[BaseException] = []
    first.run = lambda: _record(errors, plugin.save_checkpoint, _ckpt(1.0), path)  # type: ignore[method-assign]
    first.start()
    assert started.wait(scaled(60))
    plugin.save_checkpoint(_ckpt(2.0), path)  # its recover() must not delete the first's live directory
    release.set()
    first.join(scaled(60))
    assert not errors, errors
    w = CompressedCheckpointIO().load_checkpoint(path)["state_dict"]["w"]
    assert torch.equal(w, torch.full((256,), 1.0))  # the first finished last: its swap put it in


def test_a_load_during_a_resave_reads_the_checkpoint_it_opened(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "last.ckpt")
    plugin = CompressedCheckpointIO()
    plugin.save_checkpoint(_ckpt(1.0), path)
    started, release = _paused(monkeypatch, CompressedReader, "read_data")
    out: dict = {}
    errors: list[BaseException] = []
    reader = threading.Thread(target=lambda: _record(errors, lambda: out.update(plugin.load_checkpoint(path))))
    reader.start()
    assert started.wait(scaled(60))  # the load opened the checkpoint and planned its reads
    CompressedCheckpointIO().save_checkpoint(_ckpt(2.0), path)  # swapped in meanwhile
    release.set()
    reader.join(scaled(60))
    assert not errors, errors
    assert torch.equal(out["state_dict"]["w"], torch.full((256,), 1.0))
    assert torch.equal(CompressedCheckpointIO().load_checkpoint(path)["state_dict"]["w"], torch.full((256,), 2.0))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    CompressedCheckpointIO().save_checkpoint(_ckpt(3.0), path)  # the next save cleans up what the reader kept
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], leftovers


def _record(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
