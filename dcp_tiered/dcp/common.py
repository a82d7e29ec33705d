"""Small pieces shared by the storage writer and reader."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

from torch.futures import Future

from dcp_tiered.storage import Storage

T = TypeVar("T")


def completed(fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` now and return a finished future holding its result or its exception."""
    fut: Future[T] = Future()
    try:
        fut.set_result(fn())
    except BaseException as exc:
        fut.set_exception(exc)
    return fut


class UrlCheckpointId:
    """``checkpoint_id`` handling for storage classes bound to one :class:`Storage` directory."""

    storage: Storage

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike[str]") -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    @property
    def checkpoint_id(self) -> str:
        return self.storage.url


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
