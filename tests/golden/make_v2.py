"""Wrote the committed golden checkpoints of format version 2 (tests/golden/v2/): format 1's
records, stored in ``.metadata`` as one record table (dcp_tiered/dcp/record_table.py).

They are never regenerated: a reader change that breaks them breaks every checkpoint users
already hold. Kept for the record of how they were made:
    .venv/bin/python tests/golden/make_v2.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_v1 import write_golden  # noqa: E402

OUT = Path(__file__).parent / "v2"

if __name__ == "__main__":
    write_golden(OUT, {"zstd_3": "zstd:3"})
