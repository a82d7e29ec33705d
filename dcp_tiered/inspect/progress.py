"""Progress reporting for the long operations of :mod:`dcp_tiered.inspect`, without drawing anything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class ProgressBar(Protocol):
    """What a progress factory returns: a context manager counting work done with ``update(n)``."""

    def update(self, n: float = 1) -> None: ...

    def __enter__(self) -> "ProgressBar": ...

    def __exit__(self, *exc: Any) -> Any: ...


#: Called as ``factory(total, desc, unit="")``; the CLI passes :func:`dcp_tiered.cli.output.progress` (tqdm).
ProgressFactory = Callable[..., ProgressBar]


class NoProgress:
    """The default factory: counts nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, n: float = 1) -> None:
        pass

    def __enter__(self) -> "NoProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress_bar(factory: ProgressFactory | None, total: int, desc: str, unit: str = "") -> ProgressBar:
    """A bar from ``factory``, or one that counts nothing when there is none."""
    return (factory or NoProgress)(total, desc, unit=unit)
