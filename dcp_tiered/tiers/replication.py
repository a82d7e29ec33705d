"""Peer replication of node-local tiers: each rank's files of a committed step go to the other
ranks of its clique, which keep them in their own node's directory, so a lost node's files can
be fetched back from a peer on restore (:mod:`dcp_tiered.tiers.peer_fetch`).

Cliques are computed as NVIDIA resiliency-ext's ``CliqueReplicationStrategy`` does: groups of
``F = replicas`` ranks ``n, n+J, ..., n+(F-1)J`` with ``n = a*J*F + b``, ``b < J`` and
``J = replication_jump``; the world size must be a multiple of ``J*F``.  With ``J`` a multiple
of the ranks per node, no copy shares its owner's node.

Per step, in clique order, each owner broadcasts its data files on the clique's gloo group:
first the names, sizes and xxh3-64 digests (``broadcast_object_list``), then the encoded bytes as
stored, in bounded ``uint8`` chunks.  Each receiver writes ``__{owner}_*.distcp`` into its own
node's step directory, checks the digest of what it received, and commits
``.replica-{owner}.json`` (save id, files, sizes, digests).  A step is replicated on a node when
the markers of every other clique member are there.  Replication runs on its own thread and
never blocks or raises into training: failures are events, raised at ``wait()``.

A storage problem never makes a rank skip a collective (:func:`stream_file`): the clique stays in
step and the next step replicates.  Only a failed collective (a timeout) leaves a group unusable;
it is then marked broken and never used again (:func:`check_group`).  The ranks agree on their
replication settings before any group is made (:func:`agree_settings`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from dcp_tiered.errors import ConfigError, DcpTieredError, ReplicationError
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.layout import step_name
from dcp_tiered.tiers.node_commit import (  # noqa: F401 - MARKER_PREFIX, marker_name, read_markers re-exported
    MARKER_PREFIX, expected_files, marker_files, marker_name, node_of, rank_of_file, read_markers)
from dcp_tiered.tiers.config import Tier

log = logging.getLogger(__name__)

#: Largest piece of a file sent in one broadcast.
CHUNK_BYTES = 64 << 20
#: Seconds the replication thread waits for work before it ends (a later submit starts another).
IDLE_S = 5.0
#: Seconds a clique collective may wait for a peer before the replication fails.
TIMEOUT_S = 300.0
FileEntry = tuple[str, int, str]  # (name, size, xxh3-64 hex digest)


def local_world() -> int:
    """Ranks per node from ``LOCAL_WORLD_SIZE`` (torchrun sets it); 0 when unknown."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)


def jump_of(tier: Tier) -> int:
    """The tier's ``replication_jump``, or the ranks per node (1 when unknown) when not given."""
    return tier.replication_jump or local_world() or 1


def cliques(world: int, replicas: int, jump: int) -> list[list[int]]:
    """The replication cliques of ``world`` ranks (NVRx's clique strategy), ordered by first rank."""
    span = jump * replicas
    if world % span:
        raise ConfigError(f"replicas={replicas} with replication_jump={jump} needs a world size that is a multiple "
                          f"of {span} (replicas x replication_jump), got {world}")
    return sorted([[a * span + b + k * jump for k in range(replicas)] for a in range(world // span) for b in range(jump)])


def check_replication(tier: Tier, world: int) -> list[list[int]]:
    """The cliques of ``tier`` for ``world`` ranks; ConfigError when the world size does not fit, or
    when a copy would share its owner's node (``replication_jump`` not a multiple of the ranks per node)."""
    jump, per_node = jump_of(tier), local_world()
    where = f"tier {tier.name!r}"
    if per_node and jump % per_node:
        raise ConfigError(f"{where}: replication_jump={jump} must be a multiple of the ranks per node "
                          f"(LOCAL_WORLD_SIZE={per_node}), or a copy lands on its owner's node; use {per_node} "
                          f"(the world size must then be a multiple of {per_node * tier.replicas}: "
                          f"{tier.replicas} nodes or a multiple)")
    try:
        found = cliques(world, tier.replicas, jump)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for clique in found:  # a copy written into its owner's directory would overwrite the original
        dirs = {tier.resolved_url(r, node_of(r)) for r in clique}
        if len(dirs) < len(clique):
            raise ConfigError(f"{where}: ranks {clique} would keep their copies in the same directory; set "
                              "LOCAL_WORLD_SIZE (torchrun does) and replication_jump to the ranks per node")
    return found


def file_digest(storage: Storage, name: str, size: int, chunk: int = CHUNK_BYTES) -> str:
    """xxh3-64 (hex) of the first ``size`` bytes of ``name``."""
    h = xxhash.xxh3_64()
    for off in range(0, size, chunk):
        h.update(storage.read_range(name, off, min(size, off + chunk)))
    return h.hexdigest()


#: id(group) -> (group, why): clique groups whose collective failed (timed out); never used again.  The
#: group itself is held so that its id is never reused by another object.
_BROKEN: dict[int, tuple[Any, str]] = {}


def mark_broken(group: Any, why: str) -> None:
    """Remember that a collective on ``group`` failed: gloo leaves it unusable, later uses fail fast."""
    _BROKEN[id(group)] = (group, why)


def check_group(group: Any, clique: Sequence[int]) -> None:
    """Raise :class:`ReplicationError` when ``group`` (of ``clique``) failed earlier, instead of hanging on it."""
    why = _BROKEN.get(id(group), (None, None))[1]
    if why is not None:
        raise ReplicationError(f"the process group of clique {list(clique)} failed earlier ({why}) and is not used "
                               "again in this job; restart the job to replicate or fetch through this clique")


def broadcast_header(header: list[Any], src: int, group: Any, what: str) -> None:
    """``broadcast_object_list`` of ``header`` from ``src`` on a clique's ``group``; a failure marks the
    group broken (:func:`check_group`) and is raised."""
    try:
        dist.broadcast_object_list(header, src=src, group=group)
    except Exception as exc:
        mark_broken(group, f"{what}: {exc}")
        raise


def stream_file(group: Any, src: int, me: int, entry: FileEntry, read: Storage | None, write: Storage | None,
                chunk: int = CHUNK_BYTES) -> str | None:
    """Broadcast one file from global rank ``src`` (reading it from ``read``) to the other ranks of
    ``group``; a rank with ``write`` stores it there and checks the digest.  Every rank of the group
    calls it with the same ``entry`` and takes part in every chunk, so the group stays in step: a
    receiver whose write fails discards the rest; each chunk carries a status byte of the sender, so
    when the sender cannot read (or its file is short) every rank stops at that chunk and nothing
    more is sent.  A receiver deletes its file on any failure.  Returns None, or why this rank
    failed; a failed collective (a peer gone, a timeout) raises and marks ``group`` broken."""
    name, size, digest = entry
    h = xxhash.xxh3_64()
    error: str | None = None
    buf = torch.empty(max(1, min(chunk, size)) + 1, dtype=torch.uint8)  # the last byte: the sender's status
    stack = contextlib.ExitStack()
    out = None
    if write is not None:
        try:
            out = stack.enter_context(write.open_write(name))
        except Exception as exc:  # noqa: BLE001 - any failure: this rank discards what it receives
            error = f"cannot write {write.url_of(name)}: {exc}"
    done = False
    try:
        try:
            for off in range(0, size, chunk):
                n = min(chunk, size - off)
                t = buf[:n + 1]
                if me == src:
                    error = error or _read_chunk(read, name, off, t[:n])
                    t[n] = 0 if error else 1
                try:
                    dist.broadcast(t, src=src, group=group)
                except Exception as exc:
                    mark_broken(group, f"broadcast of {name} from rank {src}: {exc}")
                    raise
                if int(t[n]) == 0:  # the sender failed: every rank stops here
                    error = error or f"rank {src} could not read its {name}; nothing more of it was sent"
                    break
                if out is not None and error is None:
                    try:
                        h.update(t[:n].numpy())
                        out.write(memoryview(t[:n].numpy()))
                    except Exception as exc:  # noqa: BLE001 - keep taking part in every chunk, discarding
                        error = f"cannot write {write.url_of(name)}: {exc}"  # type: ignore[union-attr]
        finally:
            try:
                stack.close()  # flush and close: may fail too (ENOSPC)
            except Exception as exc:  # noqa: BLE001
                error = error or f"cannot write {write.url_of(name)}: {exc}"  # type: ignore[union-attr]
        if write is not None and error is None and h.hexdigest() != digest:
            error = f"{write.url_of(name)}: received bytes have xxh3 {h.hexdigest()}, the sender's file {digest}"
        done = True
    finally:
        if write is not None and (error is not None or not done):
            with contextlib.suppress(Exception):
                write.remove(name)  # never leave a partial or mismatched file
    return error


def _read_chunk(read: Storage | None, name: str, off: int, t: torch.Tensor) -> str | None:
    """Read ``len(t)`` bytes of ``name`` at ``off`` into ``t``; why not, or None."""
    if read is None:
        return f"rank has no storage to read {name} from"
    try:
        got = read.read_range_into(name, off, t.numpy())
    except Exception as exc:  # noqa: BLE001 - the receivers are told through the status byte
        return f"cannot read {read.url_of(name)}: {exc}"
    if got < len(t):
        return f"{read.url_of(name)} is shorter than the {off + len(t)} bytes offered"
    return None


def owner_files(storage: Storage, metadata: Any, owner: int) -> list[FileEntry]:
    """The data files of rank ``owner`` that ``metadata`` names, with sizes and digests of ``storage``'s copy;
    :class:`ReplicationError` when a file there does not have the size the records give it."""
    files = expected_files(metadata, lambda f: rank_of_file(f) == owner)
    for name, size in sorted(files.items()):
        actual = storage.size(name)
        if actual != size:
            raise ReplicationError(f"{storage.url_of(name)} has {actual} bytes, its save's records say {size}")
    return [(name, size, file_digest(storage, name, size)) for name, size in sorted(files.items())]


def offer_problem(entries: Sequence[FileEntry], metadata: Any, owner: int) -> str | None:
    """Why the files ``entries`` offered as rank ``owner``'s do not match what the committed ``metadata``
    records for ``owner`` (names, sizes; nothing more may be sent than it says), or None."""
    expected = expected_files(metadata, lambda f: rank_of_file(f) == owner)
    for name, size, _digest in entries:
        if expected.get(name) != size:
            return (f"offered {name} of rank {owner} with {size} bytes, the checkpoint's metadata records "
                    f"{expected.get(name, 'no such file')}; refused")
    if sum(e[1] for e in entries) > sum(expected.values()):
        return f"offered more bytes of rank {owner} than the checkpoint's metadata records; refused"
    return None


def _refused(entries: Sequence[FileEntry], metadata: Any, owner: int) -> str | None:
    """:func:`offer_problem`, never raising (a receiver must take part in the streams that follow)."""
    try:
        return offer_problem(entries, metadata, owner)
    except Exception as exc:  # noqa: BLE001
        return f"cannot check the offer of rank {owner} against the save's metadata: {exc}"


def agree_settings(tiers: Sequence[Tier], group: Any = None) -> None:
    """All-gather every rank's replication settings (per tier: replicas, jump, ``LOCAL_WORLD_SIZE``) on
    ``group`` (default: the default group); the same :class:`ConfigError` on every rank when they differ."""
    replicated = [(t.name, t.replicas, jump_of(t)) for t in tiers if t.replicas > 1]
    mine = replicated, local_world() if replicated else None  # ranks without replication may differ otherwise
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    odd = [r for r, theirs in enumerate(every) if theirs != every[0]]
    if odd:
        raise ConfigError(f"the ranks disagree on replication: rank 0 has {_settings(every[0])}, rank {odd[0]} "
                          f"{_settings(every[odd[0]])} ({len(odd)} rank(s) differ); give every rank the same tiers "
                          "(replicas, replication_jump) and LOCAL_WORLD_SIZE")


def _settings(value: Any) -> str:
    tiers, per_node = value
    if not tiers:
        return "no replicated tier"
    return ", ".join(f"tier {n!r} replicas={f} jump={j}" for n, f, j in tiers) + f", LOCAL_WORLD_SIZE={per_node}"


class Replicator:
    """Replication of the node-local tiers with ``replicas > 1`` for one rank (see the module doc).

    Construct on every rank in the same order (it creates every clique's process group);
    ``submit`` after each save's node commit; ``wait`` raises failures.  The thread ends when idle.
    """

    def __init__(self, tiers: Sequence[Tier], *, rank: int, world: int, events: Any, promoter: Any = None,
                 distributed: bool = True, timeout: float | None = None, chunk_bytes: int | None = None,
                 group: Any = None) -> None:
        self.rank, self.world, self.events, self.promoter = rank, world, events, promoter
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self.tiers = {t.name: t for t in tiers}
        self.plans: dict[str, tuple[list[int], Any]] = {}  # tier name -> (my clique, its group)
        self.all_groups: dict[str, list[tuple[list[int], Any]]] = {}
        if distributed:
            agree_settings(tiers, group)  # before any new_group: a rank configured otherwise would hang there
        for tier in tiers:
            if tier.replicas <= 1:
                continue
            found = check_replication(tier, world)
            if not distributed:
                raise ConfigError(f"tier {tier.name!r}: replicas={tier.replicas} needs torch.distributed initialized")
            td = datetime.timedelta(seconds=timeout or TIMEOUT_S)
            groups = [(c, dist.new_group(c, backend="gloo", timeout=td)) for c in found]
            self.all_groups[tier.name] = groups
            self.plans[tier.name] = next((c, g) for c, g in groups if rank in c)
        self._sent = 0  # bytes the running job sent so far (reported also when it fails)
        self._queue: queue.Queue = queue.Queue()
        self._busy: dict[str, set[int]] = {}
        self._failures: list[str] = []
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None

    def group_of(self, tier_name: str) -> "tuple[list[int], Any] | None":
        """This rank's clique on ``tier_name`` and its process group, or None without replication."""
        return self.plans.get(tier_name)

    def submit(self, step: int, tier: Tier, metadata: Any) -> None:
        """Queue the replication of ``step`` of ``tier`` (no-op for a tier without replicas); returns at once."""
        if tier.name not in self.plans:
            return
        with self._lock:
            self._busy.setdefault(tier.name, set()).add(step)
        if self.promoter is not None:
            self.promoter.set_writing([tier.name], step, True)  # retention keeps a step being replicated
        with self._lock:
            self._queue.put((step, tier, metadata))
            if self._thread is None:  # the thread ends when idle: nothing to close
                self._thread = threading.Thread(target=self._loop, name="dcp-tiered-replication", daemon=True)
                self._thread.start()

    def busy_steps(self, tier_name: str) -> set[int]:
        """Steps of ``tier_name`` whose replication is queued or running."""
        with self._lock:
            return set(self._busy.get(tier_name, ()))

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            step, tier, metadata = job
            try:
                self._run_job(step, tier, metadata)
            except Exception as exc:  # noqa: BLE001 - reported at wait(), never raised into training
                self._fail(tier, step, f"replication of step {step} on tier {tier.name!r} failed: {exc}")
            finally:
                if self.promoter is not None:
                    self.promoter.set_writing([tier.name], step, False)
                with self._lock:
                    self._busy.get(tier.name, set()).discard(step)
                    self._lock.notify_all()

    def _fail(self, tier: Tier, step: int, why: str) -> None:
        log.warning("%s", why)
        with self._lock:
            self._failures.append(why)
        self.events.emit({"event": "replication", "tier": tier.name, "step": step, "ok": False, "error": why,
                          "sent_bytes": self._sent})

    def _run_job(self, step: int, tier: Tier, metadata: Any) -> None:
        """Send this rank's files of ``step`` to its clique and receive the others' (every member runs it).

        Storage problems of one rank never skip a collective: they are collected and raised at the
        end (one failure for this step; later steps replicate as usual).  A failed collective marks
        the clique's group broken (:func:`check_group`): later jobs fail fast instead of hanging."""
        self._sent = 0
        clique, group = self.plans[tier.name]
        check_group(group, clique)
        node_dir = Storage(tier.resolved_url(self.rank, node_of(self.rank)), tier.storage_options).child(step_name(step))
        save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        t0, errors = time.perf_counter(), []
        try:
            self._drop_stale(node_dir, clique, save_id)
        except Exception as exc:  # noqa: BLE001 - still take part in the collectives below
            errors.append(f"rank {self.rank} cannot drop the replicas of an earlier save of step {step}: {exc}")
        for owner in clique:
            header: list[Any] = [self._header(node_dir, metadata, owner, step, save_id) if owner == self.rank else None]
            broadcast_header(header, owner, group, f"header of rank {owner}")
            if isinstance(header[0], str):
                errors.append(header[0])
                continue
            entries, chunk = header[0]
            refused = None if owner == self.rank else _refused(entries, metadata, owner)
            write = None if owner == self.rank or refused else node_dir  # a refused offer is received, not kept
            problems = []
            for e in entries:
                if (p := stream_file(group, owner, self.rank, e, node_dir, write, chunk)) is not None:
                    problems.append(p)
                elif owner == self.rank:
                    self._sent += e[1] * (len(clique) - 1)
            if owner == self.rank:
                errors += problems  # the sender's own read failures
                continue
            if refused or problems:
                errors += [refused] if refused else problems
            else:
                marker = {"owner": owner, "save_id": save_id, "step": step,
                          "files": [{"file": n, "size": s, "xxh3": d} for n, s, d in entries]}
                try:
                    node_dir.commit_bytes(marker_name(owner), json.dumps(marker).encode())
                except DcpTieredError as exc:
                    errors.append(f"cannot commit the replica marker of rank {owner}: {exc}")
        if errors:
            raise ReplicationError("; ".join(errors[:4]))
        self.events.emit({"event": "replication", "tier": tier.name, "step": step, "ok": True, "clique": clique,
                          "sent_bytes": self._sent, "seconds": time.perf_counter() - t0})

    def _header(self, node_dir: Storage, metadata: Any, owner: int, step: int, save_id: "str | None") -> Any:
        """What this rank (``owner``) offers its clique: its files of ``step`` and its chunk size, or why not."""
        if not save_id:
            return f"step {step}: no committed metadata"
        try:
            return owner_files(node_dir, metadata, owner), self.chunk_bytes  # the sender's chunks
        except Exception as exc:  # noqa: BLE001 - the clique still gets a header
            return f"rank {owner} cannot read its files of step {step}: {exc}"

    def _drop_stale(self, node_dir: Storage, clique: list[int], save_id: "str | None") -> None:
        """Remove the markers (and their files) of an earlier save of this step, before its files are replaced."""
        for owner, marker in read_markers(node_dir).items():
            if owner in clique and owner != self.rank and marker.get("save_id") != save_id:
                node_dir.remove(marker_name(owner))
                for name in marker_files(marker, owner):
                    node_dir.remove(name)

    def state(self, step: int) -> dict[str, Any]:
        """Per replicated tier, as this rank sees ``step``: in flight here, this rank's clique, the owners
        whose committed replica markers this node holds, and ``replicated``: every other member's is here."""
        out: dict[str, Any] = {}
        for name, (clique, _g) in self.plans.items():
            tier = self.tiers[name]
            child = Storage(tier.resolved_url(self.rank, node_of(self.rank)), tier.storage_options).child(step_name(step))
            owners = sorted(read_markers(child))
            out[name] = {"in_flight": step in self.busy_steps(name), "clique": clique, "markers": owners,
                         "replicated": all(r in owners for r in clique if r != self.rank)}
        return out

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued replication ran; raise :class:`ReplicationError` for failures since the last call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while any(self._busy.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ReplicationError(f"replication still running after {timeout} s: "
                                           f"{ {k: sorted(v) for k, v in self._busy.items() if v} }")
                self._lock.wait(left if left is not None else 1.0)
            failures, self._failures = self._failures, []
        if failures:
            raise ReplicationError(f"{len(failures)} replication(s) failed: {'; '.join(failures[:4])}")
