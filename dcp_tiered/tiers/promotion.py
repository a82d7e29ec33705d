"""Background promotion of committed checkpoints to slower tiers, and retention.

Every rank copies its own data files (so node-local sources work) and leaves a small
fragment file next to each copy; the coordinator commits the target's ``.metadata`` once
the fragments of every data file are there.  No collective is used: ranks coordinate
through the target directory only.  Each rank records what it still has to do in an
intent file inside the source checkpoint, so unfinished promotions resume after a restart.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_tiered.dcp.common import lower_thread_priority
from dcp_tiered.dcp.format import DATA_SUFFIX, METADATA_FILE, is_native_record
from dcp_tiered.dcp.metadata_io import decode_metadata, encode_metadata
from dcp_tiered.errors import CheckpointNotFoundError, DcpTieredError, PromotionError
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.storage.retry import RetryPolicy, retrying
from dcp_tiered.tiers.catalog import list_tier, tier_storage
from dcp_tiered.tiers.layout import FRAGMENT_SUFFIX, fragment_name, intent_name, parse_step
from dcp_tiered.tiers.policy import CheckpointFacts, retention_victims
from dcp_tiered.tiers.reencode import copy_file, reencode_file
from dcp_tiered.tiers.spec import Tier

log = logging.getLogger(__name__)


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
    """What one rank still has to do for one source checkpoint."""

    name: str
    source: str
    data_file: str | None
    records: list  # [[index json, record], ...]
    targets: list[str]  # tiers still to receive this rank's data file
    meta: list[str] = field(default_factory=list)  # tiers whose .metadata this rank (coordinator) commits
    save_id: str | None = None  # the save this intent belongs to (all ranks share it)
    resumed: bool = False  # picked up from storage after a restart (or from another process)

    def to_json(self) -> bytes:
        return json.dumps({k: v for k, v in self.__dict__.items() if k != "resumed"}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "_Intent":
        return cls(**json.loads(data))


class Promoter:
    """A background thread that promotes checkpoints and applies retention, one job at a time.

    Failures are retried with backoff; one that still fails is recorded and raised by
    :meth:`wait` (and :meth:`close`), never in the training loop's hot path.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        rank: int = 0,
        node: int = 0,
        is_coordinator: bool = True,
        retry: RetryPolicy = RetryPolicy(),
        metadata_timeout: float = 3600.0,
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
        self._queue: queue.Queue = queue.Queue()
        self._busy: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- public -----------------------------------------------------------------------

    def storage(self, tier: Tier) -> Storage:
        return tier_storage(tier, self.rank, self.node)

    def record_intent(self, name: str, source: Tier, targets: Sequence[str], data_file: str | None,
                      records: list[tuple[MetadataIndex, dict]], coordinator: bool, save_id: str | None = None) -> _Intent | None:
        """Record durably, in the source checkpoint, what this rank must promote; queue it with :meth:`submit`."""
        intent = _Intent(name, source.name, data_file, [[index_to_json(i), r] for i, r in records],
                         list(targets) if data_file else [], list(targets) if coordinator else [], save_id)
        if not intent.targets and not intent.meta:
            return None
        self.storage(source).child(name).commit_bytes(intent_name(self.rank), intent.to_json())
        return intent

    def submit(self, intent: _Intent) -> None:
        """Queue a recorded intent (the coordinator does so only after the source committed)."""
        self._submit(self._run_intent, intent)

    def mark_own(self, tier_name: str, step: int) -> None:
        """Note that this process writes ``step`` to ``tier_name``: its leftovers need no grace period."""
        with self._lock:
            self._own.setdefault(tier_name, set()).add(step)

    def set_writing(self, tier_names: Sequence[str], step: int, writing: bool) -> None:
        """Mark ``step`` of ``tier_names`` as being written by a save of this process, or done.

        Retention never deletes such a step: after a restore from an older step (or beside another
        job) a save in progress can be older than the newest committed checkpoint."""
        with self._lock:
            for name in tier_names:
                steps = self._writing.setdefault(name, set())
                if writing:
                    steps.add(step)
                else:
                    steps.discard(step)

    def retention(self, tier: Tier, protect: Sequence[int] = (), busy: Sequence[int] = ()) -> None:
        """Queue retention for ``tier`` (runs after any promotion already queued)."""
        self._submit(self._run_retention, tier, tuple(protect), tuple(busy))

    def resume(self) -> int:
        """Queue the unfinished promotions this rank recorded before a restart; return how many."""
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
                try:
                    data = child.read_bytes(intent_name(self.rank))
                except MissingFileError:
                    continue
                except DcpTieredError as exc:
                    log.warning("cannot read promotion intent in %s: %s", child.url, exc)
                    continue
                try:
                    intent = _Intent.from_json(data)
                except (ValueError, TypeError) as exc:
                    log.warning("ignoring unreadable promotion intent in %s: %s", child.url, exc)
                    continue
                intent.resumed = True
                self._submit(self._run_intent, intent)
                count += 1
        return count

    def busy_steps(self, tier_name: str) -> set[int]:
        """Steps of ``tier_name`` that a queued or running promotion still reads, or a save is writing."""
        with self._lock:
            reading = {parse_step(n) for (t, n), c in self._busy.items() if t == tier_name and c > 0} - {None}
            return reading | self._writing.get(tier_name, set())  # type: ignore[return-value]

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued job ran; raise :class:`PromotionError` for failures since the last call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PromotionError(f"promotions still running after {timeout}s")
                self._idle.wait(left)
        self.raise_failures()

    def raise_failures(self) -> None:
        with self._lock:
            failed, self._failures = self._failures, []
        if failed:
            lines = "; ".join(f"step {f.step} {f.source}->{f.target} ({f.kind}): {f.error}" for f in failed)
            raise PromotionError(f"{len(failed)} promotion(s) failed: {lines}")

    def close(self, wait: bool = True) -> None:
        """Finish queued work (``wait``) or drop it, then stop the thread; raise recorded failures."""
        try:
            if wait:
                self.wait()
        finally:
            self._stop.set()
            self._queue.put(None)
            if self._thread is not None:
                self._thread.join(timeout=60)

    # -- machinery --------------------------------------------------------------------

    def _submit(self, fn: Callable, *args: Any) -> None:
        if self._stop.is_set():
            raise PromotionError("the promoter is closed")
        with self._lock:
            self._pending += 1
            if len(args) and isinstance(args[0], _Intent):
                key = (args[0].source, args[0].name)
                self._busy[key] = self._busy.get(key, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dcp_tiered-promoter", daemon=True)
                self._thread.start()
        self._queue.put((fn, args))

    def _loop(self) -> None:
        lower_thread_priority(self.nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, args = job
            try:
                if not self._stop.is_set():
                    fn(*args)
            except Exception as exc:  # recorded and raised at wait(); the thread must live on
                log.exception("background job failed")
                self._record(PromotionReport(-1, "?", "?", "job", ok=False, error=f"{type(exc).__name__}: {exc}"))
            finally:
                with self._idle:
                    self._pending -= 1
                    if args and isinstance(args[0], _Intent):
                        key = (args[0].source, args[0].name)
                        self._busy[key] -= 1
                    self._idle.notify_all()

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
        src = self.storage(self.by_name[intent.source]).child(intent.name)
        if intent.targets or intent.meta:
            src.commit_bytes(intent_name(self.rank), intent.to_json())
            return
        try:
            src.remove(intent_name(self.rank))
        except DcpTieredError as exc:  # cleanup only: the promotion itself succeeded
            log.warning("could not remove finished promotion intent in %s: %s", src.url, exc)

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

    def _run_intent(self, intent: _Intent) -> None:
        source = self.by_name.get(intent.source)
        if source is None:
            log.warning("promotion intent names unknown tier %r; dropping it", intent.source)
            return
        step = parse_step(intent.name) or -1
        src = self.storage(source).child(intent.name)
        records = [(index_from_json(i), record_from_json(r)) for i, r in intent.records]
        for target_name in list(intent.targets):
            target = self.by_name.get(target_name)
            if target is None:
                intent.targets.remove(target_name)
                continue
            dst = self.storage(target).child(intent.name)
            report = PromotionReport(step, source.name, target.name, "data")
            self._attempt(f"promote {intent.data_file} of {intent.name} to {target.name}",
                          lambda: self._copy_data(src, dst, intent.data_file, records, target, intent.save_id), report,
                          raise_later=not intent.resumed)
            if report.ok:
                intent.targets.remove(target_name)
                self._save_intent(intent)
        for target_name in list(intent.meta):
            target = self.by_name.get(target_name)
            if target_name in intent.targets:
                continue  # this rank's own data did not get there: committing would only wait; a restart resumes it
            if target is None:
                intent.meta.remove(target_name)
                continue
            dst = self.storage(target).child(intent.name)
            committed_id = self._committed_save_id(src)
            if committed_id is None or (intent.save_id is not None and committed_id != intent.save_id):
                log.warning("%s: the save this promotion belongs to never committed; not promoting it to %s",
                            src.url, target.name)
                intent.meta.remove(target_name)
                self._save_intent(intent)
                continue
            report = PromotionReport(step, source.name, target.name, "metadata")
            self._attempt(f"commit {intent.name} on {target.name}",
                          lambda: self._commit_metadata(src, dst, intent.save_id), report,
                          raise_later=not intent.resumed)  # resumed work is recovery: reported, not raised
            if report.ok:
                intent.meta.remove(target_name)
                self._save_intent(intent)
                self._run_retention(target, (), ())

    @staticmethod
    def _committed_save_id(src: Storage) -> str | None:
        """The save id of the checkpoint committed in ``src`` ("" if it has none), None if uncommitted."""
        try:
            md = decode_metadata(src.read_bytes(METADATA_FILE), src.url_of(METADATA_FILE))
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
        fragment = json.dumps({"save_id": save_id, "records": [[index_to_json(i), r] for i, r in new_records]}).encode()
        dst.commit_bytes(fragment_name(data_file), fragment)
        return n

    def _fragment(self, dst: Storage, data_file: str) -> dict | None:
        try:
            doc = json.loads(dst.read_bytes(fragment_name(data_file)))
        except (MissingFileError, ValueError):
            return None
        return doc if isinstance(doc, dict) and "records" in doc else None

    def _commit_metadata(self, src: Storage, dst: Storage, save_id: str | None = None) -> int:
        raw = src.read_bytes(METADATA_FILE)
        md = decode_metadata(raw, src.url_of(METADATA_FILE))
        files = sorted({r["file"] for r in md.storage_data.values() if is_native_record(r)})
        deadline = time.monotonic() + self.metadata_timeout
        delay = 0.05
        while True:
            present = dst.file_sizes()
            fragments = {f: self._fragment(dst, f) for f in files if fragment_name(f) in present}
            # a fragment left by an older attempt at the same step (another save id) does not count
            missing = [f for f in files if fragments.get(f) is None or fragments[f].get("save_id") != save_id]
            if not missing:
                break
            if save_id and self._committed_save_id(dst) == save_id:
                return 0  # another process committed this very save (and removed the fragments)
            if time.monotonic() > deadline or self._stop.is_set():
                # not a StorageError: retrying would only wait again
                raise CheckpointNotFoundError(f"{dst.url}: data of {missing[:3]} never arrived; not committing")
            self._stop.wait(delay)
            delay = min(2.0, delay * 2)
        new_data = {}
        for f in files:
            for i, r in fragments[f]["records"]:
                new_data[index_from_json(i)] = record_from_json(r)
        if set(new_data) != set(md.storage_data):
            raise PromotionError(f"{dst.url}: promoted records do not match the source checkpoint's items")
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
            committed = info.committed or (not self.is_coordinator and any(f.endswith(DATA_SUFFIX) for f in info.files))
            pending = bool(info.pending_promotions) or any(f.endswith(FRAGMENT_SUFFIX) for f in info.files)
            if info.pending_promotions:
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
            name = next(i.name for i in infos if i.step == step)
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
