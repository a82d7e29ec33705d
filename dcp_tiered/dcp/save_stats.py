"""What one save wrote: sizes and ratio, computed from the writers' records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_tiered.dcp.format import ItemRecord, record_view


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
    for key, value in records:
        rec: ItemRecord = record_view(value)  # type: ignore[assignment]
        stats.items += 1
        stats.encoded_bytes += rec.raw_length
        stats.stored_bytes += rec.length
        files.add(rec.file)
        if rec.downcast:
            stats.downcast.append(key)
        stats.raw_bytes += rec.orig_raw_length
    stats.files = len(files)
    return stats
