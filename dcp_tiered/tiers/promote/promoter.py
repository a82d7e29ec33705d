"""Background promotion of committed checkpoints to slower tiers (and retention after it).

Every rank copies its own data files (so node-local sources work) and leaves a fragment file
next to each copy; the coordinator commits the target's ``.metadata`` once every data file's
fragment is there.  No collective is used: ranks coordinate through files only.  Each rank
records what it still owes in an intent file inside the source checkpoint, so unfinished
promotions resume after a restart.  Intents are untrusted input: validated
(:func:`~dcp_tiered.tiers.layout.parse_intent`), and an invalid one is skipped and left for gc.

:class:`Promoter` drives the pieces: :class:`~dcp_tiered.tiers.jobs.JobRunner` runs the work, one
lane per target tier (a stalled tier never delays the others); :mod:`~dcp_tiered.tiers.promote.intents`
is the source side, :mod:`~dcp_tiered.tiers.promote.fragments` the target side (copies, fragments, the
commit and its bounded wait, :func:`fragment_wait_bound`), and
:class:`~dcp_tiered.tiers.retention.Retention` decides and deletes, after each save and after each
promotion (of its source and its target), sparing the steps promotions still read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_tiered.dcp.format import builtin_from_json, native_files
from dcp_tiered.dcp.metadata_io import committed_save_id, load_metadata
from dcp_tiered.dcp.save_stats import stats_from_records
from dcp_tiered.errors import DcpTieredError, PromotionError, PromotionIOError
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.storage.retry import RetryPolicy, retrying
from dcp_tiered.tiers.topology import tier_storage
from dcp_tiered.tiers.promote.fragments import (
    FRAGMENT_WAIT_CAP, FRAGMENT_WAIT_DEFAULT, FRAGMENT_WAIT_FLOOR, FragmentReads, FragmentWait, commit_from_fragments,
    copy_with_fragment, fragment_wait_bound,
)
from dcp_tiered.tiers.promote.intents import (
    STALE, PromotionIntent, SourceMetadata, index_from_json, index_to_json, intent_mismatch,
)
from dcp_tiered.tiers.jobs import Job, JobRunner
from dcp_tiered.tiers.layout import intent_name, parse_step, read_intent
from dcp_tiered.tiers.pins import StepMarks
from dcp_tiered.tiers.retention import Retention
from dcp_tiered.tiers.config import Tier

log = logging.getLogger(__name__)

__all__ = ["FRAGMENT_WAIT_CAP", "FRAGMENT_WAIT_DEFAULT", "FRAGMENT_WAIT_FLOOR", "Promoter", "PromotionIntent",
           "PromotionReport", "fragment_wait_bound", "index_to_json", "promotion_error"]


def promotion_error(message: str, causes: list[BaseException | None]) -> PromotionError:
    """The error ``wait``/``close`` raise: a :class:`PromotionIOError` (also an ``OSError``) when every
    failure it reports is a storage failure (the first one is its ``__cause__``), else a :class:`PromotionError`."""
    if causes and all(isinstance(c, OSError) for c in causes):
        exc: PromotionError = PromotionIOError(message)
        exc.__cause__ = causes[0]
        return exc
    return PromotionError(message)


@dataclass
class PromotionReport:
    """One promotion step (data file copy, metadata commit with the checkpoint's sizes, failed delete)."""

    step: int
    source: str
    target: str
    kind: str  # "data", "metadata", "retention" or "job"
    bytes: int = 0
    seconds: float = 0.0
    attempts: int = 1
    ok: bool = True
    error: str | None = None
    raw_bytes: int = 0  # metadata commits: the checkpoint's tensors in their original dtype
    stored_bytes: int = 0  # metadata commits: its items as stored on the target

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def line(self) -> str:
        return f"step {self.step} {self.source}->{self.target} ({self.kind}): {self.error}"


class Promoter:
    """Background promotion of checkpoints to slower tiers, and retention.

    One background lane per target tier (:class:`~dcp_tiered.tiers.jobs.JobRunner`) runs that
    tier's promotions and retention in order; failures are retried with backoff, and one that
    still fails is recorded and raised by :meth:`wait` (and :meth:`close`), never in the
    training loop's hot path.

    The coordinator commits a promoted checkpoint once every rank's data file is in the
    target.  It waits for the other ranks' files at most ``metadata_timeout`` seconds without
    progress (None, the default: :func:`fragment_wait_bound`, of the order of the tier's save
    interval, 1 to 30 minutes); then that promotion fails with :class:`PromotionError` naming
    the tier, the step and the missing files per rank, the step stays uncommitted on the target
    (its partial copy is left for ``dcp-tiered gc``), and later promotions go on.  Waiting never
    delays other promotions.

    Retention (:class:`~dcp_tiered.tiers.retention.Retention`) never deletes a step that a queued
    or running promotion reads, nor one marked with :meth:`set_writing` (a save in progress, or a
    restore candidate pinned by the caller).
    """

    def __init__(self, tiers: Sequence[Tier], *, rank: int = 0, node: int = 0, is_coordinator: bool = True,
                 retry: RetryPolicy = RetryPolicy(), metadata_timeout: float | None = None,
                 on_report: Callable[[PromotionReport], None] | None = None, nice: int | None = 10,
                 cpu_slots: int | None = None, optimizer_keys: Sequence[str] = (), leftover_grace: float = 3600.0,
                 retain_sources: bool = True, world: int | None = None) -> None:
        self.tiers = list(tiers)
        self.retain_sources = retain_sources  # off for `dcp-tiered promote`: deleting is gc's job there
        self.by_name = {t.name: t for t in self.tiers}
        self.rank, self.node, self.is_coordinator = rank, node, is_coordinator
        self.retry = retry
        self.metadata_timeout = metadata_timeout
        self.on_report = on_report
        self.reports: list[PromotionReport] = []
        self._lock = threading.Lock()
        self.marks = StepMarks()
        self.keeper = Retention(self.tiers, rank=rank, node=node, is_coordinator=is_coordinator,
                                optimizer_keys=optimizer_keys, leftover_grace=leftover_grace, marks=self.marks,
                                world=world)
        # promotions to several tiers run at once; their re-encodes share this many coders
        self.cpu = threading.BoundedSemaphore(cpu_slots) if cpu_slots else None
        self.jobs = JobRunner(noun="promotion", make_error=promotion_error, on_crash=self._crashed, nice=nice,
                              thread_prefix="dcp_tiered-promoter")

    @property
    def leftover_grace(self) -> float:
        return self.keeper.leftover_grace

    @leftover_grace.setter
    def leftover_grace(self, value: float) -> None:
        self.keeper.leftover_grace = value

    @property
    def optimizer_keys(self) -> tuple[str, ...]:
        return self.keeper.optimizer_keys

    # -- queueing work ----------------------------------------------------------------

    def storage(self, tier: Tier) -> Storage:
        return tier_storage(tier, self.rank, self.node)

    def record_intent(self, name: str, source: Tier, targets: Sequence[str], data_file: str | None,
                      records: list[tuple[MetadataIndex, dict]], coordinator: bool,
                      save_id: str | None = None) -> PromotionIntent | None:
        """Record durably, in the source checkpoint, what this rank must promote; queue it with :meth:`submit`."""
        intent = PromotionIntent(name, source.name, data_file, [[index_to_json(i), r] for i, r in records],
                                 list(targets) if data_file else [], list(targets) if coordinator else [], save_id,
                                 self.rank)
        if not intent.owes:
            return None
        intent.record(self.storage(source).child(name))
        return intent

    def submit(self, intent: PromotionIntent) -> None:
        """Queue a recorded intent (the coordinator does so only after the source committed): one job per target."""
        step = parse_step(intent.name)
        for target in dict.fromkeys(intent.targets + intent.meta):
            self.jobs.submit(Job(target, self._promote, f"promote step {step} {intent.source}->{target}",
                                 (intent, target), reads=(intent.source, intent.name)))

    def mark_saved(self, tier_name: str, step: int) -> None:
        """Note that this process just committed ``step`` to ``tier_name``: no retention deletes it until a newer save."""
        self.marks.mark_saved(tier_name, step)

    def mark_own(self, tier_name: str, step: int) -> None:
        """Note that this process writes ``step`` to ``tier_name``: its leftovers need no grace period."""
        self.marks.mark_own(tier_name, step)

    def set_writing(self, tier_names: Sequence[str], step: int, writing: bool) -> None:
        """Mark ``step`` of ``tier_names`` busy (a save of this process writes it, or a restore reads it), or done.

        Retention, including the one a resumed promotion runs after its commit, never deletes
        such a step: after a restore from an older step (or beside another job) a save in
        progress can be older than the newest committed checkpoint."""
        self.marks.pin(tier_names, step, writing)

    def retention(self, tier: Tier, protect: Sequence[int] = (), busy: Sequence[int] = (), after: Job | None = None) -> None:
        """Queue retention for ``tier``, waiting for no promotion (``after``: for that job to end).  Steps that
        promotions read stay (:meth:`busy_steps`): a lagging slow tier never makes a fast one hold every save."""
        def run(job: Job) -> float | None:
            if after is not None and after in self.jobs.jobs() and not self.jobs.stopped.is_set():
                return job.poll_again(f"waiting for {after.what} to end")
            self._run_retention(tier, tuple(protect), tuple(busy))
            return None

        self.jobs.submit(Job(tier.name, run, f"retention of {tier.name}"))

    def resume(self) -> int:
        """Queue the unfinished promotions this rank recorded before a restart; return how many.

        Each intent is validated first; an invalid one is skipped with a warning and left for gc."""
        count = 0
        for tier in self.tiers:
            storage = self.storage(tier)
            try:
                names = [n for n in storage.listdir() if parse_step(n) is not None]
            except DcpTieredError as exc:
                log.warning("cannot list tier %s to resume promotions: %s", tier.name, exc)
                continue
            for name in names:
                intent = self._read_own_intent(tier, storage.child(name))
                if intent is not None and intent.owes:
                    self.submit(intent)
                    count += 1
        return count

    def _read_own_intent(self, tier: Tier, child: Storage) -> PromotionIntent | None:
        """This rank's validated intent in the checkpoint directory ``child``, or None (absent, invalid, unreadable)."""
        if child.is_link():
            log.warning("not resuming promotions of %s: it is a symbolic link (never used through links)", child.url)
            return None
        try:
            doc = read_intent(child, intent_name(self.rank), source=tier.name, tiers=self.by_name)
        except MissingFileError:
            return None
        except ValueError as exc:  # CorruptCheckpointError: invalid intent
            log.warning("%s", exc)
            return None
        except DcpTieredError as exc:
            log.warning("cannot read promotion intent in %s: %s", child.url, exc)
            return None
        return PromotionIntent(**doc, resumed=True)

    # -- state, waiting, closing ------------------------------------------------------

    def busy_steps(self, tier_name: str) -> set[int]:
        """Steps of ``tier_name`` that a queued or running promotion still reads, or that are marked busy."""
        return self._reading(tier_name) | self.marks.pinned(tier_name)

    def _reading(self, tier_name: str) -> set[int]:
        steps = {parse_step(j.reads[1]) for j in self.jobs.jobs() if isinstance(j.reads, tuple) and j.reads[0] == tier_name}
        return steps - {None}  # type: ignore[return-value]

    def pending(self) -> list[str]:
        """What is still queued or running, one line per job (e.g. a commit waiting for a rank's files)."""
        return self.jobs.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued job ran; raise :class:`PromotionError` for failures since the last call.

        ``timeout`` (seconds): give up waiting then, with a :class:`PromotionError` listing what is
        still pending (the jobs go on).  Without it the wait is still bounded: each commit waits
        for other ranks' files at most ``metadata_timeout`` (see the class docstring).  When every
        failure is a storage failure the error is a :class:`PromotionIOError` (also an ``OSError``)."""
        self.jobs.wait(timeout)

    def raise_failures(self) -> None:
        """Raise the failures recorded since the last call as one :class:`PromotionError`, if any."""
        self.jobs.raise_failures()

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Finish queued work (``wait``, at most ``timeout`` seconds) or drop it, then stop the threads.

        Raises recorded failures, or a :class:`PromotionError` listing what was still pending
        when ``timeout`` ran out (that work is dropped; unfinished intents resume after a restart)."""
        self.jobs.close(wait, timeout)

    # -- reports ----------------------------------------------------------------------

    def _record(self, report: PromotionReport, raise_later: bool = True, cause: BaseException | None = None) -> None:
        with self._lock:
            self.reports.append(report)
        if not report.ok and raise_later:
            self.jobs.fail(report.line(), cause)
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:  # a metrics hook must not kill promotions
                log.exception("promotion report hook failed")

    def _crashed(self, job: Job, exc: Exception) -> None:
        self._record(PromotionReport(-1, "?", "?", "job", ok=False, error=f"{job.what}: {type(exc).__name__}: {exc}"),
                     cause=exc)

    def _attempt(self, what: str, fn: Callable[[], int], report: PromotionReport, raise_later: bool = True) -> None:
        """Run one protocol step with retries (only storage failures are retried); record its report."""
        attempts, cause = 0, None

        def once() -> int:
            nonlocal attempts
            attempts += 1
            return fn()

        t0 = time.monotonic()
        try:
            report.bytes = retrying(once, self.retry, what, stop=self.jobs.stopped)
        except Exception as exc:
            report.ok, report.error, cause = False, f"{type(exc).__name__}: {exc}", exc
        report.seconds, report.attempts = time.monotonic() - t0, attempts
        self._record(report, raise_later, cause)

    def retain_now(self, tier: Tier) -> None:
        """Retention of ``tier`` now, on the calling thread (before a save checks the tier's memory budget)."""
        self._run_retention(tier, (), ())

    def _run_retention(self, tier: Tier, protect: tuple[int, ...], busy: tuple[int, ...]) -> None:
        def failed(info: Any, exc: DcpTieredError) -> None:  # reported, not raised: retention tries again next time
            self._record(PromotionReport(info.step, tier.name, tier.name, "retention", ok=True,
                                         error=f"delete failed: {exc}"))

        saved = self.marks.last_saved(tier.name)
        protect = (*protect, saved) if saved is not None else protect
        self.keeper.run(tier, protect, set(busy) | self._reading(tier.name), on_failure=failed)

    # -- the promotion job ------------------------------------------------------------

    def _source_dir(self, intent: PromotionIntent) -> Storage:
        return self.storage(self.by_name[intent.source]).child(intent.name)

    def _drop(self, intent: PromotionIntent, target: str, data: bool = True, meta: bool = True) -> None:
        """Take ``target`` off the intent's remaining work and record that durably."""
        intent.drop(self._source_dir(intent), target, data, meta, temp_grace=self.leftover_grace)

    def _promote(self, job: Job) -> float | None:
        """:meth:`_promote_once`; once done, retention of its source (it kept the step for this job) after it."""
        again, source = self._promote_once(job), self.by_name.get(job.args[0].source)
        if (again is None and self.retain_sources and source is not None and self.keeper.applies_to(source)
                and not self.jobs.stopped.is_set()):
            with contextlib.suppress(PromotionError):  # closed meanwhile: the next run's retention deletes it
                self.retention(source, after=job)
        return again

    def _promote_once(self, job: Job) -> float | None:
        """Promote one intent to one target: this rank's data file, then (coordinator) the commit."""
        intent, target_name = job.args
        source, target = self.by_name.get(intent.source), self.by_name.get(target_name)
        if source is None or target is None:
            log.warning("promotion intent of %s names unknown tier %r; dropping it", intent.name,
                        intent.source if source is None else target_name)
            return None
        step = parse_step(intent.name)
        step = -1 if step is None else step
        src = self.storage(source).child(intent.name)
        dst = self.storage(target).child(intent.name)
        if not job.data.get("checked"):
            job.data["checked"] = True
            if not self._may_promote(intent, target, src, dst, step):
                return None
        if target.name in intent.targets:
            job.state = f"copying {intent.data_file}"
            records = [(index_from_json(i), builtin_from_json(r)) for i, r in intent.records]
            report = PromotionReport(step, source.name, target.name, "data")
            self._attempt(f"promote {intent.data_file} of {intent.name} to {target.name}",
                          lambda: copy_with_fragment(src, dst, intent.data_file, records, target, intent.save_id,
                                                     self.cpu), report,
                          raise_later=not intent.resumed)
            job.data["copy_s"] = report.seconds
            if not report.ok:
                return None  # this rank's own data did not get there: committing would only wait; a restart resumes it
            self._drop(intent, target.name, meta=False)
        if target.name not in intent.meta:
            return None
        return self._commit_when_ready(job, intent, source, target, src, dst, step)

    def _may_promote(self, intent: PromotionIntent, target: Tier, src: Storage, dst: Storage, step: int) -> bool:
        """Checks before a job's first run: not onto its source, never through links, and for a resumed
        (untrusted) intent: its records are the committed source's, the target holds no other save."""
        if src.same_place(dst):
            log.warning("promotion of %s: target tier %s is the source directory itself; skipping it",
                        src.url, target.name)
            self._drop(intent, target.name)
            return False
        link = next((s.url for s in (src, dst) if s.is_link()), None)
        if link is not None:
            self._refuse(intent, target.name, step, f"{link} is a symbolic link; a promotion never reads or writes "
                         "through links (remove the link, or copy the files into the tier)", drop=True)
            return False
        if intent.resumed and target.name in intent.targets:
            why = intent_mismatch(src, intent)
            if why == STALE:
                log.warning("%s: the save this promotion belongs to is not the committed one; not promoting it to %s",
                            src.url, target.name)
                self._drop(intent, target.name)
                return False
            if why is not None:  # left in place for `dcp-tiered gc`
                self._refuse(intent, target.name, step, why)
                return False
        if intent.resumed:
            try:
                committed = committed_save_id(dst)
            except DcpTieredError as exc:  # cannot tell whether another save is there: leave it for later
                log.warning("resumed promotion of %s: cannot read %s (%s); leaving it for a later run",
                            src.url, dst.url, exc)
                return False
            if committed is not None and committed != intent.save_id:
                log.warning("resumed promotion of %s: %s holds a committed checkpoint of another save; "
                            "leaving it untouched", src.url, dst.url)
                self._drop(intent, target.name)
                return False
        return True

    def _commit_when_ready(self, job: Job, intent: PromotionIntent, source: Tier, target: Tier, src: Storage, dst: Storage,
                           step: int) -> float | None:
        """Commit the target once every rank's fragment is there; else poll again later, up to the bound."""
        now = time.monotonic()
        wait: FragmentWait | None = job.data.get("wait")
        if wait is None:
            try:
                source_md: SourceMetadata | None = intent.source_metadata(src)  # decoded once for every target
            except MissingFileError:
                source_md = None
            if source_md is None or (intent.save_id is not None and source_md.save_id != intent.save_id):
                log.warning("%s: the save this promotion belongs to never committed; not promoting it to %s",
                            src.url, target.name)
                self._drop(intent, target.name)
                return None
            files = native_files(source_md.md.storage_data)
            wait = job.data["wait"] = FragmentWait(files, intent.save_id, now, now, missing=files)
        if not wait.poll(dst, now, f"promotion of {intent.name} to {target.name}"):
            job.state = "committing"
            report = PromotionReport(step, source.name, target.name, "metadata")
            self._attempt(f"commit {intent.name} on {target.name}",
                          lambda: commit_measured(report, src, dst, intent.save_id, intent.source_metadata(src, again=True),
                                                  wait.reads), report,
                          raise_later=not intent.resumed)  # resumed work is recovery: reported, not raised
            if report.ok:
                self._drop(intent, target.name)
                self._run_retention(target, (), ())
            return None
        if intent.save_id and wait.listed_metadata and committed_save_id(dst) == intent.save_id:
            self._record(measured(PromotionReport(step, source.name, target.name, "metadata"), dst))  # committed by another
            self._drop(intent, target.name)
            return None
        bound = self.metadata_timeout if self.metadata_timeout is not None else fragment_wait_bound(
            source, target, job.data.get("copy_s", 0.0))
        if self.jobs.stopped.is_set():
            return None  # closing: the intent stays recorded, a restart resumes it
        if not wait.stalled(now, bound):
            return job.poll_again(wait.describe(now, bound))
        # give up; the intent stops asking for this commit (the missing files will not come)
        self._drop(intent, target.name)
        try:
            source_changed = intent.source_metadata(src, again=True).save_id != intent.save_id
        except MissingFileError:
            source_changed = True
        if source_changed:
            log.warning("promotion of %s to %s: the source changed while waiting; dropping it", src.url, target.name)
            return None
        error = (f"tier {target.name!r}, step {step}: gave up after {now - wait.start:.0f}s (bound {bound:.0f}s "
                 f"without progress) waiting for the promoted files of rank(s) {', '.join(wait.ranks())}: "
                 f"{wait.missing[:8]} never arrived in {dst.url} (a lost or restarted node?). The step is not committed "
                 f"on {target.name!r}; its partial copy is left for `dcp-tiered gc`; it stays on {source.name!r}, "
                 "and newer saves promote as usual")
        log.error("promotion failed: %s", error)
        self._record(PromotionReport(step, source.name, target.name, "metadata", seconds=now - wait.start,
                                     ok=False, error=error))
        return None

    def _refuse(self, intent: PromotionIntent, target: str, step: int, why: str, drop: bool = False) -> None:
        """Skip a promotion that must not run (warned, and a failed report: ``dcp-tiered promote`` exits 1)."""
        log.warning("promotion of %s from %s to %s refused: %s", intent.name, intent.source, target, why)
        if drop:
            self._drop(intent, target)
        self._record(PromotionReport(step, intent.source, target, "data", ok=False, error=why),
                     raise_later=not intent.resumed)




def _sizes(report: Any, storage_data: Any) -> None:
    stats = stats_from_records((i.fqn, r) for i, r in storage_data.items())
    report.raw_bytes, report.stored_bytes = stats.raw_bytes, stats.stored_bytes


def measured(report: Any, dst: Storage, result: Any = None) -> Any:
    """Set a commit ``report``'s sizes from ``dst``'s records (a commit another process made);
    return ``result`` (else the report)."""
    try:  # the commit is done whatever the metrics can read: logged, never raised
        _sizes(report, load_metadata(dst).storage_data)
    except (DcpTieredError, TypeError, ValueError) as exc:
        log.warning("step %s committed on %s, its sizes unreadable: %s", report.step, report.target, exc)
    return report if result is None else result


def commit_measured(report: Any, src: Storage, dst: Storage, save_id: str | None, source: SourceMetadata | None = None,
                    reads: FragmentReads | None = None) -> int:
    """:func:`commit_from_fragments` (of the ``source`` metadata and fragment ``reads`` given), with ``report``'s
    sizes from the records it committed (read back only when another process committed the same save);
    returns the bytes of ``.metadata``."""
    n = commit_from_fragments(src, dst, save_id, on_commit=lambda md: _sizes(report, md.storage_data), source=source,
                              reads=reads)
    return n if report.stored_bytes else measured(report, dst, n)
