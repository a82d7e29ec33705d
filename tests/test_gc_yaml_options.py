"""``dcp-tiered gc --tiers YAML`` applies the retention the checkpointer built from the same YAML
would: the file's ``leftover_grace`` counts unless ``--leftover-grace`` is given."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedWriter
from dcp_tiered.cli.__main__ import main as cli_main


def _tier_dir(tmp_path: Path, grace_line: str) -> tuple[Path, Path]:
    tier = tmp_path / "local"
    dcp.save({"a": torch.arange(8.0)}, storage_writer=CompressedWriter(tier / "step_000000005"), no_dist=True)
    leftover = tier / "step_000000001"  # uncommitted, older than the newest committed step
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x")
    old = time.time() - 90 * 60  # untouched for 90 minutes
    for p in (leftover / "__0_0.distcp", leftover):
        os.utime(p, (old, old))
    yaml_path = tmp_path / "tiers.yaml"
    yaml_path.write_text(f"{grace_line}tiers:\n  - {{name: local, url: {tier}, keep: 2}}\n")
    return tier, yaml_path


def _would_delete(yaml_path: Path, capsys: pytest.CaptureFixture, *extra: str) -> set[int]:
    capsys.readouterr()
    assert cli_main(["gc", "--tiers", str(yaml_path), "--dry-run", "--json", *extra]) == 0
    return {row["step"] for row in json.loads(capsys.readouterr().out)["would_delete"]}


def test_gc_takes_leftover_grace_from_the_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, yaml_path = _tier_dir(tmp_path, "leftover_grace: 2h\n")
    assert _would_delete(yaml_path, capsys) == set(), "the YAML's 2 h grace keeps a 90-minute-old leftover"
    assert _would_delete(yaml_path, capsys, "--leftover-grace", "1h") == {1}, "the flag overrides the file"


def test_gc_default_grace_is_the_checkpointers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, yaml_path = _tier_dir(tmp_path, "")
    assert _would_delete(yaml_path, capsys) == {1}, "default 1 h: a 90-minute-old leftover goes"
