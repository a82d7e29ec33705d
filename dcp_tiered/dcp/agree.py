"""Agreement over a process group in O(N) bytes: one rank decides over every rank's value.

``all_gather_object`` sends every rank's value to every rank: N^2 bytes over the group, which at
16k ranks costs more than the decision it feeds.  :func:`agree` gathers the values on the group's
first rank, decides there and broadcasts the decision, so the same answer reaches every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def agree(value: Any, decide: Callable[[list[Any]], T], group: Any = None, *, alone: bool = False) -> T:
    """``decide`` over every rank's ``value`` of ``group`` (index = group rank), the same result on every rank.

    Collective: every rank of ``group`` calls it.  ``alone`` (or without an initialised process group)
    it decides over ``[value]``.  Where ``decide`` raises, every rank raises that exception."""
    if alone or not (dist.is_available() and dist.is_initialized()):
        return decide([value])
    world, me = dist.get_world_size(group), dist.get_rank(group)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    gathered: "list[Any] | None" = [None] * world if me == 0 else None
    dist.gather_object(value, gathered, dst=root, group=group)
    box: list[Any] = [None]
    if me == 0:
        try:
            box[0] = (True, decide(gathered))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            box[0] = (False, exc)
    dist.broadcast_object_list(box, src=root, group=group)
    ok, out = box[0]
    if not ok:
        raise out
    return out


def failures(error: "str | None", group: Any = None, *, alone: bool = False,
             keep: int = 3) -> tuple[int, list[tuple[int, str]]]:
    """How many ranks of ``group`` report an ``error`` (not None), and the first ``keep`` as
    ``(group rank, error)``: the same on every rank (collective)."""
    def count(errors: Sequence[Any]) -> tuple[int, list[tuple[int, str]]]:
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        return len(failed), failed[:keep]

    return agree(error, count, group, alone=alone)
