"""Replica markers: the one definition of "rank r's files of a save are replicated here".

A receiver of peer replication commits ``.replica-{owner}.json`` into its node's step directory
after the owner's files arrived with the digests the owner sent.  The marker names the save
(``save_id``), the files with their sizes and digests, and the topology of the job that wrote
it (``world``, ``per_node``: ranks per node), so a process outside the job (``dcp-tiered gc``,
``ls``) judges replication as the job did.  A marker is untrusted input: a malformed one is
logged and treated as absent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from typing import Any

from dcp_tiered.errors import DcpTieredError
from dcp_tiered.names import rank_of_file
from dcp_tiered.storage import Storage

log = logging.getLogger(__name__)

#: Name prefix of a committed replica marker ``.replica-{owner}.json``.
MARKER_PREFIX = ".replica-"
#: Largest marker read.
MARKER_MAX_BYTES = 1 << 20
#: Largest world size a marker may record (more ranks than any job runs: a larger value is crafted).
MAX_WORLD = 1 << 17


def marker_name(owner: int) -> str:
    """The file name of ``owner``'s replica marker."""
    return f"{MARKER_PREFIX}{owner}.json"


def read_markers(child: Storage) -> dict[int, dict[str, Any]]:
    """The committed replica markers in step directory ``child``: owner rank -> marker.

    The owner is the one the file name ``.replica-{owner}.json`` says; a marker whose JSON names
    another owner, or whose ``files`` is not a list, is malformed: logged and treated as absent."""
    out: dict[int, dict[str, Any]] = {}
    for name, _size in child.file_sizes().items():
        if not (name.startswith(MARKER_PREFIX) and name.endswith(".json")):
            continue
        try:
            owner = int(name[len(MARKER_PREFIX):-len(".json")])
            marker = json.loads(child.read_bytes(name, MARKER_MAX_BYTES))
            if not isinstance(marker, dict) or int(marker["owner"]) != owner:
                raise ValueError(f"it does not name owner {owner}")
            if not isinstance(marker.get("files"), list):
                raise ValueError(f"its files are {marker.get('files')!r}, not a list")
            out[owner] = marker
        except (DcpTieredError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            log.warning("unreadable replica marker %s, treated as absent: %s", child.url_of(name), exc)
    return out


def vouched_files(child: Storage, save_id: "str | None") -> dict[str, int]:
    """The data files of other directories' ranks that ``child`` holds as committed replicas of the save
    ``save_id``: named, with their size, by a ``.replica-{owner}.json`` marker of that save.  A file
    without such a marker (its replication was killed before the marker, or it is left from an earlier
    save of the step) is not vouched for."""
    out: dict[str, int] = {}
    if not save_id:
        return out
    for owner, marker in read_markers(child).items():
        if marker.get("save_id") == save_id:
            out.update(marker_files(marker, owner))
    return out


def marker_files(marker: dict[str, Any], owner: int) -> dict[str, int]:
    """The files (name -> size) a replica marker of ``owner`` names that are ``owner``'s; malformed entries left out."""
    out: dict[str, int] = {}
    files = marker.get("files")
    for entry in files if isinstance(files, list) else []:
        if not isinstance(entry, dict):
            continue
        name, size = entry.get("file"), entry.get("size")
        if type(name) is not str or type(size) is not int or size < 0:  # "10", -1, True, 9.9: malformed
            continue
        if rank_of_file(name) == owner:
            out[name] = size
    return out


def new_marker(owner: int, save_id: "str | None", step: int, entries: "list[tuple[str, int, str]]", *,
               world: int, per_node: int) -> bytes:
    """The marker a receiver commits once ``owner``'s files ``entries`` (name, size, xxh3) of ``save_id`` arrived."""
    return json.dumps({"owner": owner, "save_id": save_id, "step": step, "world": world, "per_node": per_node,
                       "files": [{"file": n, "size": s, "xxh3": d} for n, s, d in entries]}).encode()


def vouches(marker: Mapping[str, Any], owner: int, save_id: "str | None",
            files: "Mapping[str, int] | None" = None, writers: "Collection[int] | None" = None) -> bool:
    """Whether ``marker`` vouches for ``owner``'s files of the save ``save_id``: the same save, no entry
    malformed, and (with ``files``, the directory's listing) every file present at full size.  A marker
    naming no file vouches only for an owner that wrote none (``writers``: the ranks whose files the
    save's records name; unknown: refused), as a rank whose items DCP stored elsewhere."""
    if not save_id or marker.get("save_id") != save_id:
        return False
    named = marker_files(dict(marker), owner)
    if len(named) != len(marker.get("files") or []):
        return False
    if not named:
        return writers is not None and owner not in writers
    return files is None or all(files.get(name, -1) >= size for name, size in named.items())


def is_replicated(markers: Mapping[int, Mapping[str, Any]], peers: Collection[int], save_id: "str | None",
                  files: "Mapping[str, int] | None" = None, writers: "Collection[int] | None" = None) -> bool:
    """The one rule: a step directory holds a full replica set of the save ``save_id`` when every rank of
    ``peers`` (the clique peers of the directory's own ranks) has a marker there that :func:`vouches`."""
    return bool(save_id) and all(p in markers and vouches(markers[p], p, save_id, files, writers) for p in peers)


def job_topology(markers: Mapping[int, Mapping[str, Any]]) -> "tuple[int, int] | None":
    """``(world, per_node)`` of the job that wrote ``markers``, as the markers record it; None when no marker
    records it (written before markers carried it) or they disagree."""
    seen = set()
    for m in markers.values():
        world, per_node = m.get("world"), m.get("per_node")
        if type(world) is int and type(per_node) is int and 0 < world <= MAX_WORLD and 0 <= per_node <= world:
            seen.add((world, per_node))
    return seen.pop() if len(seen) == 1 else None
