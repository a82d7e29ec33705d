"""The ``.metadata`` of formats 2 and 3: the native records of ``storage_data`` as one columnar table.

In memory a record is the plain-builtin dict of :class:`~dcp_tiered.dcp.format.ItemRecord`
keyed by DCP's ``MetadataIndex``.  Pickled as such it costs ~330 bytes per tensor (every
field name is a memo reference, every index a dataclass), more than stock DCP's ~205.  On
disk, format 2 stores the records that fit as columns of fixed-width little-endian unsigned
integers (the narrowest of 1, 2, 4 or 8 bytes holding the column), one ``bytes`` each:

* the index is the item's position in ``state_dict_metadata`` plus its chunk's position
  there (0 = no offset), so neither the ``MetadataIndex`` nor the shape is stored;
* strings (file, codec, filter, checksum, dtype, original dtype, object kind) are ids into
  one ``names`` tuple (0 = field absent); ``length`` is the sum of the frame lengths;
* the frame lengths and checksums of all records are two columns, cut by ``nframes``.

The table is the record of one packed item (format 3: the first of the item with the fewest
chunks), ``{"fmt": 3, "table": {...}}``, so a reader of format 1 refuses the file with "format
version 3: upgrade dcp_tiered".  Records that do not fit (stock ``_StorageInfo``, unknown fields,
odd indices, int fields or frame tables that are not exact ints, names that are not strings) stay as they are.
:func:`unpack_storage` checks the table's shape (column widths and lengths, id ranges)
before building anything, then returns the dicts, which ``check_metadata`` validates as
every record is; a checked decode (``checkpoint`` given) returns a :class:`RecordTable`, which
builds each dict when it is asked for.  ``unpack_storage(sdm, pack_storage(sdm, s)) == s``, index hints included.

One concept, the record table, over 600 lines: its packing, its reading with the checks of its rows,
the mappings over it (``PackedRecords`` as a save returns it, ``RecordTable`` as a decode does) and what
is computed over its columns (file sizes, stats, coverage, consistency with the tensor table) share
the column layout and its private helpers (``_columns``, ``_read``, ``_combinations``); cut apart,
each piece would reach into the others' internals.
"""

from __future__ import annotations

import array
import collections.abc
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from dcp_tiered.codecs.frames import MAX_FRAMES_PER_RECORD, frame_step, stored_frame_bounds
from dcp_tiered.dcp.format import (MAX_METADATA_RECORDS, READ_VERSIONS, check_against_chunks, check_against_properties,
                                   check_record, chunk_sizes, dtype_name, expected_sizes, is_downcast, is_native_record, orig_itemsize)
from dcp_tiered.dcp.save_stats import SaveStats, stats_from_records
from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError
from dcp_tiered.storage import safe_relative_name

#: Format version of a ``.metadata`` holding a record table (written; those read are ``HEAD_TABLES``'s keys).
TABLE_VERSION = 3
TABLE_FIELD = "table"
#: The head record's fields of the item and path tables (``dcp.item_table``), by format.  Format 3
#: stores their lists of names as one string each (:func:`pack_strings`) and renamed the fields, so a
#: format-2 reader reaches the version check and asks for an upgrade, not refuses them as damaged.
HEAD_TABLES = {2: ("items", "paths"), 3: ("item_table", "path_table")}
_NAMES = ("file", "codec", "filter", "checksum", "dtype", "orig_dtype", "object")
_INTS = ("fmt", "offset", "raw", "itemsize", "frame")
_KINDS = ("tensor", "bytes")
_ROW = ("item", "chunk", "index", "kind", "nframes", *_INTS, *_NAMES)
_REQUIRED = frozenset(("fmt", "kind", "file", "offset", "length", "raw", "codec", "filter", "itemsize", "frame",
                       "frames", "sums"))
_ALLOWED = _REQUIRED | frozenset(("checksum", "dtype", "orig_dtype", "shape", "object"))
_U64 = 1 << 64
#: Column widths in bytes (3: little-endian 24-bit, written since format 3, as the stored lengths of
#: frames of up to 16 MiB need), with the numpy type each is read as.
_WIDTHS = {1: "<u1", 2: "<u2", 3: "<u4", 4: "<u4", 8: "<u8"}


def _width(top: int) -> int:
    """The narrowest column width that holds ``top``."""
    return next(w for w in _WIDTHS if top < 1 << (8 * w))


def _encode(values: np.ndarray, top: int) -> bytes:
    """The uint64 array ``values`` (at most ``top``) at the narrowest width that holds ``top``."""
    width = _width(top)
    if width == 3:
        return values.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    return values.astype(_WIDTHS[width]).tobytes()


def _uint64(values: Any) -> np.ndarray:
    """The Python ints ``values`` (in ``[0, 2**64)``: OverflowError else) as uint64, through ``array``:
    twice as fast as numpy's conversion of a list of ints."""
    return np.frombuffer(array.array("Q", values), dtype=np.uint64)


def _column(values: "list | np.ndarray") -> bytes:
    """``values`` (ints in ``[0, 2**64)``) as the narrowest little-endian unsigned array."""
    if type(values) is list:
        values = _uint64(values)
    return _encode(values, int(values.max()) if len(values) else 0)


def _stacked(columns: np.ndarray) -> "list[bytes | int]":
    """Each row of the uint64 array ``columns`` as :func:`_column` stores it (one array pass, not one per
    column), or, for a row of more than one entry that holds one value throughout, that value (format 3)."""
    if not columns.shape[1]:
        return [b""] * len(columns)
    tops, lows = columns.max(axis=1).tolist(), columns.min(axis=1).tolist()
    return [top if top == low and len(col) > 1 else _encode(col, top) for col, top, low in zip(columns, tops, lows)]


def _uint(v: Any) -> bool:
    return type(v) is int and 0 <= v < _U64


def _uints(values: Any) -> bool:
    """A tuple of exact ints in ``[0, 2**64)`` (C-speed checks: frame tables can be long)."""
    return type(values) is tuple and (not values or (set(map(type, values)) == {int} and min(values) >= 0
                                                      and max(values) < _U64))


class _Packer:
    """The rows of one record table.  With ``deferred``, the values of the int fields and the frame
    tables are checked once per column by :meth:`table` (None if one is not an exact int in range: pack
    again without), not record by record: a coordinator packs hundreds of thousands of records."""

    def __init__(self, sdm: dict, deferred: bool = False) -> None:
        self.sdm = sdm
        self.deferred = deferred
        self.items = {fqn: i for i, fqn in enumerate(sdm)}
        self.entries = list(sdm.values())
        self.names: dict[str, int] = {}
        self.chunks: dict[str, dict] = {}  # fqn -> chunk offsets -> (position + 1, sizes)
        self.rows: list[tuple] = []
        self.frames: list[int] = []
        self.sums: list[int] = []
        self._ids: dict[tuple, "tuple[int, ...] | None"] = {}  # the name fields of a record -> their ids
        self._fields: dict[tuple, bool] = {}  # a record's field names -> whether the table has them
        # the head: the first row of the item with the fewest chunks (its entry stays on disk as DCP's
        # dataclasses, which the allow-list unpickler steps through): (chunks, row, first frame, index)
        self.head: "tuple[int, int, int, Any] | None" = None

    def _name(self, value: Any) -> "int | None":
        if value is None:
            return 0
        if type(value) is not str:
            return None
        return self.names.setdefault(value, len(self.names) + 1)

    def add(self, index: Any, rec: Any) -> bool:
        """Append ``rec`` as a row when it fits the table exactly; False leaves it to be stored as is."""
        if type(rec) is not dict or type(index) is not MetadataIndex:
            return False
        fields = tuple(rec)  # records share their fields: each set of them is checked once
        fit = self._fields.get(fields)
        if fit is None:
            fit = self._fields[fields] = _REQUIRED <= rec.keys() <= _ALLOWED
        if not fit:
            return False
        item = self.items.get(index.fqn)
        frames, sums, kind = rec["frames"], rec["sums"], rec["kind"]
        if item is None or kind not in _KINDS or type(frames) is not tuple or type(sums) is not tuple \
                or len(frames) != len(sums):
            return False
        ints = (rec["fmt"], rec["offset"], rec["raw"], rec["itemsize"], rec["frame"])
        if not self.deferred and not (_uints(frames) and _uints(sums) and _uints(ints) and ints[0] in _FMTS):
            return False
        try:
            length = sum(frames)  # deferred: frames not yet known to be ints (TypeError: not numbers)
        except TypeError:
            return False
        if rec["length"] != length:
            return False
        if kind == "tensor":
            entry = self.entries[item]
            if type(entry) is not TensorStorageMetadata or index.offset is None:
                return False
            table = self.chunks.get(index.fqn)
            if table is None:
                table = self.chunks[index.fqn] = {tuple(c.offsets): (j + 1, tuple(c.sizes)) for j, c in enumerate(entry.chunks)}
            found = table.get(index.offset)  # a torch.Size hashes and compares as the tuple
            if found is None or rec.get("shape") != found[1]:
                return False
            chunk = found[0]
        elif index.offset is not None or "shape" in rec:
            return False
        else:
            chunk = 0
        hint = index.index
        if not (hint is None or (type(hint) is int and 0 <= hint < _U64 - 1)):
            return False
        key = tuple(map(rec.get, _NAMES))  # records share their strings: their ids are looked up once
        try:
            names = self._ids.get(key, ())
        except TypeError:  # a name field holding an unhashable value: not a string
            return False
        if names == ():
            ids = [self._name(v) for v in key]  # None: a field that is not a string
            names = self._ids[key] = None if None in ids else tuple(ids)
        if names is None:
            return False
        cost = len(self.entries[item].chunks) if chunk else 0
        if self.head is None or cost < self.head[0]:
            self.head = (cost, len(self.rows), len(self.frames), index)
        self.rows.append((item, chunk, 0 if hint is None else hint + 1, 0 if kind == "tensor" else 1, len(frames),
                          *ints, *names))
        self.frames.extend(frames)
        self.sums.extend(sums)
        return True

    def table(self) -> "dict | None":
        """The table of the rows, the head's row first; None when a deferred check refuses a value."""
        rows, frames, sums, names = self.rows, self.frames, self.sums, tuple(self.names)
        _cost, r, at, _index = self.head
        if r:
            end = at + rows[r][4]
            rows = [rows[r], *rows[:r], *rows[r + 1:]]
            frames, sums = (v[at:end] + v[:at] + v[end:] for v in (frames, sums))
        columns = list(zip(*rows))
        if r:  # names numbered in the order the rows first use them, as a decoded table packs again
            head_ids = [i for i in rows[0][_NAME_COLUMNS[0]:] if i]
            order = list(dict.fromkeys([*head_ids, *range(1, len(names) + 1)]))
            new_id = np.zeros(len(names) + 1, dtype=np.int64)
            new_id[order] = np.arange(1, len(order) + 1)
            for j in range(_NAME_COLUMNS[0], len(columns)):
                columns[j] = new_id[list(columns[j])].tolist()
            names = tuple(names[i - 1] for i in order)
        try:
            frames, sums = _uint_array(frames), _uint_array(sums)
            if self.deferred:  # the int fields' columns, checked as the frames are
                for j in _INT_COLUMNS:
                    _uint_array(columns[j])
                if not set(columns[_FMT_COLUMN]) <= _FMTS:
                    return None
        except (TypeError, OverflowError):
            return None
        rows = _uint64(itertools.chain.from_iterable(columns)).reshape(len(columns), len(self.rows))  # ints in range
        return {"n": len(self.rows), "names": pack_strings(names), **dict(zip(_ROW, _stacked(rows))),
                "frames": _column(frames), "sums": _column(sums)}


def _uint_array(values: "list | tuple") -> np.ndarray:
    """``values`` as uint64, when each is an exact int in ``[0, 2**64)``: TypeError for another type,
    OverflowError out of range (numpy alone would take floats and bools)."""
    if values and set(map(type, values)) != {int}:
        raise TypeError("not exact ints")
    return _uint64(values)


_INT_COLUMNS = tuple(range(_ROW.index(_INTS[0]), _ROW.index(_INTS[-1]) + 1))
_FMT_COLUMN = _ROW.index("fmt")
_NAME_COLUMNS = tuple(range(_ROW.index(_NAMES[0]), len(_ROW)))
_FMTS = frozenset(READ_VERSIONS)  # the records' own format versions


def pack_storage(sdm: dict, storage: dict) -> dict:
    """``storage_data`` as format 2 writes it: the records that fit in one table, the others as they are."""
    for deferred in (True, False):  # the frame tables checked as one column, else record by record
        packer, first, rest = _Packer(sdm, deferred), None, {}
        for index, rec in storage.items():
            if packer.add(index, rec):
                first = index if first is None else first
            else:
                rest[index] = rec
        if first is None:
            return storage
        table = packer.table()
        if table is not None:
            return {packer.head[3]: {"fmt": TABLE_VERSION, TABLE_FIELD: table}, **rest}
    raise AssertionError("unreachable: a packer that checks each record's frames makes a table")


def replace_records(sdm: dict, packed: dict, records: "collections.abc.Mapping[MetadataIndex, Any]") -> dict:
    """``packed`` (as :func:`pack_storage` made it) with ``records`` in place of those of their indices:
    their rows dropped from the table over its columns, the new records kept apart from it.  A node's
    view of a save (a few node copies among all its records) so costs array work, not a repack."""
    if not records:
        return packed
    if not is_table(packed):
        return {**packed, **records}
    head_index, head = next(iter(packed.items()))
    rest = {i: r for i, r in itertools.islice(packed.items(), 1, None) if i not in records}
    arrays, frames, sums, _names = _columns(head, sdm, "the committed metadata")
    positions = {fqn: i for i, fqn in enumerate(sdm)}
    wanted = set()
    for index in records:
        item, entry = positions.get(index.fqn), sdm.get(index.fqn)
        if item is None:
            raise KeyError(f"{index.fqn!r} is no item of this checkpoint")
        chunk = 0
        if index.offset is not None:
            offsets = [tuple(c.offsets) for c in entry.chunks]
            chunk = offsets.index(tuple(index.offset)) + 1
        wanted.add(item * (1 << 32) + chunk)
    keys = arrays["item"].astype(np.int64) * (1 << 32) + arrays["chunk"].astype(np.int64)
    keep = ~np.isin(keys, np.fromiter(wanted, dtype=np.int64, count=len(wanted)))
    if keep.all():
        return {**packed, **records}
    if not keep.any():
        return {**rest, **records}
    table = dict(head[TABLE_FIELD])
    table["n"] = int(keep.sum())
    for c in _ROW:
        table[c] = _column(arrays[c][keep])
    in_kept = np.repeat(keep, arrays["nframes"].astype(np.int64))
    table["frames"], table["sums"] = _column(frames[in_kept]), _column(sums[in_kept])
    first = int(np.flatnonzero(keep)[0])
    if first:  # the table is stored under its first row's index
        fqn, chunk, hint = list(sdm)[int(arrays["item"][first])], int(arrays["chunk"][first]), int(arrays["index"][first])
        offset = sdm[fqn].chunks[chunk - 1].offsets if chunk else None
        head_index = MetadataIndex(fqn, offset, hint - 1 if hint else None)
    return {head_index: {**head, TABLE_FIELD: table}, **rest, **records}


def _exact_sum(values: np.ndarray) -> int:
    """The sum of the uint64 array ``values`` as a Python int (no wrap-around)."""
    if len(values) and int(values.max()) > (_U64 - 1) // len(values):
        return sum(values.tolist())
    return int(values.sum(dtype=np.uint64))


def packed_totals(sdm: dict, packed: dict) -> tuple[dict[str, int], SaveStats]:
    """:func:`~dcp_tiered.dcp.format.expected_sizes` and :func:`~dcp_tiered.dcp.save_stats.stats_from_records`
    of ``packed``'s records (keyed by name; table rows in their order, then the records kept apart), over
    the table's columns without building records: the rules of a record's sizes are applied once per
    distinct combination of its kind, item size and dtypes."""
    rest = itertools.islice(packed.items(), 1, None) if is_table(packed) else packed.items()
    table_ends: dict[str, int] = {}
    stats = SaveStats()
    if is_table(packed):
        arrays, frames, _sums, names = _columns(next(iter(packed.values())), sdm, "the committed metadata")
        counts = arrays["nframes"].astype(np.int64)
        bounds = np.concatenate(([0], np.cumsum(frames, dtype=np.uint64)))
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        lengths = bounds[starts + counts] - bounds[starts]
        raw, itemsize = arrays["raw"].astype(np.uint64), arrays["itemsize"].astype(np.uint64)
        top = np.zeros(len(names), dtype=np.uint64)
        np.maximum.at(top, arrays["file"].astype(np.int64), arrays["offset"].astype(np.uint64) + lengths)
        files = np.unique(arrays["file"]).tolist()
        table_ends = {names[f]: int(top[f]) for f in files}
        first, combo = _combinations([arrays[c] for c in ("kind", "itemsize", "dtype", "orig_dtype")])
        flags, per_item = [], []
        for r in first.tolist():
            fields = (int(arrays["itemsize"][r]), _KINDS[arrays["kind"][r]], names[arrays["dtype"][r]],
                      names[arrays["orig_dtype"][r]])
            flags.append(is_downcast(*fields[1:]))
            per_item.append(orig_itemsize(*fields) if flags[-1] else 0)
        down = np.array(flags, dtype=bool)[combo]
        orig_raw = np.where(down, raw // np.maximum(itemsize, 1) * np.array(per_item, dtype=np.uint64)[combo], raw)
        fqns, items = list(sdm), arrays["item"].tolist()
        stats = SaveStats(items=len(items), raw_bytes=_exact_sum(orig_raw), encoded_bytes=_exact_sum(raw),
                          stored_bytes=_exact_sum(lengths),
                          downcast=[fqns[items[r]] for r in np.flatnonzero(down).tolist()])
    apart = list(rest)
    native = [(index, rec) for index, rec in apart if is_native_record(rec)]  # the stats count those only
    more = stats_from_records((index.fqn, rec) for index, rec in native)
    stats.files = len(set(table_ends).union(rec["file"] for _, rec in native))
    ends = table_ends
    for f, end in expected_sizes(rec for _, rec in apart).items():
        ends[f] = max(ends.get(f, 0), end)
    stats.items += more.items
    stats.raw_bytes += more.raw_bytes
    stats.encoded_bytes += more.encoded_bytes
    stats.stored_bytes += more.stored_bytes
    stats.downcast += more.downcast
    return ends, stats


class _PackedValues(collections.abc.ValuesView):
    """The records of a :class:`PackedRecords`; their file ends come from the table's columns."""

    def file_ends(self) -> "dict[str, int] | None":
        table = self._mapping
        return packed_totals(table._sdm, table.packed)[0] if table._records is None else None


def unstored(fqn: str, entry: Any, has: Callable[[str, Any], bool]) -> "str | None":
    """Item ``fqn`` (a non-tensor item, or the first of a tensor's chunks) where ``has(fqn, offset)`` finds no
    record, as a message names it; None when it has them all.  A non-tensor item's record has no offset:
    loads look it up without one."""
    if type(entry) is not TensorStorageMetadata:
        return None if has(fqn, None) else f"non-tensor item {fqn!r}"
    for chunk in entry.chunks:
        if not has(fqn, chunk.offsets):
            return f"chunk {tuple(chunk.offsets)} of tensor {fqn!r}"
    return None


def first_unstored(sdm: dict, records: Any) -> "str | None":
    """The first item of ``sdm`` that no key of ``records`` names (:func:`unstored`); None when each has one."""
    stored = {(i.fqn, i.offset) for i in records}  # a torch.Size offset hashes and compares as its tuple
    has = lambda fqn, offset: (fqn, offset) in stored  # noqa: E731
    return next((what for fqn, entry in sdm.items() if (what := unstored(fqn, entry, has)) is not None), None)


class PackedRecords(collections.abc.Mapping):
    """``storage_data`` of a committed save as DCP broadcasts it to every rank: pickled as the record
    table of format 2 (about 48 bytes a record, where the dicts cost ~330 and stock's records ~205),
    read as the record dicts, which are unpacked on first use.

    ``dcp.save`` returns it on every rank; :func:`~dcp_tiered.dcp.metadata_io.encode_metadata` stores
    its table as is.  Only a save of this job builds one: it is never read from storage.  ``stats`` (the
    save's ``SaveStats``, computed once by the coordinator's writer) travel with it, so no other rank
    unpacks every record to count the save's bytes."""

    __slots__ = ("_sdm", "packed", "_records", "stats")

    def __init__(self, sdm: dict, packed: dict, records: "dict | None" = None, stats: Any = None) -> None:
        self._sdm, self.packed, self._records, self.stats = sdm, packed, records, stats

    @classmethod
    def of(cls, sdm: dict, storage: dict, stats: Any = None) -> "PackedRecords":
        return cls(sdm, pack_storage(sdm, storage), storage, stats)

    def _unpacked(self) -> dict:
        if self._records is None:
            self._records = unpack_storage(self._sdm, self.packed, "the committed metadata")
        return self._records

    def __getitem__(self, index: Any) -> Any:
        return self._unpacked()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._unpacked())

    def __len__(self) -> int:
        if self._records is None and is_table(self.packed):  # counted without unpacking
            return next(iter(self.packed.values()))[TABLE_FIELD]["n"] + len(self.packed) - 1
        return len(self._unpacked())

    def __contains__(self, index: object) -> bool:
        return index in self._unpacked()

    def values(self) -> _PackedValues:
        return _PackedValues(self)

    def missing(self) -> "str | None":
        """Why readers would refuse these records for the save's items: an item or tensor chunk that no record
        holds, or two chunks of a tensor at one offset (a record is found by its chunk's offset: one would
        stand for both); None when each chunk has its own record.  The table's rows are distinct chunks of the
        save's items, so as many rows as chunks is all of them; else the records are looked through."""
        sdm = self._sdm
        need = sum(len(e.chunks) if type(e) is TensorStorageMetadata else 1 for e in sdm.values())
        if is_table(self.packed) and next(iter(self.packed.values()))[TABLE_FIELD]["n"] == need:
            return None
        records = self._unpacked()
        unstored = first_unstored(sdm, records)
        if unstored is not None:
            return f"{unstored} has no storage record (no rank's write results hold it)"
        for fqn, entry in sdm.items():  # every chunk found, yet fewer records than chunks: two share an offset
            if type(entry) is TensorStorageMetadata:
                seen: set[tuple] = set()
                for chunk in entry.chunks:
                    if tuple(chunk.offsets) in seen:
                        return f"tensor {fqn!r} has two chunks at offset {tuple(chunk.offsets)}"
                    seen.add(tuple(chunk.offsets))
        return None

    def inconsistent(self, checkpoint: str) -> "str | None":
        """Why readers would refuse a record against the tensor table (a planner changed the table after
        the ranks wrote: a dtype other than the one written, a chunk in another shape), in their checks'
        words; None when every record agrees with it.  The table's rows by their dtype columns (a row's
        shape is its chunk's by construction); each record kept apart from the table by the readers'
        per-record checks."""
        sdm, packed = self._sdm, self.packed
        rest = itertools.islice(packed.items(), 1, None) if is_table(packed) else packed.items()
        sizes: dict[str, dict] = {}  # by item: a node leader checks a few copies of a large save
        try:
            for index, rec in rest:
                if is_native_record(rec) and type(index) is MetadataIndex and index.fqn in sdm:
                    _check_one((index, rec), sdm, checkpoint, None)
                    if index.fqn not in sizes:
                        sizes[index.fqn] = chunk_sizes({index.fqn: sdm[index.fqn]})
                    check_against_chunks(rec, index, sizes[index.fqn], checkpoint)
            if is_table(packed):
                arrays, _frames, _sums, names = _columns(next(iter(packed.values())), sdm, checkpoint)
                tensor = np.flatnonzero(arrays["kind"] == 0)
                item = arrays["item"].astype(np.int64)[tensor]
                bad = _dtype_differs(list(sdm.values()), names, arrays, item, tensor)
                if bad.any():
                    index, rec = list(self._unpacked().items())[int(tensor[np.argmax(bad)])]  # rows first, in order
                    check_against_properties(rec, sdm[index.fqn], index.fqn, checkpoint)
        except CorruptCheckpointError as exc:
            return str(exc)
        return None

    def totals(self) -> tuple[dict[str, int], SaveStats]:
        """The data files' expected sizes and the save's stats, over the table (:func:`packed_totals`)."""
        return packed_totals(self._sdm, self.packed)

    def __reduce__(self) -> tuple:
        return PackedRecords, (self._sdm, self.packed, None, self.stats)


def _bad(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: the record table {what}; the metadata is damaged or crafted")


def _read(table: dict, name: str, count: int, source: str, one_value: bool = False) -> np.ndarray:
    """Column ``name`` of ``count`` entries; its byte length must be ``count`` times a known width.  With
    ``one_value`` (a row column of the record table, whose ``count`` was checked against the records a save
    writes) it may be one int, every entry's value."""
    raw = table.get(name)
    if one_value and type(raw) is int and 0 <= raw < _U64 and count > 1:
        return np.full(count, raw, dtype=_WIDTHS[_width(raw)])
    if type(raw) is not bytes:
        raise _bad(source, f"lacks column {name!r}")
    width = len(raw) // count if count else 0
    if (width not in _WIDTHS or width * count != len(raw)) if count else raw:
        raise _bad(source, f"column {name!r} has {len(raw)} bytes for {count} entries")
    if width == 3:
        wide = np.zeros((count, 4), dtype=np.uint8)
        wide[:, :3] = np.frombuffer(raw, dtype=np.uint8).reshape(count, 3)
        return wide.view("<u4").reshape(count)
    return np.frombuffer(raw, dtype=_WIDTHS.get(width, "<u1"))


def head_tables(head: dict, source: str) -> tuple[Any, Any]:
    """The item and path tables of a head record (None where absent), once its format is one this
    version reads and it has no other fields."""
    fields = HEAD_TABLES.get(head.get("fmt")) if type(head.get("fmt")) is int else None
    if fields is None or not head.keys() <= {"fmt", TABLE_FIELD, *fields}:
        raise UnsupportedFormatError(f"{source} holds a record table of format {head.get('fmt')!r}; this version "
                                     f"reads {' and '.join(map(str, HEAD_TABLES))}: upgrade dcp_tiered")
    return head.get(fields[0]), head.get(fields[1])


def pack_strings(values: tuple) -> "bytes | tuple":
    """A list of names as format 3 stores it: UTF-8, each name ended by a NUL, one ``bytes`` (one
    unpickler step where a tuple takes two a name); the tuple itself when a name holds a NUL or does
    not encode (a lone surrogate)."""
    try:
        if any("\0" in v for v in values):
            return values
        return "\0".join(values).encode("utf-8") + b"\0" if values else b""
    except UnicodeEncodeError:
        return values


def read_strings(value: Any, source: str, what: str) -> tuple:
    """The names :func:`pack_strings` stored (a tuple of ``str`` is read as it is)."""
    if type(value) is bytes and (not value or value.endswith(b"\0")):
        try:
            return tuple(value.decode("utf-8").split("\0")[:-1])
        except UnicodeDecodeError:
            pass
    elif type(value) is tuple and set(map(type, value)) <= {str}:
        return value
    raise _bad(source, f"has {what} that are not strings")


def is_table(storage: Any) -> bool:
    """Whether ``storage_data`` (as unpickled) starts with a format-2 record table."""
    if type(storage) is not dict or not storage:
        return False
    first = next(iter(storage.values()))
    return type(first) is dict and TABLE_FIELD in first


def _columns(head: dict, sdm: dict, source: str) -> tuple[dict, list, list, tuple]:
    """Check the table's shape and ranges (vectorized), then return its columns as lists."""
    head_tables(head, source)
    table = head[TABLE_FIELD]
    if type(table) is not dict or type(table.get("n")) is not int or not 1 <= table["n"] <= MAX_METADATA_RECORDS:
        raise _bad(source, "has no valid record count")
    n = table["n"]
    slots = sum(len(e.chunks) if type(e) is TensorStorageMetadata else 1 for e in sdm.values())
    if n > slots:  # each row holds a distinct chunk or non-tensor item: more rows are refused before any is read
        raise _bad(source, f"has {n} rows for the {slots} chunks and non-tensor items of the tensor table")
    names = read_strings(table.get("names"), source, "names")
    cols = {c: _read(table, c, n, source, one_value=True) for c in _ROW}
    limits = {"item": len(sdm) - 1, "kind": len(_KINDS) - 1, "nframes": MAX_FRAMES_PER_RECORD,
              **{c: len(names) for c in _NAMES}}
    for c, top in limits.items():
        if int(cols[c].max()) > top:
            raise _bad(source, f"column {c!r} holds values above {top}")
    total = int(cols["nframes"].sum(dtype=np.uint64))
    frames, sums = (_read(table, c, total, source) for c in ("frames", "sums"))
    return cols, frames, sums, (None, *names)


def unpack_storage(sdm: dict, storage: dict, source: str, *, checkpoint: "str | None" = None,
                   max_object_bytes: "int | None" = None) -> "dict | RecordTable":
    """``storage_data`` in memory (one dict record per index) from its on-disk form (see module doc).

    ``sdm`` must already be checked (``state_dict_metadata`` types).  With ``checkpoint`` (the name
    messages give) the table's records are checked as ``check_metadata`` checks each record
    (:func:`_check_rows`), and only the records stored apart from the table (``RecordTable.rest``)
    still need it; without, every record does.  With ``checkpoint`` the result is a
    :class:`RecordTable` (records built when asked for) unless an empty chunk could make two rows
    one index; else a dict.
    """
    if not is_table(storage):
        return storage
    items = iter(storage.items())
    first_index, head = next(items)
    arrays, frame_col, sum_col, names = _columns(head, sdm, source)
    if checkpoint is not None and not ((arrays["kind"] == 0) & (arrays["raw"] == 0)).any():
        table = RecordTable(sdm, arrays, frame_col, sum_col, names, source)
        if table.key(0) != first_index:
            raise _bad(source, "is not stored under its first record's index")
        _check_rows(arrays, frame_col, names, sdm, table.rows(), checkpoint, max_object_bytes)
        for index, rec in items:
            if index in table:
                raise _bad(source, f"and another record both hold {getattr(index, 'fqn', index)!r}")
            table.rest[index] = rec
        table._packed = storage
        return table
    cols = {c: v.tolist() for c, v in arrays.items()}
    frames, sums = frame_col.tolist(), sum_col.tolist()
    fqns, out, at, new, index_type = list(sdm), {}, 0, object.__new__, MetadataIndex
    chunk_lists = [getattr(e, "chunks", ()) if type(e) is TensorStorageMetadata else () for e in sdm.values()]
    rows = zip(*(cols[c] for c in _ROW))
    for item, chunk, hint, kind, nframes, fmt, offset, raw, itemsize, frame, *ids in rows:
        fqn = fqns[item]
        fr, sm = tuple(frames[at:at + nframes]), tuple(sums[at:at + nframes])
        at += nframes
        file, codec, filt, check, dtype, orig, obj = ids
        rec = {"fmt": fmt, "file": names[file], "offset": offset, "length": sum(fr), "raw": raw,
               "codec": names[codec], "frames": fr, "sums": sm}
        if check:
            rec["checksum"] = names[check]
        rec["kind"], rec["itemsize"], rec["filter"] = _KINDS[kind], itemsize, names[filt]
        if dtype:
            rec["dtype"] = names[dtype]
        if orig:
            rec["orig_dtype"] = names[orig]
        index = new(index_type)  # as MetadataIndex(fqn, offsets, hint) builds it, without its checks
        fields = index.__dict__
        fields["fqn"], fields["index"] = fqn, hint - 1 if hint else None
        if kind == 0:
            chunks = chunk_lists[item]
            if not 1 <= chunk <= len(chunks):
                raise _bad(source, f"names chunk {chunk} of {fqn!r}, which has {len(chunks)}")
            fields["offset"], rec["shape"] = chunks[chunk - 1].offsets, tuple(chunks[chunk - 1].sizes)
        elif chunk:
            raise _bad(source, f"gives the non-tensor item {fqn!r} a chunk")
        if obj:
            rec["object"] = names[obj]
        rec["frame"] = frame
        out[index] = rec
    if len(out) != len(cols["item"]):  # two rows under one index: the second replaced the first
        _refuse_duplicate(cols, fqns, chunk_lists, source)
    if next(iter(out)) != first_index:
        raise _bad(source, "is not stored under its first record's index")
    if checkpoint is not None:
        _check_rows(arrays, frame_col, names, sdm, list(out.items()), checkpoint, max_object_bytes)
    for index, rec in items:
        if index in out:
            raise _bad(source, f"and another record both hold {getattr(index, 'fqn', index)!r}")
        out[index] = rec
    return out


class RecordTable(collections.abc.Mapping):
    """``storage_data`` of a decoded format-2 ``.metadata``: the record table's rows, checked as columns,
    become record dicts (equal to what :func:`unpack_storage` builds eagerly) only when looked up or
    iterated, so a rank restoring its own shards builds their records only; ``rest``: the records
    stored apart from the table.  Read-only; pickled as a plain dict."""

    def __init__(self, sdm: dict, arrays: dict, frames: np.ndarray, sums: np.ndarray, names: tuple,
                 source: str) -> None:
        self._fqns = list(sdm)
        self._item_of = {fqn: i for i, fqn in enumerate(self._fqns)}
        self._chunks = [e.chunks if type(e) is TensorStorageMetadata else () for e in sdm.values()]
        self._offsets: dict[int, dict] = {}  # item -> chunk offsets -> position + 1, made when first asked
        self._names = names
        self._cols = {c: v.tolist() for c, v in arrays.items()}
        self._frames, self._sums = frames.tolist(), sums.tolist()
        self._starts = (np.cumsum(arrays["nframes"], dtype=np.int64) - arrays["nframes"]).tolist()
        self.n = len(self._cols["item"])
        item, chunk, kind = (arrays[c].astype(np.int64) for c in ("item", "chunk", "kind"))
        nchunks = np.array([len(c) for c in self._chunks], dtype=np.int64)
        bad = np.where(kind == 0, (chunk < 1) | (chunk > nchunks[item]), chunk != 0)
        if bad.any():
            r = int(np.argmax(bad))
            fqn, c = self._fqns[int(item[r])], int(chunk[r])
            raise _bad(source, f"names chunk {c} of {fqn!r}, which has {len(self._chunks[int(item[r])])}" if kind[r] == 0
                       else f"gives the non-tensor item {fqn!r} a chunk")
        self._stride = int(nchunks.max(initial=0)) + 1  # any chunk of any item, not only those with rows
        self._row = dict(zip((item * self._stride + chunk).tolist(), range(self.n)))
        if len(self._row) != self.n:  # two rows under one (item, chunk)
            _refuse_duplicate(self._cols, self._fqns, self._chunks, source)
        self._keys: list = [None] * self.n
        self._built: list = [None] * self.n
        self.rest: dict = {}
        self._sdm, self._packed = sdm, None  # the on-disk form (head and records apart), set by unpack_storage

    def _row_of(self, index: Any) -> "int | None":
        item = self._item_of.get(getattr(index, "fqn", None)) if type(index) is MetadataIndex else None
        if item is None:
            return None
        offset = index.offset
        if offset is None:
            chunk = 0
        else:
            table = self._offsets.get(item)
            if table is None:
                table = self._offsets[item] = {c.offsets: j + 1 for j, c in enumerate(self._chunks[item])}
            chunk = table.get(offset)  # a torch.Size hashes and compares as its tuple
            if chunk is None:
                return None
        return self._row.get(item * self._stride + chunk)

    def key(self, r: int) -> MetadataIndex:
        """The index of row ``r`` (as ``MetadataIndex(fqn, offsets, hint)`` builds it)."""
        index = self._keys[r]
        if index is None:
            cols = self._cols
            item, chunk, hint = cols["item"][r], cols["chunk"][r], cols["index"][r]
            index = object.__new__(MetadataIndex)
            fields = index.__dict__
            fields["fqn"], fields["index"] = self._fqns[item], hint - 1 if hint else None
            if chunk:
                fields["offset"] = self._chunks[item][chunk - 1].offsets
            self._keys[r] = index
        return index

    def record(self, r: int) -> dict:
        """The record dict of row ``r``."""
        rec = self._built[r]
        if rec is not None:
            return rec
        cols, names = self._cols, self._names
        at, nframes = self._starts[r], cols["nframes"][r]
        fr, sm = tuple(self._frames[at:at + nframes]), tuple(self._sums[at:at + nframes])
        rec = {"fmt": cols["fmt"][r], "file": names[cols["file"][r]], "offset": cols["offset"][r], "length": sum(fr),
               "raw": cols["raw"][r], "codec": names[cols["codec"][r]], "frames": fr, "sums": sm}
        if cols["checksum"][r]:
            rec["checksum"] = names[cols["checksum"][r]]
        kind = cols["kind"][r]
        rec["kind"], rec["itemsize"], rec["filter"] = _KINDS[kind], cols["itemsize"][r], names[cols["filter"][r]]
        for field, column in (("dtype", "dtype"), ("orig_dtype", "orig_dtype")):
            if cols[column][r]:
                rec[field] = names[cols[column][r]]
        if kind == 0:
            rec["shape"] = tuple(self._chunks[cols["item"][r]][cols["chunk"][r] - 1].sizes)
        if cols["object"][r]:
            rec["object"] = names[cols["object"][r]]
        rec["frame"] = cols["frame"][r]
        self._built[r] = rec
        return rec

    def rows(self) -> "_Rows":
        """The rows as a sequence of ``(index, record)``, built when indexed."""
        return _Rows(self)

    def view(self) -> "RecordTable":
        """The same table for another caller: the columns and indexes shared (read-only), the records it
        builds and the records kept apart its own, so one caller's edit of a record is not another's."""
        out = object.__new__(RecordTable)  # not copy.copy: the table pickles (and so copies) as a dict
        out.__dict__.update(self.__dict__)
        out._built = [None] * self.n
        out.rest = {index: dict(rec) if type(rec) is dict else rec for index, rec in self.rest.items()}
        return out

    def file_ends(self) -> dict[str, int]:
        """Each data file's size as :func:`~dcp_tiered.dcp.format.expected_sizes` gives it, over the
        table's columns (:func:`packed_totals`): no record is built."""
        return packed_totals(self._sdm, self._packed)[0]

    def row_codecs(self) -> set[str]:
        """The codecs the table's rows name (not the records kept apart, ``rest``)."""
        return {self._names[i] for i in set(self._cols["codec"])}

    def covered(self) -> np.ndarray:
        """Per item of the tensor table, whether the table's rows hold every chunk (non-tensor: a row)."""
        counts = np.bincount(np.array(self._cols["item"], dtype=np.int64), minlength=len(self._fqns))
        need = np.array([len(c) if type(c) is list else 1 for c in self._chunks], dtype=np.int64)
        return counts == need  # rows hold distinct valid chunks: as many as there are is all of them

    def largest_bytes_item(self) -> int:
        """The largest raw size a non-tensor row declares (0: none)."""
        return max((raw for raw, kind in zip(self._cols["raw"], self._cols["kind"]) if kind == 1), default=0)

    def __getitem__(self, index: Any) -> dict:
        r = self._row_of(index)
        return self.rest[index] if r is None else self.record(r)

    def __contains__(self, index: object) -> bool:
        return self._row_of(index) is not None or index in self.rest

    def __iter__(self) -> Iterator[Any]:
        for r in range(self.n):
            yield self.key(r)
        yield from self.rest

    def __len__(self) -> int:
        return self.n + len(self.rest)

    def items(self) -> "_Items":
        return _Items(self)

    def values(self) -> "_Values":
        return _Values(self)

    def __reduce__(self) -> tuple:
        return dict, (list(self.items()),)


class _Items(collections.abc.ItemsView):
    """A :class:`RecordTable`'s items, row by row (no lookup by index)."""

    def __iter__(self) -> Iterator[tuple]:
        table = self._mapping
        for r in range(table.n):
            yield table.key(r), table.record(r)
        yield from table.rest.items()


class _Values(collections.abc.ValuesView):
    """A :class:`RecordTable`'s records, row by row; their file ends come from the table's columns."""

    def file_ends(self) -> dict[str, int]:
        return self._mapping.file_ends()

    def __iter__(self) -> Iterator[dict]:
        table = self._mapping
        for r in range(table.n):
            yield table.record(r)
        yield from table.rest.values()


class _Rows(collections.abc.Sequence):
    def __init__(self, table: RecordTable) -> None:
        self.table = table

    def __len__(self) -> int:
        return self.table.n

    def __getitem__(self, r: Any) -> tuple:
        return self.table.key(r), self.table.record(r)


def _refuse_duplicate(cols: dict, fqns: list, chunk_lists: list, source: str) -> None:
    """Raise for the first row whose index (item and chunk offsets) an earlier row has."""
    seen: set = set()
    for item, chunk in zip(cols["item"], cols["chunk"]):
        offsets = tuple(chunk_lists[item][chunk - 1].offsets) if chunk else None
        if (item, offsets) in seen:
            raise _bad(source, f"has two records for {fqns[item]!r} at {offsets or ()}")
        seen.add((item, offsets))
    raise AssertionError("unreachable: no two rows share an index")


#: The fields of a row that are the same for many rows (strings, item size, frame size): the rules on
#: them are checked once per distinct combination, by the per-record checks themselves.  The data file
#: counts only as named or not: each rank has its own, and its name is checked once per file.
_STATIC = ("fmt", "kind", "itemsize", "frame", *(c for c in _NAMES if c != "file"))
_BIG = 1 << 62


def _check_rows(cols: dict, frames: np.ndarray, names: tuple, sdm: dict, records: list, checkpoint: str,
                max_object_bytes: "int | None") -> None:
    """Refuse the table's records that :func:`~dcp_tiered.dcp.format.check_record` (and the checks of a
    record against the tensor table) would refuse, in time linear in the rows and frames.

    ``check_record`` itself checks one record of each distinct combination of the static fields
    (:data:`_STATIC`), which covers every rule on strings, codecs, dtypes, item and frame sizes, and
    each data file's name is checked once (``safe_relative_name``, as for each record); the
    rules on each row's own numbers (sizes, frame count, each frame's stored size against its codec's
    bounds, shape against raw bytes, kind against the tensor table, the non-tensor size cap) run over
    the columns.  The first row these refuse is checked again by the per-record functions, so the
    error is theirs.  (``records``: the rows as built, ``(index, record)`` in row order.)"""
    n = len(records)
    first, combo = _combinations([cols[c] for c in _STATIC] + [(cols["file"] != 0).astype(np.uint8)])
    files, at = np.unique(cols["file"], return_index=True)
    key = records.table.key if type(records) is _Rows else (lambda r: records[r][0])  # no record built for a name
    for f, r in zip(files.tolist(), at.tolist()):
        if f:  # a row without a file is its combination's: check_record refuses it
            safe_relative_name(names[f], f"record of {key(r).fqn!r} in {checkpoint}")
    headers, steps, full_lo = (np.empty(len(first), dtype=np.uint64) for _ in range(3))
    for c, r in enumerate(first.tolist()):
        rec = _check_one(records[int(r)], sdm, checkpoint, max_object_bytes)
        step = frame_step(rec["frame"], rec["itemsize"])
        headers[c] = stored_frame_bounds(rec["codec"], rec["filter"], rec["itemsize"], 0)[1]
        steps[c], full_lo[c] = step, stored_frame_bounds(rec["codec"], rec["filter"], rec["itemsize"], step)[0]
    raw, offset, itemsize, nframes = (cols[c].astype(np.uint64) for c in ("raw", "offset", "itemsize", "nframes"))
    kind, item, chunk = cols["kind"], cols["item"].astype(np.int64), cols["chunk"].astype(np.int64)
    step = steps[combo]
    bad = (offset >= _BIG) | (raw >= _BIG)
    if bad.any():  # refused before any arithmetic on them (which would wrap)
        _refuse(records, bad, sdm, checkpoint, max_object_bytes)
    bad |= (raw % itemsize != 0) | (nframes != (raw + step - 1) // step)
    entries = list(sdm.values())
    is_bytes = np.array([type(e) is BytesStorageMetadata for e in entries], dtype=bool)
    bad |= (kind == 1) != is_bytes[item]
    if max_object_bytes is not None:
        bad |= (kind == 1) & (raw > max_object_bytes)
    tensor = kind == 0
    if tensor.any():  # the shape is the chunk's (unpack took it from there): its items must be the raw bytes
        base, numels = _chunk_numels(entries)
        at = base[item[tensor]] + chunk[tensor] - 1
        bad[tensor] |= numels[at] != raw[tensor] // itemsize[tensor]
        bad[tensor] |= _dtype_differs(entries, names, cols, item[tensor], tensor)
    if len(frames):
        row = np.repeat(np.arange(n), nframes.astype(np.int64))
        last = np.zeros(len(frames), dtype=bool)
        last[np.cumsum(nframes.astype(np.int64))[nframes > 0] - 1] = True
        c = combo[row]
        last_raw = raw - (nframes - 1) * step  # rows with frames only: nframes >= 1 there
        hi = np.where(last, headers[c] + last_raw[row], headers[c] + steps[c])
        lo = np.where(last, _last_lo(cols, names, combo, first, last_raw, nframes)[row], full_lo[c])
        over = (frames < lo) | (frames > hi)
        bad[row[over]] = True
    if bad.any():
        _refuse(records, bad, sdm, checkpoint, max_object_bytes)
    lengths = np.zeros(n, dtype=np.uint64)  # each frame is within its bound here, so the sums are exact
    if len(frames):
        lengths[nframes > 0] = np.add.reduceat(frames.astype(np.uint64), np.flatnonzero(np.r_[True, row[1:] != row[:-1]]))
    bad = (lengths >= _BIG) | _shared_bytes(cols, lengths)
    if bad.any():
        _refuse(records, bad, sdm, checkpoint, max_object_bytes)


def _combinations(columns: list) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of ``columns`` (equal-length unsigned arrays): the first row of each, in the
    columns' lexicographic order, and each row's number among them (``np.unique(axis=0)``'s index and
    inverse); as one sort of a mixed-radix key when the key fits 63 bits, which it does when only a
    few fields vary much (the file names)."""
    tops = [int(c.max()) + 1 if len(c) else 1 for c in columns]
    if math.prod(tops) >= 1 << 63:
        _rows, first, combo = np.unique(np.stack([c.astype(np.uint64) for c in columns], axis=1), axis=0,
                                        return_index=True, return_inverse=True)
        return first, combo.reshape(-1)
    key = np.zeros(len(columns[0]), dtype=np.int64)
    for c, top in zip(columns, tops):
        key = key * top + c.astype(np.int64)
    _keys, first, combo = np.unique(key, return_index=True, return_inverse=True)
    return first, combo.reshape(-1)


def _refuse(records: list, bad: np.ndarray, sdm: dict, checkpoint: str, max_object_bytes: "int | None") -> None:
    """Raise for the first row ``bad`` marks: the per-record checks' own error where they refuse it."""
    r = int(np.flatnonzero(bad)[0])
    _check_one(records[r], sdm, checkpoint, max_object_bytes)
    raise CorruptCheckpointError(f"record of {records[r][0].fqn!r} in {checkpoint} has sizes, a dtype or a place in "
                                 "its data file that are impossible for its codec, shape and the other records (the "
                                 "metadata is damaged or crafted)")


def _dtype_differs(entries: list, names: tuple, cols: dict, items: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Of the tensor ``rows`` (of the items ``items``), which were saved in another dtype than the one their
    item's tensor properties give: the rule of ``check_against_properties``, over the columns."""
    return _dtype_ids(entries, names)[items] != _row_dtype(cols)[rows]


def _dtype_ids(entries: list, names: tuple) -> np.ndarray:
    """Per item, the name id of the dtype its tensor properties give (-1: not a name of the table)."""
    ids = {name: i for i, name in enumerate(names) if name is not None}
    out = np.full(len(entries), -1, dtype=np.int64)
    for i, entry in enumerate(entries):
        if type(entry) is TensorStorageMetadata:
            out[i] = ids.get(dtype_name(entry.properties.dtype), -1)
    return out


def _row_dtype(cols: dict) -> np.ndarray:
    """Per row, the name id of the dtype its tensor was saved as: the original dtype, else the stored one."""
    orig, dtype = cols["orig_dtype"].astype(np.int64), cols["dtype"].astype(np.int64)
    return np.where(orig != 0, orig, dtype)


def _shared_bytes(cols: dict, lengths: np.ndarray) -> np.ndarray:
    """Rows whose stored bytes (``lengths``: each row's) overlap another row's in the same data file (a
    record copied onto another index would load the same values into both, every checksum valid)."""
    n = len(lengths)
    file, offset = cols["file"].astype(np.int64), cols["offset"].astype(np.uint64)
    stored = np.flatnonzero(lengths > 0)  # without empty records, an overlap shows between neighbours
    order = stored[np.lexsort((offset[stored], file[stored]))]
    f, o, e = file[order], offset[order], offset[order] + lengths[order]
    clash = (f[1:] == f[:-1]) & (o[1:] < e[:-1])
    bad = np.zeros(n, dtype=bool)
    bad[order[1:][clash]] = True
    return bad


def _check_one(row: tuple, sdm: dict, checkpoint: str, max_object_bytes: "int | None") -> dict:
    """The per-record checks of one row: ``check_record``, its kind and shape against the tensor table,
    its file name."""
    index, rec = row
    fqn = index.fqn
    check_record(rec, fqn, checkpoint, max_object_bytes)
    safe_relative_name(rec["file"], f"record of {fqn!r} in {checkpoint}")
    if (rec["kind"] == "bytes") != (type(sdm[fqn]) is BytesStorageMetadata):
        raise CorruptCheckpointError(f"{checkpoint}: record of {fqn!r} is a {rec['kind']} item, but "
                                     "state_dict_metadata says otherwise")
    check_against_properties(rec, sdm[fqn], fqn, checkpoint)
    # no check_against_chunks: a row's shape and offsets are its chunk's, by unpack_storage
    return rec


def _chunk_numels(entries: list) -> tuple[np.ndarray, np.ndarray]:
    """Where each item's chunks start in one flat array, and the element count of every chunk there
    (capped at 2**63: no raw size is that large)."""
    chunk_lists = [entry.chunks if type(entry) is TensorStorageMetadata else () for entry in entries]
    sizes = [chunk.sizes for chunks in chunk_lists for chunk in chunks]
    cap = 1 << 63
    if max(map(max, filter(None, sizes)), default=0) < _BIG:
        numels = [n if n < cap else cap for n in map(math.prod, sizes)]
    else:  # a dimension of 2**62 or more is refused as check_record does: no raw size matches
        numels = [cap if s and max(s) >= _BIG else min(math.prod(s), cap) for s in sizes]
    counts_arr = np.fromiter(map(len, chunk_lists), dtype=np.int64, count=len(chunk_lists))
    return np.cumsum(counts_arr) - counts_arr, np.array(numels, dtype=np.uint64)


def _last_lo(cols: dict, names: tuple, combo: np.ndarray, first: np.ndarray, last_raw: np.ndarray,
             nframes: np.ndarray) -> np.ndarray:
    """The smallest stored size of each row's last frame (0 for rows without frames): one bounds
    lookup per distinct (combination, raw size of the last frame)."""
    out = np.zeros(len(combo), dtype=np.uint64)
    has = np.flatnonzero(nframes > 0)
    if not len(has):
        return out
    at, back = _combinations([combo[has].astype(np.uint64), last_raw[has]])
    pairs = zip(combo[has][at].tolist(), last_raw[has][at].tolist())
    los = np.empty(len(at), dtype=np.uint64)
    for k, (c, lr) in enumerate(pairs):
        r = int(first[c])  # the combination's fields: codec, filter, item size
        los[k] = stored_frame_bounds(names[cols["codec"][r]], names[cols["filter"][r]], int(cols["itemsize"][r]), lr)[0]
    out[has] = los[back]
    return out
