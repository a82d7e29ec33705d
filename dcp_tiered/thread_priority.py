"""Lower CPU priority for background threads (encoding, promotion), so training gets the cores first."""

from __future__ import annotations

import os
import threading


def lower_thread_priority(nice: int | None) -> None:
    """Give the calling thread a lower CPU priority (Linux applies nice values per thread).

    Background encoding and promotion then yield the cores to the training loop first.
    Does nothing where the platform does not support it.
    """
    if not nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError):
        pass
