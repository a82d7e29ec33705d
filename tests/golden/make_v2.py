"""Wrote the committed golden checkpoints of format version 2 (tests/golden/v2/): format 1's
records, stored in ``.metadata`` as one record table (dcp_tiered/dcp/record_table.py).

They are never regenerated: a reader change that breaks them breaks every checkpoint users
already hold. Kept for the record of how they were made:
    .venv/bin/python tests/golden/make_v2.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).parent))
from values import golden_state  # noqa: E402

from dcp_tiered import CompressedWriter, DowncastSavePlanner  # noqa: E402

OUT = Path(__file__).parent / "v2"

if __name__ == "__main__":
    if OUT.exists():
        sys.exit(f"{OUT} exists: golden checkpoints are never regenerated")
    # a small frame size so tensors span several frames
    dcp.save(golden_state(), storage_writer=CompressedWriter(OUT / "zstd_3", codec="zstd:3", frame_size=64 << 10),
             no_dist=True)
    dcp.save(golden_state(), storage_writer=CompressedWriter(OUT / "zstd_bf16_downcast", frame_size=64 << 10),
             planner=DowncastSavePlanner(torch.bfloat16), no_dist=True)
