"""Leader load: one rank per group reads a checkpoint, the others receive it over the group.

When every rank of a data-parallel group restores the same replicated state from shared
or object storage, storage serves N times the bytes and throttles.  With
:func:`load_and_broadcast` one leader per group reads and decompresses (a plain
``dcp.load(..., no_dist=True)``), and sends the tensors to the other ranks of its group
in buckets of bounded size; non-tensor values travel pickled with the header.  Receivers
never touch storage: give a path or a zero-argument reader factory and only the leader
builds a reader.

Scope: replicated (DDP-style) state of plain tensors and Python values.  Sharded state
(``DTensor``, ``ShardedTensor``) is refused with :class:`ConfigError`: load it with
``dcp.load`` and a :class:`CompressedReader`, where every rank reads only its shards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import StorageReader

from dcp_tiered.dcp.agree import failures
from dcp_tiered.dcp.bucket_broadcast import broadcast_tensors
from dcp_tiered.dcp.objects import normalize_safe_globals
from dcp_tiered.dcp.reader import CompressedReader
from dcp_tiered.dcp.statedict import Path_, expand_stateful, leaves_by_path, set_leaf
from dcp_tiered.errors import ConfigError, LeaderLoadError
from dcp_tiered.ranks import cores, default_threads

__all__ = ["DEFAULT_BUCKET_BYTES", "BroadcastStats", "LeaderLoadError", "load_and_broadcast"]

#: Default bucket size: bounds the extra memory a broadcast needs on every rank.
DEFAULT_BUCKET_BYTES = 64 << 20

ReaderSource = Union[StorageReader, "str", "os.PathLike[str]", Callable[[], StorageReader]]


@dataclass
class BroadcastStats:
    """What one rank did in :func:`load_and_broadcast`."""

    leader: bool
    group_ranks: list[int]
    leader_rank: int  # global rank of this rank's leader
    tensors: int = 0
    bytes_sent: int = 0  # tensor bytes broadcast in this group
    buckets: int = 0
    load_s: float = 0.0  # the leader's dcp.load (0 on receivers)
    broadcast_s: float = 0.0


# -- structure: what the leader describes and every receiver checks --------------------------------


def _name(path: Path_) -> str:
    return ".".join(str(p) for p in path)


def _check_plain(path: Path_, t: torch.Tensor) -> None:
    kind = type(t).__name__
    try:
        from torch.distributed.tensor import DTensor

        sharded = isinstance(t, DTensor)
    except ImportError:  # pragma: no cover - every supported torch has DTensor
        sharded = False
    if sharded or kind == "ShardedTensor":
        raise ConfigError(
            f"load_and_broadcast: {_name(path)} is a {kind}; leader load is for replicated (DDP-style) "
            "state of plain tensors. Load sharded state with dcp.load and a CompressedReader instead"
        )


def _describe(leaves: dict[Path_, Any]) -> list[tuple[Path_, str, tuple[int, ...]] | tuple[Path_, None, None]]:
    """(path, dtype name, shape) per tensor leaf, (path, None, None) per other leaf."""
    out: list = []
    for path, v in leaves.items():
        if isinstance(v, torch.Tensor):
            _check_plain(path, v)
            out.append((path, str(v.dtype), tuple(v.shape)))
        else:
            out.append((path, None, None))
    return out


def check_broadcastable(state_dict: dict[str, Any]) -> None:
    """Refuse (:class:`ConfigError`) a state dict that leader load cannot serve: sharded tensors
    (``DTensor``, ``ShardedTensor``); ``Stateful`` values must already be expanded."""
    _describe(leaves_by_path(state_dict))


def _mismatch(theirs: list, mine: dict[Path_, Any]) -> str | None:
    """Why this rank's state dict does not match the leader's structure (None when it does)."""
    problems = []
    seen = set()
    for path, dtype, shape in theirs:
        seen.add(path)
        if path not in mine:
            problems.append(f"{_name(path)}: missing here")
            continue
        v = mine[path]
        if dtype is None:
            continue  # a non-tensor value is replaced by the leader's, whatever it was here
        if not isinstance(v, torch.Tensor):
            problems.append(f"{_name(path)}: the leader has a tensor, this rank a {type(v).__name__}")
        elif str(v.dtype) != dtype or tuple(v.shape) != tuple(shape):
            problems.append(f"{_name(path)}: leader {dtype}{list(shape)}, this rank {v.dtype}{list(v.shape)}")
    extra = [p for p in mine if p not in seen]
    problems += [f"{_name(p)}: not in the leader's state dict" for p in extra]
    if not problems:
        return None
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return "; ".join(problems[:5]) + more


# -- groups ----------------------------------------------------------------------------------------


def _my_group(process_group: Any) -> Any:
    """The group of ``process_group`` (one group, or a list of groups) holding this rank."""
    me = dist.get_rank()
    if not isinstance(process_group, (list, tuple)):
        if process_group is None:
            return None  # the default group
        if not isinstance(process_group, dist.ProcessGroup) or me not in dist.get_process_group_ranks(process_group):
            raise ConfigError(f"load_and_broadcast: rank {me} is not in the process group given")
        return process_group
    mine = []
    for g in process_group:
        if g is None:
            g = dist.group.WORLD
        if not isinstance(g, dist.ProcessGroup):
            continue  # GroupMember.NON_GROUP_MEMBER: new_group() on a rank outside the group
        if me in dist.get_process_group_ranks(g):
            mine.append(g)
    if len(mine) != 1:
        raise ConfigError(
            f"load_and_broadcast: rank {me} is in {len(mine)} of the {len(process_group)} process groups given; "
            "every rank that calls it must be in exactly one"
        )
    return mine[0]


def _comm_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _leader_threads(group_size: int) -> int:
    """Decompression threads for a leader: its own share of the node's cores plus the shares of
    the receivers of its group (they wait while it reads), at most every core."""
    return max(1, min(cores(), default_threads() * group_size))


def _reader(source: ReaderSource, storage_options: dict | None, threads: int | None = None,
            safe_globals: Any = None) -> StorageReader:
    if isinstance(source, StorageReader):
        return source
    if isinstance(source, (str, os.PathLike)):
        return CompressedReader(source, storage_options=storage_options, threads=threads, safe_globals=safe_globals)
    if callable(source):
        reader = source()
        if not isinstance(reader, StorageReader):
            raise ConfigError(f"load_and_broadcast: the reader factory returned {type(reader).__name__}, not a StorageReader")
        return reader
    raise ConfigError(
        f"load_and_broadcast: storage_reader must be a StorageReader, a path or a zero-argument factory, "
        f"got {type(source).__name__}"
    )


def load_and_broadcast(
    state_dict: dict[str, Any],
    storage_reader: ReaderSource,
    *,
    process_group: Any = None,
    src: int = 0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    planner: Any = None,
    storage_options: dict[str, Any] | None = None,
    threads: int | None = None,
    safe_globals: Any = None,
) -> BroadcastStats:
    """Load ``state_dict`` in place on one leader per group and broadcast it to the group.

    Args:
        state_dict: the destination, as for ``dcp.load``: plain tensors (any device, views
            included) are written in place, other values are replaced.  Top-level ``Stateful``
            values (modules, optimizers, an ``AppState``) are expanded to their
            ``state_dict()`` and get ``load_state_dict`` called with the loaded state on every
            rank, as ``dcp.load`` does.  Every rank of a group must pass the same structure
            (keys, tensor dtypes and shapes); a mismatch raises :class:`ConfigError` on every
            rank of the group.
        storage_reader: a ``StorageReader``; a path or URL (a :class:`CompressedReader` is
            built, with ``storage_options``); or a zero-argument factory returning a reader.
            With a path or a factory only the leader touches storage.
        process_group: the group (default: the default group), or a list of disjoint groups
            (e.g. one per node or per model-parallel replica): each rank uses the group that
            holds it, and the groups load and broadcast concurrently.
        src: rank within each group (group rank) of its leader.
        bucket_bytes: largest broadcast; bounds the extra memory used on every rank.
        planner: a ``LoadPlanner`` for the leader's ``dcp.load``.
        storage_options: fsspec options when ``storage_reader`` is a path.
        threads: decompression threads of the reader built from a path (default: the
            leader's share of the node's cores plus its receivers' shares, as they wait).
        safe_globals: the opt-in of the reader built from a path for non-tensor values that
            need more than ``weights_only`` (see :class:`CompressedReader`).  Receivers get the
            leader's loaded values, unpickled from the group (trusted: it is this job's leader).

    Without an initialized default process group this is ``dcp.load(..., no_dist=True)``.
    If the leader's load fails, the leader raises its error and the receivers raise
    :class:`LeaderLoadError`, so a caller can try another checkpoint on every rank alike.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ConfigError(f"load_and_broadcast: bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    normalize_safe_globals(safe_globals, "load_and_broadcast")
    # Every rank expands its own Stateful objects; finish() calls their load_state_dict at the end.
    state_dict, finish = expand_stateful(state_dict, nested=False)  # as dcp.load does

    def load(reader_threads: int | None) -> None:
        reader = _reader(storage_reader, storage_options, reader_threads, safe_globals)
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)

    if not (dist.is_available() and dist.is_initialized()):
        return _load_alone(state_dict, load, threads, finish, [0])
    group = _my_group(process_group)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if not 0 <= src < len(ranks):
        raise ConfigError(f"load_and_broadcast: src={src} is not a rank of a group of {len(ranks)} ranks")
    if len(ranks) == 1:
        return _load_alone(state_dict, load, threads, finish, list(ranks))
    g = _Group(group, list(ranks), ranks[src], _comm_device(group))
    stats = BroadcastStats(dist.get_rank() == g.leader, list(ranks), g.leader)
    if stats.leader:
        header = _leader_load(state_dict, lambda: load(threads or _leader_threads(len(g.ranks))), g, stats)
    else:
        header = _receive_header(g)
    mine = leaves_by_path(state_dict)
    _agree_on_structure(header["desc"], mine, stats.leader, g)
    _deliver(state_dict, header, mine, bucket_bytes, stats, g)
    finish()  # Stateful objects take their loaded state, on every rank
    return stats


@dataclass(frozen=True)
class _Group:
    """This rank's broadcast group: the process group (None: the default one), its global
    ranks, the global rank of its leader, and the device collectives run on."""

    group: Any
    ranks: list[int]
    leader: int
    device: torch.device


def _load_alone(state_dict: dict[str, Any], load: Callable[[int | None], None], threads: int | None,
                finish: Callable[[], None], ranks: list[int]) -> BroadcastStats:
    """No one to broadcast to: a plain load (sharded state refused as with a group)."""
    _describe(leaves_by_path(state_dict))
    t0 = time.perf_counter()
    load(threads)
    finish()
    return BroadcastStats(True, ranks, ranks[0], load_s=time.perf_counter() - t0)


def _leader_load(state_dict: dict[str, Any], load: Callable[[], None], g: _Group, stats: BroadcastStats) -> dict:
    """The leader loads, then broadcasts the header: its outcome, structure and non-tensor values.

    Every failure is reported to the receivers first (else they would wait), then re-raised.
    """
    t0 = time.perf_counter()
    failure: BaseException | None = None
    try:
        _describe(leaves_by_path(state_dict))  # refuse sharded state before reading anything
        load()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failure = exc
    stats.load_s = time.perf_counter() - t0
    if failure is not None:
        header = {"error": f"{type(failure).__name__}: {failure}", "config": isinstance(failure, ConfigError)}
    else:
        leaves = leaves_by_path(state_dict)
        desc = _describe(leaves)
        header = {
            "error": None,
            "desc": desc,
            "objects": {p: leaves[p] for p, dtype, _ in desc if dtype is None},
        }
    box: list[Any] = [header]
    dist.broadcast_object_list(box, src=g.leader, group=g.group, device=g.device)
    if failure is not None:
        raise failure
    return header


def _receive_header(g: _Group) -> dict:
    """A receiver gets the leader's header; raises when the leader failed."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=g.leader, group=g.group, device=g.device)
    header = box[0]
    if header["error"] is not None:
        if header["config"]:  # e.g. sharded state: the same mistake on every rank
            raise ConfigError(f"the leader (rank {g.leader}) of this rank's group refused: {header['error']}")
        raise LeaderLoadError(f"the leader (rank {g.leader}) of this rank's group failed to load: {header['error']}")
    return header


def _agree_on_structure(desc: list, mine: dict[Path_, Any], leader: bool, g: _Group) -> None:
    """Every rank checks its structure against the leader's; all of the group agree before any
    tensor moves, and all raise :class:`ConfigError` naming every rank that differs."""
    problem = None
    if not leader:
        try:
            _describe(mine)
            problem = _mismatch(desc, mine)
        except ConfigError as exc:
            problem = str(exc)
    count, bad = failures(problem, g.group)
    if count:
        detail = "; ".join(f"rank {g.ranks[r]}: {p}" for r, p in bad) + (f"; and {count - len(bad)} more" if count > len(bad) else "")
        raise ConfigError(f"load_and_broadcast: state dicts differ from the leader's (rank {g.leader}): {detail}")


def _deliver(state_dict: dict[str, Any], header: dict, mine: dict[Path_, Any], bucket_bytes: int,
             stats: BroadcastStats, g: _Group) -> None:
    """Receivers take the leader's non-tensor values; the tensors go from the leader in buckets."""
    if not stats.leader:
        for path, value in header["objects"].items():
            set_leaf(state_dict, path, value)
    t0 = time.perf_counter()
    tensors = [mine[p] for p, dtype, _ in header["desc"] if dtype is not None]
    sizes = [t.numel() * t.element_size() for t in tensors]
    stats.buckets = broadcast_tensors(tensors, sizes, bucket_bytes, leader=stats.leader, src=g.leader,
                                      group=g.group, device=g.device)
    stats.tensors = len(tensors)
    stats.bytes_sent = sum(sizes)
    stats.broadcast_s = time.perf_counter() - t0
