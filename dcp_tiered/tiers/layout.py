"""Where checkpoints live inside a tier: ``{tier url}/step_{step:09d}/``, plus promotion files."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Collection
from typing import Any

from dcp_tiered.errors import CorruptCheckpointError, StorageError
from dcp_tiered.names import DATA_FILE
from dcp_tiered.storage import MissingFileError, Storage

#: Exactly what :func:`step_name` writes: 9 ASCII digits, more (no leading zero) only for steps >= 1e9,
#: so that no two names alias one step (``step_3``, ``step_0000000003``, non-ASCII digits are not steps).
STEP_DIR = re.compile(r"step_([0-9]{9}|[1-9][0-9]{9,18})", re.ASCII)
INTENT_PREFIX = ".promote-"
FRAGMENT_SUFFIX = ".records.json"


def step_name(step: int) -> str:
    """Directory name of ``step`` (zero padded so names sort by step)."""
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    """Step number of a checkpoint directory name, or None if it is not one."""
    m = STEP_DIR.fullmatch(name) if isinstance(name, str) else None
    return int(m.group(1)) if m else None


def intent_name(rank: int) -> str:
    """Per-rank file in a source checkpoint recording promotions still to do."""
    return f"{INTENT_PREFIX}{rank}.json"


def fragment_name(data_file: str) -> str:
    """File in a target checkpoint written once ``data_file`` was promoted (its new records)."""
    return f".{data_file}{FRAGMENT_SUFFIX}"


# -- promotion intents: untrusted input ---------------------------------------------------------

#: Largest promotion intent read (checked before reading): a rank's records for its items.
INTENT_MAX_BYTES = 64 << 20
INTENT_FILE = re.compile(r"^\.promote-(\d{1,9})\.json$")
INTENT_FIELDS = ("name", "source", "rank", "data_file", "records", "targets", "meta", "save_id")
_TIER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # as Tier names; only ever looked up, never a path

_SAVE_ID = re.compile(r"^[0-9a-f]{1,64}$")
_MAX_ITEMS = 1_000_000
_MAX_KEY = 4096


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"promotion intent {where}: {what}; skipped (left for `dcp-tiered gc`)")


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tier_list(doc: dict, key: str, where: str, source: str, tiers: "Collection[str] | None") -> None:
    names = doc[key]
    if not isinstance(names, list) or len(names) > 64 or not all(isinstance(n, str) and _TIER_NAME.match(n) for n in names):
        raise _bad(where, f"{key!r} must be a list of tier names")
    if len(set(names)) != len(names) or source in names:
        raise _bad(where, f"{key!r} repeats a tier or names the source tier {source!r}")
    unknown = [n for n in names if tiers is not None and n not in tiers]
    if unknown:
        raise _bad(where, f"{key!r} names unknown tiers {unknown}")


def _check_records(doc: dict, where: str) -> None:
    from dcp_tiered.dcp.format import ItemRecord

    records = doc["records"]
    if not isinstance(records, list) or len(records) > _MAX_ITEMS:
        raise _bad(where, "'records' must be a list")
    for entry in records:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and len(entry[0]) == 3
                and isinstance(entry[1], dict)):
            raise _bad(where, "each record must be [[key, offset, index], {record}]")
        (fqn, offset, index), rec = entry
        if not isinstance(fqn, str) or len(fqn) > _MAX_KEY:
            raise _bad(where, "a record key is not a string")
        if offset is not None and not (isinstance(offset, list) and len(offset) <= 64 and all(map(_is_uint, offset))):
            raise _bad(where, f"the offset of {fqn!r} is not a list of sizes")
        if index is not None and not _is_uint(index):
            raise _bad(where, f"the index of {fqn!r} is not a number")
        for k, v in rec.items():
            flat = v if isinstance(v, list) else [v]
            if not isinstance(k, str) or not all(x is None or isinstance(x, (str, int, float)) for x in flat):
                raise _bad(where, f"the record of {fqn!r} holds a field of the wrong type")
        try:
            item = ItemRecord.from_json(rec, fqn, where)
        except (ValueError, TypeError) as exc:
            raise _bad(where, str(exc)) from None
        if item.file != doc["data_file"]:
            raise _bad(where, f"the record of {fqn!r} names file {item.file!r}, not the intent's {doc['data_file']!r}")


def parse_intent(data: bytes, where: str, *, file_name: "str | None" = None, dir_name: "str | None" = None,
                 source: "str | None" = None, tiers: "Collection[str] | None" = None) -> dict:
    """Validate a promotion intent (``.promote-{rank}.json``): untrusted input, never acted on unchecked.

    A JSON object with exactly :data:`INTENT_FIELDS`, typed and bounded; its ``name`` is a step
    directory name equal to ``dir_name`` (where it was found), its ``rank`` the one in ``file_name``,
    its ``source`` equal to ``source``, its targets known tier names (``tiers``) other than the
    source, its records valid native records of its one plain-named data file.  Raises
    :class:`~dcp_tiered.errors.CorruptCheckpointError` (a ``ValueError``) naming what is wrong.
    """
    if len(data) > INTENT_MAX_BYTES:
        raise _bad(where, f"{len(data)} bytes, above the {INTENT_MAX_BYTES}-byte limit")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _bad(where, f"not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or set(doc) != set(INTENT_FIELDS):
        raise _bad(where, f"expected a JSON object with the fields {list(INTENT_FIELDS)}")
    name, src = doc["name"], doc["source"]
    if not isinstance(name, str) or len(name) > 64 or parse_step(name) is None or (dir_name is not None and name != dir_name):
        raise _bad(where, f"'name' {str(name)[:80]!r} is not the step directory it was found in ({dir_name!r})")
    if not isinstance(src, str) or not _TIER_NAME.match(src) or (source is not None and src != source) or (
            tiers is not None and src not in tiers):
        raise _bad(where, f"'source' {str(src)[:80]!r} is not the tier it was found in ({source!r})")
    m = INTENT_FILE.match(file_name) if file_name is not None else None
    if not _is_uint(doc["rank"]) or (file_name is not None and (m is None or int(m.group(1)) != doc["rank"])):
        raise _bad(where, f"'rank' {str(doc['rank'])[:20]!r} does not match the file name {file_name!r}")
    if doc["data_file"] is not None and not (isinstance(doc["data_file"], str) and DATA_FILE.match(doc["data_file"])):
        raise _bad(where, f"'data_file' {str(doc['data_file'])[:80]!r} is not a plain data file name")
    if not isinstance(doc["save_id"], str) or not _SAVE_ID.match(doc["save_id"]):
        raise _bad(where, "'save_id' is not a save id")
    _tier_list(doc, "targets", where, src, tiers)
    _tier_list(doc, "meta", where, src, tiers)
    if doc["targets"] and doc["data_file"] is None:
        raise _bad(where, "data targets without a data file")
    _check_records(doc, where)
    return doc


def read_small_file(storage: Storage, file_name: str, limit: int = INTENT_MAX_BYTES) -> bytes:
    """Read a small bookkeeping file (intent, fragment) of untrusted origin: at most ``limit`` bytes,
    checked before reading, and locally only a regular file (never a link, FIFO or device)."""
    where = storage.url_of(file_name)
    if storage.is_local:
        try:
            st = os.lstat(storage.path(file_name))
        except FileNotFoundError as exc:
            raise MissingFileError(f"{where} does not exist") from exc
        except OSError as exc:
            raise StorageError(f"cannot stat {where}: {exc.strerror}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise _bad(where, "not a regular file")
    size = storage.size(file_name)
    if size > limit:
        raise _bad(where, f"{size} bytes, above the {limit}-byte limit")
    data = storage.read_bytes(file_name)
    if len(data) > limit:  # grew since the size check
        raise _bad(where, f"more than the {limit}-byte limit")
    return data


def read_intent(storage: Storage, file_name: str, **expect: Any) -> dict:
    """Read (:func:`read_small_file`) and validate (:func:`parse_intent`) the intent ``file_name``
    of the checkpoint directory ``storage``; ``dir_name`` defaults to the directory's name."""
    expect.setdefault("dir_name", storage.url.rstrip("/").rsplit("/", 1)[-1])
    return parse_intent(read_small_file(storage, file_name), storage.url_of(file_name), file_name=file_name, **expect)
