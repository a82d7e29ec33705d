"""A plugin checkpoint becomes a normal Lightning ``.ckpt`` with ``dcp-tiered convert`` (issue 25 item 7).

``convert last.ckpt out.ckpt`` on the plugin's ``last.ckpt`` directory exited 4 ("not a regular file"),
and with a trailing slash wrote the plugin's inner layout, which ``Model.load_from_checkpoint`` cannot
read (``KeyError: 'pytorch-lightning_version'``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dcp_tiered.cli.__main__ import main  # noqa: E402
from dcp_tiered.integrations.lightning import CompressedCheckpointIO  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch, _i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def plugin_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=8)
    model = Tiny()
    trainer = L.Trainer(max_steps=2, plugins=[CompressedCheckpointIO()], default_root_dir=root, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    trainer.save_checkpoint(root / "last.ckpt")
    assert (root / "last.ckpt").is_dir()
    return root, model


@pytest.mark.parametrize("slash", ["", "/"])
def test_convert_gives_a_checkpoint_that_lightning_loads_without_the_plugin(plugin_ckpt, slash: str) -> None:
    root, model = plugin_ckpt
    out = root / f"out{len(slash)}.ckpt"
    assert main(["convert", f"{root / 'last.ckpt'}{slash}", str(out)]) == 0
    assert out.is_file()
    back = Tiny.load_from_checkpoint(out)
    assert back.hparams.width == 8
    for a, b in zip(back.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    raw = torch.load(out, weights_only=False)
    assert raw["global_step"] == 2 and "pytorch-lightning_version" in raw and raw["optimizer_states"]
    assert main(["convert", str(root / "last.ckpt"), str(out)]) != 0  # exists: --overwrite says replace
    assert main(["convert", str(root / "last.ckpt"), str(out), "--overwrite"]) == 0
