"""Lower CPU priority for background threads (encoding, promotion), so training gets the cores first."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def lower_thread_priority(nice: int | None) -> None:
    """Run the calling thread ``nice`` steps below the process's main thread (Linux applies nice
    values per thread), so background encoding and promotion yield the cores to training first.

    Idempotent: a thread started from an already lowered one (it inherits the value) is not
    lowered again.  Does nothing where the platform does not support it.
    """
    if not nice:
        return
    try:
        tid = threading.get_native_id()
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)  # the main thread's value + nice
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except (AttributeError, OSError):
        pass


def run_lowered(nice: int | None, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own at ``nice`` lower priority, so the caller's priority never
    changes (an unprivileged process cannot raise it back); ``fn()`` here when ``nice`` is unset."""
    if not nice:
        return fn()
    with ThreadPoolExecutor(1, thread_name_prefix="dcp_tiered-write", initializer=lower_thread_priority,
                            initargs=(nice,)) as pool:
        return pool.submit(fn).result()
