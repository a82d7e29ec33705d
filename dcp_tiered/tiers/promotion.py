"""Background promotion of committed checkpoints to slower tiers, and retention.

Every rank copies its own data files (so node-local sources work) and leaves a small
fragment file next to each copy; the coordinator commits the target's ``.metadata`` once
the fragments of every data file are there.  No collective is used: ranks coordinate
through the target directory only.  Each rank records what it still has to do in an
intent file inside the source checkpoint, so unfinished promotions resume after a restart.

Work runs on one background thread per target tier (a "lane": promotions to that tier and
its retention), so a tier that stalls never delays promotions to the others.  A commit
waiting for other ranks' files never holds its lane: it polls, and between polls the lane
runs the next job.  The wait is bounded (:func:`fragment_wait_bound`); past the bound the
promotion gives up with a :class:`~dcp_tiered.errors.PromotionError` naming the tier, the
step and the missing files of each rank.

Intent files are untrusted input (another process, an older version or an attacker may
have written them): they are validated by :func:`~dcp_tiered.tiers.layout.parse_intent`,
and an invalid one is skipped with a warning and left for ``dcp-tiered gc``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_tiered.dcp.common import lower_thread_priority
from dcp_tiered.dcp.format import DATA_SUFFIX, METADATA_FILE, is_native_record
from dcp_tiered.dcp.metadata_io import decode_metadata, encode_metadata, load_metadata, read_metadata_bytes
from dcp_tiered.errors import DcpTieredError, PromotionError
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.storage.retry import RetryPolicy, retrying
from dcp_tiered.tiers.catalog import list_tier, tier_storage
from dcp_tiered.tiers.layout import (
    FRAGMENT_SUFFIX, INTENT_FIELDS, fragment_name, intent_name, parse_intent, parse_step, read_intent, read_small_file,
)
from dcp_tiered.tiers.policy import CheckpointFacts, retention_victims
from dcp_tiered.tiers.reencode import copy_file, reencode_file
from dcp_tiered.tiers.spec import Tier

log = logging.getLogger(__name__)

#: Bounds (seconds) of the wait of a promotion's commit for the files of the other ranks.
FRAGMENT_WAIT_FLOOR = 60.0
FRAGMENT_WAIT_CAP = 1800.0
#: Used when neither the source nor the target tier has a time interval (``every``).
FRAGMENT_WAIT_DEFAULT = 600.0
_POLL_FIRST, _POLL_MAX = 0.05, 2.0
_DATA_RANK = re.compile(r"^__(\d+)_")


def fragment_wait_bound(source: Tier, target: Tier, own_copy_s: float = 0.0) -> float:
    """How long a promotion's commit waits, without progress, for the other ranks' promoted files.

    Of the order of the save interval: the target tier's ``every`` (else the source's, else
    :data:`FRAGMENT_WAIT_DEFAULT`), and at least three times as long as this rank's own copy of
    its data file took (ranks copy files of similar sizes at the same time); clamped to
    [:data:`FRAGMENT_WAIT_FLOOR`, :data:`FRAGMENT_WAIT_CAP`] (1 to 30 minutes).  Any new or
    growing file in the target directory counts as progress and restarts the wait.
    """
    interval = target.every or source.every or FRAGMENT_WAIT_DEFAULT
    return min(FRAGMENT_WAIT_CAP, max(FRAGMENT_WAIT_FLOOR, interval, 3.0 * own_copy_s))


def _rank_of(data_file: str) -> str:
    m = _DATA_RANK.match(data_file)
    return m.group(1) if m else "?"


def _same_place(a: Storage, b: Storage) -> bool:
    """Whether two storages are one directory (symlinks and trailing slashes resolved where local)."""
    if a.is_local and b.is_local:
        return os.path.realpath(a.root) == os.path.realpath(b.root)
    return type(a.fs) is type(b.fs) and a.root.rstrip("/") == b.root.rstrip("/")


#: Record fields a re-encoding promotion rewrites; every other field must equal the source's.
_REENCODED = frozenset({"offset", "length", "codec", "filter", "frames", "sums"})


def _changed_items(file: str, new: dict, old: dict) -> list:
    """Items of the data file ``file`` whose promoted record (``new``) does not describe the source item
    (``old``): a byte-for-byte copy keeps every record as it is; a re-encoded file keeps every field
    but the encoding, and the items in the source's order (:func:`~dcp_tiered.tiers.reencode.reencode_file`)."""
    keys = [i for i, r in old.items() if is_native_record(r) and r["file"] == file]
    if any(not isinstance(new.get(i), dict) for i in keys):
        return [i for i in keys if not isinstance(new.get(i), dict)]
    if all(new[i].get("codec") == old[i]["codec"] and new[i].get("filter") == old[i]["filter"] for i in keys):
        return [i for i in keys if new[i] != old[i]]  # copied byte for byte
    bad = [i for i in keys if {k: v for k, v in new[i].items() if k not in _REENCODED}
           != {k: v for k, v in old[i].items() if k not in _REENCODED}]
    sized = [i for i in keys if old[i]["length"]]  # empty items hold no bytes: their place does not matter
    by_old = sorted(sized, key=lambda i: old[i]["offset"])
    by_new = sorted(sized, key=lambda i: new[i].get("offset", -1) if isinstance(new[i].get("offset"), int) else -1)
    return bad or [a for a, b in zip(by_old, by_new) if a != b]


def index_to_json(index: MetadataIndex) -> list:
    return [index.fqn, list(index.offset) if index.offset is not None else None, index.index]


def index_from_json(data: list) -> MetadataIndex:
    fqn, offset, idx = data
    return MetadataIndex(fqn, torch.Size(offset) if offset is not None else None, idx)


def record_from_json(rec: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in rec.items()}


@dataclass
class PromotionReport:
    """One finished (or failed) promotion step: a data file copy or a metadata commit."""

    step: int
    source: str
    target: str
    kind: str  # "data" or "metadata"
    bytes: int = 0
    seconds: float = 0.0
    attempts: int = 1
    ok: bool = True
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Intent:
    """What one rank still has to do for one source checkpoint (``.promote-{rank}.json``)."""

    name: str
    source: str
    data_file: str | None
    records: list  # [[index json, record], ...]
    targets: list[str]  # tiers still to receive this rank's data file
    meta: list[str] = field(default_factory=list)  # tiers whose .metadata this rank (coordinator) commits
    save_id: str | None = None  # the save this intent belongs to (all ranks share it)
    rank: int = 0  # the rank that wrote it (also in its file name)
    resumed: bool = False  # picked up from storage after a restart (or from another process)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def to_json(self) -> bytes:
        return json.dumps({k: getattr(self, k) for k in INTENT_FIELDS}).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "(bytes)", **expect: Any) -> "_Intent":
        """Parse and validate (see :func:`~dcp_tiered.tiers.layout.parse_intent`); ``ValueError`` if invalid."""
        return cls(**parse_intent(data, where, **expect))


@dataclass(eq=False)
class _Job:
    """One unit of background work on a lane; ``fn(job)`` returns when to run it again, or None when done."""

    lane: str
    fn: Callable[["_Job"], float | None]
    what: str
    args: tuple = ()
    busy: tuple[str, str] | None = None  # (source tier, checkpoint name) read by this job
    state: str = "queued"
    data: dict = field(default_factory=dict)  # progress kept between runs (the fragment wait)


class _Lane:
    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.ready: deque[_Job] = deque()
        self.later: list[tuple[float, int, _Job]] = []  # heap: (monotonic time, seq, job)
        self.thread: threading.Thread | None = None


class Promoter:
    """Background promotion of checkpoints to slower tiers, and retention.

    One background thread per target tier runs that tier's promotions and retention in order;
    failures are retried with backoff, and one that still fails is recorded and raised by
    :meth:`wait` (and :meth:`close`), never in the training loop's hot path.

    The coordinator commits a promoted checkpoint once every rank's data file is in the
    target.  It waits for the other ranks' files at most ``metadata_timeout`` seconds without
    progress (None, the default: :func:`fragment_wait_bound`, of the order of the tier's save
    interval, 1 to 30 minutes); then that promotion fails with :class:`PromotionError` naming
    the tier, the step and the missing files per rank, the step stays uncommitted on the target
    (its partial copy is left for ``dcp-tiered gc``), and later promotions go on.  Waiting never
    delays other promotions.

    Retention never deletes a step that a queued or running promotion reads, nor one marked
    with :meth:`set_writing` (a save in progress, or a restore candidate pinned by the caller).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        rank: int = 0,
        node: int = 0,
        is_coordinator: bool = True,
        retry: RetryPolicy = RetryPolicy(),
        metadata_timeout: float | None = None,
        on_report: Callable[[PromotionReport], None] | None = None,
        nice: int | None = 10,
        optimizer_keys: Sequence[str] = (),
        leftover_grace: float = 3600.0,
    ) -> None:
        self.tiers = list(tiers)
        self.nice = nice
        self.optimizer_keys = tuple(optimizer_keys)
        self.leftover_grace = leftover_grace
        self._own: dict[str, set[int]] = {}  # steps this process wrote or deleted, per tier
        self._writing: dict[str, set[int]] = {}  # steps a save of this process is writing now, per tier
        self.by_name = {t.name: t for t in self.tiers}
        self.rank, self.node, self.is_coordinator = rank, node, is_coordinator
        self.retry = retry
        self.metadata_timeout = metadata_timeout
        self.on_report = on_report
        self.reports: list[PromotionReport] = []
        self._failures: list[PromotionReport] = []
        self._busy: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: dict[_Job, None] = {}  # pending jobs, in submission order
        self._lanes: dict[str, _Lane] = {}
        self._seq = itertools.count()
        self._stop = threading.Event()

    # -- public -----------------------------------------------------------------------

    def storage(self, tier: Tier) -> Storage:
        return tier_storage(tier, self.rank, self.node)

    def record_intent(self, name: str, source: Tier, targets: Sequence[str], data_file: str | None,
                      records: list[tuple[MetadataIndex, dict]], coordinator: bool, save_id: str | None = None) -> _Intent | None:
        """Record durably, in the source checkpoint, what this rank must promote; queue it with :meth:`submit`."""
        intent = _Intent(name, source.name, data_file, [[index_to_json(i), r] for i, r in records],
                         list(targets) if data_file else [], list(targets) if coordinator else [], save_id, self.rank)
        if not intent.targets and not intent.meta:
            return None
        self.storage(source).child(name).commit_bytes(intent_name(self.rank), intent.to_json())
        return intent

    def submit(self, intent: _Intent) -> None:
        """Queue a recorded intent (the coordinator does so only after the source committed): one job per target."""
        step = parse_step(intent.name)
        for target in dict.fromkeys(intent.targets + intent.meta):
            self._submit(_Job(target, self._promote, f"promote step {step} {intent.source}->{target}", (intent, target),
                              busy=(intent.source, intent.name)))

    def mark_own(self, tier_name: str, step: int) -> None:
        """Note that this process writes ``step`` to ``tier_name``: its leftovers need no grace period."""
        with self._lock:
            self._own.setdefault(tier_name, set()).add(step)

    def set_writing(self, tier_names: Sequence[str], step: int, writing: bool) -> None:
        """Mark ``step`` of ``tier_names`` busy (a save of this process writes it, or a restore reads it), or done.

        Retention, including the one a resumed promotion runs after its commit, never deletes
        such a step: after a restore from an older step (or beside another job) a save in
        progress can be older than the newest committed checkpoint."""
        with self._lock:
            for name in tier_names:
                steps = self._writing.setdefault(name, set())
                if writing:
                    steps.add(step)
                else:
                    steps.discard(step)

    def retention(self, tier: Tier, protect: Sequence[int] = (), busy: Sequence[int] = ()) -> None:
        """Queue retention for ``tier``: it runs once every promotion from or to ``tier`` queued before it is done."""
        with self._lock:
            before = [j for j in self._jobs if j.busy is not None and tier.name in (j.busy[0], j.lane)]

        def run(job: _Job) -> float | None:
            with self._lock:
                waiting = [j for j in before if j in self._jobs]
            if waiting and not self._stop.is_set():  # poll without holding the lane
                job.state = f"waiting for {len(waiting)} promotion(s) of {tier.name} to finish"
                job.data["delay"] = min(_POLL_MAX, job.data.get("delay", _POLL_FIRST / 2) * 2)
                return time.monotonic() + job.data["delay"]
            self._run_retention(tier, tuple(protect), tuple(busy))
            return None

        self._submit(_Job(tier.name, run, f"retention of {tier.name}"))

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
                child = storage.child(name)
                if child.is_link():
                    log.warning("not resuming promotions of %s: it is a symbolic link (never used through links)", child.url)
                    continue
                try:
                    doc = read_intent(child, intent_name(self.rank), dir_name=name, source=tier.name, tiers=self.by_name)
                except MissingFileError:
                    continue
                except ValueError as exc:  # CorruptCheckpointError: invalid intent
                    log.warning("%s", exc)
                    continue
                except DcpTieredError as exc:
                    log.warning("cannot read promotion intent in %s: %s", child.url, exc)
                    continue
                intent = _Intent(**doc, resumed=True)
                if not intent.targets and not intent.meta:
                    continue
                self.submit(intent)
                count += 1
        return count

    def busy_steps(self, tier_name: str) -> set[int]:
        """Steps of ``tier_name`` that a queued or running promotion still reads, or that are marked busy."""
        with self._lock:
            reading = {parse_step(n) for (t, n), c in self._busy.items() if t == tier_name and c > 0} - {None}
            return reading | self._writing.get(tier_name, set())  # type: ignore[return-value]

    def pending(self) -> list[str]:
        """What is still queued or running, one line per job (e.g. a commit waiting for a rank's files)."""
        with self._lock:
            return [f"{j.what}: {j.state}" for j in self._jobs]

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued job ran; raise :class:`PromotionError` for failures since the last call.

        ``timeout`` (seconds): give up waiting then, with a :class:`PromotionError` listing what is
        still pending (the jobs go on).  Without it the wait is still bounded: each commit waits
        for other ranks' files at most ``metadata_timeout`` (see the class docstring)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    pending = [f"{j.what}: {j.state}" for j in self._jobs]
                    raise PromotionError(f"{len(pending)} promotion job(s) still pending after {timeout}s: "
                                         + "; ".join(pending[:10]))
                self._idle.wait(left)
        self.raise_failures()

    def raise_failures(self) -> None:
        with self._lock:
            failed, self._failures = self._failures, []
        if failed:
            lines = "; ".join(f"step {f.step} {f.source}->{f.target} ({f.kind}): {f.error}" for f in failed)
            raise PromotionError(f"{len(failed)} promotion(s) failed: {lines}")

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Finish queued work (``wait``, at most ``timeout`` seconds) or drop it, then stop the threads.

        Raises recorded failures, or a :class:`PromotionError` listing what was still pending
        when ``timeout`` ran out (that work is dropped; unfinished intents resume after a restart)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if wait:
                self.wait(timeout)
        finally:
            self._stop.set()
            with self._lock:
                lanes = list(self._lanes.values())
                for lane in lanes:
                    lane.cond.notify_all()
            if deadline is None:  # dropping work (wait=False) does not wait long for a stuck job
                deadline = time.monotonic() + (60.0 if wait else 2.0)
            for lane in lanes:  # a job stuck in storage I/O cannot be interrupted: its daemon thread is left
                if lane.thread is not None and lane.thread is not threading.current_thread():
                    lane.thread.join(timeout=max(0.1, deadline - time.monotonic()))

    # -- machinery --------------------------------------------------------------------

    def _submit(self, job: _Job) -> None:
        if self._stop.is_set():
            raise PromotionError("the promoter is closed")
        with self._lock:
            self._jobs[job] = None
            if job.busy is not None:
                self._busy[job.busy] = self._busy.get(job.busy, 0) + 1
            lane = self._lanes.get(job.lane)
            if lane is None:
                lane = self._lanes[job.lane] = _Lane(threading.Condition(self._lock))
                lane.thread = threading.Thread(target=self._loop, args=(lane,), name=f"dcp_tiered-promoter-{job.lane}",
                                               daemon=True)
                lane.thread.start()
            lane.ready.append(job)
            lane.cond.notify()

    def _done(self, job: _Job) -> None:
        """Forget a finished or dropped job (the lock is held)."""
        self._jobs.pop(job, None)
        if job.busy is not None:
            self._busy[job.busy] -= 1
            if not self._busy[job.busy]:
                del self._busy[job.busy]
        self._idle.notify_all()

    def _next(self, lane: _Lane) -> _Job | None:
        """The lane's next job to run (None: stop); jobs waiting to poll again wait in a heap (the lock is held)."""
        while True:
            if self._stop.is_set():
                for job in list(lane.ready) + [j for _, _, j in lane.later]:
                    self._done(job)
                lane.ready.clear()
                lane.later.clear()
                return None
            now = time.monotonic()
            if lane.later and lane.later[0][0] <= now:  # a due poll is quick: before the next copy
                return heapq.heappop(lane.later)[2]
            if lane.ready:
                return lane.ready.popleft()
            lane.cond.wait(lane.later[0][0] - now if lane.later else None)

    def _loop(self, lane: _Lane) -> None:
        lower_thread_priority(self.nice)
        while True:
            with self._lock:
                job = self._next(lane)
                if job is None:
                    return
                if job.state == "queued":
                    job.state = "running"
            again = None
            try:
                again = job.fn(job)
            except Exception as exc:  # recorded and raised at wait(); the thread must live on
                log.exception("background job failed: %s", job.what)
                self._record(PromotionReport(-1, "?", "?", "job", ok=False, error=f"{job.what}: {type(exc).__name__}: {exc}"))
            with self._lock:
                if again is not None and not self._stop.is_set():
                    heapq.heappush(lane.later, (again, next(self._seq), job))
                else:
                    self._done(job)

    def _record(self, report: PromotionReport, raise_later: bool = True) -> None:
        with self._lock:
            self.reports.append(report)
            if not report.ok and raise_later:
                self._failures.append(report)
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:  # a metrics hook must not kill promotions
                log.exception("promotion report hook failed")

    def _save_intent(self, intent: _Intent) -> None:
        """Write the intent's remaining work (the intent's lock is held), or remove it once all is done."""
        src = self.storage(self.by_name[intent.source]).child(intent.name)
        if intent.targets or intent.meta:
            src.commit_bytes(intent_name(intent.rank), intent.to_json())
            return
        try:
            src.remove(intent_name(intent.rank))
            src.remove_temps(intent_name(intent.rank), older_than=self.leftover_grace)  # a rank killed mid-rewrite
        except DcpTieredError as exc:  # cleanup only: the promotion itself succeeded
            log.warning("could not remove finished promotion intent in %s: %s", src.url, exc)

    def _drop(self, intent: _Intent, target: str, data: bool = True, meta: bool = True) -> None:
        """Take ``target`` off the intent's remaining work and record that durably."""
        with intent.lock:
            if data and target in intent.targets:
                intent.targets.remove(target)
            if meta and target in intent.meta:
                intent.meta.remove(target)
            self._save_intent(intent)

    def _attempt(self, what: str, fn: Callable[[], int], report: PromotionReport, raise_later: bool = True) -> None:
        attempts = 0

        def once() -> int:
            nonlocal attempts
            attempts += 1
            return fn()

        t0 = time.monotonic()
        try:
            report.bytes = retrying(once, self.retry, what, stop=self._stop)
        except Exception as exc:
            report.ok, report.error = False, f"{type(exc).__name__}: {exc}"
        report.seconds, report.attempts = time.monotonic() - t0, attempts
        self._record(report, raise_later)

    def _promote(self, job: _Job) -> float | None:
        """Promote one intent to one target: this rank's data file, then (coordinator) the commit."""
        intent, target_name = job.args
        st = job.data
        source, target = self.by_name.get(intent.source), self.by_name.get(target_name)
        if source is None or target is None:
            log.warning("promotion intent of %s names unknown tier %r; dropping it", intent.name,
                        intent.source if source is None else target_name)
            return None
        step = parse_step(intent.name)
        step = -1 if step is None else step
        src = self.storage(source).child(intent.name)
        dst = self.storage(target).child(intent.name)
        if not st.get("checked"):
            st["checked"] = True
            if _same_place(src, dst):
                log.warning("promotion of %s: target tier %s is the source directory itself; skipping it",
                            src.url, target.name)
                self._drop(intent, target.name)
                return None
            link = next((s.url for s in (src, dst) if s.is_link()), None)
            if link is not None:
                self._refuse(intent, target.name, step, f"{link} is a symbolic link; a promotion never reads or writes "
                             "through links (remove the link, or copy the files into the tier)", drop=True)
                return None
            if intent.resumed and target.name in intent.targets:
                why = self._intent_mismatch(src, intent)
                if why == "stale":
                    log.warning("%s: the save this promotion belongs to is not the committed one; not promoting it to %s",
                                src.url, target.name)
                    self._drop(intent, target.name)
                    return None
                if why is not None:  # left in place for `dcp-tiered gc`
                    self._refuse(intent, target.name, step, why)
                    return None
            if intent.resumed:
                try:
                    committed = self._committed_save_id(dst)
                except DcpTieredError as exc:  # cannot tell whether another save is there: leave it for later
                    log.warning("resumed promotion of %s: cannot read %s (%s); leaving it for a later run",
                                src.url, dst.url, exc)
                    return None
                if committed is not None and committed != intent.save_id:
                    log.warning("resumed promotion of %s: %s holds a committed checkpoint of another save; "
                                "leaving it untouched", src.url, dst.url)
                    self._drop(intent, target.name)
                    return None
        if target.name in intent.targets:
            job.state = f"copying {intent.data_file}"
            records = [(index_from_json(i), record_from_json(r)) for i, r in intent.records]
            report = PromotionReport(step, source.name, target.name, "data")
            self._attempt(f"promote {intent.data_file} of {intent.name} to {target.name}",
                          lambda: self._copy_data(src, dst, intent.data_file, records, target, intent.save_id), report,
                          raise_later=not intent.resumed)
            st["copy_s"] = report.seconds
            if not report.ok:
                return None  # this rank's own data did not get there: committing would only wait; a restart resumes it
            self._drop(intent, target.name, meta=False)
        if target.name not in intent.meta:
            return None
        return self._commit_when_ready(job, intent, source, target, src, dst, step)

    def _commit_when_ready(self, job: _Job, intent: _Intent, source: Tier, target: Tier, src: Storage, dst: Storage,
                           step: int) -> float | None:
        """Commit the target once every rank's fragment is there; else poll again later, up to the bound."""
        st = job.data
        now = time.monotonic()
        if "files" not in st:
            committed_id = self._committed_save_id(src)
            if committed_id is None or (intent.save_id is not None and committed_id != intent.save_id):
                log.warning("%s: the save this promotion belongs to never committed; not promoting it to %s",
                            src.url, target.name)
                self._drop(intent, target.name)
                return None
            md = load_metadata(src)
            st["files"] = sorted({r["file"] for r in md.storage_data.values() if is_native_record(r)})
            st["start"] = st["progress"] = now
        try:
            present = dst.file_sizes()
            missing = self._missing_fragments(dst, st["files"], present, intent.save_id)
        except DcpTieredError as exc:  # storage trouble: keep polling within the bound
            log.warning("promotion of %s to %s: cannot list the target (%s); trying again", intent.name, target.name, exc)
            present, missing = st.get("seen", {}), st.get("missing", st["files"])
        if not missing:
            job.state = "committing"
            report = PromotionReport(step, source.name, target.name, "metadata")
            self._attempt(f"commit {intent.name} on {target.name}",
                          lambda: self._commit_metadata(src, dst, intent.save_id), report,
                          raise_later=not intent.resumed)  # resumed work is recovery: reported, not raised
            if report.ok:
                self._drop(intent, target.name)
                self._run_retention(target, (), ())
            return None
        if intent.save_id and self._committed_save_id(dst) == intent.save_id:
            self._record(PromotionReport(step, source.name, target.name, "metadata"))  # another process committed it
            self._drop(intent, target.name)
            return None
        if present != st.get("seen"):  # a file appeared or grew: the other ranks are getting there
            st["seen"], st["progress"] = present, now
        st["missing"] = missing
        bound = self.metadata_timeout if self.metadata_timeout is not None else fragment_wait_bound(
            source, target, st.get("copy_s", 0.0))
        ranks = sorted({_rank_of(f) for f in missing})
        if now - st["progress"] < bound and not self._stop.is_set():
            job.state = (f"waiting {now - st['start']:.0f}s (bound {bound:.0f}s without progress) for "
                         f"{len(missing)} file(s) of rank(s) {', '.join(ranks)}: {missing[:4]}")
            st["delay"] = min(_POLL_MAX, st.get("delay", _POLL_FIRST / 2) * 2)
            return now + st["delay"]
        if self._stop.is_set():
            return None  # closing: the intent stays recorded, a restart resumes it
        # give up; the intent stops asking for this commit (the missing files will not come)
        self._drop(intent, target.name)
        if self._committed_save_id(src) != intent.save_id:
            log.warning("promotion of %s to %s: the source changed while waiting; dropping it", src.url, target.name)
            return None
        error = (f"tier {target.name!r}, step {step}: gave up after {now - st['start']:.0f}s (bound {bound:.0f}s "
                 f"without progress) waiting for the promoted files of rank(s) {', '.join(ranks)}: {missing[:8]} "
                 f"never arrived in {dst.url} (a lost or restarted node?). The step is not committed on "
                 f"{target.name!r}; its partial copy is left for `dcp-tiered gc`; it stays on {source.name!r}, "
                 "and newer saves promote as usual")
        log.error("promotion failed: %s", error)
        self._record(PromotionReport(step, source.name, target.name, "metadata", seconds=now - st["start"],
                                     ok=False, error=error))
        return None

    def _refuse(self, intent: _Intent, target: str, step: int, why: str, drop: bool = False) -> None:
        """Skip a promotion that must not run (warned, and a failed report: ``dcp-tiered promote`` exits 1)."""
        log.warning("promotion of %s from %s to %s refused: %s", intent.name, intent.source, target, why)
        if drop:
            self._drop(intent, target)
        self._record(PromotionReport(step, intent.source, target, "data", ok=False, error=why),
                     raise_later=not intent.resumed)

    @staticmethod
    def _intent_mismatch(src: Storage, intent: _Intent) -> str | None:
        """Why the records of a (resumed, untrusted) intent are not exactly the committed source
        checkpoint's records of its data file, or None when they are ("stale": the intent is of
        another save than the committed one).  A promotion copies and commits
        the records it is given: records swapped or altered between keys would commit wrong values."""
        try:
            md = load_metadata(src)
        except MissingFileError:  # a node-local source: only the coordinator's node holds .metadata
            return None  # the commit checks the records this copy used (its fragment) against the source's
        except DcpTieredError as exc:
            return f"cannot read {src.url_of(METADATA_FILE)} to check the promotion intent: {exc}"
        if intent.save_id is not None and (getattr(md.storage_meta, "save_id", None) or "") != intent.save_id:
            return "stale"
        want = {(i.fqn, tuple(i.offset) if i.offset is not None else None): r for i, r in md.storage_data.items()
                if is_native_record(r) and r["file"] == intent.data_file}
        got: dict = {}
        for i, r in intent.records:
            got[(i[0], tuple(i[1]) if i[1] is not None else None)] = record_from_json(r)
        if got.keys() != want.keys():
            return (f"the promotion intent in {src.url} lists other items of {intent.data_file} than its .metadata; "
                    "not promoting it (left for `dcp-tiered gc`)")
        bad = sorted(k for k, r in got.items() if r != want[k])
        if bad:
            return (f"the promotion intent in {src.url} holds records of {[k for k, _ in bad[:3]]} that differ from "
                    f"the committed .metadata of {intent.data_file}; not promoting it (left for `dcp-tiered gc`)")
        return None

    @staticmethod
    def _committed_save_id(src: Storage) -> str | None:
        """The save id of the checkpoint committed in ``src`` ("" if it has none), None if uncommitted."""
        try:
            md = load_metadata(src)
        except MissingFileError:
            return None
        return getattr(md.storage_meta, "save_id", None) or ""

    def _copy_data(self, src: Storage, dst: Storage, data_file: str, records: list, target: Tier,
                   save_id: str | None = None) -> int:
        committed_id = self._committed_save_id(dst)
        if committed_id is not None:
            if save_id and committed_id == save_id:
                return 0  # another process (e.g. one that resumed this intent) promoted this save already
            # an older checkpoint of the same step is being replaced: un-commit it before its
            # data files change, so no .metadata ever describes files that are being rewritten
            dst.remove(METADATA_FILE)
        if all(r["codec"] == target.codec for _, r in records):
            n = copy_file(src, dst, data_file)
            new_records = records
        else:
            n, new_records = reencode_file(src, dst, data_file, records, target.codec)
        fragment = json.dumps({"save_id": save_id, "records": [[index_to_json(i), r] for i, r in new_records],
                               "source": [[index_to_json(i), r] for i, r in records]}).encode()
        dst.commit_bytes(fragment_name(data_file), fragment)
        return n

    @staticmethod
    def _fragment(dst: Storage, data_file: str) -> dict | None:
        """A rank's fragment (its promoted records), or None if absent or unreadable (written by another process)."""
        try:
            doc = json.loads(read_small_file(dst, fragment_name(data_file)))
        except (MissingFileError, ValueError, RecursionError):
            return None
        if not (isinstance(doc, dict) and isinstance(doc.get("records"), list)):
            return None
        return doc

    def _missing_fragments(self, dst: Storage, files: list[str], present: dict[str, int], save_id: str | None) -> list[str]:
        """Data files whose fragment of this save is not in ``dst`` yet (an older attempt's does not count)."""
        missing = []
        for f in files:
            frag = self._fragment(dst, f) if fragment_name(f) in present else None
            if frag is None or frag.get("save_id") != save_id:
                missing.append(f)
        return missing

    def _commit_metadata(self, src: Storage, dst: Storage, save_id: str | None = None) -> int:
        raw = read_metadata_bytes(src)
        md = decode_metadata(raw, src.url_of(METADATA_FILE))
        files = sorted({r["file"] for r in md.storage_data.values() if is_native_record(r)})
        present = dst.file_sizes()
        if save_id and self._committed_save_id(dst) == save_id:
            return 0  # another process committed this very save (and removed the fragments)
        if save_id and (getattr(md.storage_meta, "save_id", None) or "") != save_id:
            raise PromotionError(f"{src.url} was saved again while being promoted; not committing {dst.url}")
        fragments = {f: self._fragment(dst, f) for f in files}
        missing = [f for f, doc in fragments.items() if doc is None or doc.get("save_id") != save_id]
        if missing:
            raise PromotionError(f"{dst.url}: promoted files {missing[:3]} vanished before the commit")
        new_data = {}
        try:
            for f in files:
                for i, r in fragments[f]["records"]:  # type: ignore[index]
                    new_data[index_from_json(i)] = record_from_json(r)
        except (TypeError, ValueError) as exc:
            raise PromotionError(f"{dst.url}: a promotion fragment is malformed ({exc}); not committing") from None
        if set(new_data) != set(md.storage_data):
            raise PromotionError(f"{dst.url}: promoted records do not match the source checkpoint's items")
        # a fragment may re-encode (offsets, sizes, frames, codec) but never change what an item is
        changed = [i.fqn for f in files for i in _changed_items(f, new_data, md.storage_data)]
        try:  # the records each copy read (its intent's): exactly the source's records of that file
            for f in files:
                used = {index_from_json(i): record_from_json(r) for i, r in fragments[f].get("source", ())}  # type: ignore[union-attr]
                want = {i: r for i, r in md.storage_data.items() if is_native_record(r) and r["file"] == f}
                if "source" in fragments[f] and used != want:  # type: ignore[operator]
                    changed += sorted({i.fqn for i in set(used) ^ set(want)} | {i.fqn for i in want if used.get(i) != want[i]})
        except (TypeError, ValueError) as exc:
            raise PromotionError(f"{dst.url}: a promotion fragment is malformed ({exc}); not committing") from None
        if changed:
            raise PromotionError(f"{dst.url}: promoted records of {changed[:3]} do not describe the source checkpoint's "
                                 "items (a damaged or crafted promotion fragment); not committing")
        for f in files:
            size = max(r["offset"] + r["length"] for r in new_data.values() if r["file"] == f)
            if present.get(f, -1) != size:
                raise PromotionError(f"{dst.url_of(f)} has {present.get(f)} bytes, expected {size}")
        md.storage_data = new_data
        if md.storage_meta is not None:
            md.storage_meta.checkpoint_id = dst.url
        dst.commit_bytes(METADATA_FILE, encode_metadata(md))
        for f in files:
            try:
                dst.remove(fragment_name(f))
            except DcpTieredError as exc:  # cleanup only: the target is committed
                log.warning("could not remove promotion fragment %s: %s", dst.url_of(fragment_name(f)), exc)
        return len(raw)

    def _run_retention(self, tier: Tier, protect: tuple[int, ...], busy: tuple[int, ...]) -> None:
        if not tier.node_local and not self.is_coordinator:
            return
        try:
            infos = list_tier(tier, self.tiers.index(tier), self.rank, self.node, with_metadata=bool(self.optimizer_keys))
            storage = self.storage(tier)
            ages = storage.file_ages(time.time()) if self.leftover_grace > 0 else {}
        except DcpTieredError as exc:
            log.warning("retention: cannot list tier %s: %s", tier.name, exc)
            return
        busy_now = set(busy) | self.busy_steps(tier.name)
        facts = []
        for info in infos:
            if info.unusable:  # a link (or a .metadata that is not a file): never deleted, nor through it
                log.warning("retention of tier %s: leaving %s alone: %s", tier.name, info.name, info.problem)
                continue
            committed = info.committed or (not self.is_coordinator and any(f.endswith(DATA_SUFFIX) for f in info.files))
            pending = bool(set(info.pending_promotions) & set(self.by_name)) or any(f.endswith(FRAGMENT_SUFFIX) for f in info.files)
            if set(info.pending_promotions) & set(self.by_name):  # an intent naming no known tier pins nothing
                busy_now.add(info.step)
            file_ages = [a for n, a in ages.items() if n.startswith(info.name + "/")]
            with self._lock:
                mine = info.step in self._own.get(tier.name, ())
            # a leftover of this process's own saves or deletes needs no grace period
            age = float("inf") if mine else (min(file_ages) if file_ages else None)
            full = info.keys is None or not self.optimizer_keys or info.has_prefix(self.optimizer_keys)
            facts.append(CheckpointFacts(info.step, committed, busy=info.step in busy_now or (pending and not committed),
                                         full=full, age=age))
        for step in retention_victims(facts, tier.keep, protect, self.leftover_grace):
            name = next(i.name for i in infos if i.step == step and not i.unusable)
            self.mark_own(tier.name, step)
            try:
                child = storage.child(name)
                if child.exists(METADATA_FILE):
                    child.remove(METADATA_FILE)  # un-commit first: a half-deleted checkpoint is never listed
                child.remove_tree()
                log.info("retention: deleted %s", child.url)
            except DcpTieredError as exc:
                log.warning("retention: could not delete %s of tier %s: %s", name, tier.name, exc)
                self._record(PromotionReport(step, tier.name, tier.name, "retention", ok=True, error=f"delete failed: {exc}"))
