"""Peer replication of node-local tiers: each rank's files of a committed step go to the other
ranks of its clique, which keep them in their own node's directory, so a lost node's files can
be fetched back from a peer on restore (:mod:`dcp_tiered.tiers.replicas.fetch`).

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

import datetime
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from dcp_tiered.dcp.agree import agree
from dcp_tiered.dcp.format import expected_sizes
from dcp_tiered.errors import ConfigError, DcpTieredError, ReplicationError
from dcp_tiered.names import rank_of_file
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.replicas.markers import is_replicated, marker_files, marker_name, new_marker, read_markers
from dcp_tiered.tiers.replicas import stream
from dcp_tiered.tiers.replicas.stream import FileEntry, broadcast_header, check_group, file_digest, stream_file
from dcp_tiered.tiers.retention import save_writers
from dcp_tiered.tiers.topology import check_replication, jump_of, local_world, step_dir

log = logging.getLogger(__name__)

#: Seconds the replication thread waits for work before it ends (a later submit starts another).
IDLE_S = 5.0
#: Seconds a clique collective may wait for a peer before the replication fails.
TIMEOUT_S = 300.0


def owner_files(storage: Storage, metadata: Any, owner: int) -> list[FileEntry]:
    """The data files of rank ``owner`` that ``metadata`` names, with sizes and digests of ``storage``'s copy;
    :class:`ReplicationError` when a file there does not have the size the records give it."""
    files = expected_sizes(metadata.storage_data.values(), lambda f: rank_of_file(f) == owner)
    for name, size in sorted(files.items()):
        actual = storage.size(name)
        if actual != size:
            raise ReplicationError(f"{storage.url_of(name)} has {actual} bytes, its save's records say {size}")
    return [(name, size, file_digest(storage, name, size)) for name, size in sorted(files.items())]


def offer_problem(entries: Sequence[FileEntry], metadata: Any, owner: int) -> str | None:
    """Why the files ``entries`` offered as rank ``owner``'s do not match what the committed ``metadata``
    records for ``owner`` (names, sizes; nothing more may be sent than it says), or None."""
    expected = expected_sizes(metadata.storage_data.values(), lambda f: rank_of_file(f) == owner)
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
    """Compare every rank's replication settings (per tier: replicas, jump, ``LOCAL_WORLD_SIZE``) on
    ``group`` (default: the default group); the same :class:`ConfigError` on every rank when they differ."""
    replicated = [(t.name, t.replicas, jump_of(t)) for t in tiers if t.replicas > 1]
    mine = replicated, local_world() if replicated else None  # ranks without replication may differ otherwise

    def differ(every: list[Any]) -> "str | None":
        odd = [r for r, theirs in enumerate(every) if theirs != every[0]]
        if not odd:
            return None
        return (f"the ranks disagree on replication: rank 0 has {_settings(every[0])}, rank {odd[0]} "
                f"{_settings(every[odd[0]])} ({len(odd)} rank(s) differ); give every rank the same tiers "
                "(replicas, replication_jump) and LOCAL_WORLD_SIZE")

    problem = agree(mine, differ, group)
    if problem is not None:
        raise ConfigError(problem)


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
        self.chunk_bytes = chunk_bytes or stream.CHUNK_BYTES
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
        node_dir = step_dir(tier, self.rank, step)
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
                marker = new_marker(owner, save_id, step, entries, world=self.world, per_node=local_world())
                try:
                    node_dir.commit_bytes(marker_name(owner), marker)
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
        whose committed replica markers this node holds, and ``replicated``
        (:func:`~dcp_tiered.tiers.replicas.markers.is_replicated` for this rank's clique peers: what its own
        replication brought; retention asks the same rule for every rank of the directory)."""
        out: dict[str, Any] = {}
        for name, (clique, _g) in self.plans.items():
            child = step_dir(self.tiers[name], self.rank, step)
            markers = read_markers(child)
            try:
                save_id, writers = save_writers(child)
            except DcpTieredError:
                save_id, writers = None, None
            peers = [r for r in clique if r != self.rank]  # this rank's own replication (its wait covers it)
            out[name] = {"in_flight": step in self.busy_steps(name), "clique": clique, "markers": sorted(markers),
                         "replicated": is_replicated(markers, peers, save_id, child.file_sizes(), writers)}
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
