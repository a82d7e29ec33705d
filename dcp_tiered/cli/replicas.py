"""The replica state of node-local tiers with peer replication (``Tier(replicas=F)``), for ``dcp-tiered ls``.

A replicated tier has one directory per node (``{node}``) or per rank (``{rank}``).  Each step
directory holds its own ranks' data files and, for every peer of their cliques, the peer's files
under a committed ``.replica-{owner}.json`` marker (see :mod:`dcp_tiered.tiers.replicas`).
Every directory of the tier that exists is listed (the template's placeholder matched against its
parent's entries), so a step is shown even when node 0's directory is gone.  A step is fully
replicated when, for every rank, every other member of its clique holds its marker, from the save
that committed the step there, with every file it names at full size.  The world size is the
highest rank that wrote a data file of the step (its ``.metadata`` records) plus one.
"""

from __future__ import annotations

import re
from typing import Any

from dcp_tiered.errors import ConfigError, DcpTieredError
from dcp_tiered.names import METADATA_FILE
from dcp_tiered.ranks import local_world
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.catalog import CheckpointInfo, inspect_checkpoint, list_tier
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.layout import parse_step, step_name
from dcp_tiered.tiers.replicas.markers import MAX_WORLD, read_markers, vouches
from dcp_tiered.tiers.topology import cliques


def dir_kind(tier: Tier) -> str:
    """``"node"`` or ``"rank"``: what one directory of the tier belongs to."""
    return "node" if "{node}" in tier.url and "{rank}" not in tier.url else "rank"


def tier_dirs(tier: Tier) -> dict[int, Storage]:
    """The directories of node-local ``tier`` that exist, by node (or rank) index.

    The placeholder's path segment is matched against the entries of its parent; a template
    with the placeholder in more than one segment is resolved for index 0 only."""
    holder = "{" + dir_kind(tier) + "}"
    url = tier.url.replace("{node}", holder).replace("{rank}", holder)  # "{rank}/{node}": one index (the rank)
    start = url.index(holder)
    parent, _, head = url[:start].rpartition("/")
    rest = url[start + len(holder):]
    tail, sep, below = rest.partition("/")
    if holder in below or not parent:
        found = [0]
    else:
        pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"$")
        found = sorted({int(m.group(1)) for n in Storage(parent, tier.storage_options).listdir()
                        if (m := pattern.match(n))})
    dirs = {k: Storage(_resolve(tier, k), tier.storage_options) for k in found}
    return {k: d for k, d in dirs.items() if d.exists()}


def _resolve(tier: Tier, index: int) -> str:
    return tier.resolved_url(index, index) if dir_kind(tier) == "node" else tier.resolved_url(index, 0)


def replicated_infos(tier: Tier, index: int, with_metadata: bool) -> list[CheckpointInfo]:
    """The listing of ``tier`` over all its directories: each step from the lowest directory holding it
    (committed first), newest step first."""
    by_step: dict[int, CheckpointInfo] = {}
    for k, storage in tier_dirs(tier).items():
        for name in storage.listdir():
            step = parse_step(name)
            if step is None or (step in by_step and by_step[step].committed):
                continue
            info = inspect_checkpoint(storage, tier, index, name, with_metadata)
            if step not in by_step or info.committed:
                by_step[step] = info
    if not by_step:  # no directory yet: as for any tier
        return list_tier(tier, index, with_metadata=with_metadata)
    return sorted(by_step.values(), key=lambda i: i.step, reverse=True)


def _step_facts(child: Storage) -> dict[str, Any]:
    """One directory's step: committed, its save id and the ranks of its records, the markers in it."""
    from dcp_tiered.tiers.retention import save_writers  # reads .metadata: torch

    files = child.file_sizes()
    facts: dict[str, Any] = {"url": child.url, "committed": METADATA_FILE in files, "files": files,
                             "save_id": None, "ranks": set(), "markers": {}}
    if not files:
        return facts
    facts["markers"] = read_markers(child)
    if facts["committed"]:
        try:
            facts["save_id"], facts["ranks"] = save_writers(child)
        except DcpTieredError as exc:
            facts["problem"] = str(exc)
    return facts


def _marker_ok(owner: int, marker: dict[str, Any], facts: dict[str, Any]) -> bool:
    """A marker vouches for its owner's files: from the save committed here, every file present at full size."""
    save_id = facts["save_id"] if facts["save_id"] is not None else marker.get("save_id")
    return vouches(marker, owner, save_id, facts["files"], facts["ranks"] if facts["committed"] else None)


def ranks_per_node(given: int | None, world: int, dirs: int) -> int:
    """Ranks per node: ``given`` (``--ranks-per-node``), else ``LOCAL_WORLD_SIZE``, else the world over the
    directories (the highest index + 1; a lost last node then needs one of the first two)."""
    per_node = given or local_world()
    if per_node:
        return per_node
    if dirs and world % dirs == 0:
        return world // dirs
    raise ConfigError(f"cannot tell the ranks per node of {world} ranks in {dirs} node directories: "
                      "give --ranks-per-node or LOCAL_WORLD_SIZE")


def step_state(tier: Tier, step: int, dirs: dict[int, Storage], per_node: int | None = None) -> dict[str, Any]:
    """The replica state of ``step`` of ``tier`` over its directories ``dirs`` (see the module doc):
    per directory the owners whose replicas it holds, ``replicated``, and ``missing`` ``(owner, dir)`` pairs."""
    kind = dir_kind(tier)
    facts = {k: _step_facts(s.child(step_name(step))) for k, s in dirs.items()}
    out: dict[str, Any] = {"replicas": tier.replicas, "replication_jump": tier.replication_jump, "kind": kind,
                           "world": None, "cliques": [], "dirs": [], "replicated": False, "missing": [], "problem": None}
    ranks = set().union(*(f["ranks"] for f in facts.values()))
    if not ranks:
        out["problem"] = "no readable committed .metadata of this step in any directory"
        return out
    world = out["world"] = max(ranks) + 1
    if world > MAX_WORLD:
        out["problem"] = f"its records name rank {world - 1}, more ranks than a job runs ({MAX_WORLD}): crafted or damaged"
        return out
    try:
        local = ranks_per_node(per_node, world, max(dirs) + 1) if kind == "node" else 1
        out["cliques"] = found = cliques(world, tier.replicas, tier.replication_jump or local)
    except ConfigError as exc:
        out["problem"] = str(exc)
        return out

    def dir_of(rank: int) -> int:
        return rank // local

    held: dict[int, list[int]] = {}
    ranks_of: dict[int, list[int]] = {}
    for r in range(world):
        ranks_of.setdefault(dir_of(r), []).append(r)
    for k in range(dir_of(world - 1) + 1):
        f = facts.get(k)
        held[k] = sorted(o for o, m in f["markers"].items() if _marker_ok(o, m, f)) if f else []
        out["dirs"].append({
            "index": k, "url": f["url"] if f else _resolve(tier, k), "exists": f is not None and bool(f["files"]),
            "committed": bool(f and f["committed"]), "ranks": ranks_of.get(k, []),
            "replicas_of": held[k], "stale": sorted(o for o in (f["markers"] if f else {}) if o not in held[k])})
    out["missing"] = [{"owner": r, kind: dir_of(m)} for c in found for r in c for m in c
                      if m != r and r not in held[dir_of(m)]]
    out["replicated"] = not out["missing"]
    return out


def summary(state: dict[str, Any]) -> str:
    """One table cell: ``full`` or ``PARTIAL (missing ...)``, then what each directory holds."""
    if state["problem"]:
        return f"? {state['problem']}"
    kind = state["kind"]
    holds = "; ".join(f"{kind} {d['index']}: {','.join(map(str, d['replicas_of'])) or '-'}"
                      + ("" if d["exists"] else " (gone)") for d in state["dirs"])
    if state["replicated"]:
        return f"full; {holds}"
    gaps = ", ".join(f"{m['owner']} on {kind} {m[kind]}" for m in state["missing"][:6])
    more = f" +{len(state['missing']) - 6}" if len(state["missing"]) > 6 else ""
    return f"PARTIAL (missing {gaps}{more}); {holds}"
