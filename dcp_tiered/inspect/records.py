"""The one place in :mod:`dcp_tiered.inspect` that reads the fields of a ``storage_data`` record.

Native records (a dict of format 1) and stock DCP ``_StorageInfo`` records are seen through
one :class:`StoredItem`; a malformed record surfaces as ``CorruptCheckpointError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredItem:
    """One record, native or stock, as the fields describe and verify use."""

    native: bool
    file: str
    offset: int
    length: int
    fmt: int | None = None
    kind: str = ""
    codec: str = ""
    filter: str = "none"
    dtype: str | None = None
    raw: int = 0
    frames: tuple[int, ...] = ()
    sums: tuple[int, ...] = ()
    transforms: tuple[str, ...] = ()


def stored_item(rec: Any) -> StoredItem:
    """The record's fields (to be replaced by ``ItemRecord`` of ``dcp/format.py``)."""
    from dcp_tiered.dcp.format import is_native_record

    if not is_native_record(rec):
        return StoredItem(False, rec.relative_path, rec.offset, rec.length,
                          transforms=tuple(getattr(rec, "transform_descriptors", None) or ()))
    return StoredItem(True, rec["file"], rec["offset"], rec["length"], rec["fmt"], rec["kind"], rec["codec"],
                      rec["filter"], rec.get("dtype"), rec["raw"], rec["frames"], rec["sums"])


# What reading a field of the wrong type or range raises; from metadata that means a malformed checkpoint.
_MALFORMED = (TypeError, AttributeError, KeyError, IndexError, ValueError, OverflowError)


@contextlib.contextmanager
def untrusted(reader: Any) -> Iterator[None]:
    """Turn a builtin error raised while interpreting ``reader``'s metadata into ``CorruptCheckpointError``."""
    from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError

    try:
        yield
    except DcpTieredError:
        raise
    except _MALFORMED as exc:
        raise CorruptCheckpointError(
            f"{getattr(reader, 'checkpoint_id', 'the checkpoint')}/.metadata is malformed "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); restore from another tier or an older step"
        ) from exc
