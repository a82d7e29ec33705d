"""Where a rank runs, as the launcher tells it, torch-free: the one reader of ``LOCAL_WORLD_SIZE``.

torchrun (and every launcher that follows it) sets ``LOCAL_WORLD_SIZE`` to the ranks on this
node.  Node numbering (``{node}`` in tier URLs, replication cliques, node commits), the default
encoder thread count and the CLI's view of a node directory all come from here.
"""

from __future__ import annotations

import os

#: Global rank of DCP's coordinator (rank 0 of the save's group), which commits in ``finish``.
COORDINATOR = 0


def local_world() -> int:
    """Ranks per node from ``LOCAL_WORLD_SIZE``; 0 when the launcher did not say."""
    try:
        return max(0, int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0))
    except ValueError:
        return 0


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
