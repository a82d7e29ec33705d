"""``TieredCheckpointer``: the training-loop API over tiers.

``maybe_save(step, state_dict)`` is cheap when nothing is due.  When tiers are due, the
state is serialized once to the fastest of them (synchronously, or staged and written in
the background with ``async_save=True``) and promoted to the others in the background.
``restore(state_dict)`` loads the newest good checkpoint, preferring the fastest tier.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from dcp_tiered.dcp.objects import normalize_safe_globals
from dcp_tiered.dcp.planners import DowncastSavePlanner
from dcp_tiered.dcp.reader import CompressedReader
from dcp_tiered.dcp.statedict import expand_stateful, flatten_keys
from dcp_tiered.errors import ConfigError, DcpTieredError, RestoreError, SaveError
from dcp_tiered.storage.retry import RetryPolicy
from dcp_tiered.tiers.catalog import CheckpointInfo, list_tier, list_tiers
from dcp_tiered.tiers.layout import step_name
from dcp_tiered.tiers.policy import Schedule, TierHistory, due_tiers, includes_optimizer, record_save, restore_order
from dcp_tiered.tiers.promotion import Promoter, PromotionReport
from dcp_tiered.tiers.report import EventLog, SaveReport
from dcp_tiered.tiers.spec import Tier, check_checkpointer_options, check_step, load_tiers_yaml, validate_tiers
from dcp_tiered.tiers.writer import TieredWriter, node_of

log = logging.getLogger(__name__)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: CPU priority offset of background saves and promotions, so the training loop keeps the cores.
BACKGROUND_NICE = 10


def describe_error(exc: BaseException, limit: int = 800) -> str:
    """``Type: message`` of ``exc`` on one line, at most ``limit`` characters; for DCP's
    ``CheckpointException`` (whose text holds every rank's traceback) the first failure's."""
    rank = None
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        rank, (exc, _) = min(failures.items(), key=lambda kv: kv[0])
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    if rank is not None:
        text += f" (rank {rank})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def root_cause(exc: BaseException) -> BaseException:
    """The first rank's failure inside DCP's ``CheckpointException``, else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        return min(failures.items(), key=lambda kv: kv[0])[1][0]
    return exc


def _check_timeout(timeout: Any) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 <= timeout < float("inf")):
        raise ConfigError(f"timeout must be None or a non-negative number of seconds, got {timeout!r}")


def _without_paths(state_dict: Mapping[str, Any], paths: Sequence[str]) -> tuple[dict[str, Any], bool]:
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


def _state_bytes(state_dict: Mapping[str, Any]) -> int:
    total = 0
    for v in state_dict.values():
        if isinstance(v, Mapping):
            total += _state_bytes(v)
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


class TieredCheckpointer:
    """Save to tiers on their schedules, promote in the background, restore with fallback.

    Args:
        tiers: tiers, fastest first (see :class:`Tier`).
        async_save: stage the state to host memory and write in the background; at most
            one save is in flight, staging buffers are reused between saves.
        optimizer_every: every Nth save holds the optimizer state (the entries named by
            ``optimizer_keys``); the others hold the model only.
        optimizer_keys: top-level keys, or dotted paths into the (``Stateful``-expanded)
            state, of the optimizer state: ``["app.optim"]`` for the DCP tutorial's
            ``{"app": AppState(model, optimizer)}``.  A warning says when none matches.
        on_busy: ``"wait"`` (default) or ``"skip"`` when a save is due while one is in flight.
        clock: wall-clock function for schedules (inject a fake one in tests).
        process_group: group whose ranks save together (default: the default group).
        event_log: path of a JSON-lines file receiving every save/promotion/restore report.
        retry: backoff policy for promotions.
        leftover_grace: retention removes an uncommitted leftover only once it is this old
            (another process may still be writing it); ``0`` removes leftovers at once.
        via_fastest: when only slower tiers are due, write to the fastest tier too and
            promote from there (the default), so a slow tier never blocks the training loop
            for longer than a fast-tier save.
        safe_globals: what non-tensor values need beyond ``weights_only`` (numpy values:
            :func:`~dcp_tiered.dcp.objects.numpy_safe_globals`); a save holding a value that
            restore would refuse without it fails at save time, naming the key.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        async_save: bool = False,
        optimizer_every: int = 1,
        optimizer_keys: Sequence[str] = ("optim", "optimizer"),
        on_busy: str = "wait",
        clock: Callable[[], float] = time.time,
        process_group: Any = None,
        event_log: "str | os.PathLike[str] | None" = None,
        retry: RetryPolicy = RetryPolicy(),
        threads: int | None = None,
        frame_size: int | None = None,
        resume_promotions: bool = True,
        via_fastest: bool = True,
        leftover_grace: "str | float" = "1h",
        safe_globals: "Sequence[Any] | None" = None,
    ) -> None:
        opts = check_checkpointer_options(
            optimizer_every=optimizer_every, optimizer_keys=optimizer_keys, on_busy=on_busy, threads=threads,
            frame_size=frame_size, async_save=async_save, via_fastest=via_fastest,
            resume_promotions=resume_promotions, leftover_grace=leftover_grace)
        self.safe_globals = normalize_safe_globals(safe_globals, "TieredCheckpointer")
        self.async_save = opts["async_save"]
        self.via_fastest = opts["via_fastest"]
        self.optimizer_every = opts["optimizer_every"]
        self.optimizer_keys = opts["optimizer_keys"]
        self.on_busy = opts["on_busy"]
        self.clock = clock
        self.threads, self.frame_size = opts["threads"], opts["frame_size"]
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
        self.events = EventLog(event_log)
        self.promoter = Promoter(self.tiers, rank=self.rank, node=self.node, is_coordinator=self.rank == 0,
                                 retry=retry, on_report=self._on_promotion,
                                 optimizer_keys=self.optimizer_keys if self.optimizer_every > 1 else (),
                                 leftover_grace=opts["leftover_grace"])
        self.histories = {t.name: TierHistory() for t in self.tiers}
        self._schedules = [Schedule(t.every, t.every_steps, t.max_per_hour) for t in self.tiers]
        self._clock_based = any(t.every is not None or t.max_per_hour is not None for t in self.tiers)
        self._due_step: int | None = None  # the step of the decision cached by due()
        self._due_names: list[str] = []
        self.reports: list[SaveReport] = []
        self.restore_failures = 0
        self.skipped = 0
        self._saves = 0
        self._inflight: tuple[Future, SaveReport, float, TieredWriter, DowncastSavePlanner | None] | None = None
        self._failed: BaseException | None = None
        self._sync_next = False
        self._stager: DefaultStager | None = None
        self._closed = False
        # Unfinished promotions of an earlier run resume once the restore that usually follows
        # construction has finished (or at the first save, wait or close): a resumed commit and
        # its retention never run while ranks are choosing and loading a checkpoint.
        self._resume_pending = opts["resume_promotions"]
        self._warned_no_optim = False

    def _resume_promotions(self) -> None:
        if self._resume_pending:
            self._resume_pending = False
            n = self.promoter.resume()
            if n:
                log.info("resuming %d unfinished promotion(s)", n)

    @classmethod
    def from_yaml(cls, path: "str | os.PathLike[str]", **overrides: Any) -> "TieredCheckpointer":
        """Build from a YAML file with ``tiers:`` and optional checkpointer options (``async_save``, ...)."""
        tiers, options = load_tiers_yaml(path)
        allowed = {"async_save", "optimizer_every", "optimizer_keys", "on_busy", "event_log", "threads", "frame_size",
                   "via_fastest", "leftover_grace"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ConfigError(f"{path}: unknown option(s) {unknown}; known: {sorted(allowed)}")
        return cls(tiers, **{**options, **overrides})

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

    def _decide(self, step: int) -> list[str]:
        now = self.clock()
        idx = due_tiers(self._schedules, [self.histories[t.name] for t in self.tiers], step, now, self.via_fastest)
        if self.distributed and self._clock_based:
            # wall clocks differ between ranks: the coordinator's decision is everyone's
            mask = torch.tensor([sum(1 << i for i in idx)], dtype=torch.int64)
            dist.broadcast(mask, src=self._src, group=self._decide_pg)
            idx = [i for i in range(len(self.tiers)) if int(mask.item()) >> i & 1]
        names = [self.tiers[i].name for i in idx]
        for n in names:
            self.histories[n] = record_save(self.histories[n], step, now)
        return names

    def due(self, step: int) -> bool:
        """Whether a save is due at ``step``: decide once (collectively, when the schedules use the
        wall clock: all ranks call it for the same steps) and remember it for ``maybe_save(step)``.

        Lets a training loop skip building the state dict when nothing is due; cheap (no
        collective, no allocation) when every tier is scheduled by steps only.
        """
        if self._closed:
            raise ConfigError("this TieredCheckpointer is closed")
        check_step(step)
        self._resume_promotions()
        if self._due_step != step:
            self._due_names = self._decide(step)
            self._due_step = step
        return bool(self._due_names)

    def maybe_save(self, step: int, state_dict: "Mapping[str, Any] | Callable[[], Mapping[str, Any]]", *,
                   force: bool = False) -> SaveReport | None:
        """Save ``state_dict`` as ``step`` to the tiers that are due; return the report, or None.

        ``state_dict`` may be a zero-argument callable returning the state: it is called only
        when a save is due.  A decision already made by :meth:`due` for ``step`` is reused.
        Raises :class:`SaveError` if the previous background save failed (the save asked
        for now is then not attempted; the next one runs synchronously).
        """
        if self._closed:
            raise ConfigError("this TieredCheckpointer is closed")
        check_step(step)
        self._resume_promotions()
        if self._inflight is not None or self._failed is not None:
            self._check_background()
        if force:
            due = [t.name for t in self.tiers]
        elif self._due_step == step:
            due = self._due_names
        else:
            due = self._decide(step)
        self._due_step, self._due_names = None, []
        if not due:
            return None
        if callable(state_dict) and not isinstance(state_dict, Mapping):
            state_dict = state_dict()
            if not isinstance(state_dict, Mapping):
                raise ConfigError(f"the state callable passed to maybe_save returned {type(state_dict).__name__}, "
                                  "not a mapping")
        if self._inflight is not None:
            if self.on_busy == "skip" and not self._inflight[0].done():
                self.skipped += 1
                log.info("step %d: a save is still in flight; skipping (on_busy='skip')", step)
                return None
            t0 = time.perf_counter()
            self._finish_inflight(wait=True)
            waited = time.perf_counter() - t0
            self._check_background()
            return self._save(step, state_dict, due, waited)
        return self._save(step, state_dict, due)

    def _save(self, step: int, state_dict: Mapping[str, Any], due: list[str], waited: float = 0.0) -> SaveReport:
        state_dict = expand_stateful(state_dict)[0]  # Stateful objects at any depth, as restore expects them
        with_optim = includes_optimizer(self._saves, self.optimizer_every)
        self._saves += 1
        sd, found = _without_paths(state_dict, self.optimizer_keys)
        if with_optim:
            sd = dict(state_dict)
        if self.optimizer_every > 1 and not found and not self._warned_no_optim:
            self._warned_no_optim = True
            log.warning("optimizer_every=%d but no entry of the state matches optimizer_keys %s (top-level keys: %s): "
                        "every save holds everything; name the optimizer entry, e.g. optimizer_keys=['app.optim']",
                        self.optimizer_every, list(self.optimizer_keys), sorted(state_dict)[:8])
        with_optim = with_optim and found
        primary = next(t for t in self.tiers if t.name == due[0])
        planner = DowncastSavePlanner(_DTYPES[primary.dtype]) if primary.dtype else None
        for name in due:
            self.promoter.mark_own(name, step)
        self.promoter.set_writing(due, step, True)
        use_async = self.async_save and not self._sync_next
        # overwrite: after a restore from an older step, the steps after it are saved again
        writer = TieredWriter(self.tiers, due=due, promoter=self.promoter, threads=self.threads, frame_size=self.frame_size,
                              safe_globals=self.safe_globals,
                              nice=BACKGROUND_NICE if use_async else None, overwrite=True)
        self._sync_next = False
        report = SaveReport(step, list(due), with_optim, use_async, raw_bytes=_state_bytes(sd), waited_s=waited)
        name = step_name(step)
        kwargs: dict[str, Any] = {"storage_writer": writer, "planner": planner, "checkpoint_id": name}
        if self.distributed:
            kwargs["process_group"] = self._save_pg
        else:
            kwargs["no_dist"] = True
        t0 = time.perf_counter()
        if use_async:
            if self._stager is None:
                cuda = torch.cuda.is_available()
                self._stager = DefaultStager(StagingOptions(cuda, False, False, False))
            try:
                fut = dcp.async_save(sd, async_stager=self._stager, **kwargs)
            except BaseException:
                self.promoter.set_writing(due, step, False)
                raise
            report.blocked_s = waited + time.perf_counter() - t0
            self._inflight = (fut, report, t0, writer, planner)  # type: ignore[assignment]
            self.reports.append(report)
            return report
        try:
            dcp.save(sd, **kwargs)
        except BaseException as exc:
            self.promoter.set_writing(due, step, False)
            if isinstance(exc, KeyboardInterrupt):
                raise
            report.ok, report.error = False, describe_error(exc, 2000)
            report.total_s = time.perf_counter() - t0
            report.blocked_s = waited + report.total_s
            self.reports.append(report)
            self.events.emit(report.as_dict())
            raise SaveError(f"checkpoint save of step {step} to tier {due[0]!r} failed: {describe_error(exc)}"
                            ) from root_cause(exc)
        self.promoter.set_writing(due, step, False)
        report.total_s = time.perf_counter() - t0
        report.blocked_s = waited + report.total_s
        self._complete(report, writer, planner)
        self.reports.append(report)
        return report

    def _complete(self, report: SaveReport, writer: TieredWriter, planner: DowncastSavePlanner | None) -> None:
        report.ok = True
        stats = writer.last_stats
        if stats is not None:
            report.stored_bytes = stats.stored_bytes
            report.raw_bytes = stats.raw_bytes or report.raw_bytes
        if planner is not None:
            report.downcast_kept = dict(planner.report.kept)
        primary = next(t for t in self.tiers if t.name == report.tiers[0])
        if primary.node_local and self.rank != 0:
            # DCP runs finish() (which queues retention) on the coordinator only; other ranks
            # clean their own node-local directories once they know the save committed.
            self.promoter.retention(primary, protect=[report.step])
        self.events.emit(report.as_dict())

    def _finish_inflight(self, wait: bool = False) -> None:
        if self._inflight is None:
            return
        fut, report, t0, writer, planner = self._inflight  # type: ignore[misc]
        if not wait and not fut.done():
            return
        self._inflight = None
        try:
            fut.result()
        except BaseException as exc:
            self.promoter.set_writing(report.tiers, report.step, False)
            if isinstance(exc, KeyboardInterrupt):
                raise
            report.ok, report.error = False, describe_error(exc, 2000)
            report.total_s = time.perf_counter() - t0
            self.events.emit(report.as_dict())
            self._failed = exc
            return
        self.promoter.set_writing(report.tiers, report.step, False)
        report.total_s = time.perf_counter() - t0
        self._complete(report, writer, planner)

    def _on_promotion(self, report: PromotionReport) -> None:
        self.events.emit({"event": "promotion", **report.as_dict()})

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight and every promotion are done; raise the first failure.

        With ``timeout`` (seconds, for both together) raise :class:`SaveError` if the save is
        still in flight, or :class:`PromotionError` naming the promotions still pending."""
        _check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._closed:
            self._resume_promotions()
        if self._inflight is not None and deadline is not None:
            fut, report = self._inflight[0], self._inflight[1]
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise SaveError(f"the save of step {report.step} to tier {report.tiers[0]!r} is still in flight "
                                f"after {timeout} s") from None
            except BaseException:  # noqa: BLE001 - recorded and raised by _check_background below
                pass
        self._finish_inflight(wait=True)
        self._check_background()
        self.promoter.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float | None = None) -> None:
        """:meth:`wait` (with ``timeout``), then stop background work. Safe to call twice.

        When ``timeout`` runs out while the save or promotions are still running, the error is
        raised and the checkpointer stays open: call ``close()`` again to keep waiting (work
        dropped by a process that exits instead resumes in the next run, from its intents)."""
        if self._closed:
            return
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
        required = flatten_keys(expand_stateful(state_dict)[0])
        rejected: dict[tuple[int, int], str] = {}
        tried: set[tuple[int, int]] = set()
        committed = False
        pinned: set[tuple[int, int]] = set()
        unlisted: list[str] = []
        try:
            for _ in range(3):
                candidates, reasons, found = self._agree_candidates(required, step, pinned, unlisted)
                committed = committed or found
                for cand, why in reasons.items():
                    rejected.setdefault(cand, why)
                fresh = [c for c in candidates if c not in tried]
                if not fresh:
                    break
                for cand in fresh:
                    tried.add(cand)
                    rejected.pop(cand, None)
                    why = self._attempt_restore(cand, state_dict, broadcast, bucket_bytes)
                    if why is None:
                        now = self.clock()
                        for i in {c[1] for c in candidates}:
                            self.histories[self.tiers[i].name] = TierHistory(cand[0], now, ())
                        return cand[0]
                    rejected[cand] = why
        finally:
            for s, i in pinned:
                self.promoter.set_writing([self.tiers[i].name], s, False)
            self._resume_promotions()
        if not committed and not unlisted:
            return None
        order = restore_order(rejected)
        listed = [(self.tiers[i].name, s, rejected[(s, i)]) for s, i in order]
        lines = "; ".join([f"step {s} on tier {t!r}: {why}" for t, s, why in listed[:8]] + unlisted[:4])
        more = f"; and {len(listed) - 8} more" if len(listed) > 8 else ""
        wanted = f" of step {step}" if step is not None else ""
        raise RestoreError(f"no committed checkpoint{wanted} could be restored ({len(listed)} candidate(s)): "
                           f"{lines}{more}", listed)

    def _local_view(self, required: Sequence[str], pinned: set[tuple[int, int]], unlisted: list[str]
                    ) -> list[tuple[int, int, str | None]]:
        """``(step, tier index, why unusable or None)`` of each committed checkpoint this rank answers for:
        the node-local tiers as this rank sees them, and the shared tiers on the coordinator.
        Each one is pinned against retention at once; tiers that cannot be listed go to ``unlisted``."""
        out: list[tuple[int, int, str | None]] = []
        for i, tier in enumerate(self.tiers):
            if not tier.node_local and self.rank != 0:
                continue
            try:
                infos = list_tier(tier, i, self.rank, self.node)
            except DcpTieredError as exc:
                log.warning("restore: cannot list tier %s: %s", tier.name, exc)
                unlisted.append(f"tier {tier.name!r} cannot be listed: {describe_error(exc)}")
                continue
            for info in infos:
                if not (info.committed or info.unusable):  # a linked checkpoint is named, never skipped
                    continue
                if (info.step, i) not in pinned:
                    self.promoter.set_writing([tier.name], info.step, True)
                    pinned.add((info.step, i))
                why = None
                if not info.complete or info.keys is None:
                    why = info.problem or "files missing or unreadable metadata"
                else:
                    missing = [k for k in required if k not in info.keys]
                    if missing:
                        extra = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                        why = f"lacks key(s) {missing[:3]}{extra} of the state dict"
                out.append((info.step, i, why))
        return out

    def _agree_candidates(self, required: Sequence[str], step: int | None, pinned: set[tuple[int, int]],
                          unlisted: list[str]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str], bool]:
        """The candidate list every rank agrees on (one all-gather), the rejected ones with why,
        and whether any committed checkpoint exists; listing problems of any rank go to ``unlisted``."""
        problems: list[str] = []
        try:
            view = self._local_view(required, pinned, problems)
        except Exception as exc:  # noqa: BLE001 - this rank must still take part in the collective below
            problems.append(f"listing the tiers failed: {describe_error(exc)}")
            view = []
        views: list[Any] = [(view, problems)]
        if self.distributed:
            views = [None] * self.world
            dist.all_gather_object(views, (view, problems), group=self._decide_pg)
        seen: dict[tuple[int, int], dict[int, str | None]] = {}
        for rank, (v, probs) in enumerate(views):
            for p in probs:
                line = f"rank {rank}: {p}" if self.distributed else p
                if line not in unlisted:
                    unlisted.append(line)
            for s, i, why in v:
                seen.setdefault((s, i), {})[rank] = why
        usable: list[tuple[int, int]] = []
        reasons: dict[tuple[int, int], str] = {}
        found = False
        for (s, i), by_rank in seen.items():
            found = True
            if step is not None and s != step:
                reasons[(s, i)] = f"not the requested step {step}"
                continue
            if self.tiers[i].node_local:
                problems = [f"rank {r}: {by_rank[r]}" if r in by_rank else f"rank {r}: not committed there"
                            for r in range(len(views)) if by_rank.get(r, "") is not None]
            else:
                problems = [by_rank[0]] if by_rank.get(0) is not None else []
            if problems:
                reasons[(s, i)] = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} ranks)" if len(problems) > 3 else "")
            else:
                usable.append((s, i))
        return restore_order(usable), reasons, found

    def _attempt_restore(self, cand: tuple[int, int], state_dict: dict[str, Any], broadcast: Any,
                         bucket_bytes: int) -> str | None:
        """Load one candidate on every rank; None if every rank succeeded, else why (the same on every rank)."""
        s, i = cand
        tier = self.tiers[i]
        url = tier.resolved_url(self.rank, self.node).rstrip("/") + "/" + step_name(s)
        t0 = time.perf_counter()
        error = None
        try:
            plain, finish = expand_stateful(state_dict)

            def make_reader() -> CompressedReader:
                return CompressedReader(url, storage_options=tier.storage_options, threads=self.threads,
                                        safe_globals=self.safe_globals)

            if broadcast is not False and broadcast is not None and self.distributed:
                from dcp_tiered.dcp.broadcast import load_and_broadcast

                groups = self._save_pg if broadcast is True else broadcast
                load_and_broadcast(plain, make_reader, process_group=groups, bucket_bytes=bucket_bytes)
            else:
                kwargs: dict[str, Any] = {"process_group": self._save_pg} if self.distributed else {"no_dist": True}
                dcp.load(plain, storage_reader=make_reader(), **kwargs)
            finish()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = describe_error(exc)
        errors = [error]
        if self.distributed:
            errors = [None] * self.world
            dist.all_gather_object(errors, error, group=self._decide_pg)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            self.events.emit({"event": "restore", "step": s, "tier": tier.name, "seconds": time.perf_counter() - t0})
            return None
        why = failed[0][1] if len(failed) == self.world else f"rank {failed[0][0]}: {failed[0][1]}"
        self.restore_failures += 1
        log.warning("restore: step %d on tier %s failed (%s); trying the next candidate", s, tier.name, why)
        self.events.emit({"event": "restore_failure", "step": s, "tier": tier.name, "error": why})
        return why

    def raise_if_failed(self) -> None:
        """Raise a recorded background save failure now (also done by ``maybe_save``/``wait``)."""
        self._check_background()

