"""``TieredCheckpointer``: the training-loop API over tiers.

``maybe_save(step, state_dict)`` is cheap when nothing is due.  When tiers are due, the
state is serialized once to the fastest of them (synchronously, or staged and written in
the background with ``async_save=True``) and promoted to the others in the background.
``restore(state_dict)`` loads the newest good checkpoint, preferring the fastest tier.

One concept, one module, over 600 lines: the checkpointer owns the decision of each save
(schedule, optimizer cadence, what the save holds), its memory-budget refusal and the fallback to
the other due tiers (a refused async save keeps its staged copy: :class:`KeepStaged`), the
in-flight async save and its completion (node commits, replication), and the objects every
mechanism shares: the promoter, the replicator, the restorer and the pins.  The mechanisms
themselves live in ``save/``, ``promote/``, ``replicas/``, ``restore.py`` and ``retention.py``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager, StagingOptions

from dcp_tiered.checks import check_timeout
from dcp_tiered.dcp.objects import normalize_safe_globals
from dcp_tiered.dcp.planners import DowncastSavePlanner
from dcp_tiered.dcp.save_stats import stats_from_records
from dcp_tiered.dcp.statedict import OptimizerSnapshot, expand_stateful, reachable_optimizers
from dcp_tiered.errors import ConfigError, MemoryBudgetError, SaveError
from dcp_tiered.storage.retry import RetryPolicy
from dcp_tiered.tiers.catalog import CheckpointInfo, list_tiers
from dcp_tiered.tiers.layout import step_name
from dcp_tiered.tiers.save.node_commit import commit_after_save
from dcp_tiered.tiers.config import CheckpointerOptions
from dcp_tiered.tiers.policy import SaveSchedule, includes_optimizer
from dcp_tiered.tiers.promote.promoter import Promoter, PromotionReport
from dcp_tiered.tiers.events import EventLog, SaveReport, SaveReports, describe_error, root_cause
from dcp_tiered.tiers.replicas.replicate import Replicator
from dcp_tiered.tiers.restore import Restorer
from dcp_tiered.tiers.config import Tier, check_step, load_tiers_yaml, validate_tiers
from dcp_tiered.tiers.save.budget import budget_applies, save_budget_error
from dcp_tiered.tiers.save.staging import KeepStaged
from dcp_tiered.tiers.save.writer import TieredWriter
from dcp_tiered.tiers.topology import node_of

log = logging.getLogger(__name__)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TieredCheckpointer:
    """Save to tiers on their schedules, promote in the background, restore with fallback.

    Args:
        tiers: tiers, fastest first (see :class:`Tier`).
        options: a :class:`~dcp_tiered.tiers.config.CheckpointerOptions`.  Its fields are
            also keyword arguments here (``async_save=True``, ``optimizer_every=5``, ...),
            which override ``options``.
        clock: wall-clock function for schedules (inject a fake one in tests).
        process_group: group whose ranks save together (default: the default group).
        retry: backoff policy for promotions.
        safe_globals: what non-tensor values need beyond ``weights_only`` (numpy values:
            :func:`~dcp_tiered.dcp.objects.numpy_safe_globals`); a save holding a value that
            restore would refuse without it fails at save time, naming the key.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        options: CheckpointerOptions | None = None,
        clock: Callable[[], float] = time.time,
        process_group: Any = None,
        retry: RetryPolicy = RetryPolicy(),
        safe_globals: "Sequence[Any] | None" = None,
        **kwargs: Any,
    ) -> None:
        self.options = opts = CheckpointerOptions.merged(options, kwargs)
        self.safe_globals = normalize_safe_globals(safe_globals, "TieredCheckpointer")
        self.clock = clock
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.node = node_of(self.rank)
        self.tiers = validate_tiers(tiers, rank=self.rank, node=self.node)  # reachable as this rank sees them
        # DCP's own collectives for async saves run on a background thread: give them a group
        # of their own so they never interleave with this object's main-thread collectives.
        ranks = dist.get_process_group_ranks(process_group) if self.distributed and process_group is not None else None
        self._save_pg = dist.new_group(ranks=ranks, backend="gloo") if self.distributed else None
        self._decide_pg = dist.new_group(ranks=ranks, backend="gloo") if self.distributed else None
        self._src = ranks[0] if ranks else 0  # global rank of the coordinator
        self.events = EventLog(opts.event_log)
        self.promoter = Promoter(self.tiers, rank=self.rank, node=self.node, is_coordinator=self.rank == 0,
                                 retry=retry, on_report=self._on_promotion, nice=opts.nice,
                                 optimizer_keys=opts.optimizer_keys if opts.optimizer_every > 1 else (),
                                 leftover_grace=opts.leftover_grace, cpu_slots=opts.background_threads_or_default(),
                                 world=self.world if self.distributed else None)
        self.schedule = SaveSchedule(self.tiers, via_fastest=opts.via_fastest)
        # Replication of node-local tiers (every clique's group is made here, on every rank alike);
        # restore fetches a lost node's files through the same groups.
        self.replicator = Replicator(self.tiers, rank=self.rank, world=self.world, events=self.events,
                                     promoter=self.promoter, distributed=self.distributed, group=self._decide_pg)
        self._restorer = Restorer(self.tiers, rank=self.rank, node=self.node, world=self.world,
                                  distributed=self.distributed, promoter=self.promoter, events=self.events,
                                  replicator=self.replicator, list_group=self._decide_pg, load_group=self._save_pg,
                                  reader_options={"threads": opts.threads, "safe_globals": self.safe_globals})
        self._due_step: int | None = None  # the step of the decision cached by due()
        self._due_names: tuple[str, ...] = ()
        self.reports: list[SaveReport] = SaveReports(self.events)  # replication outcomes filled in (at wait())
        self.skipped = self._saves = 0
        self._skipped_step: int | None = None
        self._inflight: tuple[Future, SaveReport, float, TieredWriter, DowncastSavePlanner | None] | None = None
        self._failed: BaseException | None = None
        self._sync_next = self._closed = False
        self._stager: KeepStaged | None = None
        self._save_thread: ThreadPoolExecutor | None = None  # runs the async saves, one after another
        # Unfinished promotions of an earlier run resume once the restore that usually follows construction has
        # finished (or at the first save, wait or close): never while ranks are choosing and loading a checkpoint.
        self._resume_pending = opts.resume_promotions
        self._warned_no_optim = False

    @property
    def restore_failures(self) -> int:
        """Restore candidates that failed to load and were skipped, over every restore."""
        return self._restorer.failures

    def _resume_promotions(self) -> None:
        if self._resume_pending:
            self._resume_pending = False
            n = self.promoter.resume()
            if n:
                log.info("resuming %d unfinished promotion(s)", n)

    @classmethod
    def from_yaml(cls, path: "str | os.PathLike[str]", **overrides: Any) -> "TieredCheckpointer":
        """Build from a YAML file with ``tiers:`` and optional :class:`CheckpointerOptions` fields
        (``async_save: true``, ...); ``overrides`` are keyword arguments of the constructor. An
        ``options=`` override is the base the file's options apply to."""
        tiers, options = load_tiers_yaml(path)
        base = overrides.pop("options", None)
        return cls(tiers, options=CheckpointerOptions.from_mapping(options, where=os.fspath(path), base=base), **overrides)

    # -- saving ---------------------------------------------------------------------

    def _check_background(self) -> None:
        fut = self._inflight[0] if self._inflight else None
        if fut is not None and fut.done():
            self._finish_inflight()
        if self._failed is not None:
            exc, self._failed = self._failed, None
            self._sync_next = True
            raise SaveError(f"a background checkpoint save failed: {describe_error(exc)}; "
                            "the next save runs synchronously") from root_cause(exc)

    def _decide(self, step: int) -> tuple[str, ...]:
        return self.schedule.decide(step, self.clock(), agree=self._coordinators_due if self.distributed else None)

    def _coordinators_due(self, idx: list[int]) -> list[int]:
        """The coordinator's due tiers on every rank: wall clocks differ between ranks."""
        mask = torch.tensor([sum(1 << i for i in idx)], dtype=torch.int64)
        dist.broadcast(mask, src=self._src, group=self._decide_pg)
        return [i for i in range(len(self.tiers)) if int(mask.item()) >> i & 1]

    def due(self, step: int) -> bool:
        """Whether a save is due at ``step``: decide once (collectively, when the schedules use the
        wall clock: all ranks call it for the same steps) and remember it for ``maybe_save(step)``.

        Lets a training loop skip building the state dict when nothing is due; cheap (no
        collective, no allocation) when every tier is scheduled by steps only.
        """
        return bool(self.due_tiers(step))

    def due_tiers(self, step: int) -> tuple[str, ...]:
        """The names of the tiers due at ``step`` (empty when none): :meth:`due`, naming them."""
        self._enter(step, background=False)
        if self._due_step != step:
            self._due_names = tuple(self._decide(step))
            self._due_step = step
        return self._due_names

    def _enter(self, step: int, background: bool = True) -> None:  # the checks before a decision or save
        if self._closed:
            raise ConfigError("this TieredCheckpointer is closed")
        check_step(step)
        self._resume_promotions()
        if background and (self._inflight is not None or self._failed is not None):
            self._check_background()

    def maybe_save(self, step: int, state_dict: "Mapping[str, Any] | Callable[[], Mapping[str, Any]]", *,
                   force: bool = False) -> SaveReport | None:
        """Save ``state_dict`` as ``step`` to the tiers that are due; return the report, or None.

        ``state_dict`` may be a zero-argument callable returning the state: it is called only
        when a save is due.  A decision already made by :meth:`due` for ``step`` is reused.
        ``force``: every tier, whatever the schedules (recorded as a save by each).
        Raises :class:`SaveError` if the previous background save failed (the save asked
        for now is then not attempted; the next one runs synchronously).
        """
        self._enter(step)
        if force:
            due = self.schedule.record_all(step, self.clock())
        elif self._due_step == step:
            due = self._due_names
        else:
            due = self._decide(step)
        self._due_step, self._due_names = None, ()
        return self._save_due(step, state_dict, due)

    def save_now(self, step: int, state_dict: "Mapping[str, Any] | Callable[[], Mapping[str, Any]]") -> SaveReport:
        """Save ``step`` to every tier now, whatever the schedules: ``maybe_save(force=True)``, but
        always with the optimizer state (whatever ``optimizer_every``) and never skipped as busy."""
        self._enter(step)
        self._due_step, self._due_names = None, ()
        return self._save_due(step, state_dict, self.schedule.record_all(step, self.clock()), True)  # type: ignore

    def _save_due(self, step: int, state_dict: "Mapping[str, Any] | Callable[[], Mapping[str, Any]]",
                  due: Sequence[str], full: bool = False) -> SaveReport | None:
        if not due:
            return None
        if callable(state_dict) and not isinstance(state_dict, Mapping):
            state_dict = state_dict()
            if not isinstance(state_dict, Mapping):
                raise ConfigError(f"the state callable returned {type(state_dict).__name__}, not a mapping")
        if self._inflight is not None:
            if self.options.on_busy == "skip" and not full and not self._inflight[0].done():
                self.skipped, self._skipped_step = self.skipped + 1, step
                log.info("step %d: a save is still in flight; skipping (on_busy='skip')", step)
                return None
            t0 = time.perf_counter()
            self._finish_inflight(wait=True)
            waited = time.perf_counter() - t0
            self._check_background()
            return self._save(step, state_dict, due, full, waited)
        return self._save(step, state_dict, due, full)

    def _save(self, step: int, state_dict: Mapping[str, Any], due: Sequence[str], full: bool, waited: float = 0.0) -> SaveReport:
        fresh = OptimizerSnapshot(reachable_optimizers(state_dict))  # DCP's get_state_dict steps fresh ones at lr 0
        try:
            sd, with_optim = self._payload(step, state_dict, full)
            use_async, self._sync_next = self.options.async_save and not self._sync_next, False
            return self._write(sd, SaveReport(step, list(due), with_optim, use_async, state_bytes(sd), waited_s=waited))
        finally:  # the save holds its copy now (async: staged), so the live state goes back as it was
            fresh.undo()

    def _check_budget(self, sd: Mapping[str, Any], report: SaveReport) -> None:
        """A memory tier refusing the save of ``report`` by this checkpointer, decided on every
        rank before anything is staged or written (sync and async alike): the save moves to the other due
        tiers (``report.tiers``), or fails now (:meth:`_fail_save`)."""
        while True:
            primary = next(t for t in self.tiers if t.name == report.tiers[0])
            if budget_applies(primary):  # what the tier holds that retention deletes goes first (in async mode
                try:  # the last save's retention may still be queued); never skips the collective below
                    self.promoter.retain_now(primary)
                except Exception as why:  # noqa: BLE001 - the budget then counts what retention left
                    log.warning("retention of tier %s before the budget check failed: %s", primary.name, why)
            try:
                exc = save_budget_error(primary, sd, step_name(report.step), planner=self._planner(primary.name) or
                                        DefaultSavePlanner(), promoter=self.promoter,
                                        frame_size=self.options.frame_size, rank=self.rank, world=self.world,
                                        group=self._decide_pg, src=self._src)
            except SaveError as failed:  # the check itself failed (on any rank): every rank fails the save alike
                self._fail_save(report, failed, time.perf_counter())
            if exc is None:
                return
            if not fall_back(report, exc, self.events):
                self._fail_save(report, exc, time.perf_counter())

    def _fail_save(self, report: SaveReport, exc: BaseException, t0: float) -> NoReturn:
        """Record the failed save of ``report`` (started at ``t0``) and raise :class:`SaveError`."""
        report.ok, report.error = False, describe_error(exc, 2000)
        report.total_s = time.perf_counter() - t0
        report.blocked_s = report.waited_s + report.total_s
        self.reports.append(report)
        self.events.emit(report.as_dict())
        raise SaveError(f"checkpoint save of step {report.step} to tier {report.tiers[0]!r} failed: "
                        f"{describe_error(exc)}") from root_cause(exc)

    def _planner(self, tier_name: str) -> DowncastSavePlanner | None:
        dtype = next(t for t in self.tiers if t.name == tier_name).dtype
        return DowncastSavePlanner(_DTYPES[dtype]) if dtype else None

    def _write(self, sd: Mapping[str, Any], report: SaveReport, staged: bool = False) -> SaveReport:
        """Save ``sd`` to ``report.tiers``; ``staged``: ``sd`` is the staged copy of an async save falling back."""
        if not staged:
            self._check_budget(sd, report)
        step, due, opts, bg = report.step, report.tiers, self.options, report.async_save
        planner = self._planner(due[0])
        for name in due:
            self.promoter.mark_own(name, step)
        self.promoter.set_writing(due, step, True)
        # async: within the CPU budget (sync blocks training anyway); overwrite: a step saved again after a restore
        writer = TieredWriter(self.tiers, due=due, promoter=self.promoter, frame_size=opts.frame_size,
                              threads=opts.background_threads_or_default() if bg else opts.threads,
                              safe_globals=self.safe_globals, nice=opts.nice if bg else None, overwrite=True,
                              cpu_slots=self.promoter.cpu if bg else None)  # one budget with promotion re-encodes
        kwargs: dict[str, Any] = {"storage_writer": writer, "planner": planner, "checkpoint_id": step_name(step),
                                  **({"process_group": self._save_pg} if self.distributed else {"no_dist": True})}
        t0 = time.perf_counter()
        if bg:
            self._stager = self._stager or KeepStaged(StagingOptions(torch.cuda.is_available(), False, False, False))
            try:
                fut = self._save_in_background(sd, self._stager.again(sd) if staged else self._stager, kwargs)
            except BaseException as exc:  # staging failed: nothing runs in the background
                self.promoter.set_writing(due, step, False)
                if not isinstance(exc, Exception):
                    raise
                self._sync_next = True  # as after a failed background save
                self._fail_save(report, exc, t0)
            self._inflight = (fut, report, t0, writer, planner)  # type: ignore[assignment]
            if not staged:
                report.blocked_s = report.waited_s + time.perf_counter() - t0
                self.reports.append(report)
            return report
        try:
            metadata = dcp.save(sd, **kwargs)  # the committed Metadata, on every rank
        except BaseException as exc:
            self.promoter.set_writing(due, step, False)
            if isinstance(exc, KeyboardInterrupt):
                raise
            if fall_back(report, exc, self.events):
                return self._write(sd, report, staged=True)  # the writer refused: decided, no second check
            self._fail_save(report, exc, t0)
        self.promoter.set_writing(due, step, False)
        report.total_s = time.perf_counter() - t0
        report.blocked_s = report.waited_s + report.total_s
        self._complete(report, writer, planner, metadata)
        self.reports.append(report)
        return report

    def _save_in_background(self, sd: Mapping[str, Any], stager: AsyncStager, kwargs: dict[str, Any]) -> Future:
        """``dcp.async_save`` in thread mode, on this checkpointer's one save thread: stage ``sd`` now, then
        ``dcp.save`` the staged copy there.  (``dcp.async_save`` starts a new thread per call, and the call
        then waits for that thread to hand the GIL back: up to the 5 ms switch interval, per save.)"""
        staged = stager.stage(sd)  # KeepStaged or AlreadyStaged: a state, never a Future
        if self._save_thread is None:
            self._save_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_tiered-save")
        fut = self._save_thread.submit(dcp.save, staged, **kwargs)
        if stager.should_synchronize_after_execute:
            stager.synchronize_staging()
        return fut

    def _payload(self, step: int, state_dict: Mapping[str, Any], full: bool) -> tuple[dict[str, Any], bool]:
        """What this save holds (``Stateful`` objects expanded at any depth, as restore expects them;
        without the optimizer entries unless ``full`` or this save is one of every ``optimizer_every``:
        see :func:`~dcp_tiered.tiers.policy.includes_optimizer`) and whether it holds the optimizer state."""
        state_dict = expand_stateful(state_dict)[0]
        opts = self.options
        with_optim = full or includes_optimizer(self._saves, opts.optimizer_every, step, self.schedule.step_period)
        self._saves += 1
        sd, found = without_paths(state_dict, opts.optimizer_keys)
        if opts.optimizer_every > 1 and not found and not self._warned_no_optim:
            self._warned_no_optim = True
            log.warning("optimizer_every=%d but no entry of the state matches optimizer_keys %s (top-level keys: %s): "
                        "every save holds everything; name the optimizer entry, e.g. optimizer_keys=['app.optim']",
                        opts.optimizer_every, list(opts.optimizer_keys), sorted(state_dict)[:8])
        return (dict(state_dict) if with_optim else sd), with_optim and found

    def _complete(self, report: SaveReport, writer: TieredWriter, planner: DowncastSavePlanner | None, metadata: Any) -> None:
        report.ok = True
        stats = committed_stats(writer.last_stats, metadata)
        if stats is not None:
            report.stored_bytes = stats.stored_bytes
            report.raw_bytes = stats.raw_bytes or report.raw_bytes
        if planner is not None:
            report.downcast_kept = dict(planner.report.kept)
        primary = next(t for t in self.tiers if t.name == report.tiers[0])
        if primary.node_local:  # DCP commits the coordinator's directory only: commit the others (their leaders)
            commit_after_save(primary, report.step, metadata, rank=self.rank, world=self.world,
                              promoter=self.promoter, events=self.events)
            self.replicator.submit(report.step, primary, metadata)  # in the background, to its clique
        self.events.emit(report.as_dict())

    def _finish_inflight(self, wait: bool = False, deadline: float | None = None) -> None:
        """Collect the async save in flight (``wait``: block for it, until ``deadline``, a monotonic time:
        then raise :class:`SaveError` and leave it in flight), and a fallback save it turns into."""
        if self._inflight is None:
            return
        fut, report, t0, writer, planner = self._inflight  # type: ignore[misc]
        if wait:
            try:
                fut.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except BaseException as exc:  # the save's own failure is handled below
                if not fut.done():  # the wait ended first (timeout, Ctrl-C): the save stays in flight, its buffers kept
                    if isinstance(exc, FutureTimeout):
                        raise SaveError(f"the save of step {report.step} to tier {report.tiers[0]!r} is still in "
                                        "flight when the timeout ran out") from None
                    raise
        if not fut.done():
            return
        self._inflight = None
        staged, self._stager.staged = self._stager.staged, None  # type: ignore[union-attr]
        try:
            metadata = fut.result()  # the committed Metadata, on every rank
        except BaseException as exc:
            self.promoter.set_writing(report.tiers, report.step, False)
            if isinstance(exc, KeyboardInterrupt):
                raise
            if staged is not None and fall_back(report, exc, self.events):  # write the staged copy to the other tiers
                self._write(staged, report, staged=True)
                return self._finish_inflight(wait, deadline)
            report.ok, report.error = False, describe_error(exc, 2000)
            report.total_s = time.perf_counter() - t0
            self.events.emit(report.as_dict())
            self._failed = exc
            return
        self.promoter.set_writing(report.tiers, report.step, False)
        report.total_s = time.perf_counter() - t0
        self._complete(report, writer, planner, metadata)

    def _on_promotion(self, report: PromotionReport) -> None:
        self.events.emit({"event": "promotion", **report.as_dict()})

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight and every promotion are done; raise the first failure.

        With ``timeout`` (seconds, for both together) raise :class:`SaveError` if the save is
        still in flight, or :class:`PromotionError` naming the promotions still pending."""
        check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._closed:
            self._resume_promotions()
        self._finish_inflight(wait=True, deadline=deadline)
        self._check_background()
        self.promoter.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.replicator.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float | None = None, *, final_step: int | None = None,
              state_dict: "Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None" = None) -> None:
        """:meth:`wait` (with ``timeout``), then stop background work. Safe to call twice.

        ``final_step`` (with ``state_dict``): first save that step as :meth:`save_now` does, to the
        tiers whose last save (or restore) is not that step (a failure raises; still open).
        When ``timeout`` runs out while the save or promotions are still running, the error is
        raised and the checkpointer stays open: call ``close()`` again to keep waiting (work
        dropped by a process that exits instead resumes in the next run, from its intents)."""
        if self._closed:
            return
        if final_step is not None:
            if state_dict is None:
                raise ConfigError("close(final_step=...) needs the state to save: pass state_dict=")
            self._enter(final_step)
            new = self._skipped_step != final_step  # a final step skipped as busy is saved now
            self._save_due(final_step, state_dict, self.schedule.record_all(final_step, self.clock(), new), True)
        try:
            self.wait(timeout)
        except BaseException:
            if timeout is not None and (self._inflight is not None or self.promoter.pending()):
                raise  # timed out: still open, a later close() finishes the work
            self._shut()
            raise
        self._shut()

    def _shut(self) -> None:
        self._closed = True
        self.promoter.close(wait=False, timeout=2.0)
        if self._stager is not None and self._inflight is None:
            self._stager.close()
        if self._save_thread is not None:  # a save still running (a failed close) finishes, then the thread ends
            self._save_thread.shutdown(wait=self._inflight is None)
            self._save_thread = None

    def __enter__(self) -> "TieredCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- catalog and restore -------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint of every tier as this rank sees it (committed or not)."""
        return list_tiers(self.tiers, self.rank, self.node)

    def restore(self, state_dict: dict[str, Any], *, step: int | None = None, broadcast: Any = False,
                bucket_bytes: int = 64 << 20) -> int | None:
        """Load the newest good checkpoint holding every key of ``state_dict`` into it; return its step.

        ``state_dict`` is what ``dcp.load`` takes: tensors are loaded in place, other values
        replaced, and ``Stateful`` objects (at any depth) get ``load_state_dict`` called with
        their loaded state.  Collective: every rank of the group calls it.  The coordinator
        lists the shared tiers, every rank lists its node-local ones, and all ranks agree on
        one ordered candidate list (newest step first, fastest tier first; a node-local
        candidate only if every rank sees it whole).  Candidates are pinned against retention
        until the restore ends; after a failed attempt on any rank, every rank moves on to
        the same next candidate (failures count in ``restore_failures``).  When every
        candidate failed the tiers are listed again (a resumed promotion may have committed
        a newer step meanwhile).

        Returns None only when no tier holds a committed checkpoint (``step`` asks for that step).
        Raises :class:`RestoreError` when committed checkpoints exist but none could be
        restored, or a tier could not be listed, naming each candidate and why it was rejected.

        ``broadcast=True``: for replicated (DDP-style) state, one rank reads and decompresses
        and broadcasts the tensors to the others in ``bucket_bytes`` buckets
        (:func:`~dcp_tiered.dcp.broadcast.load_and_broadcast`), so storage serves the
        checkpoint once instead of once per rank; ``broadcast=<group or list of groups>``
        picks one leader per group (e.g. one per node).
        """
        if step is not None:
            check_step(step)
        self._finish_inflight(wait=True)
        fresh = OptimizerSnapshot(reachable_optimizers(state_dict))  # undone unless a checkpoint is loaded
        try:
            try:
                found = self._restorer.restore(state_dict, step, broadcast, bucket_bytes)
            except BaseException:
                fresh.undo()
                raise
            if found is None:
                fresh.undo()
                return None
            restored, tiers = found
            self.schedule.restored(restored, self.clock(), tiers)  # the schedules count from the restored step
            return restored
        finally:
            self._resume_promotions()

    def raise_if_failed(self) -> None:
        """Raise a recorded background save failure now (also done by ``maybe_save``/``wait``)."""
        self._check_background()


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


def without_paths(state_dict: Mapping[str, Any], paths: Sequence[str]) -> tuple[dict[str, Any], bool]:
    """``state_dict`` without the entries at the dotted ``paths`` (``"optim"``, ``"app.optim"``),
    copying only the mappings on the way; and whether any path was there."""
    out = dict(state_dict)
    found = False
    for path in paths:
        *parents, last = path.split(".")
        node: Any = out
        for i, part in enumerate(parents):
            child = node.get(part) if isinstance(node, Mapping) else None
            if not isinstance(child, Mapping):
                node = None
                break
            node[part] = dict(child)  # a copy: the caller's state dict is never changed
            node = node[part]
        if isinstance(node, dict) and last in node:
            del node[last]
            found = True
    return out, found


def state_bytes(state_dict: Mapping[str, Any]) -> int:
    """Bytes of the tensors in ``state_dict`` (nested mappings included), as held in memory."""
    total = 0
    for v in state_dict.values():
        if isinstance(v, Mapping):
            total += state_bytes(v)
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def committed_stats(writer_stats: Any, metadata: Any) -> Any:
    """Sizes of a committed save: the coordinator's writer computed them at commit; every other
    rank reads them from the committed ``Metadata`` that ``dcp.save`` returns everywhere (so a
    save's raw/stored bytes are the same on every rank, for its report and the metrics): the
    coordinator's, carried with the records, or counted from the records."""
    if writer_stats is not None or not getattr(metadata, "storage_data", None):
        return writer_stats
    carried = getattr(metadata.storage_data, "stats", None)
    if carried is not None:
        return carried
    return stats_from_records((getattr(k, "fqn", k), r) for k, r in metadata.storage_data.items())
