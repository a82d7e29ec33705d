"""Restore through peers: a rank whose node-local files of a step are gone (a replaced node) gets
them back from a clique peer holding a committed replica (:mod:`dcp_tiered.tiers.replicas.replicate`).

Every rank reports the replica markers its node holds (:func:`holdings`); with every rank's
report the ranks make the same plan (:func:`plan_fetch`): for each rank lacking the step, the
lowest rank of its clique that holds its files under a marker of the same save and sees the step
committed.  :func:`fetch` then streams the files on the clique's group (the receiver's, then the
holder's own, which the receiver keeps as a replica again); the receiver checks each digest, writes
them into its node's directory (a file failing its digest, or any write, is deleted), commits the
holder's replica marker, and once every rank's fetch succeeded, the node's lowest receiving rank
commits the ``.metadata`` there if missing (:func:`commit_node_metadata`).  Offers are checked
against the committed ``.metadata`` on both sides: no file, and no byte, that it does not record
is sent or written.  The load that follows verifies every frame's checksum as it reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dcp_tiered.dcp.metadata_io import decode_metadata, load_metadata
from dcp_tiered.errors import DcpTieredError
from dcp_tiered.names import METADATA_FILE
from dcp_tiered.ranks import local_world
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.layout import parse_step
from dcp_tiered.tiers.replicas.markers import marker_name, new_marker, read_markers
from dcp_tiered.tiers.replicas.replicate import offer_problem, owner_files
from dcp_tiered.tiers.replicas import stream
from dcp_tiered.tiers.replicas.stream import broadcast_header, check_group, stream_file
from dcp_tiered.tiers.topology import dir_ranks, step_dir, tier_storage

log = logging.getLogger(__name__)

Held = tuple[int, int, int, "str | None"]  # (tier index, step, owner rank, save id)
Plan = dict[int, int]  # receiver rank -> holder rank


def holdings(tiers: Sequence[Tier], rank: int, node: int) -> list[Held]:
    """The committed replica markers in this rank's node directories of the replicated tiers."""
    out: list[Held] = []
    for i, tier in enumerate(tiers):
        if tier.replicas <= 1:
            continue
        try:
            storage = tier_storage(tier, rank, node)
            for name in storage.listdir():
                step = parse_step(name)
                if step is None:
                    continue
                for owner, marker in read_markers(storage.child(name)).items():
                    out.append((i, step, owner, marker.get("save_id")))
        except Exception as exc:  # noqa: BLE001 - one tier's problem never hides the others' replicas
            log.warning("restore: cannot list the replicas of tier %s: %s", tier.name, exc)
    return out


def plan_fetch(cand: tuple[int, int], lacking: Sequence[int], ok_ranks: Sequence[int], save_id: "str | None",
               held: Sequence[Sequence[Held]], cliques: Sequence[Sequence[int]]) -> Plan | None:
    """For each rank in ``lacking``, a holder of its files of candidate ``cand``: a rank of its clique in
    ``ok_ranks`` (sees the candidate committed and whole) whose node holds a marker of that rank with
    ``save_id``.  None when some lacking rank has no holder (the candidate stays unusable)."""
    s, i = cand
    if save_id is None:
        return None
    clique_of = {member: c for c in cliques for member in c}
    ok = set(ok_ranks)
    vouched: dict[int, set[int]] = {}  # holder -> owners it holds a marker of, of this candidate and save

    def holds(h: int, r: int) -> bool:
        if h not in vouched:
            vouched[h] = {e[2] for e in held[h] if e[0] == i and e[1] == s and e[3] == save_id}
        return r in vouched[h]

    plan: Plan = {}
    for r in lacking:
        holder = next((h for h in clique_of.get(r, ()) if h != r and h in ok and holds(h, r)), None)
        if holder is None:
            return None
        plan[r] = holder
    return plan


def _offer(mine: Storage, holder: int, receiver: int) -> Any:
    """The holder's header for ``receiver``: the receiver's files (from their replica marker) and the
    holder's own (to be kept there as a replica again), with sizes and digests, the ``.metadata`` to
    commit and the save id; or why the holder cannot send them.  Every file of the marker must be
    one the committed ``.metadata`` records for ``receiver``, at that size, and be that size here:
    a damaged or hostile marker never makes a receiver write more (or other) bytes than the checkpoint has."""
    try:
        marker = read_markers(mine)[receiver]
        entries = [(str(f["file"]), int(f["size"]), str(f["xxh3"])) for f in marker["files"]]
        metadata = load_metadata(mine)
        if marker.get("save_id") != getattr(metadata.storage_meta, "save_id", None):
            return f"rank {holder}'s replica of rank {receiver} is of another save than its .metadata"
        why = offer_problem(entries, metadata, receiver)
        for name, size, _digest in entries if why is None else ():
            if mine.size(name) != size:
                why = f"{mine.url_of(name)} has {mine.size(name)} bytes, its replica marker says {size}"
                break
        if why is not None:
            return f"rank {holder} cannot offer its replica of rank {receiver}: {why}"
        own = owner_files(mine, metadata, holder)
        return entries, mine.read_bytes(METADATA_FILE), own, marker["save_id"], stream.CHUNK_BYTES  # the holder's chunks
    except Exception as exc:  # noqa: BLE001 - the clique still gets a header
        return f"rank {holder} cannot read its replica of rank {receiver}: {exc}"


def fetch(tier: Tier, step: int, plan: Plan, *, rank: int, node: int,
          clique_groups: Sequence[tuple[list[int], Any]]) -> tuple[str | None, int, bytes | None]:
    """Carry out ``plan`` (the same on every rank; every rank calls it): each holder streams the files of
    its receiver on their clique's group, then its own files, which the receiver keeps as a committed
    replica again (its node held them before it was lost, and its ranks' loads may need them: items
    DCP stored once, in the holder's file).  Returns why this rank failed, or None (storage problems
    never make it skip a collective of its clique), the bytes this rank received, and the
    ``.metadata`` a receiver got (its node commits it once every receiving rank of the node succeeded:
    :func:`commit_node_metadata`).  A failed collective raises and marks the clique's group broken."""
    mine = step_dir(tier, rank, step, node)
    error: str | None = None
    received, metadata = 0, None
    for receiver, holder in sorted(plan.items()):
        clique, group = next(((c, g) for c, g in clique_groups if receiver in c), ([], None))
        if rank not in clique:
            continue
        check_group(group, clique)
        header: list[Any] = [_offer(mine, holder, receiver) if rank == holder else None]
        broadcast_header(header, holder, group, f"fetch header of rank {holder}")
        if isinstance(header[0], str):
            error = error or header[0] if rank == receiver else error
            continue
        entries, md, own, save_id, chunk = header[0]
        refused = _refusal(md, entries, own, receiver, holder) if rank == receiver else None
        write = mine if rank == receiver and refused is None else None  # a refused offer is received, not kept
        problems = [p for e in entries + own if (p := stream_file(group, holder, rank, e, mine, write, chunk))
                    is not None]
        if rank != receiver:
            continue
        problems = [refused] if refused else problems
        if problems:
            error = error or "; ".join(problems[:3])
            continue
        received += sum(e[1] for e in entries + own)
        try:
            world = max(r for c, _g in clique_groups for r in c) + 1  # the cliques cover every rank
            mine.commit_bytes(marker_name(holder), new_marker(holder, save_id, step, own, world=world,
                                                              per_node=local_world()))
            metadata = md
        except Exception as exc:  # noqa: BLE001 - the other pairs' collectives still follow
            error = error or f"cannot commit {mine.url}: {exc}"
        log.info("restore: rank %d fetched %d file(s) of step %d from rank %d", rank, len(entries) + len(own), step,
                 holder)
    return error, received, metadata


def _refusal(md: bytes, entries: list, own: list, receiver: int, holder: int) -> str | None:
    """The receiver's own check of an offer against the ``.metadata`` that came with it, or None."""
    try:
        metadata = decode_metadata(md, f"the .metadata offered by rank {holder}")
        return offer_problem(entries, metadata, receiver) or offer_problem(own, metadata, holder)
    except Exception as exc:  # noqa: BLE001 - the receiver still takes part in the streams
        return f"rank {holder} offered an unreadable .metadata or offer: {exc}"


def commit_node_metadata(tier: Tier, step: int, plan: Plan, metadata: "bytes | None", *, rank: int,
                         node: int) -> str | None:
    """After every rank's fetch succeeded: the lowest receiving rank of this rank's directory commits the
    ``.metadata`` it received there (if not there yet); why that failed, or None."""
    here = set(dir_ranks(tier, rank, max(plan) + 1 if plan else 0))
    receivers = sorted(r for r in plan if r in here)
    if not receivers or receivers[0] != rank or metadata is None:
        return None
    mine = step_dir(tier, rank, step, node)
    try:
        if not mine.commit_bytes(METADATA_FILE, metadata, exclusive=True):
            return f"{mine.url_of(METADATA_FILE)} holds another save's .metadata; not replaced"
    except DcpTieredError as exc:
        return f"cannot commit {mine.url_of(METADATA_FILE)}: {exc}"
    return None
