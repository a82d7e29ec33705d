"""When a memory tier refuses a save for its budget: save to the other due tiers instead.

A memory tier (:mod:`~dcp_tiered.tiers.memory`) refuses a save that would not fit before any
byte is written.  Slower tiers due at the same step should not lose their save for it:
:func:`fallback_tiers` says which tiers the save goes to instead (the next due one becomes the
primary).  An async save fails in the background after its state was staged;
:class:`KeepStaged` keeps the staged copy so that the fallback writes it without staging again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager

from dcp_tiered.errors import MemoryBudgetError
from dcp_tiered.tiers.events import EventLog, SaveReport, describe_error, root_cause

log = logging.getLogger("dcp_tiered.tiers.checkpointer")  # where the checkpointer's other warnings go


def fallback_tiers(exc: BaseException, due: Sequence[str]) -> tuple[str, ...] | None:
    """The due tiers to save to instead when ``exc`` is the primary tier (``due[0]``) refusing the save
    for its memory budget (:class:`MemoryBudgetError`); None when there is no fallback (another
    failure, or no other tier was due)."""
    seen: BaseException | None = root_cause(exc)
    while seen is not None and not isinstance(seen, MemoryBudgetError):
        seen = seen.__cause__
    if seen is None or getattr(seen, "tier", None) != due[0] or len(due) < 2:
        return None
    return tuple(due[1:])


def fall_back(report: SaveReport, exc: BaseException, events: EventLog) -> bool:
    """Whether the save of ``report`` moves to its other due tiers (now ``report.tiers``) because ``exc``
    is its primary memory tier refusing it (:func:`fallback_tiers`); logged and emitted as a
    ``memory_fallback`` event naming the tier, the tiers saved to instead and the refusal."""
    rest = fallback_tiers(exc, report.tiers)
    if rest is None:
        return False
    log.warning("step %d: memory tier %r refused the save; saving to %s instead", report.step, report.tiers[0],
                list(rest))
    events.emit({"event": "memory_fallback", "step": report.step, "refused_by": report.tiers[0], "tiers": list(rest),
                 "error": describe_error(exc, 2000)})
    report.tiers = list(rest)
    return True


class KeepStaged(DefaultStager):
    """``DefaultStager`` that keeps the last staged state (its buffers are reused by the next stage)."""

    staged: Any = None

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self.staged = super().stage(state_dict, **kwargs)
        return self.staged

    def again(self, staged: Any) -> "AlreadyStaged":
        """A stager for writing ``staged`` (a state this stager staged) once more, kept as :attr:`staged`."""
        self.staged = staged
        return AlreadyStaged()


class AlreadyStaged(AsyncStager):
    """Stages nothing: for a state that is a staged copy already (the fallback of an async save)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
