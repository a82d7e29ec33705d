"""Reading an untrusted checkpoint's metadata in :mod:`dcp_tiered.inspect`.

Records are seen through ``record_view`` of :mod:`dcp_tiered.dcp.format` (native
``ItemRecord`` or stock ``StockRecord``); a malformed record surfaces as ``CorruptCheckpointError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError

# What reading a field of the wrong type or range raises; from metadata that means a malformed checkpoint.
_MALFORMED = (TypeError, AttributeError, KeyError, IndexError, ValueError, OverflowError)


@contextlib.contextmanager
def untrusted(reader: Any) -> Iterator[None]:
    """Turn a builtin error raised while interpreting ``reader``'s metadata into ``CorruptCheckpointError``."""
    try:
        yield
    except DcpTieredError:
        raise
    except _MALFORMED as exc:
        raise CorruptCheckpointError(
            f"{getattr(reader, 'checkpoint_id', 'the checkpoint')}/.metadata is malformed "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); restore from another tier or an older step"
        ) from exc
