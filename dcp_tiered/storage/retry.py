"""Retry with exponential backoff for storage operations that fail transiently."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dcp_tiered.errors import CorruptCheckpointError, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying: ``attempts`` tries, waits doubling from ``base`` up to ``cap`` seconds."""

    attempts: int = 6
    base: float = 0.5
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        """Wait before retry number ``attempt`` (1-based), with jitter."""
        return min(self.cap, self.base * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)


def retrying(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    stop: threading.Event | None = None,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Call ``fn`` until it succeeds or ``policy`` is exhausted; re-raise the last error.

    Only :class:`StorageError` (I/O, network, throttling) is retried: corrupt data and
    programming errors fail at once.  ``stop`` cuts the waits short (shutdown).
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except CorruptCheckpointError:
            raise
        except StorageError as exc:
            if attempt == policy.attempts:
                raise
            wait = policy.delay(attempt)
            log.warning("%s failed (attempt %d/%d): %s; retrying in %.1fs", what, attempt, policy.attempts, exc, wait)
            if on_retry is not None:
                on_retry(attempt, exc)
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover
