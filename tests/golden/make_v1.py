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

if __name__ == "__main__":
    if OUT.exists():
        sys.exit(f"{OUT} exists: golden checkpoints are never regenerated")
    for codec in ("none", "lz4", "zstd:3"):
        # a small frame size so tensors span several frames
        dcp.save(golden_state(), storage_writer=CompressedWriter(OUT / codec.replace(":", "_"), codec=codec, frame_size=64 << 10),
                 no_dist=True)
    dcp.save(golden_state(), storage_writer=CompressedWriter(OUT / "zstd_bf16_downcast", frame_size=64 << 10),
             planner=DowncastSavePlanner(torch.bfloat16), no_dist=True)
