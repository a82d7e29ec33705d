"""The names inside a checkpoint directory, torch-free: the one definition every layer uses.

A checkpoint directory holds one data file per rank (``__{rank}_{tag}0.distcp``, the tag
unique to a save on object stores; on a node-local tier also a node-copies file
``__{rank}_{tag}node_0.distcp`` and the list of those copies, ``.node-copies-{rank}.json``),
the commit marker ``.metadata`` (written last: the checkpoint is committed if and only if it
exists) and, while a save runs locally, a lock.
"""

from __future__ import annotations

import re

#: The commit marker of a checkpoint: DCP's ``Metadata`` pickle plus an integrity trailer.
METADATA_FILE = ".metadata"
#: Suffix of a data file.
DATA_SUFFIX = ".distcp"
#: Held (``flock``) by a local save's coordinator from planning to the commit.
LOCK_FILE = ".lock"

_DATA_RANK = re.compile(r"^__([0-9]{1,9})_", re.ASCII)  # a rank is at most 9 ASCII digits
#: A data file name as read from untrusted records or intents: plain, no separator, no ``..`` prefix.
DATA_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.distcp$")


def rank_prefix(rank: int) -> str:
    """The data-file prefix of ``rank``'s files (``__{rank}_``); a save on an object store appends its tag."""
    return f"__{rank}_"


def node_copies_prefix(prefix: str) -> str:
    """The data-file prefix of a rank's node-copies file (a node-local tier's copies of replicated items,
    ``tiers/save/node_commit``), from that of its data file: ``__{rank}_{tag}node_`` (the name tells
    its rank, as every data file's does)."""
    return f"{prefix}node_"


def node_copies_list(rank: int) -> str:
    """The file in which ``rank`` lists the node copies it wrote for a save into its directory of a
    node-local tier (their records, which the directory's leader commits; ``tiers/save/node_commit``):
    ``.node-copies-{rank}.json``, written by every rank of a directory other than the coordinator's."""
    return f".node-copies-{rank}.json"


def data_file(prefix: str) -> str:
    """The data file a rank with ``prefix`` writes (``{prefix}0.distcp``)."""
    return f"{prefix}0{DATA_SUFFIX}"


def rank_of_file(name: str) -> int | None:
    """The rank that wrote the data file ``name`` (``__{rank}_...``), or None for other files."""
    m = _DATA_RANK.match(name)
    return int(m.group(1)) if m else None
