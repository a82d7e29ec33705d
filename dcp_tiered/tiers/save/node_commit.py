"""Per-node commits of node-local tiers.

DCP runs ``finish`` (which writes ``.metadata``) on the coordinator only, so with ``{node}``
or ``{rank}`` in a tier's URL only the coordinator's directory used to be committed, and a
multi-node job never restored from its node-local tier.  After a save, every rank holds the
committed ``Metadata`` (DCP broadcasts ``finish``'s result, also to an async save's future).
The leader of each other directory (its lowest rank) checks that the data files of the
directory's ranks are all there at their recorded sizes, then commits the same ``.metadata``
there, with the writer's integrity trailer and commit primitive.  A directory whose files are
not all in is never committed: restore then skips that step on the node-local tier.

A node's directory holds its own ranks' files, and with peer replication other ranks' files
as replicas, which count only under a committed replica marker of the same save
(:func:`vouched_files`); items DCP deduplicated into another node's file (replicated,
DDP-style state) may not be there.  Restore finds that out before reading any data (:class:`~dcp_tiered.dcp.reader.CompressedReader` checks every file of its
plan first) and every rank falls back to the next candidate together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcp_tiered.dcp.format import expected_sizes, record_view
from dcp_tiered.dcp.metadata_io import encode_metadata, load_metadata
from dcp_tiered.dcp.writer import commit_metadata
from dcp_tiered.errors import DcpTieredError
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.names import rank_of_file
from dcp_tiered.tiers.layout import step_name
from dcp_tiered.tiers.replicas.markers import vouched_files
from dcp_tiered.tiers.topology import COORDINATOR, dir_ranks, step_dir
from dcp_tiered.tiers.config import Tier

log = logging.getLogger(__name__)

@dataclass
class NodeCommit:
    """What the leader of one node-local directory did after a save."""

    tier: str
    step: int | None
    url: str
    ranks: list[int]
    ok: bool
    error: str | None = None

    def as_event(self) -> dict[str, Any]:
        return {"event": "node_commit", **asdict(self)}


def _problems(child: Storage, expected: dict[str, int]) -> list[str]:
    out = []
    for name, size in sorted(expected.items()):
        try:
            actual = child.size(name)
        except MissingFileError:
            out.append(f"{name} is missing")
            continue
        if actual != size:
            out.append(f"{name} has {actual} bytes, expected {size}")
    return out


def commit_node(tier: Tier, name: str, metadata: Metadata, *, rank: int, world: int, overwrite: bool = True,
                step: int | None = None) -> NodeCommit | None:
    """Commit ``metadata`` (the save's committed ``Metadata``) in the directory ``name`` of node-local
    ``tier`` that ``rank`` sees, once every data file of the directory's ranks has its recorded size.

    Runs on the directory's leader (its lowest rank) only, and not for the coordinator's directory
    (committed by the save itself); returns None elsewhere.  Never raises: a directory whose files
    are missing or short, or that cannot be written, stays uncommitted (``ok=False`` says why).
    """
    ranks = dir_ranks(tier, rank, world)
    if not tier.node_local or ranks[0] != rank or COORDINATOR in ranks:
        return None
    child = step_dir(tier, rank, name)
    result = NodeCommit(tier.name, step, child.url, ranks, ok=False)
    try:
        problems = _problems(child, expected_sizes(metadata.storage_data.values(), lambda f: rank_of_file(f) in ranks))
        if problems:
            result.error = (f"not committing {child.url} for rank(s) {ranks}: {'; '.join(problems[:4])}"
                            f"{' ...' if len(problems) > 4 else ''}; restore uses another tier or step")
        else:
            meta = metadata.storage_meta
            if meta is not None:
                meta.checkpoint_id = child.url
            commit_metadata(child, encode_metadata(metadata), overwrite, ())
            result.ok = True
    except DcpTieredError as exc:
        result.error = f"committing {child.url} failed: {exc}"
    if result.error:
        log.warning("node-local tier %s: %s", tier.name, result.error)
    return result


def commit_after_save(tier: Tier, step: int, metadata: Any, *, rank: int, world: int, promoter: Any,
                      events: Any) -> NodeCommit | None:
    """After a save to node-local ``tier`` returned ``metadata`` on this rank: :func:`commit_node`,
    report it as a ``node_commit`` event, and queue this directory's retention once committed (a
    directory left uncommitted keeps its older steps: its last restorable one is never deleted)."""
    if not isinstance(metadata, Metadata):
        log.warning("node-local tier %s: the save of step %d returned %r, not Metadata; not committing this node",
                    tier.name, step, type(metadata).__name__)
        return None
    done = commit_node(tier, step_name(step), metadata, rank=rank, world=world, step=step)
    if done is None:
        return None
    events.emit(done.as_event())
    if done.ok:
        promoter.retention(tier, protect=[step])
    return done


def files_to_read(state_dict: dict[str, Any], metadata: Metadata) -> set[str]:
    """The data files ``dcp.load`` of ``state_dict`` (``Stateful`` objects expanded) reads on this
    rank from a checkpoint described by ``metadata``: DCP's default load plan, made locally."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata, is_coordinator=False)
    return {record_view(metadata.storage_data[item.storage_index]).file for item in planner.create_local_plan().items}


def lacking_files(child: Storage, files: dict[str, int], state_dict: dict[str, Any],
                  own: Callable[[str], bool] | None = None) -> list[str]:
    """The data files this rank would read from the committed node-local directory ``child``
    (``files``: what it holds, with sizes) that are not there at full size: files of another
    node's ranks, e.g. replicated items that DCP stored once.  With ``own`` (which files the
    directory's own ranks wrote), a file of another rank counts only as a committed replica of
    this save (:func:`vouched_files`) at its recorded size.  Empty when the directory holds
    every file, or when the plan cannot be made here (the load then reports the problem)."""
    metadata = load_metadata(child)
    if own is not None:
        vouched = vouched_files(child, getattr(metadata.storage_meta, "save_id", None))
        files = {f: size for f, size in files.items() if own(f) or vouched.get(f) == size}
    absent = {f for f, size in expected_sizes(metadata.storage_data.values()).items() if files.get(f, -1) < size}
    if not absent:
        return []
    try:
        needed = files_to_read(state_dict, metadata)
    except Exception as exc:  # noqa: BLE001 - DCP's planner raises builtins for mismatched state; the load tells
        log.debug("cannot plan the load of %s here: %s", child.url, exc)
        return []
    return sorted(needed & absent)
