"""Format 2 ``.metadata``: DCP's item table (``state_dict_metadata``) and ``planner_data`` as columns.

Pickled as DCP builds them, these cost ~140 bytes and ~40 pure-Python unpickler steps per
tensor (three dataclasses, ``torch.Size`` reductions, a path tuple), most of a large
checkpoint's open time.  Next to the record table (:mod:`dcp_tiered.dcp.record_table`) the
head record then holds:

* ``items``: the names in order; per item its kind (0 tensor, 1 bytes), an id into a tuple of
  the distinct ``TensorProperties``, its number of dimensions and of chunks; then the sizes,
  and the chunk offsets and sizes, of all tensors as flat columns;
* ``paths``: per item the length of its planner path (0: the path is the item's name alone, as
  in a flat state dict), and ids into a tuple of the distinct path parts (``str`` or ``int``), in
  the items' order (``planner_data`` read back lists its keys so, whatever order DCP gave them).

Format 3 stores them as ``item_table`` and ``path_table``, their names and path parts as one
string each (:func:`~dcp_tiered.dcp.record_table.pack_strings`; an int part as its digits, marked
in ``part_kind``).  ``state_dict_metadata`` on disk keeps only the entry of the head record's item
(so a format-1 reader reaches that record and asks for an upgrade) and ``planner_data`` is None.  Either
table is written only when every entry fits exactly; ``unpack`` of ``pack`` is equal.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                                                   TensorStorageMetadata)

from dcp_tiered.dcp.format import MAX_DIM, MAX_DIMS
from dcp_tiered.dcp.gc_pause import gc_paused
from dcp_tiered.dcp.record_table import _bad, _column, _read, pack_strings, read_strings
from dcp_tiered.dcp.tiling import array_tiling_problem, split_tilings
from dcp_tiered.errors import CorruptCheckpointError

_ITEM_ROW = ("kind", "prop", "ndim", "nchunks")
#: Longest int path part stored as digits (a list index or an int key; never a number slow to read)
_MAX_INDEX_DIGITS = 21
#: An int path part's digits exactly as ``str(int)`` writes them (no sign but one minus, no leading zero)
_INDEX_DIGITS = re.compile(r"0|-?[1-9][0-9]*", re.ASCII)


def _tensor_ok(entry: Any) -> bool:
    size, chunks = entry.size, entry.chunks
    return (type(entry.properties) is TensorProperties and type(size) is torch.Size and len(size) <= MAX_DIMS
            and type(chunks) is list and all(d >= 0 for d in size)
            and all(type(c) is ChunkStorageMetadata and type(c.offsets) is torch.Size and type(c.sizes) is torch.Size
                    and len(c.offsets) == len(c.sizes) == len(size) for c in chunks))


def pack_items(sdm: dict, one_string: bool = True) -> "dict | None":
    """The item table of ``sdm``, or None when an entry does not fit it exactly; its names as one
    string (format 3), or the tuple of them (``one_string`` False)."""
    props: dict[tuple, tuple[int, TensorProperties]] = {}
    rows, sizes, offsets, chunk_sizes = [], [], [], []
    for fqn, entry in sdm.items():
        if type(fqn) is not str:
            return None
        if type(entry) is BytesStorageMetadata and not vars(entry):
            rows.append((1, 0, 0, 0))
            continue
        if type(entry) is not TensorStorageMetadata or not _tensor_ok(entry):
            return None
        p = entry.properties
        key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory, tuple(sorted(vars(p))))
        pid = props.setdefault(key, (len(props) + 1, p))[0]
        rows.append((0, pid, len(entry.size), len(entry.chunks)))
        sizes.extend(entry.size)
        for c in entry.chunks:
            offsets.extend(c.offsets)
            chunk_sizes.extend(c.sizes)
    every = sizes + offsets + chunk_sizes
    if max(every, default=0) >= MAX_DIM or min(every, default=0) < 0:  # the finish's checks name it
        return None
    columns = list(zip(*rows))
    return {"fqns": pack_strings(tuple(sdm)) if one_string else tuple(sdm), "props": tuple(p for _, p in props.values()),
            **{c: _column(list(v)) for c, v in zip(_ITEM_ROW, columns)},
            "size": _column(sizes), "offsets": _column(offsets), "chunk_sizes": _column(chunk_sizes)}


def pack_paths(planner_data: Any, fqns: list) -> "dict | None":
    """The path table of ``planner_data`` (its keys the items' names, in any order: DCP's dedup moves
    replicated items behind the ranks' own; stored, and read back, in the items' order), or None when
    it does not fit."""
    if type(planner_data) is not dict or len(planner_data) != len(fqns) or not all(f in planner_data for f in fqns):
        return None
    parts: dict[tuple, int] = {}
    counts, ids = [], []
    for fqn in fqns:
        path = planner_data[fqn]
        if type(path) is not tuple or not path:
            return None
        if len(path) == 1 and path[0] == fqn and type(path[0]) is str:  # a flat state dict's: stored as 0 parts
            counts.append(0)
            continue
        counts.append(len(path))
        for part in path:
            if type(part) not in (str, int):
                return None
            ids.append(parts.setdefault((type(part), part), len(parts)))
    values = tuple(v for _, v in parts)
    table = {"nparts": _column(counts), "ids": _column(ids)}
    names = pack_strings(tuple(map(str, values)))
    if type(names) is bytes and all(len(str(v)) <= _MAX_INDEX_DIGITS for v in values if type(v) is int):
        # an int part as its decimal digits, marked in part_kind
        return {"parts": names, "part_kind": _column([int(type(v) is int) for v in values]), **table}
    return {"parts": values, **table}


class BroadcastItems(dict):
    """``state_dict_metadata`` of a save as DCP broadcasts it to every rank after ``finish``: the same
    dict, pickled as its item table (``table``, from :func:`pack_items`) and unpickled as the plain dict
    :func:`items_from_table` builds from it, with the collector paused.  Every rank so receives a few
    bytes a chunk where DCP's dataclasses cost ~60, and builds them in time linear in the chunks.  Only
    a save's own broadcast carries one: :func:`~dcp_tiered.dcp.metadata_io.encode_metadata` stores plain
    dicts, so no file holds its reduction."""

    __slots__ = ("table",)

    def __init__(self, sdm: Any = (), table: "dict | None" = None) -> None:
        super().__init__(sdm)
        self.table = table  # None (made as a dict is, by code copying one): pickled as a dict

    @classmethod
    def of(cls, sdm: Any) -> Any:
        """``sdm`` as one, or ``sdm`` itself where an entry does not fit the item table."""
        # the names as a tuple: the other tables of the broadcast (planner_data, the records' indices)
        # hold the same string objects, which pickle writes once; one string would repeat them
        table = pack_items(sdm, one_string=False) if type(sdm) is dict else None
        return sdm if table is None else cls(sdm, table)

    def __reduce__(self) -> tuple:
        return (items_from_table, (self.table,)) if self.table is not None else (dict, (dict(self),))


def items_from_table(table: dict) -> dict:
    """The ``state_dict_metadata`` a :class:`BroadcastItems` was, from its table (DCP's broadcast: trusted)."""
    with gc_paused():
        return unpack_items(table, "the save's metadata, as broadcast")


def _limits(cols: dict, limits: dict, source: str, table: str) -> None:
    for c, top in limits.items():
        if len(cols[c]) and int(cols[c].max()) > top:
            raise _bad(source, f"{table} column {c!r} holds values above {top}")


def declared_counts(items: Any, source: str) -> tuple[int, int]:
    """The items and tensor chunks an item table declares (its names, the sum of its ``nchunks``
    column), read without building any: the record limit is checked on them before
    :func:`unpack_items` builds DCP's objects, so a few bytes cannot make it build millions."""
    fqns = read_strings(items.get("fqns") if type(items) is dict else None, source, "item names")
    return len(fqns), sum(_read(items, "nchunks", len(fqns), source).tolist())  # exact: a uint64 sum could wrap


def unpack_items(items: Any, source: str) -> dict:
    """``state_dict_metadata`` from its item table (shapes and ranges checked before anything is built)."""
    fqns, props = (items.get(k) if type(items) is dict else None for k in ("fqns", "props"))
    fqns = read_strings(fqns, source, "item names")
    if not fqns or len(set(fqns)) != len(fqns):
        raise _bad(source, "has an item table without distinct names")
    if type(props) is not tuple or not set(map(type, props)) <= {TensorProperties}:
        raise _bad(source, "has tensor properties of the wrong type")
    n = len(fqns)
    cols = {c: _read(items, c, n, source) for c in _ITEM_ROW}
    _limits(cols, {"kind": 1, "prop": len(props), "ndim": MAX_DIMS, "nchunks": 1 << 32}, source, "item")
    kind, prop, ndim, nchunks = (cols[c].astype(np.uint64) for c in _ITEM_ROW)
    tensor = kind == 0
    if ((prop == 0) != ~tensor).any() or (ndim[~tensor] != 0).any() or (nchunks[~tensor] != 0).any() or (
            nchunks[tensor & (ndim == 0)] > 1).any():
        raise _bad(source, "has items whose kind, properties, dimensions and chunks disagree")
    dims = _read(items, "size", int(ndim.sum()), source)
    count = int((ndim * nchunks).sum())
    offs, csz = (_read(items, c, count, source) for c in ("offsets", "chunk_sizes"))
    if any(len(a) and int(a.max()) >= MAX_DIM for a in (dims, offs, csz)):
        raise _bad(source, "has a dimension above 2**62")
    if any(type(p.dtype) is not torch.dtype for p in props):
        raise _bad(source, "has tensor properties without a dtype")
    dims, offs, csz = dims.tolist(), offs.tolist(), csz.tolist()
    sdm, at, cat, size, chunk = {}, 0, 0, torch.Size, ChunkStorageMetadata
    for fqn, k, p, d, c in zip(fqns, *(cols[name].tolist() for name in _ITEM_ROW)):
        if k:
            sdm[fqn] = BytesStorageMetadata()
            continue
        properties = object.__new__(TensorProperties)  # a copy per item, as unpickling makes
        properties.__dict__.update(props[p - 1].__dict__)
        if d:  # each chunk's d offsets and d sizes, cut from the flat columns at C speed
            o, z = iter(offs[cat:cat + d * c]), iter(csz[cat:cat + d * c])
            chunks = list(map(chunk, map(size, zip(*[o] * d)), map(size, zip(*[z] * d))))
            cat += d * c
        else:  # a 0-d tensor: at most one chunk
            chunks = [chunk(size(), size()) for _ in range(c)]
        sdm[fqn] = TensorStorageMetadata(properties, size(dims[at:at + d]), chunks)
        at += d
    return sdm


def table_chunk_problem(items: dict, source: str) -> "tuple[str, str] | None":
    """:func:`chunk_problem` of an item table that :func:`pack_items` made or :func:`unpack_items` read."""
    fqns = read_strings(items["fqns"], source, "item names")
    kind, _prop, ndim, nchunks = (_read(items, c, len(fqns), source).astype(np.int64) for c in _ITEM_ROW)
    count = int((ndim * nchunks).sum())
    dims = _read(items, "size", int(ndim.sum()), source)
    offs, csz = (_read(items, c, count, source) for c in ("offsets", "chunk_sizes"))
    return chunk_problem(fqns, kind == 0, ndim, nchunks, dims, offs, csz)


def check_table_chunks(items: dict, source: str) -> None:
    """Refuse an item table (already read by :func:`unpack_items`) whose chunks lie outside their tensor
    or do not tile it exactly, as ``check_metadata`` refuses such chunks tensor by tensor."""
    problem = table_chunk_problem(items, source)
    if problem is not None:
        raise CorruptCheckpointError(f"{source}: tensor {problem[0]!r}: {problem[1]}; the metadata is damaged or crafted")


def chunk_problem(fqns: "tuple | list", tensor: np.ndarray, ndim: np.ndarray, nchunks: np.ndarray, dims: np.ndarray,
                  offs: np.ndarray, csz: np.ndarray) -> "tuple[str, str] | None":
    """The first tensor (by name) whose chunks lie outside its size or do not tile it exactly, and why;
    None when every tensor's do.  Over the item table's columns (``tensor``: which items are tensors),
    all tensors at once; only layouts that are not a split along dim 0 are checked one by one."""
    dims, offs, csz = (a.astype(np.int64) for a in (dims, offs, csz))
    ndim, nchunks = ndim.astype(np.int64), nchunks.astype(np.int64)
    per_chunk = ndim * nchunks
    entry_item = np.repeat(np.arange(len(fqns)), per_chunk)
    k = np.arange(len(offs)) - (np.cumsum(per_chunk) - per_chunk)[entry_item]
    dim_at = (np.cumsum(ndim) - ndim)[entry_item] + k % np.maximum(ndim[entry_item], 1)
    outside = (offs > dims[dim_at]) | (csz > dims[dim_at] - offs)
    if outside.any():
        i = int(entry_item[np.argmax(outside)])
        return fqns[i], "has a chunk outside its size"
    proven = split_tilings(dims, ndim, nchunks, offs, csz)
    dim_base, entry_base = np.cumsum(ndim) - ndim, np.cumsum(per_chunk) - per_chunk
    for i in np.flatnonzero(tensor & ~proven).tolist():
        d, c, at = int(ndim[i]), int(nchunks[i]), int(entry_base[i])
        problem = array_tiling_problem(dims[dim_base[i]:dim_base[i] + d].tolist(), offs[at:at + d * c].reshape(c, d),
                                       csz[at:at + d * c].reshape(c, d))
        if problem is not None:
            return fqns[i], problem
    return None


def _typed_parts(paths: dict, names: tuple, source: str) -> tuple:
    """The path parts of format 3: the names, those ``part_kind`` marks as ints read back from their digits."""
    kinds = _read(paths, "part_kind", len(names), source)
    _limits({"part_kind": kinds}, {"part_kind": 1}, source, "path")
    parts = list(names)
    for i in np.flatnonzero(kinds).tolist():
        digits = parts[i]
        if not (len(digits) <= _MAX_INDEX_DIGITS and _INDEX_DIGITS.fullmatch(digits)):
            raise _bad(source, f"has an index path part {digits[:40]!r} that is not an integer")
        parts[i] = int(digits)
    return tuple(parts)


def unpack_paths(paths: Any, fqns: list, source: str) -> dict:
    """``planner_data`` from its path table."""
    parts = paths.get("parts") if type(paths) is dict else None
    if type(parts) is bytes:
        parts = _typed_parts(paths, read_strings(parts, source, "path parts"), source)
    if type(parts) is not tuple or not set(map(type, parts)) <= {str, int}:
        raise _bad(source, "has path parts that are not names or indices")
    counts = _read(paths, "nparts", len(fqns), source)
    _limits({"nparts": counts}, {"nparts": 4096}, source, "path")
    ids = _read(paths, "ids", int(counts.sum(dtype=np.uint64)), source)
    _limits({"ids": ids}, {"ids": len(parts) - 1}, source, "path")
    ids, out, at = ids.tolist(), {}, 0
    for fqn, k in zip(fqns, counts.tolist()):
        out[fqn] = tuple(parts[i] for i in ids[at:at + k]) if k else (fqn,)
        at += k
    return out
