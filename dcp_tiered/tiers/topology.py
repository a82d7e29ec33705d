"""Topology: which node a rank is on, which ranks share a directory of a tier, the replication
cliques, and a tier's step directory as one rank sees it.  Torch-free.

Node numbers come from :mod:`dcp_tiered.ranks` (the one reader of ``LOCAL_WORLD_SIZE``).  A
tier's URL may hold ``{rank}`` or ``{node}``: then every rank (or node) has a directory of its
own, and everything that asks "where does rank r keep step s of tier T" asks here.
"""

from __future__ import annotations

from collections.abc import Callable

from dcp_tiered.errors import ConfigError
from dcp_tiered.names import rank_of_file
from dcp_tiered.ranks import COORDINATOR, local_world, node_of
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.layout import step_name

__all__ = ["COORDINATOR", "check_replication", "clique_peers", "cliques", "dir_leaders", "dir_ranks", "holds_file", "jump_of",
           "local_world", "node_of", "shares_coordinator_dir", "step_dir", "tier_storage"]


def tier_storage(tier: Tier, rank: int = 0, node: "int | None" = None) -> Storage:
    """The storage of ``tier`` as seen by ``rank`` on ``node`` (default: the node of ``rank``)."""
    return Storage(tier.resolved_url(rank, node_of(rank) if node is None else node), tier.storage_options)


def step_dir(tier: Tier, rank: int, step: "int | str", node: "int | None" = None) -> Storage:
    """The directory of ``step`` (a step number or a directory name) of ``tier`` as ``rank`` sees it."""
    return tier_storage(tier, rank, node).child(step if isinstance(step, str) else step_name(step))


def dir_ranks(tier: Tier, rank: int, world: int, per_node: "int | None" = None) -> list[int]:
    """The ranks (ascending) that write into the same directory of ``tier`` as ``rank`` (``per_node``: the
    ranks per node, default :func:`~dcp_tiered.ranks.local_world`)."""
    mine = tier.resolved_url(rank, node_of(rank, per_node))
    return [r for r in range(world) if tier.resolved_url(r, node_of(r, per_node)) == mine]


def dir_leaders(tier: Tier, world: int, per_node: int | None = None) -> list[int]:
    """For each of ``world`` ranks, the lowest rank writing into the same directory of ``tier`` (its leader):
    ranks with one leader share a directory (that of the coordinator's directory is ``COORDINATOR``)."""
    first: dict[str, int] = {}
    return [first.setdefault(tier.resolved_url(r, node_of(r, per_node)), r) for r in range(world)]


def holds_file(tier: Tier, rank: int, world: int) -> Callable[[str], bool]:
    """Whether a data file belongs in the directory of node-local ``tier`` that ``rank`` sees."""
    ranks = set(dir_ranks(tier, rank, world))
    return lambda name: rank_of_file(name) in ranks


def shares_coordinator_dir(tier: Tier, rank: int) -> bool:
    """Whether ``rank`` sees the same directory of ``tier`` as the coordinator (which commits it in ``finish``)."""
    return tier.resolved_url(rank, node_of(rank)) == tier.resolved_url(COORDINATOR, node_of(COORDINATOR))


def jump_of(tier: Tier, per_node: "int | None" = None) -> int:
    """The tier's ``replication_jump``, or the ranks per node (1 when unknown) when not given."""
    return tier.replication_jump or (local_world() if per_node is None else per_node) or 1


def cliques(world: int, replicas: int, jump: int) -> list[list[int]]:
    """The replication cliques of ``world`` ranks (NVRx's clique strategy), ordered by first rank."""
    span = jump * replicas
    if world % span:
        raise ConfigError(f"replicas={replicas} with replication_jump={jump} needs a world size that is a multiple "
                          f"of {span} (replicas x replication_jump), got {world}")
    return sorted([[a * span + b + k * jump for k in range(replicas)] for a in range(world // span) for b in range(jump)])


def check_replication(tier: Tier, world: int, per_node: "int | None" = None) -> list[list[int]]:
    """The cliques of ``tier`` for ``world`` ranks with ``per_node`` ranks per node (default
    :func:`~dcp_tiered.ranks.local_world`); ConfigError when the world size does not fit, or when a copy
    would share its owner's node (``replication_jump`` not a multiple of the ranks per node)."""
    per_node = local_world() if per_node is None else per_node
    jump = jump_of(tier, per_node)
    where = f"tier {tier.name!r}"
    if per_node and jump % per_node:
        raise ConfigError(f"{where}: replication_jump={jump} must be a multiple of the ranks per node "
                          f"(LOCAL_WORLD_SIZE={per_node}), or a copy lands on its owner's node; use {per_node} "
                          f"(the world size must then be a multiple of {per_node * tier.replicas}: "
                          f"{tier.replicas} nodes or a multiple)")
    try:
        found = cliques(world, tier.replicas, jump)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for clique in found:  # a copy written into its owner's directory would overwrite the original
        dirs = {tier.resolved_url(r, node_of(r, per_node)) for r in clique}
        if len(dirs) < len(clique):
            raise ConfigError(f"{where}: ranks {clique} would keep their copies in the same directory; set "
                              "LOCAL_WORLD_SIZE (torchrun does) and replication_jump to the ranks per node")
    return found


def clique_peers(tier: Tier, rank: int, world: int, per_node: "int | None" = None) -> set[int]:
    """The ranks whose replicas the directory of ``tier`` that ``rank`` sees must hold: every other member of
    the cliques of that directory's ranks; ConfigError when the world does not fit the tier's replication."""
    mine = set(dir_ranks(tier, rank, world, per_node))
    return {p for c in check_replication(tier, world, per_node) if mine & set(c) for p in c} - mine
