"""What one save wrote: sizes and ratio, computed from the writers' records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_tiered.dcp.format import ItemRecord, record_sizes


@dataclass
class SaveStats:
    """Totals over every item of a committed checkpoint.

    ``raw_bytes`` counts tensors in their original dtype (what an uncompressed fp32 save
    would write), ``encoded_bytes`` what was encoded (after any downcast), and
    ``stored_bytes`` what landed in storage.
    """

    items: int = 0
    raw_bytes: int = 0
    encoded_bytes: int = 0
    stored_bytes: int = 0
    files: int = 0
    downcast: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Stored bytes over raw bytes (lower is better)."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": round(self.ratio, 4)}


def stats_from_records(records: Iterable[tuple[str, "dict | ItemRecord"]]) -> SaveStats:
    """Sum native records ``(key, record)`` (plain or typed) into :class:`SaveStats`."""
    stats = SaveStats()
    files = set()
    items = encoded = stored = raw = 0
    for key, value in records:
        file, length, raw_length, orig_raw, downcast = record_sizes(value)
        items += 1
        encoded += raw_length
        stored += length
        files.add(file)
        if downcast:
            stats.downcast.append(key)
        raw += orig_raw
    stats.items, stats.encoded_bytes, stats.stored_bytes, stats.raw_bytes = items, encoded, stored, raw
    stats.files = len(files)
    return stats
