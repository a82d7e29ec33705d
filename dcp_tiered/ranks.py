"""Where a rank runs, as the launcher tells it, torch-free: the one reader of ``LOCAL_WORLD_SIZE``.

torchrun (and every launcher that follows it) sets ``LOCAL_WORLD_SIZE`` to the ranks on this
node.  Node numbering (``{node}`` in tier URLs, replication cliques, node commits), the default
encoder thread count and the CLI's view of a node directory all come from here.
"""

from __future__ import annotations

import os

from dcp_tiered.errors import ConfigError

#: Global rank of DCP's coordinator (rank 0 of the save's group), which commits in ``finish``.
COORDINATOR = 0


def local_world() -> int:
    """Ranks per node from ``LOCAL_WORLD_SIZE``; 0 when the launcher did not say.  A value that is not a
    non-negative integer is a :class:`~dcp_tiered.errors.ConfigError` (it would put every rank on node 0)."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "") or "0"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"LOCAL_WORLD_SIZE={text!r} is not a number of ranks per node; set it as torchrun does")
    return value


def node_of(rank: int, per_node: int | None = None) -> int:
    """Node index of ``rank`` with ``per_node`` ranks per node (default :func:`local_world`); 0 when unknown."""
    local = local_world() if per_node is None else per_node
    return rank // local if local > 0 else 0


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """Cores available to this process divided among the ranks of this node."""
    return max(1, cores() // max(1, local_world()))
