"""When a memory tier refuses a save for its budget: save to the other due tiers instead.

A memory tier (:mod:`~dcp_tiered.tiers.memory`) refuses a save that would not fit before any
byte is written.  Slower tiers due at the same step should not lose their save for it:
:func:`fallback_tiers` says which tiers the save goes to instead (the next due one becomes the
primary).  :func:`save_budget_error` decides the refusal on the main thread before a save (and
before an async save stages its state), with every rank's real item sizes, so sync and async saves
refuse, fall back and raise alike.  Should the writer still refuse an async save in the background
(the tier changed meanwhile), :class:`KeepStaged` keeps the staged copy so that the fallback writes
it without staging again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager

from dcp_tiered.errors import MemoryBudgetError, SaveError
from dcp_tiered.tiers.events import EventLog, SaveReport, describe_error, root_cause
from dcp_tiered.tiers.memory import budget_applies, budget_error, local_item_bytes, mark_passed, node_save_bytes

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


def save_budget_error(tier: Any, sd: Mapping[str, Any], checkpoint: str, *, planner: Any, promoter: Any,
                      frame_size: int | None, rank: int, world: int, group: Any = None,
                      src: int = 0) -> MemoryBudgetError | None:
    """Whether the save of ``sd`` as ``checkpoint`` to ``tier`` is refused for its memory budget: the
    error, or None when it fits (or the tier is not checked).  Collective over ``group`` (every rank
    calls it, on the main thread, before anything is staged or written; all get the same answer).

    Each rank plans its part with ``planner`` (a fresh planner of the save's kind: a downcasting one
    reports which tensors it stores narrower) and sizes its items (non-tensor values by their bytes or
    pickled size); the coordinator (group rank 0) drops replicated items as DCP does, sums per
    node, and checks next to what the tier holds (:func:`~dcp_tiered.tiers.memory.held_bytes`, with
    this process's pins and the steps its queued promotions read)."""
    if not budget_applies(tier):
        return None
    planner.set_up_planner(dict(sd), None, rank == 0)
    plan = planner.create_local_plan()
    mine = (plan, local_item_bytes(plan, planner, frame_size, tier.dtype))
    gathered = [mine]
    if group is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    answer: list[Any] = [None]
    if rank == 0:  # the coordinator (group rank 0, global rank ``src``)
        from dcp_tiered.tiers.writer import node_of

        plans = [p for p, _ in gathered]
        try:  # the planner's public global plan drops replicated items as the save will
            plans = planner.create_global_plan(plans)[0]
        except Exception as exc:  # noqa: BLE001 - the save reports it; count every item meanwhile
            log.debug("budget check of %s: no global plan (%s); counting replicated items on every rank", checkpoint, exc)
        by_index = [dict(s) for _, s in gathered]
        per_node = node_save_bytes(plans, node_of, frame_size, sizes=by_index, tier_dtype=tier.dtype)
        answer[0] = budget_error(tier, per_node, checkpoint, rank=rank, world=world, marks=promoter.marks,
                                 busy=promoter.busy_steps(tier.name), optimizer_keys=promoter.optimizer_keys,
                                 known_tiers=set(promoter.by_name), grace=promoter.leftover_grace)
        mark_passed(tier, checkpoint, answer[0] is None)  # the writer does not check this save again
    if group is not None:
        dist.broadcast_object_list(answer, src=src, group=group)
    return answer[0]


def check_budget(ck: Any, sd: Mapping[str, Any], report: SaveReport) -> None:
    """A memory tier refusing the save of ``report`` by the ``TieredCheckpointer`` ``ck``, decided on every
    rank before anything is staged or written (sync and async alike): the save moves to the other due
    tiers (``report.tiers``), or fails now (:func:`fail_save`)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_tiered.tiers.layout import step_name

    while True:
        primary = next(t for t in ck.tiers if t.name == report.tiers[0])
        if budget_applies(primary):  # what the tier holds that retention deletes goes first (in async mode
            ck.promoter.retain_now(primary)  # the last save's retention may still be queued)
        exc = save_budget_error(primary, sd, step_name(report.step), planner=ck._planner(primary.name) or
                                DefaultSavePlanner(), promoter=ck.promoter, frame_size=ck.options.frame_size,
                                rank=ck.rank, world=ck.world, group=ck._decide_pg, src=ck._src)
        if exc is None:
            return
        if not fall_back(report, exc, ck.events):
            fail_save(ck, report, exc, time.perf_counter())


def fail_save(ck: Any, report: SaveReport, exc: BaseException, t0: float) -> NoReturn:
    """Record the failed save of ``report`` (started at ``t0``) on ``ck`` and raise :class:`SaveError`."""
    report.ok, report.error = False, describe_error(exc, 2000)
    report.total_s = time.perf_counter() - t0
    report.blocked_s = report.waited_s + report.total_s
    ck.reports.append(report)
    ck.events.emit(report.as_dict())
    raise SaveError(f"checkpoint save of step {report.step} to tier {report.tiers[0]!r} failed: "
                    f"{describe_error(exc)}") from root_cause(exc)


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
