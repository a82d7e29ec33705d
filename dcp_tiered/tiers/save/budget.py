"""Memory tiers: a ``Tier`` on ``/dev/shm`` or another tmpfs, and the budget check before a save.

A memory tier survives a crashed training process (the files stay in the node's RAM), not a
lost node.  Its ``memory_budget`` caps what the tier may hold on one node: a save that would
not fit fails before any byte is written, instead of filling the RAM the training needs.

Retention deletes the previous checkpoint only after the new one commits, so while a save is
written the tier holds its ``keep`` checkpoints plus the new one: a budget for ``keep=1`` must
hold two checkpoints.  The budget counts everything the tier holds and will go on holding
(:func:`held_bytes`): the checkpoints retention keeps, those pending promotions still read (a
slower tier lagging behind), and leftovers of crashed saves for ``leftover_grace``.  The new save is
counted at an upper bound of its stored size (:func:`local_item_bytes`: raw bytes at the tier's dtype,
frame headers, non-tensor values by their size; the codec is not counted).
"""

from __future__ import annotations

import fnmatch
import io
import logging
import os
import pickle
import re
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from dcp_tiered.dcp.planners import DEFAULT_EXCLUDE
from dcp_tiered.errors import MemoryBudgetError, SaveError
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.catalog import list_tier
from dcp_tiered.tiers.config import existing_parent
from dcp_tiered.tiers.policy import retention_victims
from dcp_tiered.tiers.retention import checkpoint_facts, newest_replicated
from dcp_tiered.tiers.save.node_commit import copies_node_local, place_replicated, with_copies
from dcp_tiered.tiers.topology import check_replication, dir_leaders, node_of

log = logging.getLogger(__name__)

#: Estimated stored size of one non-tensor item (its size is unknown before it is serialized).
OBJECT_ESTIMATE = 4096
#: Bytes per item of ``.metadata`` and frame headers, beyond the raw bytes (an upper bound).
ITEM_OVERHEAD = 512
#: Largest frame header (one plane per byte of an 8-byte element: 1 + 8 * 5 bytes).
FRAME_HEADER_MAX = 41
_DEFAULT_FRAME = 4 << 20


class _Counter:
    """A write-only file that only counts what is written to it (a pickle's size without its bytes)."""

    n = 0

    def write(self, b: Any) -> int:
        self.n += len(b) if not isinstance(b, memoryview) else b.nbytes
        return self.n


def object_bytes(value: Any) -> int:
    """Stored size of one non-tensor value: ``bytes``/``bytearray``/``memoryview``/``io.BytesIO`` by their
    length, anything else by its pickled size (a save stores ``torch.save(value)``, a pickle plus a small
    header that :data:`ITEM_OVERHEAD` covers).  The pickle is written to a counter, not kept: its cost is
    one pickling pass, which the save repeats anyway; a value that cannot be pickled counts
    :data:`OBJECT_ESTIMATE` (the save itself then fails on it)."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, io.BytesIO):
        return value.getbuffer().nbytes
    counter = _Counter()
    try:
        pickle.Pickler(counter, protocol=pickle.DEFAULT_PROTOCOL).dump(value)
    except Exception:  # noqa: BLE001 - the save reports it, naming the key
        return OBJECT_ESTIMATE
    return counter.n


def downcast_itemsize(fqn: str, dtype: Any, tier_dtype: str | None) -> int:
    """Bytes per element a tensor ``fqn`` of ``dtype`` is stored with on a tier of ``tier_dtype``: the
    :class:`~dcp_tiered.dcp.planners.DowncastSavePlanner` rule (floating tensors wider than 2 bytes, not
    matching its default exclusions) for bf16; fp16 keeps a tensor whose values do not fit, so fp16 is
    counted at the full size (an upper bound, used where the tensors cannot be looked at)."""
    size = dtype.itemsize
    if tier_dtype != "bf16" or not dtype.is_floating_point or size <= 2:
        return size
    return size if any(fnmatch.fnmatchcase(fqn, p) for p in DEFAULT_EXCLUDE) else 2


def item_bytes(item: Any, frame_size: int, *, itemsize: int | None = None, obj_bytes: int | None = None) -> int:
    """Upper bound of the bytes one DCP ``WriteItem`` stores: raw bytes plus frame headers and metadata
    (``itemsize``: the stored element size; ``obj_bytes``: a non-tensor value's size, see :func:`object_bytes`)."""
    td = getattr(item, "tensor_data", None)
    if td is None:
        return (OBJECT_ESTIMATE if obj_bytes is None else obj_bytes) + ITEM_OVERHEAD
    numel = 1
    for d in td.chunk.sizes:
        numel *= int(d)
    raw = numel * (td.properties.dtype.itemsize if itemsize is None else itemsize)
    return raw + (-(-raw // frame_size)) * FRAME_HEADER_MAX + ITEM_OVERHEAD


def local_item_bytes(plan: Any, planner: Any, frame_size: int | None, tier_dtype: str | None) -> dict[Any, int]:
    """Each item of this rank's local ``plan`` (made by ``planner``, which still holds the state) and its
    stored size: tensors at the dtype ``planner`` stores them with (a downcasting planner's choice),
    non-tensor values by :func:`object_bytes`."""
    cast = getattr(planner, "_cast", None)
    target = 2 if tier_dtype in ("bf16", "fp16") else None
    out = {}
    for item in plan.items:
        if getattr(item, "tensor_data", None) is None:
            out[item.index] = item_bytes(item, frame_size or _DEFAULT_FRAME,
                                         obj_bytes=object_bytes(planner.lookup_object(item.index)))
        else:
            size = target if cast is not None and item.index in cast else None
            out[item.index] = item_bytes(item, frame_size or _DEFAULT_FRAME, itemsize=size)
    return out


def node_save_bytes(plans: Sequence[Any], node_of: Any, frame_size: int | None = None,
                    sizes: Sequence[Mapping[Any, int]] | None = None, tier_dtype: str | None = None) -> dict[int, int]:
    """Bytes a save stores per node: each rank's plan (index = rank) summed onto ``node_of(rank)``; an
    item's size from ``sizes[rank]`` (:func:`local_item_bytes`) when given, else estimated from the plan
    alone (tensors downcast by :func:`downcast_itemsize`, non-tensor values :data:`OBJECT_ESTIMATE`)."""
    out: dict[int, int] = defaultdict(int)
    frame = frame_size or _DEFAULT_FRAME
    for rank, plan in enumerate(plans):
        for it in plan.items:
            known = sizes[rank].get(it.index) if sizes is not None else None
            if known is None:
                td = getattr(it, "tensor_data", None)
                known = item_bytes(it, frame, itemsize=None if td is None or not tier_dtype else
                                   downcast_itemsize(it.index.fqn, td.properties.dtype, tier_dtype))
            out[node_of(rank)] += known
    return dict(out)


def held_bytes(infos: Sequence[Any], keep: int, replacing: str | None = None, *, busy: Collection[int] = (),
               own: Collection[int] = (), ages: Mapping[str, float] | None = None, grace: float = 3600.0,
               optimizer_keys: Sequence[str] = (), known_tiers: Collection[str] | None = None,
               protect: Collection[int] = ()) -> int:
    """Bytes the tier holds, and will go on holding, next to a new save: every checkpoint directory of
    ``infos`` (:func:`~dcp_tiered.tiers.catalog.list_tier`) that retention would not delete now, leaving
    out the one ``replacing`` rewrites.

    That is the ``keep`` newest committed checkpoints, the newest one holding ``optimizer_keys`` (kept
    beyond ``keep`` with ``optimizer_every``), every step ``busy`` (a save or restore of this process, a
    queued or running promotion reading it) or with a pending promotion intent, and the uncommitted
    leftovers of crashed saves younger than ``grace`` seconds (``own``: this process's steps, whose
    leftovers retention deletes at once), and the steps in ``protect`` (the newest fully replicated one of a
    replicated tier, see :func:`~dcp_tiered.tiers.retention.newest_replicated`).  Committed steps
    retention deletes are not counted.  Pure.
    """
    usable = [i for i in infos if not i.unusable and i.name != replacing]
    known = known_tiers if known_tiers is not None else {t for i in usable for t in i.pending_promotions}
    facts = [checkpoint_facts(i, ages=ages or {}, busy=busy, own=own, known_tiers=known,
                              optimizer_keys=optimizer_keys) for i in usable]
    victims = set(retention_victims(facts, keep, protect, grace))
    return sum(i.size_bytes for i in usable if i.step not in victims)


def budget_problem(tier_name: str, needed: int, held: int, budget: int | None, free: int | None,
                   keep: int, node: int = 0, dtype: str | None = None) -> str | None:
    """Why a save of ``needed`` new bytes does not fit next to ``held`` (None when it fits): pure.

    ``free``: the smallest of the tier's free space, the free RAM and the cgroup's room (:func:`_free_bytes`).
    The advice names only what changes the estimate (the codec does not: it counts raw bytes)."""
    total = needed + held
    parts = f"{_size(needed)} new + {_size(held)} the tier holds = {_size(total)}"
    smaller = "save less state per step" if dtype else "store floats as bf16 on this tier (dtype='bf16')"
    advice = (f"raise memory_budget, lower keep (now {keep}; while a save is written the tier holds keep + 1 "
              f"checkpoints, plus those still waiting to be promoted), or {smaller}")
    if budget is not None and total > budget:
        return (f"memory tier {tier_name!r} refuses the save: it needs {parts} on node {node}, over its "
                f"memory_budget of {_size(budget)}; nothing was written. To fix: {advice}")
    if free is not None and needed > free:
        return (f"memory tier {tier_name!r} refuses the save: it needs {_size(needed)} new on node {node}, but only "
                f"{_size(free)} free (the least of its file system's free space, MemAvailable and the cgroup's "
                f"memory.max - memory.current); nothing was written. To fix: free memory, {advice}")
    return None


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def mem_available(meminfo: str) -> int | None:
    """``MemAvailable`` in bytes from ``/proc/meminfo`` text (None when absent). Pure."""
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def cgroup_room(cgroup_line: str, root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the cgroup v2 of ``/proc/self/cgroup`` text may still charge (tmpfs pages count): the least
    ``memory.max - memory.current`` over it and its ancestors; None without cgroup v2 or limits."""
    m = re.search(r"^0::(/.*)$", cgroup_line, re.MULTILINE)
    if m is None:
        return None
    room, path = None, m.group(1).rstrip("/")
    while True:
        try:
            with open(f"{root}{path}/memory.max", encoding="ascii") as f:
                limit = f.read().strip()
            with open(f"{root}{path}/memory.current", encoding="ascii") as f:
                current = int(f.read().strip())
            if limit != "max":
                left = max(0, int(limit) - current)
                room = left if room is None else min(room, left)
        except (OSError, ValueError):
            pass
        if not path:
            return room
        path = path.rsplit("/", 1)[0]


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _free_bytes(path: str, ram: bool = True) -> int | None:
    """The least of: free space of the file system holding ``path``, and (``ram``) ``MemAvailable`` and the
    cgroup v2 room (:func:`cgroup_room`): a tmpfs file takes RAM, whatever the tmpfs size says."""
    found = []
    try:
        st = os.statvfs(existing_parent(path))
        found.append(st.f_bavail * st.f_frsize)
    except OSError:
        pass
    if ram:
        found += [n for n in (mem_available(_read("/proc/meminfo")), cgroup_room(_read("/proc/self/cgroup")))
                  if n is not None]
    return min(found) if found else None


#: (id of the tier, checkpoint name) of saves whose budget :func:`save_budget_error` already passed (it saw
#: every rank's real sizes): :func:`check_save_fits` does not check them again with its plan-only estimate.
_PASSED: dict[int, str] = {}
_PASSED_LOCK = threading.Lock()


def budget_applies(tier: Any) -> bool:
    """Whether saves to ``tier`` are checked: a memory tier, or any tier given a ``memory_budget``."""
    return getattr(tier, "memory_budget", None) is not None or getattr(tier, "kind", None) == "memory"


def budget_error(tier: Any, per_node: Mapping[int, int], checkpoint: str | None, *, rank: int = 0, world: int = 1,
                 marks: Any = None, busy: Collection[int] = (), optimizer_keys: Sequence[str] = (),
                 known_tiers: Collection[str] | None = None, grace: float = 3600.0) -> MemoryBudgetError | None:
    """The refusal of a save storing ``per_node`` bytes (node -> bytes) to ``tier`` (None when it fits).

    Checked for the node with the most bytes, next to what the tier holds on this rank's node
    (:func:`held_bytes`; nodes are alike; with ``{rank}`` in the URL, in every directory of the node).
    ``marks`` (:class:`~dcp_tiered.tiers.pins.StepMarks`) and ``busy``: this process's own and
    pinned steps.  Lists the tier."""
    budget = getattr(tier, "memory_budget", None)
    node = node_of(rank)
    # This node's directories of the tier: one, or one per rank with '{rank}' in the URL.
    ranks = {tier.resolved_url(r, node): r for r in range(world) if node_of(r) == node} or {tier.resolved_url(rank, node): rank}
    own = marks.own(tier.name) if marks is not None else ()
    busy = set(busy) | (marks.pinned(tier.name) if marks is not None else set())
    held, root, local = 0, None, False
    for url, r in sorted(ranks.items()):
        store = Storage(url, tier.storage_options)
        root, local = root or store.root, local or store.is_local
        infos = list_tier(tier, 0, r, node, with_metadata=bool(optimizer_keys), known=known_tiers)
        ages = store.file_ages(time.time()) if grace > 0 else {}
        replicated = newest_replicated(tier, store, infos, r, world)  # retention keeps it too
        held += held_bytes(infos, tier.keep, checkpoint, busy=busy, own=own, ages=ages, grace=grace,
                           optimizer_keys=optimizer_keys, known_tiers=known_tiers,
                           protect=[replicated] if replicated is not None else [])
    busiest, needed = max(per_node.items(), key=lambda kv: kv[1], default=(node, 0))
    free = _free_bytes(root, ram=getattr(tier, "kind", None) == "memory") if local and root else None
    problem = budget_problem(tier.name, needed, held, budget, free, tier.keep, busiest, getattr(tier, "dtype", None))
    return None if problem is None else MemoryBudgetError(problem, tier=tier.name, needed=needed + held, budget=budget)


def mark_passed(tier: Any, checkpoint: str, passed: bool) -> None:
    """Note (or forget) that the save of ``checkpoint`` to ``tier`` passed its budget check already (one
    save per tier at a time: a newer note replaces an older one)."""
    with _PASSED_LOCK:
        if passed:
            _PASSED[id(tier)] = checkpoint
        else:
            _PASSED.pop(id(tier), None)


def check_save_fits(tier: Any, plans: Sequence[Any], checkpoint: str | None, *, rank: int = 0,
                    frame_size: int | None = None) -> None:
    """Refuse a save to ``tier`` that would not fit its ``memory_budget`` or the free memory (coordinator,
    before anything is written; DCP then fails the save on every rank).  Raises :class:`MemoryBudgetError`.

    ``plans``: the global plan (index = rank); sizes are estimated from it alone (:func:`node_save_bytes`).
    A save whose budget ``TieredCheckpointer`` checked already, before staging and with every value's
    real size, is not checked again here.  A tier that is neither a memory tier nor given a budget is
    not checked."""
    if not budget_applies(tier):
        return
    with _PASSED_LOCK:
        if checkpoint is not None and _PASSED.get(id(tier)) == checkpoint:
            del _PASSED[id(tier)]
            return
    per_node = node_save_bytes(plans, node_of, frame_size, tier_dtype=getattr(tier, "dtype", None))
    exc = budget_error(tier, per_node, checkpoint, rank=rank, world=len(plans))
    if exc is not None:
        raise exc


def save_budget_error(tier: Any, sd: Mapping[str, Any], checkpoint: str, *, planner: Any, promoter: Any,
                      frame_size: int | None, rank: int, world: int, group: Any = None,
                      src: int = 0) -> MemoryBudgetError | None:
    """Whether the save of ``sd`` as ``checkpoint`` to ``tier`` is refused for its memory budget: the
    error, or None when it fits (or the tier is not checked).  Collective over ``group`` (every rank
    calls it, on the main thread, before anything is staged or written; all get the same answer).

    Each rank plans its part with ``planner`` (a fresh planner of the save's kind: a downcasting one
    reports which tensors it stores narrower) and sizes its items (non-tensor values by their bytes or
    pickled size); the coordinator (group rank 0) drops replicated items as DCP does, sums per
    node, and checks next to what the tier holds (:func:`~dcp_tiered.tiers.save.budget.held_bytes`, with
    this process's pins and the steps its queued promotions read)."""
    if not budget_applies(tier):
        return None
    try:
        planner.set_up_planner(dict(sd), None, rank == 0)
        plan = planner.create_local_plan()
        mine: tuple[Any, Any, str | None] = (plan, local_item_bytes(plan, planner, frame_size, tier.dtype), None)
    except Exception as exc:  # noqa: BLE001 - every rank must still take part in the gather below
        mine = (None, None, f"rank {rank}: {type(exc).__name__}: {exc}")
    gathered: list[Any] = [mine]
    if group is not None:  # only the coordinator reads the plans: O(N) bytes, not every plan to every rank
        gathered = [None] * world if rank == src else None  # type: ignore[assignment]
        dist.gather_object(mine, gathered, dst=src, group=group)
    answer: list[Any] = [None]
    if rank == src:
        answer[0] = _coordinator_answer(tier, gathered, checkpoint, planner=planner, promoter=promoter,
                                        frame_size=frame_size, rank=rank, world=world)
        mark_passed(tier, checkpoint, answer[0] is None)  # the writer does not check this save again
    if group is not None:
        dist.broadcast_object_list(answer, src=src, group=group)
    if isinstance(answer[0], str):  # a failure on any rank: the same error everywhere
        raise SaveError(f"the memory budget check of {checkpoint} for tier {tier.name!r} failed: {answer[0]}; "
                        "nothing was saved")
    return answer[0]


def _coordinator_answer(tier: Any, gathered: list, checkpoint: str, *, planner: Any, promoter: Any,
                        frame_size: int | None, rank: int, world: int) -> "MemoryBudgetError | str | None":
    """The coordinator's decision over every rank's plan and sizes: the refusal, None, or why it failed."""
    failed = [why for _p, _s, why in gathered if why is not None]
    if failed:
        return "; ".join(failed[:3])
    try:
        plans = [p for p, _s, _w in gathered]
        deduped = False
        try:  # the planner's public global plan drops replicated items as the save will
            plans, deduped = planner.create_global_plan(plans)[0], True
        except Exception as exc:  # noqa: BLE001 - the save reports it; count every item meanwhile
            log.debug("budget check of %s: no global plan (%s); counting replicated items on every rank", checkpoint, exc)
        if deduped and copies_node_local(tier):  # the copies of replicated items each other directory gets
            local = [p.items for p, _s, _w in gathered]
            plans, copies = place_replicated(plans, [[it.index for it in items] for items in local],
                                             dir_leaders(tier, world))
            plans = with_copies(plans, copies)
        by_index = [dict(s) for _p, s, _w in gathered]
        per_rank = node_save_bytes(plans, lambda r: r, frame_size, sizes=by_index, tier_dtype=tier.dtype)
        per_node = replicated_node_bytes(tier, per_rank, world)
        return budget_error(tier, per_node, checkpoint, rank=rank, world=world, marks=promoter.marks,
                            busy=promoter.busy_steps(tier.name), optimizer_keys=promoter.optimizer_keys,
                            known_tiers=set(promoter.by_name), grace=promoter.leftover_grace)
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        return f"rank {rank}: {type(exc).__name__}: {exc}"


def replicated_node_bytes(tier: Any, per_rank: Mapping[int, int], world: int) -> dict[int, int]:
    """Bytes a save stores on each node: every rank's bytes on its own node and, on a tier with
    ``replicas > 1``, once more on the node of each other member of its clique (peer replication
    writes the copies onto the same tier)."""
    cliques = check_replication(tier, world) if getattr(tier, "replicas", 1) > 1 else [[r] for r in range(world)]
    out: dict[int, int] = defaultdict(int)
    for clique in cliques:
        for owner in clique:
            for holder in clique:
                out[node_of(holder)] += per_rank.get(owner, 0)
    return dict(out)
