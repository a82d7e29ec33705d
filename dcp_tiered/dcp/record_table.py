"""Format 2 ``.metadata``: the native records of ``storage_data`` as one columnar table.

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

The table is the record of the first packed item: ``{"fmt": 2, "table": {...}}``, so a
reader of format 1 refuses the file with "format version 2: upgrade dcp_tiered".  Records
that do not fit (stock ``_StorageInfo``, unknown fields, odd indices) stay as they are.
:func:`unpack_storage` checks the table's shape (column widths and lengths, id ranges)
before building anything, then returns the dicts, which ``check_metadata`` validates as
every record is.  ``unpack_storage(sdm, pack_storage(sdm, s)) == s``, index hints included.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Iterator

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_tiered.codecs.frames import MAX_FRAMES_PER_RECORD
from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError

#: Format version of a ``.metadata`` holding a record table.
TABLE_VERSION = 2
TABLE_FIELD = "table"
#: Fields of the head record: the record table, and the item and path tables (``dcp.item_table``).
_HEAD = frozenset(("fmt", TABLE_FIELD, "items", "paths"))
_NAMES = ("file", "codec", "filter", "checksum", "dtype", "orig_dtype", "object")
_INTS = ("fmt", "offset", "raw", "itemsize", "frame")
_KINDS = ("tensor", "bytes")
_ROW = ("item", "chunk", "index", "kind", "nframes", *_INTS, *_NAMES)
_REQUIRED = frozenset(("fmt", "kind", "file", "offset", "length", "raw", "codec", "filter", "itemsize", "frame",
                       "frames", "sums"))
_ALLOWED = _REQUIRED | frozenset(("checksum", "dtype", "orig_dtype", "shape", "object"))
_U64 = 1 << 64
_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def _column(values: list) -> bytes:
    """``values`` (ints in ``[0, 2**64)``) as the narrowest little-endian unsigned array."""
    top = max(values, default=0)
    width = next(w for w in _WIDTHS if top < 1 << (8 * w))
    return np.array(values, dtype=np.uint64).astype(_WIDTHS[width]).tobytes()


def _uint(v: Any) -> bool:
    return type(v) is int and 0 <= v < _U64


def _uints(values: Any) -> bool:
    return type(values) is tuple and all(type(v) is int and 0 <= v < _U64 for v in values)


class _Packer:
    def __init__(self, sdm: dict) -> None:
        self.sdm = sdm
        self.items = {fqn: i for i, fqn in enumerate(sdm)}
        self.names: dict[str, int] = {}
        self.chunks: dict[str, dict] = {}  # fqn -> chunk offsets -> position + 1
        self.rows: list[tuple] = []
        self.frames: list[int] = []
        self.sums: list[int] = []

    def _chunk(self, fqn: str, entry: Any, offset: Any) -> "int | None":
        table = self.chunks.get(fqn)
        if table is None:
            table = self.chunks[fqn] = {tuple(c.offsets): j + 1 for j, c in enumerate(entry.chunks)}
        return table.get(tuple(offset))

    def _name(self, value: Any) -> "int | None":
        if value is None:
            return 0
        if type(value) is not str:
            return None
        return self.names.setdefault(value, len(self.names) + 1)

    def add(self, index: Any, rec: Any) -> bool:
        """Append ``rec`` as a row when it fits the table exactly; False leaves it to be stored as is."""
        if type(rec) is not dict or type(index) is not MetadataIndex or not _REQUIRED <= rec.keys() <= _ALLOWED:
            return False
        item, entry = self.items.get(index.fqn), self.sdm.get(index.fqn)
        frames, sums, kind = rec["frames"], rec["sums"], rec["kind"]
        if item is None or kind not in _KINDS or not (_uints(frames) and _uints(sums) and len(frames) == len(sums)):
            return False
        if not all(_uint(rec[f]) for f in _INTS) or rec["fmt"] not in (1, TABLE_VERSION) or rec["length"] != sum(frames):
            return False
        if kind == "tensor":
            if type(entry) is not TensorStorageMetadata or index.offset is None:
                return False
            chunk = self._chunk(index.fqn, entry, index.offset)
            if chunk is None or rec.get("shape") != tuple(entry.chunks[chunk - 1].sizes):
                return False
        elif index.offset is not None or "shape" in rec:
            return False
        else:
            chunk = 0
        hint = index.index
        if not (hint is None or (type(hint) is int and 0 <= hint < _U64 - 1)):
            return False
        names = [self._name(rec.get(f)) for f in _NAMES]
        if None in names:
            return False
        self.rows.append((item, chunk, 0 if hint is None else hint + 1, _KINDS.index(kind), len(frames),
                          *(rec[f] for f in _INTS), *names))
        self.frames.extend(frames)
        self.sums.extend(sums)
        return True

    def table(self) -> dict:
        columns = list(zip(*self.rows))
        return {"n": len(self.rows), "names": tuple(self.names), **{c: _column(list(v)) for c, v in zip(_ROW, columns)},
                "frames": _column(self.frames), "sums": _column(self.sums)}


def pack_storage(sdm: dict, storage: dict) -> dict:
    """``storage_data`` as format 2 writes it: the records that fit in one table, the others as they are."""
    packer, first, rest = _Packer(sdm), None, {}
    for index, rec in storage.items():
        if packer.add(index, rec):
            first = index if first is None else first
        else:
            rest[index] = rec
    if first is None:
        return storage
    return {first: {"fmt": TABLE_VERSION, TABLE_FIELD: packer.table()}, **rest}


class PackedRecords(collections.abc.Mapping):
    """``storage_data`` of a committed save as DCP broadcasts it to every rank: pickled as the record
    table of format 2 (about 48 bytes a record, where the dicts cost ~330 and stock's records ~205),
    read as the record dicts, which are unpacked on first use.

    ``dcp.save`` returns it on every rank; :func:`~dcp_tiered.dcp.metadata_io.encode_metadata` stores
    its table as is.  Only a save of this job builds one: it is never read from storage."""

    __slots__ = ("_sdm", "packed", "_records")

    def __init__(self, sdm: dict, packed: dict, records: "dict | None" = None) -> None:
        self._sdm, self.packed, self._records = sdm, packed, records

    @classmethod
    def of(cls, sdm: dict, storage: dict) -> "PackedRecords":
        return cls(sdm, pack_storage(sdm, storage), storage)

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

    def __reduce__(self) -> tuple:
        return PackedRecords, (self._sdm, self.packed)


def _bad(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: the record table {what}; the metadata is damaged or crafted")


def _read(table: dict, name: str, count: int, source: str) -> np.ndarray:
    """Column ``name`` of ``count`` entries; its byte length must be ``count`` times a known width."""
    raw = table.get(name)
    if type(raw) is not bytes:
        raise _bad(source, f"lacks column {name!r}")
    width = len(raw) // count if count else 0
    if (width not in _WIDTHS or width * count != len(raw)) if count else raw:
        raise _bad(source, f"column {name!r} has {len(raw)} bytes for {count} entries")
    return np.frombuffer(raw, dtype=_WIDTHS.get(width, "<u1"))


def is_table(storage: Any) -> bool:
    """Whether ``storage_data`` (as unpickled) starts with a format-2 record table."""
    if type(storage) is not dict or not storage:
        return False
    first = next(iter(storage.values()))
    return type(first) is dict and TABLE_FIELD in first


def _columns(head: dict, sdm: dict, source: str) -> tuple[dict, list, list, tuple]:
    """Check the table's shape and ranges (vectorized), then return its columns as lists."""
    if head.get("fmt") != TABLE_VERSION or not head.keys() <= _HEAD:
        raise UnsupportedFormatError(f"{source} holds a record table of format {head.get('fmt')!r}; "
                                     f"this version reads {TABLE_VERSION}: upgrade dcp_tiered")
    table = head[TABLE_FIELD]
    if type(table) is not dict or type(table.get("n")) is not int or table["n"] < 1:
        raise _bad(source, "has no valid record count")
    n, names = table["n"], table.get("names")
    if type(names) is not tuple or not set(map(type, names)) <= {str}:
        raise _bad(source, "has names that are not strings")
    cols = {c: _read(table, c, n, source) for c in _ROW}
    limits = {"item": len(sdm) - 1, "kind": len(_KINDS) - 1, "nframes": MAX_FRAMES_PER_RECORD,
              **{c: len(names) for c in _NAMES}}
    for c, top in limits.items():
        if int(cols[c].max()) > top:
            raise _bad(source, f"column {c!r} holds values above {top}")
    total = int(cols["nframes"].sum(dtype=np.uint64))
    frames, sums = (_read(table, c, total, source).tolist() for c in ("frames", "sums"))
    return {c: v.tolist() for c, v in cols.items()}, frames, sums, (None, *names)


def unpack_storage(sdm: dict, storage: dict, source: str) -> dict:
    """``storage_data`` in memory (one dict record per index) from its on-disk form (see module doc).

    ``sdm`` must already be checked (``state_dict_metadata`` types); the records returned
    still need ``check_metadata`` like any other.
    """
    if not is_table(storage):
        return storage
    items = iter(storage.items())
    first_index, head = next(items)
    cols, frames, sums, names = _columns(head, sdm, source)
    fqns, out, at = list(sdm), {}, 0
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
        offsets = None
        if kind == 0:
            chunks = getattr(sdm[fqn], "chunks", ())
            if not 1 <= chunk <= len(chunks):
                raise _bad(source, f"names chunk {chunk} of {fqn!r}, which has {len(chunks)}")
            offsets, rec["shape"] = chunks[chunk - 1].offsets, tuple(chunks[chunk - 1].sizes)
        elif chunk:
            raise _bad(source, f"gives the non-tensor item {fqn!r} a chunk")
        if obj:
            rec["object"] = names[obj]
        rec["frame"] = frame
        index = MetadataIndex(fqn, offsets, hint - 1 if hint else None)
        if index in out:
            raise _bad(source, f"has two records for {fqn!r} at {tuple(offsets or ())}")
        out[index] = rec
    if next(iter(out)) != first_index:
        raise _bad(source, "is not stored under its first record's index")
    for index, rec in items:
        if index in out:
            raise _bad(source, f"and another record both hold {getattr(index, 'fqn', index)!r}")
        out[index] = rec
    return out
