"""``dcp-tiered ls`` says whether a checkpoint holds the optimizer state the way retention (``gc``) decides
it: by the ``optimizer_keys`` of the ``--tiers`` file (it used to look for ``optim``/``optimizer`` only,
so a DCP-tutorial ``app.optim`` state showed ``optim: no`` while ``gc`` kept it as the full one)."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedWriter
from dcp_tiered.cli.__main__ import main


def test_ls_reads_optimizer_keys_from_the_tiers_file(tmp_path, capsys):
    tier = tmp_path / "tier"
    dcp.save({"app": {"model": {"w": torch.ones(3)}, "optim": {"state": {"0": {"m": torch.zeros(3)}}}}},
             storage_writer=CompressedWriter(tier / "step_000000001", sync_files=False), no_dist=True)
    yaml = tmp_path / "tiers.yaml"
    yaml.write_text(f"tiers:\n  - {{name: local, url: {tier}}}\noptimizer_keys: [app.optim]\noptimizer_every: 2\n")
    assert main(["ls", "--tiers", str(yaml), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["optimizer"] is True, row
    assert main(["ls", "--local-path", str(tier), "--json"]) == 0  # default keys: optim, optimizer
    (row,) = json.loads(capsys.readouterr().out)
    assert row["optimizer"] is False, row
