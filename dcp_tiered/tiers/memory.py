"""Memory tiers: a ``Tier`` on ``/dev/shm`` or another tmpfs, and the budget check before a save.

A memory tier survives a crashed training process (the files stay in the node's RAM), not a
lost node.  Its ``memory_budget`` caps what the tier may hold on one node: a save that would
not fit fails before any byte is written, instead of filling the RAM the training needs.

Retention deletes the previous checkpoint only after the new one commits, so while a save is
written the tier holds its ``keep`` checkpoints plus the new one: a budget for ``keep=1`` must
hold two checkpoints.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from dcp_tiered.errors import ConfigError, MemoryBudgetError
from dcp_tiered.tiers.layout import parse_step

#: File system types whose files live in RAM.
MEMORY_FSTYPES = frozenset({"tmpfs", "ramfs"})
#: Where Linux keeps its shared-memory tmpfs.
SHM_DIR = "/dev/shm"
#: Estimated stored size of one non-tensor item (its size is unknown before it is serialized).
OBJECT_ESTIMATE = 4096
#: Bytes per item of ``.metadata`` and frame headers, beyond the raw bytes (an upper bound).
ITEM_OVERHEAD = 512
#: Largest frame header (one plane per byte of an 8-byte element: 1 + 8 * 5 bytes).
FRAME_HEADER_MAX = 41
_DEFAULT_FRAME = 4 << 20
METADATA_FILE = ".metadata"  # the commit marker of a checkpoint (as dcp.format names it, without torch)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)


def parse_bytes(value: "int | str | None", where: str = "size") -> int | None:
    """``"8GiB"`` -> 8589934592, ``"512MiB"``, ``"1.5GB"`` (decimal), or a positive int of bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected bytes or a size such as '8GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)) and m.group(2).lower() in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(f"{where}: cannot read {value!r} as a size; use bytes or e.g. '512MiB', '8GiB', '2GB'")
    if n < 1:
        raise ConfigError(f"{where}: must be at least 1 byte, got {value!r}")
    return n


def mount_fstype(mounts: str, path: str) -> str | None:
    """The file system type of the mount holding absolute ``path``, from ``/proc/mounts`` text (the longest
    mount point containing it wins; mount points use octal escapes for spaces)."""
    best, fstype = "", None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype


def _existing(path: str) -> str:
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def is_memory_path(path: str) -> bool:
    """Whether local ``path`` (or, when it does not exist yet, its nearest existing parent) is on a tmpfs."""
    real = os.path.realpath(_existing(os.path.abspath(os.path.expanduser(path))))
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            fstype = mount_fstype(f.read(), real)
    except OSError:  # no /proc (not Linux): only the well-known place
        fstype = None
    if fstype is not None:
        return fstype in MEMORY_FSTYPES
    return real == SHM_DIR or real.startswith(SHM_DIR + "/")


def _item_bytes(item: Any, frame_size: int) -> int:
    """Upper bound of the bytes one DCP ``WriteItem`` stores: raw bytes plus frame headers and metadata."""
    td = getattr(item, "tensor_data", None)
    if td is None:
        return OBJECT_ESTIMATE + ITEM_OVERHEAD
    numel = 1
    for d in td.chunk.sizes:
        numel *= int(d)
    raw = numel * td.properties.dtype.itemsize
    return raw + (-(-raw // frame_size)) * FRAME_HEADER_MAX + ITEM_OVERHEAD


def node_save_bytes(plans: Sequence[Any], node_of: Any, frame_size: int | None = None) -> dict[int, int]:
    """Bytes a save stores per node: each rank's plan (index = rank) summed onto ``node_of(rank)``."""
    out: dict[int, int] = defaultdict(int)
    for rank, plan in enumerate(plans):
        out[node_of(rank)] += sum(_item_bytes(it, frame_size or _DEFAULT_FRAME) for it in plan.items)
    return dict(out)


def held_bytes(sizes: Mapping[str, int], keep: int, replacing: str | None = None) -> int:
    """Bytes of what the tier holds (``Storage.file_sizes``) that retention keeps next to a new save: its
    ``keep`` newest committed checkpoints, leaving out the checkpoint ``replacing`` rewrites.

    Older committed checkpoints (retention deletes them, maybe still in the background) and the
    leftovers of interrupted saves (retention removes them) are not counted: they would otherwise refuse
    every save until they are gone.  The free-space check still sees them.  Pure.
    """
    per_step: dict[int, int] = defaultdict(int)
    committed: set[int] = set()
    for name, n in sizes.items():
        top, _, rest = name.partition("/")
        step = parse_step(top)
        if step is None or not rest or top == replacing:
            continue
        per_step[step] += n
        committed.update([step] if rest == METADATA_FILE else [])
    return sum(per_step[s] for s in sorted(committed, reverse=True)[: max(1, keep)])


def budget_problem(tier_name: str, needed: int, held: int, budget: int | None, free: int | None,
                   keep: int, node: int = 0) -> str | None:
    """Why a save of ``needed`` new bytes does not fit next to ``held`` (None when it fits): pure."""
    total = needed + held
    parts = f"{_size(needed)} new + {_size(held)} the tier holds = {_size(total)}"
    advice = (f"raise memory_budget, lower keep (now {keep}; while a save is written the tier holds keep + 1 "
              "checkpoints), or store fewer bytes (codec='zstd:1', dtype='bf16')")
    if budget is not None and total > budget:
        return (f"memory tier {tier_name!r} refuses the save: it needs {parts} on node {node}, over its "
                f"memory_budget of {_size(budget)}; nothing was written. To fix: {advice}")
    if free is not None and needed > free:
        return (f"memory tier {tier_name!r} refuses the save: it needs {_size(needed)} new on node {node}, but its "
                f"file system has only {_size(free)} free; nothing was written. To fix: free memory, {advice}")
    return None


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(_existing(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_save_fits(tier: Any, plans: Sequence[Any], checkpoint: str | None, *, rank: int = 0,
                    frame_size: int | None = None) -> None:
    """Refuse a save to ``tier`` that would not fit its ``memory_budget`` or its file system (coordinator,
    before anything is written; DCP then fails the save on every rank).

    Checked for the node with the most bytes of this save (``plans`` index = rank), next to what the tier
    holds on this rank's node (nodes are alike; with ``{rank}`` in the URL, in every directory of the node).  Raises :class:`MemoryBudgetError`.  A tier that is neither
    a memory tier nor given a budget is not checked.
    """
    from dcp_tiered.storage import Storage
    from dcp_tiered.tiers.writer import node_of

    budget = getattr(tier, "memory_budget", None)
    if budget is None and getattr(tier, "kind", None) != "memory":
        return
    node = node_of(rank)
    # This node's directories of the tier: one, or one per rank with '{rank}' in the URL.
    urls = sorted({tier.resolved_url(r, node) for r in range(len(plans)) if node_of(r) == node} or
                  {tier.resolved_url(rank, node)})
    dirs = [Storage(url, tier.storage_options) for url in urls]
    per_node = node_save_bytes(plans, node_of, frame_size)
    busiest, needed = max(per_node.items(), key=lambda kv: kv[1], default=(node, 0))
    held = sum(held_bytes(d.file_sizes(), tier.keep, checkpoint) for d in dirs)
    free = _free_bytes(dirs[0].root) if dirs[0].is_local else None
    problem = budget_problem(tier.name, needed, held, budget, free, tier.keep, busiest)
    if problem is not None:
        raise MemoryBudgetError(problem, tier=tier.name, needed=needed + held, budget=budget)

