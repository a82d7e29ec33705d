"""Per-node commits of node-local tiers.

DCP runs ``finish`` (which writes ``.metadata``) on the coordinator only, so with ``{node}``
or ``{rank}`` in a tier's URL only the coordinator's directory used to be committed, and a
multi-node job never restored from its node-local tier.  After a save, every rank holds the
committed ``Metadata`` (DCP broadcasts ``finish``'s result, also to an async save's future).
The leader of each other directory (its lowest rank) checks that the data files of the
directory's ranks are all there at their recorded sizes, then commits that ``Metadata`` there
(its :func:`node_view`), with the writer's integrity trailer and commit primitive.  A directory
whose files are not all in is never committed: restore then skips that step on the node-local tier.

Node copies.  DCP stores an item that several ranks hold (replicated: DDP-style parameters, a torch
optimizer's ``step`` tensors and param groups beside FSDP shards) once, in one rank's file.  On a
node-local tier (with or without ``replicas``), :func:`place_replicated` (run by ``TieredWriter`` on the
coordinator, from what every rank's local plan held) keeps every replicated item that a rank of
the coordinator's directory holds in that directory (so its ``.metadata``, which promotions copy,
stays the plain checkpoint), and names for each other directory a rank of it holding the item to
write a copy into its node-copies file (:func:`~dcp_tiered.names.node_copies_prefix`).  Each rank of
such a directory lists the copies it wrote, with their records, in its directory
(:func:`~dcp_tiered.names.node_copies_list`, empty where it wrote none; :func:`copies_list`); the
directory's leader reads its ranks' lists (:func:`read_copies`) and commits its :func:`node_view`, which
names those copies, so every rank loads from its own node.  The copies' records never travel through
the coordinator: the ``Metadata`` DCP broadcasts to every rank would otherwise carry every node's
copies (nodes x replicated items, to every rank: bytes growing as N^2).  A directory never holds more
than one copy of an item; the coordinator's and the shared tiers' checkpoints hold none.

A node's directory holds its own ranks' files, and with peer replication other ranks' files
as replicas, which count only under a committed replica marker of the same save
(:func:`vouched_files`); in a directory committed without node copies (by an older version),
items DCP stored in another node's file may not be there.  Restore finds that out
before reading any data (:class:`~dcp_tiered.dcp.reader.CompressedReader` checks every file of its
plan first) and every rank falls back to the next candidate together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from dcp_tiered.dcp.format import MAX_DIMS, check_record, expected_sizes, record_view
from dcp_tiered.dcp.metadata_io import encode_metadata, load_metadata
from dcp_tiered.dcp.record_table import PackedRecords, replace_records
from dcp_tiered.dcp.writer import commit_metadata
from dcp_tiered.errors import CorruptCheckpointError
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.names import node_copies_list, rank_of_file
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
    copied_bytes: int = 0  # the stored bytes of this directory's node copies

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
    """Commit ``metadata`` (the save's committed ``Metadata``, as :func:`node_view` shows it to this
    directory) in the directory ``name`` of node-local ``tier`` that ``rank`` sees, once every data file
    of the directory's ranks (node copies included) has its recorded size.

    Runs on the directory's leader (its lowest rank) only, and not for the coordinator's directory
    (committed by the save itself); returns None elsewhere.  Never raises: a directory whose files
    are missing or short, or that cannot be written, stays uncommitted (``ok=False`` says why).
    """
    ranks = dir_ranks(tier, rank, world)
    if not tier.node_local or ranks[0] != rank or COORDINATOR in ranks:
        return None
    child = step_dir(tier, rank, name)
    result = NodeCommit(tier.name, step, child.url, ranks, ok=False, copied_bytes=0)
    try:
        save_id = getattr(metadata.storage_meta, "save_id", None)
        copies = [c for r in ranks for c in read_copies(child, r, save_id, metadata.state_dict_metadata)]
        view, result.copied_bytes = node_view(metadata, ranks, copies)
        problems = _problems(child, expected_sizes(view.storage_data.values(), lambda f: rank_of_file(f) in ranks))
        if not problems and type(view.storage_data) is PackedRecords:
            problems = [p for p in (view.storage_data.inconsistent(child.url),) if p]  # a node copy readers refuse
        if problems:
            result.error = (f"not committing {child.url} for rank(s) {ranks}: {'; '.join(problems[:4])}"
                            f"{' ...' if len(problems) > 4 else ''}; restore uses another tier or step")
        else:
            if view.storage_meta is not None:
                view.storage_meta = dataclasses.replace(view.storage_meta, checkpoint_id=child.url)
            commit_metadata(child, encode_metadata(view), overwrite, ())
            result.ok = True
    except Exception as exc:  # noqa: BLE001 - never raises: one node's commit must not fail its rank's save
        result.error = f"committing {child.url} failed: {type(exc).__name__}: {exc}"
    if result.error:
        log.warning("node-local tier %s: %s", tier.name, result.error)
    return result


# -- node copies -------------------------------------------------------------------------------------



@dataclass(frozen=True)
class HeldItems:
    """The ``storage_data`` of a rank's local ``SavePlan`` (before DCP drops duplicates): the items it holds."""

    indexes: tuple[MetadataIndex, ...]


def _size(item: WriteItem) -> int:
    return item.tensor_storage_size() or 1  # as DCP's dedup counts: a non-tensor item as 1


def _lightest(candidates: list[int], load: list[int], size: int) -> int:
    """The least loaded of ``candidates`` (the lowest rank of equals), loaded with ``size`` more."""
    w = min(candidates, key=lambda r: (load[r], r))
    load[w] += size
    return w


def place_replicated(plans: Sequence[SavePlan], held: Sequence[Sequence[MetadataIndex]],
                     leaders: Sequence[int]) -> tuple[list[SavePlan], list[list[WriteItem]]]:
    """Place the replicated items of a save to a node-local tier so that every directory holds what its
    ranks hold: ``plans`` (the global plan, after DCP kept each item on one rank), ``held`` (the items each
    rank's local plan held) and ``leaders`` (:func:`~dcp_tiered.tiers.topology.dir_leaders`).

    An item that a rank of the coordinator's directory holds is moved there if DCP kept it elsewhere; for
    each other directory where ranks hold an item kept outside it, one of them writes a node copy.  Each
    goes to the least loaded holder (DCP's own balance).  Returns the new plans and each rank's copies."""
    owner: dict[MetadataIndex, int] = {}
    items: dict[MetadataIndex, WriteItem] = {}
    load = [0] * len(plans)
    for r, plan in enumerate(plans):
        for it in plan.items:
            owner[it.index], items[it.index] = r, it
            load[r] += _size(it)
    holders: dict[MetadataIndex, list[int]] = {}
    for r, indexes in enumerate(held):
        for index in indexes:
            holders.setdefault(index, []).append(r)
    moved: list[set[MetadataIndex]] = [set() for _ in plans]
    added: list[list[WriteItem]] = [[] for _ in plans]
    copies: list[list[WriteItem]] = [[] for _ in plans]
    for index, ranks in holders.items():
        o = owner.get(index)
        if len(ranks) < 2 or o is None:
            continue
        item, size = items[index], _size(items[index])
        by_dir: dict[int, list[int]] = {}
        for r in ranks:
            by_dir.setdefault(leaders[r], []).append(r)
        if leaders[o] != COORDINATOR and COORDINATOR in by_dir:
            w = _lightest(by_dir[COORDINATOR], load, size)
            load[o] -= size
            moved[o].add(index)
            added[w].append(item)
            o = w
        for leader, candidates in by_dir.items():
            if leader != leaders[o]:
                copies[_lightest(candidates, load, size)].append(item)
    new = [dataclasses.replace(p, items=[it for it in p.items if it.index not in moved[r]] + added[r])
           if moved[r] or added[r] else p for r, p in enumerate(plans)]
    return new, copies


def copies_node_local(tier: Any) -> bool:
    """Whether a save to ``tier`` writes node copies: every node-local tier.  With ``replicas`` too, since
    replication runs in the background: a save that returned must restore from each node's own files
    even when it is killed before its replicas are written."""
    return tier.node_local


def with_copies(plans: Sequence[SavePlan], copies: Sequence[Sequence[WriteItem]]) -> list[SavePlan]:
    """Each rank's plan with the node copies it writes (:func:`place_replicated`): what the save stores,
    for the memory budget."""
    return [dataclasses.replace(p, items=[*p.items, *c]) if c else p for p, c in zip(plans, copies)]


#: Largest node-copies list read: a rank lists at most the replicated items it holds, a few hundred bytes each.
MAX_COPIES_LIST_BYTES = 64 << 20


def copies_list(save_id: "str | None", copies: Sequence[tuple[MetadataIndex, dict]]) -> bytes:
    """The node-copies list a rank writes (:func:`~dcp_tiered.names.node_copies_list`): the save's id and
    each copy's index and record, as JSON."""
    entries = [{"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset), "index": i.index, "record": rec}
               for i, rec in copies]
    return json.dumps({"save_id": save_id, "copies": entries}).encode()


def read_copies(storage: Storage, rank: int, save_id: "str | None", sdm: dict) -> list[tuple[MetadataIndex, dict]]:
    """The node copies that ``rank`` listed in ``storage`` (its directory) for the save ``save_id``, each
    of an item of the save (``sdm``: its tensor table; a tensor's at one of its chunks), its record checked
    as readers check one, in ``rank``'s own file.  A list that is missing, of another save or malformed
    raises :class:`CorruptCheckpointError` naming it (the directory is then not committed)."""
    name = node_copies_list(rank)
    where = storage.url_of(name)
    try:
        doc = json.loads(storage.read_bytes(name, max_bytes=MAX_COPIES_LIST_BYTES))
    except MissingFileError:
        raise CorruptCheckpointError(f"{where} is missing: rank {rank} did not list its node copies of this save") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where} is not a node-copies list ({exc})") from None
    if type(doc) is not dict or type(doc.get("copies")) is not list or doc.get("save_id") != save_id:
        raise CorruptCheckpointError(f"{where} is not the node-copies list of save {save_id!r}")
    out = []
    offsets: dict[str, set] = {}  # by item, made once: linear in the list, however many entries name one item
    for entry in doc["copies"]:
        fqn, offset, hint, rec = (entry.get(k) for k in ("fqn", "offset", "index", "record")) if type(entry) is dict else [None] * 4
        if not (type(fqn) is str and type(rec) is dict and (hint is None or type(hint) is int) and (offset is None or (
                type(offset) is list and len(offset) <= MAX_DIMS and all(type(o) is int and o >= 0 for o in offset)))):
            raise CorruptCheckpointError(f"{where} holds an entry that is not a node copy's index and record")
        entry = sdm.get(fqn)
        chunks = getattr(entry, "chunks", None)
        if chunks is not None and fqn not in offsets:
            offsets[fqn] = {tuple(c.offsets) for c in chunks}
        if entry is None or (offset is None) != (chunks is None) or (chunks is not None and tuple(offset) not in offsets[fqn]):
            raise CorruptCheckpointError(f"{where} lists a copy of {fqn[:80]!r} at {offset}, which is no item or chunk "
                                         "of this save")
        rec = {k: tuple(v) if type(v) is list else v for k, v in rec.items()}  # JSON lists: the record's tuples
        check_record(rec, fqn, where)
        if rank_of_file(rec["file"]) != rank:
            raise CorruptCheckpointError(f"{where} lists a copy of {fqn!r} in {rec['file'][:80]!r}, not a file of rank {rank}")
        out.append((MetadataIndex(fqn, None if offset is None else torch.Size(offset), hint), rec))
    return out


def node_view(metadata: Metadata, ranks: Collection[int], copies: Sequence[tuple[MetadataIndex, dict]]
              ) -> tuple[Metadata, int]:
    """The ``Metadata`` the directory of ``ranks`` commits: the save's, each item that one of ``ranks``
    wrote a node copy of (``copies``: what they listed, :func:`read_copies`) pointing to that copy; and
    the stored bytes of those copies.  The records as ``dcp.save`` returned them (packed) stay packed:
    the copies' rows are swapped over the table's columns, so a node leader neither unpacks nor packs
    every record of the save."""
    storage, sdm = metadata.storage_data, metadata.state_dict_metadata
    packed = type(storage) is PackedRecords
    mine = {index: record for index, record in copies
            if rank_of_file(record_view(record).file) in ranks and (packed or index in storage)}
    copied = sum(record_view(record).length for record in mine.values())
    if packed:
        view: Any = PackedRecords(sdm, replace_records(sdm, storage.packed, mine), None, storage.stats)
    else:
        view = {**storage, **mine}
    return dataclasses.replace(metadata, storage_data=view), copied


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
        promoter.mark_saved(tier.name, step)
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
