"""Pieces of DCP's storage protocol that CompressedWriter and CompressedReader share: finished futures, checkpoint ids."""

from __future__ import annotations

import os
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
