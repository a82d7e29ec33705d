"""Restore through peers: a rank whose node-local files of a step are gone (a replaced node) gets
them back from a clique peer holding a committed replica (:mod:`dcp_tiered.tiers.replication`).

Every rank reports the replica markers its node holds (:func:`holdings`); with every rank's
report the ranks make the same plan (:func:`plan_fetch`): for each rank lacking the step, the
lowest rank of its clique that holds its files under a marker of the same save and sees the step
committed.  :func:`fetch` then streams the files on the clique's group (the receiver's, then the
holder's own, which the receiver keeps as a replica again); the receiver checks each digest, writes
them into its node's directory, commits the holder's replica marker and the holder's
``.metadata`` there if missing.  The load that follows verifies every frame's checksum as it reads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from dcp_tiered.dcp.metadata_io import load_metadata
from dcp_tiered.errors import DcpTieredError
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.catalog import tier_storage
from dcp_tiered.tiers.layout import parse_step, step_name
from dcp_tiered.tiers.replication import marker_name, owner_files, read_markers, stream_file
from dcp_tiered.tiers.spec import Tier

log = logging.getLogger(__name__)

METADATA = ".metadata"
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
        except DcpTieredError as exc:
            log.warning("restore: cannot list the replicas of tier %s: %s", tier.name, exc)
    return out


def plan_fetch(cand: tuple[int, int], lacking: Sequence[int], ok_ranks: Sequence[int], save_id: "str | None",
               held: Sequence[Sequence[Held]], cliques: Sequence[Sequence[int]]) -> Plan | None:
    """For each rank in ``lacking``, a holder of its files of candidate ``cand``: a rank of its clique in
    ``ok_ranks`` (sees the candidate committed and whole) whose node holds a marker of that rank with
    ``save_id``.  None when some lacking rank has no holder (the candidate stays unusable)."""
    s, i = cand
    plan: Plan = {}
    for r in lacking:
        clique = next((c for c in cliques if r in c), [])
        holder = next((h for h in clique if h != r and h in ok_ranks
                       and any(e[:3] == (i, s, r) and e[3] == save_id for e in held[h])), None)
        if holder is None or save_id is None:
            return None
        plan[r] = holder
    return plan


def _offer(mine: Storage, holder: int, receiver: int) -> Any:
    """The holder's header for ``receiver``: the receiver's files (from their replica marker) and the
    holder's own (to be kept there as a replica again), with sizes and digests, the ``.metadata`` to
    commit and the save id; or why the holder cannot send them."""
    try:
        marker = read_markers(mine)[receiver]
        entries = [(f["file"], int(f["size"]), f["xxh3"]) for f in marker["files"]]
        return entries, mine.read_bytes(METADATA), owner_files(mine, load_metadata(mine), holder), marker["save_id"]
    except (DcpTieredError, KeyError, TypeError, ValueError) as exc:
        return f"rank {holder} cannot read its replica of rank {receiver}: {exc}"


def fetch(tier: Tier, step: int, plan: Plan, *, rank: int, node: int,
          clique_groups: Sequence[tuple[list[int], Any]]) -> tuple[str | None, int]:
    """Carry out ``plan`` (the same on every rank; every rank calls it): each holder streams the files of
    its receiver on their clique's group, then its own files, which the receiver keeps as a committed
    replica again (its node held them before it was lost, and its ranks' loads may need them: items
    DCP stored once, in the holder's file).  Returns why this rank failed, or None (it still took
    part in every collective of its clique), and the bytes this rank received."""
    name = step_name(step)
    mine = tier_storage(tier, rank, node).child(name)
    error: str | None = None
    received = 0
    for receiver, holder in sorted(plan.items()):
        clique, group = next(((c, g) for c, g in clique_groups if receiver in c), ([], None))
        if rank not in clique:
            continue
        header: list[Any] = [_offer(mine, holder, receiver) if rank == holder else None]
        dist.broadcast_object_list(header, src=holder, group=group)
        if isinstance(header[0], str):
            error = error or header[0] if rank == receiver else error
            continue
        entries, metadata, own, save_id = header[0]
        write = mine if rank == receiver else None
        problems = [p for e in entries + own if (p := stream_file(group, holder, rank, e, mine, write)) is not None]
        if rank != receiver:
            continue
        if problems:
            error = error or "; ".join(problems[:3])
            continue
        received += sum(e[1] for e in entries + own)
        try:
            marker = {"owner": holder, "save_id": save_id, "step": step,
                      "files": [{"file": n, "size": s, "xxh3": d} for n, s, d in own]}
            mine.commit_bytes(marker_name(holder), json.dumps(marker).encode())
            mine.commit_bytes(METADATA, metadata, exclusive=True)  # the node's commit, if not there yet
        except DcpTieredError as exc:
            error = error or f"cannot commit {mine.url}: {exc}"
        log.info("restore: rank %d fetched %d file(s) of step %d from rank %d", rank, len(entries) + len(own), step,
                 holder)
    return error, received
