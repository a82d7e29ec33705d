"""The cyclic garbage collector paused while a table of many acyclic objects is built or packed.

Decoding a ``.metadata`` (or packing one at ``finish``) makes a few objects per record, none in a
cycle; each collection the allocations trigger walks every tracked object younger than the last
full one, so on a large checkpoint the collector costs as much as the decode.  Reference counting
frees everything as before; the collector runs again when the last pause ends (pauses nest and may
overlap across threads).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_PAUSES = 0
_WAS_ENABLED = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Within the block, no automatic collections; the collector's state is restored at the last exit."""
    global _PAUSES, _WAS_ENABLED
    with _LOCK:
        if _PAUSES == 0:
            _WAS_ENABLED = gc.isenabled()
            gc.disable()
        _PAUSES += 1
    try:
        yield
    finally:
        with _LOCK:
            _PAUSES -= 1
            if _PAUSES == 0 and _WAS_ENABLED:
                gc.enable()
