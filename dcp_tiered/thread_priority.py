"""Background threads (encoding, promotion, async saves) yield to the training loop: a lower CPU
priority, so training gets the cores first, and a pause as a save starts off the main thread, so
the caller that started it gets the GIL back at once."""

from __future__ import annotations

import os
import threading
import time
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


#: How long a background save sleeps as it starts (see :func:`yield_to_caller`).
YIELD_S = 0.001


def yield_to_caller() -> None:
    """On a thread other than the main one, sleep :data:`YIELD_S`: called as a save starts there.

    ``dcp.async_save`` starts a new thread for every save and returns only when it gets the GIL
    back. Without a pause the new thread keeps the GIL for the interpreter's switch interval
    (5 ms) or until it blocks, and the training loop waits that long.  A zero sleep is not
    enough: the thread that drops the GIL often takes it again before the waiting one wakes.
    """
    if threading.current_thread() is not threading.main_thread():
        time.sleep(YIELD_S)


def run_lowered(nice: int | None, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own at ``nice`` lower priority, so the caller's priority never
    changes (an unprivileged process cannot raise it back); ``fn()`` here when ``nice`` is unset."""
    if not nice:
        return fn()
    with ThreadPoolExecutor(1, thread_name_prefix="dcp_tiered-write", initializer=lower_thread_priority,
                            initargs=(nice,)) as pool:
        return pool.submit(fn).result()
