"""Wrote the committed golden checkpoints of format version 3 (tests/golden/v3/): format 2's
record table with the head record's lists of names stored as one string each and its item and
path tables (dcp_tiered/dcp/item_table.py).

They are never regenerated: a reader change that breaks them breaks every checkpoint users
already hold. Kept for the record of how they were made:
    .venv/bin/python tests/golden/make_v3.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_v1 import write_golden  # noqa: E402

OUT = Path(__file__).parent / "v3"

if __name__ == "__main__":
    write_golden(OUT, {"zstd_3": "zstd:3"})
