"""Wrote the committed golden checkpoints of format version 1 (tests/golden/v1/).

They are never regenerated: a reader change that breaks them breaks every checkpoint users
already hold. Kept for the record of how they were made:
    .venv/bin/python tests/golden/make_v1.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).parent))
from values import golden_state  # noqa: E402

from dcp_tiered import CompressedWriter, DowncastSavePlanner  # noqa: E402

OUT = Path(__file__).parent / "v1"


def write_golden(out: Path, codecs: dict[str, str]) -> None:
    """``golden_state()`` saved once per codec (directory name -> codec), plus a bf16 downcast."""
    if out.exists():
        sys.exit(f"{out} exists: golden checkpoints are never regenerated")
    for name, codec in codecs.items():
        # a small frame size so tensors span several frames
        dcp.save(golden_state(), storage_writer=CompressedWriter(out / name, codec=codec, frame_size=64 << 10),
                 no_dist=True)
    dcp.save(golden_state(), storage_writer=CompressedWriter(out / "zstd_bf16_downcast", frame_size=64 << 10),
             planner=DowncastSavePlanner(torch.bfloat16), no_dist=True)


if __name__ == "__main__":
    write_golden(OUT, {c.replace(":", "_"): c for c in ("none", "lz4", "zstd:3")})
