"""``tools/crash_harness --hostile``: its case classes are drawn deterministically and cover every class, and
the fixtures of the new classes are what they claim (a format-2 table of over 512 chunks per tensor, a
replicated tier listed as fully replicated). The 10,000-case run is in docs/reliability.md."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dcp_tiered.dcp.metadata_io import unpack_metadata
from tools import crash_harness as H
from tools import hostile_classes as HC


def test_cases_are_drawn_deterministically_over_every_class():
    kinds = Counter(H.hostile_kind(5, i) for i in range(3000))
    assert set(kinds) == set(H.HOSTILE_WEIGHTS)
    assert [H.hostile_kind(5, i) for i in range(50)] == [H.hostile_kind(5, i) for i in range(50)]
    assert {H.hostile_kind(5, i, ("marker", "paths")) for i in range(200)} == {"marker", "paths"}
    assert [H.outcome_category(o) for o in ("detected", "loaded", "KNOWN_x", "FAIL hang: x", "FAIL builtin KeyError",
                                            "FAIL foreign X", "FAIL wrong: y", "skipped")] == [
        "refused", "verified", "known", "hang", "builtin", "builtin", "wrong", "skipped"]


def test_new_class_fixtures_and_cases(tmp_path):
    fx = HC.Fixtures(tmp_path)
    bases = fx.get("table")  # asserts format 2 and an exact round trip of each base
    chunks = {name: max(len(v.chunks) for v in unpack_metadata(raw).state_dict_metadata.values()
                        if hasattr(v, "chunks")) for name, (_, raw, _) in bases.items()}
    assert min(chunks.values()) > 512, chunks
    for i in range(3):
        assert not HC.marker_case(fx, random.Random(f"t:{i}")).startswith("FAIL")
