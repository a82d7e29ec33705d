"""``read_plugin_checkpoints()``: the way Lightning users load (``Model.load_from_checkpoint(path)``,
``fit/validate(ckpt_path=...)`` on a Trainer without the plugin) reads the plugin's directory
checkpoints, bit for bit; stock ``.ckpt`` files load as before; closing puts Lightning back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from dcp_tiered.integrations.lightning import CompressedCheckpointIO, read_plugin_checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lightning_io_script", ROOT / "tests" / "lightning_io_script.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)  # type: ignore[union-attr]


def _trainer(max_steps: int, plugins: list, callbacks: list = (), root: "Path | None" = None) -> L.Trainer:
    """A CPU trainer; without ``callbacks`` no ModelCheckpoint (Lightning's default one writes into ``root``)."""
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                     callbacks=list(callbacks), plugins=plugins, enable_checkpointing=bool(callbacks),
                     default_root_dir=root)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """4 steps with the plugin (last.ckpt a directory), 4 with stock TorchCheckpointIO (a file)."""
    tmp = tmp_path_factory.mktemp("loader")
    out = {}
    for name, plugins in (("ours", [CompressedCheckpointIO()]), ("stock", [])):
        L.seed_everything(0, verbose=False)
        model = script.Net(hidden=16)
        _trainer(4, plugins, [ModelCheckpoint(dirpath=tmp / name, save_last=True, every_n_train_steps=2)],
                 root=tmp).fit(model, script.data())
        out[name] = (tmp / name / "last.ckpt", {k: v.clone() for k, v in model.state_dict().items()})
    assert (tmp / "ours" / "last.ckpt").is_dir() and (tmp / "stock" / "last.ckpt").is_file()
    return out


def _same(model: torch.nn.Module, expected: dict) -> None:
    torch.testing.assert_close(model.state_dict(), expected, rtol=0, atol=0)


def test_model_load_from_checkpoint_reads_a_plugin_directory(saved):
    path, weights = saved["ours"]
    with pytest.raises(IsADirectoryError):
        script.Net.load_from_checkpoint(path)  # Lightning alone: a directory is no file
    with read_plugin_checkpoints():
        model = script.Net.load_from_checkpoint(path)
        stock = script.Net.load_from_checkpoint(saved["stock"][0])  # a stock file, as before
    _same(model, weights)
    _same(stock, saved["stock"][1])
    assert model.hparams.hidden == 16
    with pytest.raises(IsADirectoryError):
        script.Net.load_from_checkpoint(path)  # closed: Lightning is as it was


def test_trainer_without_the_plugin_validates_and_resumes_from_a_plugin_directory(saved, tmp_path):
    path, weights = saved["ours"]
    reading = read_plugin_checkpoints()
    try:
        fresh = script.Net(hidden=16)
        _trainer(4, [], root=tmp_path).validate(fresh, dataloaders=script.data(), ckpt_path=str(path), verbose=False)
        _same(fresh, weights)
        trainer = _trainer(6, [], root=tmp_path)
        trainer.fit(script.Net(hidden=16), script.data(), ckpt_path=str(path))
        assert trainer.global_step == 6  # resumed at step 4, two more steps
    finally:
        reading.close()


def test_a_missing_path_keeps_lightnings_message(tmp_path):
    with read_plugin_checkpoints(), pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        script.Net.load_from_checkpoint(tmp_path / "nothing.ckpt")


def test_handles_closed_in_any_order_put_lightning_back(saved):
    """The newest open handle's plugin loads; Lightning is as it was once the last handle closes."""
    import lightning.pytorch.core.saving as saving

    original = saving.pl_load
    a, b = read_plugin_checkpoints(), read_plugin_checkpoints()
    a.close()
    _same(script.Net.load_from_checkpoint(saved["ours"][0]), saved["ours"][1])  # b still open
    b.close()
    b.close()
    assert saving.pl_load is original
    with pytest.raises(IsADirectoryError):
        script.Net.load_from_checkpoint(saved["ours"][0])
