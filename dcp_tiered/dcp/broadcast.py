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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import StorageReader

from dcp_tiered.dcp.objects import normalize_safe_globals
from dcp_tiered.dcp.statedict import expand_stateful
from dcp_tiered.errors import ConfigError, DcpTieredError

#: Default bucket size: bounds the extra memory a broadcast needs on every rank.
DEFAULT_BUCKET_BYTES = 64 << 20

ReaderSource = Union[StorageReader, "str", "os.PathLike[str]", Callable[[], StorageReader]]
Path_ = tuple  # a path of mapping keys and list indices from the state dict root


class LeaderLoadError(DcpTieredError, RuntimeError):
    """Raised on the receivers of a group whose leader failed to load (its error is in the message)."""


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


# -- state dict traversal ----------------------------------------------------------------------


def _is_container(value: Any) -> bool:
    """DCP's traversal rule: mappings are traversed; a list is traversed when it holds (at any
    depth) a tensor or a mapping; everything else (tuples too) is a leaf."""
    if isinstance(value, Mapping):
        return True
    if not isinstance(value, list):
        return False
    return any(isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and _is_container(v)) for v in value)


def _leaves(state_dict: Mapping[str, Any]) -> dict[Path_, Any]:
    out: dict[Path_, Any] = {}

    def walk(path: Path_, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(path + (k,), v)
        elif _is_container(value):
            for i, v in enumerate(value):
                walk(path + (i,), v)
        else:
            out[path] = value

    for k, v in state_dict.items():
        walk((k,), v)
    return out


def _set(state_dict: Any, path: Path_, value: Any) -> None:
    parent = state_dict
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value


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
    from dcp_tiered.dcp.writer import default_threads

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, default_threads() * group_size))


def _reader(source: ReaderSource, storage_options: dict | None, threads: int | None = None,
            safe_globals: Any = None) -> StorageReader:
    if isinstance(source, StorageReader):
        return source
    if isinstance(source, (str, os.PathLike)):
        from dcp_tiered.dcp.reader import CompressedReader

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


# -- buckets ---------------------------------------------------------------------------------------


def _plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Buckets of (tensor index, byte start, byte end) segments, each at most ``bucket_bytes``.

    Small tensors are packed together and never split; a tensor of ``bucket_bytes`` or more
    starts a bucket of its own and is sent in whole-bucket slices (straight from and into the
    tensor when it is contiguous on the communication device).
    """
    buckets: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= bucket_bytes:
            if cur:
                buckets.append(cur)
                cur, used = [], 0
            for s in range(0, n, bucket_bytes):
                buckets.append([(i, s, min(n, s + bucket_bytes))])
            continue
        if used + n > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append((i, 0, n))
        used += n
    if cur:
        buckets.append(cur)
    return buckets


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


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

    def load_alone(ranks: list[int]) -> BroadcastStats:
        _describe(_leaves(state_dict))  # same refusal of sharded state as with a group
        t0 = time.perf_counter()
        reader = _reader(storage_reader, storage_options, threads, safe_globals)
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
        finish()
        return BroadcastStats(True, ranks, ranks[0], load_s=time.perf_counter() - t0)

    if not (dist.is_available() and dist.is_initialized()):
        return load_alone([0])

    group = _my_group(process_group)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if not 0 <= src < len(ranks):
        raise ConfigError(f"load_and_broadcast: src={src} is not a rank of a group of {len(ranks)} ranks")
    if len(ranks) == 1:
        return load_alone(list(ranks))
    leader = ranks[src]
    me = dist.get_rank()
    stats = BroadcastStats(me == leader, list(ranks), leader)
    device = _comm_device(group)

    # 1. The leader loads; the header carries its outcome, structure and non-tensor values.
    header: dict[str, Any]
    if stats.leader:
        t0 = time.perf_counter()
        failure: BaseException | None = None
        try:
            _describe(_leaves(state_dict))  # refuse sharded state before reading anything
            reader = _reader(storage_reader, storage_options, threads or _leader_threads(len(ranks)), safe_globals)
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException;
            failure = exc  # every failure is reported to the receivers first (else they would wait), then re-raised
        stats.load_s = time.perf_counter() - t0
        if failure is not None:
            header = {"error": f"{type(failure).__name__}: {failure}", "config": isinstance(failure, ConfigError)}
        else:
            leaves = _leaves(state_dict)
            desc = _describe(leaves)
            header = {
                "error": None,
                "desc": desc,
                "objects": {p: leaves[p] for p, dtype, _ in desc if dtype is None},
            }
        box: list[Any] = [header]
        dist.broadcast_object_list(box, src=leader, group=group, device=device)
        if failure is not None:
            raise failure
    else:
        box = [None]
        dist.broadcast_object_list(box, src=leader, group=group, device=device)
        header = box[0]
        if header["error"] is not None:
            if header["config"]:  # e.g. sharded state: the same mistake on every rank
                raise ConfigError(f"the leader (rank {leader}) of this rank's group refused: {header['error']}")
            raise LeaderLoadError(f"the leader (rank {leader}) of this rank's group failed to load: {header['error']}")

    # 2. Every rank checks its structure against the leader's; all of the group agree first.
    desc = header["desc"]
    mine = _leaves(state_dict)
    problem = None
    if not stats.leader:
        try:
            _describe(mine)
            problem = _mismatch(desc, mine)
        except ConfigError as exc:
            problem = str(exc)
    problems: list[Any] = [None] * len(ranks)
    dist.all_gather_object(problems, problem, group=group)
    bad = {r: p for r, p in zip(ranks, problems) if p is not None}
    if bad:
        detail = "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items()))
        raise ConfigError(f"load_and_broadcast: state dicts differ from the leader's (rank {leader}): {detail}")

    # 3. Non-tensor values: replaced by the leader's.
    if not stats.leader:
        for path, value in header["objects"].items():
            _set(state_dict, path, value)

    # 4. Tensors, in buckets.
    t0 = time.perf_counter()
    tensors = [mine[p] for p, dtype, _ in desc if dtype is not None]
    sizes = [t.numel() * t.element_size() for t in tensors]
    buckets = _plan_buckets(sizes, bucket_bytes)
    staging: dict[int, torch.Tensor] = {}  # receivers: contiguous stand-ins for tensors that are not

    def source_bytes(i: int) -> torch.Tensor:
        t = tensors[i]
        if not (t.is_contiguous() and t.device == device):
            t = staging.get(i) if i in staging else staging.setdefault(i, t.detach().to(device).contiguous())
        return _byte_view(t)

    def dest_bytes(i: int) -> torch.Tensor:
        t = tensors[i]
        if t.is_contiguous() and t.device == device:
            return _byte_view(t)
        if i not in staging:
            staging[i] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return _byte_view(staging[i])

    buf: torch.Tensor | None = None
    with torch.no_grad():
        for bucket in buckets:
            if len(bucket) == 1:
                i, s, e = bucket[0]
                view = (source_bytes(i) if stats.leader else dest_bytes(i))[s:e]
                dist.broadcast(view, src=leader, group=group)
            else:
                n = sum(e - s for _, s, e in bucket)
                if buf is None:
                    buf = torch.empty(min(bucket_bytes, sum(sizes)), dtype=torch.uint8, device=device)
                flat = buf[:n]
                if stats.leader:
                    off = 0
                    for i, s, e in bucket:
                        flat[off:off + e - s].copy_(source_bytes(i)[s:e])
                        off += e - s
                dist.broadcast(flat, src=leader, group=group)
                if not stats.leader:
                    off = 0
                    for i, s, e in bucket:
                        dest_bytes(i)[s:e].copy_(flat[off:off + e - s])
                        off += e - s
            for i, _, e in bucket:
                # a staged tensor is complete once its last byte went out or arrived
                if i in staging and e == sizes[i]:
                    done = staging.pop(i)
                    if not stats.leader:
                        tensors[i].copy_(done)
    stats.tensors = len(tensors)
    stats.bytes_sent = sum(sizes)
    stats.buckets = len(buckets)
    stats.broadcast_s = time.perf_counter() - t0
    finish()  # Stateful objects take their loaded state, on every rank
    return stats
