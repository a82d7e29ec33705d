"""Reading and writing ``.metadata``: a DCP ``Metadata`` pickle plus an integrity trailer.

The trailer (a magic string and the xxh3-64 of the pickle) lets this package detect a
damaged ``.metadata`` before trusting any size in it.  ``pickle.load`` stops at the
pickle's STOP opcode, so stock DCP readers still read the file; files without the
trailer (written by stock DCP) are read without the integrity check.

A ``.metadata`` is untrusted input: its size is checked before it is read, it is unpickled
through the allow-list, and every table and record is then checked for types and ranges
(:func:`check_metadata`), so later code never meets a ``str`` where it expects an ``int``.

One concept over 600 lines: the encode and the checked decode of one file, whose checks (tables,
planner paths, storage meta, records) the writer runs too before a commit, so that the same
definitions say what a save may commit and what a reader accepts, and the decode cache.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import os
import pickle
import threading
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_tiered.codecs import checksum
from dcp_tiered.dcp.format import (
    KIND_BYTES,
    MAX_DIMS,
    MAX_METADATA_BYTES,
    MAX_METADATA_RECORDS,
    METADATA_FILE,
    check_against_chunks,
    check_against_properties,
    check_record,
    chunk_sizes,
    is_native_record,
    shape_ok,
)
from dcp_tiered.dcp.gc_pause import gc_paused
from dcp_tiered.dcp.item_table import BroadcastItems, check_table_chunks, declared_counts, pack_items, pack_paths, table_chunk_problem, unpack_items, unpack_paths
from dcp_tiered.dcp.record_table import (HEAD_TABLES, TABLE_FIELD, TABLE_VERSION, PackedRecords, RecordTable, first_unstored, head_tables, unstored,
                                         is_table, pack_storage, pack_strings, unpack_storage)
from dcp_tiered.dcp.safe_pickle import safe_loads
from dcp_tiered.dcp.tiling import array_tiling_problem, tiling_problem
from dcp_tiered.errors import CorruptCheckpointError, MetadataTooLargeError, UnsafeCheckpointError, UnsupportedFormatError
from dcp_tiered.storage import MissingFileError, Storage, safe_relative_name

_MAGIC = b"\x00dcp_tiered.md1"
_ITEMS, _PATHS = HEAD_TABLES[TABLE_VERSION]
_TRAILER = len(_MAGIC) + 8
_MAX_TRANSFORMS = 8


def encode_metadata(metadata: Metadata, where: str = METADATA_FILE) -> bytes:
    """Pickle ``metadata`` (native records as format 2's record table) and append the integrity trailer.

    Raises :class:`MetadataTooLargeError` (before anything is committed) when readers would refuse the
    result: more records or chunks than ``MAX_METADATA_RECORDS``, or more bytes than ``MAX_METADATA_BYTES``;
    :class:`UnsupportedFormatError` for a chunk layout readers cannot verify (:mod:`~dcp_tiered.dcp.tiling`)."""
    metadata, items = _plain(metadata)
    records, chunks = _counts(metadata)
    if _over_record_limit(records, chunks):
        raise MetadataTooLargeError(
            f"{where}: this save has {records} storage records and {chunks} tensor chunks, over the "
            f"{MAX_METADATA_RECORDS} a reader accepts; nothing was committed. A record is one tensor shard of one "
            "rank: save fewer, larger tensors (e.g. flattened or fused parameters), or shard each over fewer ranks "
            "(HSDP: shard within a group of ranks, replicate across groups; DCP stores a replicated shard once)")
    try:  # what readers check beside the records and the chunks (checked below), checked before the commit too
        sdm = metadata.state_dict_metadata or {}
        _check_entries(sdm, where, chunks=False)
        _check_planner_data(getattr(metadata, "planner_data", None), where, sdm)
        _check_fields(metadata, where)
    except CorruptCheckpointError as exc:
        raise UnsupportedFormatError(f"readers would refuse this save ({exc}); nothing was committed. Keep the "
                                     f"state dict at most {MAX_PATH_PARTS} levels deep, and a save planner's metadata "
                                     "of DCP's types") from None
    packed = _packed(metadata, items)
    problem = _tiling_problem(metadata, packed)  # what readers check, checked first
    if problem is not None:
        raise UnsupportedFormatError(f"{where}: tensor {problem[0]!r}: {problem[1]}; readers would refuse this "
                                     "checkpoint, nothing was committed. The save planner's chunks must lie inside "
                                     "their tensor and tile it exactly")
    body = pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) + _TRAILER > MAX_METADATA_BYTES:
        raise MetadataTooLargeError(
            f"{where}: this save's metadata is {len(body) + _TRAILER} bytes, over the {MAX_METADATA_BYTES}-byte "
            f"limit readers accept ({records} records); nothing was committed. Save fewer, larger tensors "
            "(e.g. flattened or fused parameters), or shard each over fewer ranks (HSDP)")
    return body + _MAGIC + checksum((body,)).to_bytes(8, "little")


def _tiling_problem(metadata: Metadata, packed: Metadata) -> "tuple[str, str] | None":
    """The first tensor of ``metadata`` whose chunks do not tile it exactly, and why: over the item table
    of ``packed`` (its format-2 form) when it has one, as readers check it, else tensor by tensor."""
    head = next(iter(packed.storage_data.values()), None) if type(packed.storage_data) is dict else None
    if type(head) is dict and _ITEMS in head:
        return table_chunk_problem(head[_ITEMS], "the save's item table")
    for fqn, item in (metadata.state_dict_metadata or {}).items():
        if type(item) is TensorStorageMetadata:
            problem = tensor_chunks_problem(item.size, item.chunks)
            if problem is not None:
                return fqn, problem
    return None


def _over_record_limit(records: int, chunks: int) -> bool:
    """The one rule of how many records and tensor chunks a ``.metadata`` may hold: what a save may commit
    (:func:`encode_metadata`) and what a reader decodes (:func:`_check_counts`)."""
    return max(records, chunks) > MAX_METADATA_RECORDS


def _check_counts(md: Metadata, source: str, table: bool) -> None:
    """Refuse a ``.metadata`` declaring more records or chunks than a save may write, before any per-record
    work (a format-2 item table's items and chunks are counted from its columns, before they are built):
    decoding time is bounded by ``MAX_METADATA_RECORDS`` as memory is by ``MAX_METADATA_BYTES``."""
    records, chunks = _counts(md)
    if table:
        head = next(iter(md.storage_data.values()))
        rows = head.get(TABLE_FIELD, {}).get("n") if isinstance(head.get(TABLE_FIELD), dict) else None
        records += rows - 1 if type(rows) is int and rows > 0 else 0
        items = head_tables(head, source)[0]
        if items is not None:
            declared = declared_counts(items, source)
            records, chunks = max(records, declared[0]), max(chunks, declared[1])
    if _over_record_limit(records, chunks):
        raise _bad(source, f"it declares {records} records and {chunks} chunks, over the {MAX_METADATA_RECORDS} "
                           "a save writes")


def _counts(md: Metadata) -> tuple[int, int]:
    """Storage records and tensor chunks of ``md`` (as decoded, or a table's declared row count)."""
    storage = getattr(md, "storage_data", None)
    sdm = getattr(md, "state_dict_metadata", None)
    records = len(storage) if isinstance(storage, (dict, PackedRecords, RecordTable)) else 0
    chunks = sum(len(c) for t in sdm.values() if type(c := getattr(t, "chunks", None)) is list) if isinstance(sdm, dict) else 0
    return records, chunks


def _plain(metadata: Metadata) -> tuple[Metadata, "dict | None"]:
    """``metadata`` with a plain dict in place of the :class:`~dcp_tiered.dcp.item_table.BroadcastItems` a
    save returns (never pickled into a file), and the item table it had made already."""
    sdm = metadata.state_dict_metadata
    if type(sdm) is not BroadcastItems:
        return metadata, None
    out = copy.copy(metadata)
    out.state_dict_metadata = dict(sdm)
    return out, sdm.table


def _packed(metadata: Metadata, items: "dict | None" = None) -> Metadata:
    """``metadata`` as format 3 stores it: records, items and planner paths as tables in the head record
    (``items``: its item table where made already)."""
    sdm, storage = metadata.state_dict_metadata, metadata.storage_data
    if type(storage) is RecordTable:  # a decoded checkpoint's, saved again
        storage = dict(storage)
    if type(storage) is PackedRecords:  # packed once by the writer's finish, for the broadcast too
        packed = dict(storage.packed)
        if not is_table(packed):
            return _as_dict(metadata, packed)
    elif type(sdm) is not dict or type(storage) is not dict:
        return metadata
    else:
        packed = pack_storage(sdm, storage)
        if packed is storage:
            return metadata
    out = _as_dict(metadata, packed)
    first, head = next(iter(packed.items()))
    packed[first] = head = dict(head)  # the head gains the item tables; the caller's stays as it was
    if items is None:
        items = pack_items(sdm)
    elif type(items["fqns"]) is tuple:  # a broadcast's table: its names as format 3 stores them
        items = {**items, "fqns": pack_strings(items["fqns"])}
    if items is not None:
        head[_ITEMS] = items
        out.state_dict_metadata = {first.fqn: sdm[first.fqn]}  # a format-1 reader reaches the head, asks to upgrade
        paths = pack_paths(metadata.planner_data, list(sdm))
        if paths is not None:
            head[_PATHS], out.planner_data = paths, None
    return out


def _as_dict(metadata: Metadata, storage: dict) -> Metadata:
    out = copy.copy(metadata)
    out.storage_data = storage
    return out


def _unpacked(md: Metadata, source: str) -> bool:
    """Replace the item and path tables of a format-2 head record by DCP's own tables; whether it had an
    item table."""
    items, paths = head_tables(next(iter(md.storage_data.values())), source)
    if items is None:
        return False
    md.state_dict_metadata = unpack_items(items, source)
    if paths is not None:
        md.planner_data = unpack_paths(paths, list(md.state_dict_metadata), source)
    return True


#: Decoded ``.metadata`` by the xxh3-128 digest of its bytes, with the largest non-tensor item it
#: declares: listing, node checks, peer fetch and the reader of one restore each ask for the same
#: checkpoint, and it is decoded once.  Bounded by entries and by an estimate of the decoded size
#: (decoded objects take about 28 times the encoded bytes).
_DECODED: "collections.OrderedDict[bytes, tuple[Metadata, int, int]]" = collections.OrderedDict()
_DECODED_LOCK = threading.Lock()
DECODE_CACHE_ENTRIES = 16
#: Bound of the decoded objects held, estimated as :data:`DECODED_PER_BYTE` times the encoded bytes.
DECODE_CACHE_BYTES = 1 << 30
DECODED_PER_BYTE = 32


#: Decodes past the cache's bound kept while a :func:`decoded_once` scope is open (a restore's), by digest.
_PINNED: "dict[bytes, tuple[Metadata, int, int]]" = {}
_PIN_DEPTH = 0


@contextlib.contextmanager
def decoded_once() -> Any:
    """Within it, a ``.metadata`` past :data:`DECODE_CACHE_BYTES` (about 0.9M records), which the cache
    declines, is decoded once: a restore lists, checks and reads its candidate, and each decoded it.
    The first such decode is kept until the outermost scope ends, later ones while their estimated
    size stays within the cache's bound: a restore lists the newest step first and tries it first,
    and it never holds every candidate's decode at once."""
    global _PIN_DEPTH
    with _DECODED_LOCK:
        _PIN_DEPTH += 1
    try:
        yield
    finally:
        with _DECODED_LOCK:
            _PIN_DEPTH -= 1
            if not _PIN_DEPTH:
                _PINNED.clear()


def _fresh(md: Metadata) -> Metadata:
    """A ``Metadata`` of its own for the caller (who may replace tables or the storage meta), sharing the
    immutable parts (records, tensor properties) with the cached one."""
    out = copy.copy(md)
    out.state_dict_metadata = dict(md.state_dict_metadata)
    storage = md.storage_data
    if type(storage) is RecordTable:  # its records built for this caller
        out.storage_data = storage.view()
    else:
        out.storage_data = {i: dict(r) if type(r) is dict else copy.copy(r) for i, r in storage.items()} \
            if isinstance(storage, dict) else storage  # records of its own: stock's _StorageInfo is mutable
    out.planner_data = dict(md.planner_data) if isinstance(md.planner_data, dict) else md.planner_data
    out.storage_meta = copy.copy(md.storage_meta)
    return out


def _largest_object(md: Metadata) -> int:
    """The largest size a non-tensor item of checked ``md`` declares (what ``max_object_bytes`` caps)."""
    sdm, largest, storage = md.state_dict_metadata, 0, md.storage_data
    if type(storage) is RecordTable:
        largest, storage = storage.largest_bytes_item(), storage.rest
    for index, record in storage.items():
        if is_native_record(record):
            if record["kind"] == KIND_BYTES:
                largest = max(largest, record["raw"])
        elif type(sdm.get(index.fqn)) is BytesStorageMetadata:
            largest = max(largest, record.length)
    return largest


def decode_metadata(data: bytes, source: str, *, max_object_bytes: "int | None" = None) -> Metadata:
    """Verify the trailer (when present), unpickle through the allow-list, check every table and record.

    ``max_object_bytes`` additionally caps the declared size of non-tensor items.  The same bytes are
    decoded once per process (:data:`_DECODED`); each call returns a ``Metadata`` of its own.
    """
    key = xxhash.xxh3_128_digest(data)
    with _DECODED_LOCK:
        hit = _DECODED.get(key) or _PINNED.get(key)
        if key in _DECODED:
            _DECODED.move_to_end(key)
    if hit is None:
        with gc_paused():
            md = _decode(data, source, None)
        hit = (md, _largest_object(md), len(data) * DECODED_PER_BYTE)
        with _DECODED_LOCK:
            if hit[2] <= DECODE_CACHE_BYTES:
                _DECODED[key] = hit
                while len(_DECODED) > DECODE_CACHE_ENTRIES or sum(h[2] for h in _DECODED.values()) > DECODE_CACHE_BYTES:
                    _DECODED.popitem(last=False)
            elif _PIN_DEPTH and (not _PINNED or sum(h[2] for h in _PINNED.values()) + hit[2] <= DECODE_CACHE_BYTES):
                _PINNED[key] = hit  # the first (a restore lists the newest step first), more within the bound
    if max_object_bytes is not None and hit[1] > max_object_bytes:
        _decode(data, source, max_object_bytes)  # raises, naming the item
    return _fresh(hit[0])


def _decode(data: bytes, source: str, max_object_bytes: "int | None") -> Metadata:
    body = data
    if len(data) >= _TRAILER and data[-_TRAILER:-8] == _MAGIC:
        body = data[:-_TRAILER]
        if checksum((body,)) != int.from_bytes(data[-8:], "little"):
            raise CorruptCheckpointError(f"{source} is damaged: its checksum does not match; restore from another tier or step")
    md = safe_loads(body, source)
    if type(md) is not Metadata:
        raise UnsafeCheckpointError(f"{source} holds a {type(md).__name__}, not DCP Metadata")
    table = is_table(getattr(md, "storage_data", None))
    _check_counts(md, source, table)
    items_checked = table and _unpacked(md, source)
    if items_checked:  # the tensors' chunks, over the item table's columns
        check_table_chunks(head_tables(next(iter(md.storage_data.values())), source)[0], source)
    _check_tables(md, source, tensors_checked=items_checked)
    checked = 0
    if table:
        packed = md.storage_data
        md.storage_data = unpack_storage(md.state_dict_metadata, packed, source,
                                         checkpoint=_checkpoint_of(source), max_object_bytes=max_object_bytes)
        checked = next(iter(packed.values()))[TABLE_FIELD]["n"]  # a valid table: its rows were checked
    _check_records(md, source, max_object_bytes, skip=checked)
    return md


def _checkpoint_of(source: str) -> str:
    """The checkpoint a ``.metadata`` source names, as record messages give it."""
    return source.rsplit("/", 1)[0] if source.endswith(METADATA_FILE) else source


def unpack_metadata(data: bytes) -> Metadata:
    """The ``Metadata`` of a ``.metadata`` file *we trust* (plain pickle, no checks), records as dicts.

    For tools and tests that edit a checkpoint of their own; untrusted files go through
    :func:`decode_metadata`.  Re-pickle the edited object with plain ``pickle`` (records stay
    dicts, which every reader accepts) or with :func:`encode_metadata`.
    """
    body = data[:-_TRAILER] if len(data) >= _TRAILER and data[-_TRAILER:-8] == _MAGIC else data
    md = pickle.loads(body)
    if is_table(md.storage_data):
        _unpacked(md, "trusted metadata")
        md.storage_data = unpack_storage(md.state_dict_metadata, md.storage_data, "trusted metadata")
    return md


def read_metadata_bytes(storage: Storage, name: str = METADATA_FILE, limit: int = MAX_METADATA_BYTES) -> bytes:
    """The bytes of ``name``, refused by its size before it is read when above ``limit``.

    A local file is read to at most one byte past the size it reported, so a file that is
    not what its size says (growing, or a device) is refused instead of read without end.
    Raises ``MissingFileError`` when the file does not exist.
    """
    size = storage.size(name)
    where = storage.url_of(name)
    if size > limit:
        raise CorruptCheckpointError(
            f"{where} is {size} bytes, above the {limit}-byte limit for checkpoint metadata: it is damaged or crafted"
        )
    if storage.is_local:
        data = storage.read_range(name, 0, size + 1)
        too_long = len(data) > size
    else:  # object stores report sizes they serve; no devices or growing files there
        data = storage.read_bytes(name)
        too_long = len(data) > limit
    if too_long:
        raise CorruptCheckpointError(f"{where} grew while being read, or is not a regular file")
    return data


def load_metadata(storage: Storage, *, max_object_bytes: "int | None" = None, limit: int = MAX_METADATA_BYTES) -> Metadata:
    """Read (size checked first) and decode the ``.metadata`` of the checkpoint in ``storage``."""
    return decode_metadata(read_metadata_bytes(storage, METADATA_FILE, limit), storage.url_of(METADATA_FILE),
                           max_object_bytes=max_object_bytes)


def _bad(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: {what}; the metadata is damaged or crafted")


def _size_ok(value: Any) -> bool:
    return type(value) is torch.Size and shape_ok(value)


def _check_tensor_md(fqn: str, md: TensorStorageMetadata, source: str) -> None:
    _check_tensor_fields(fqn, md, source)
    problem = tensor_chunks_problem(md.size, md.chunks)
    if problem is not None:
        raise _bad(source, f"tensor {fqn!r}: {problem}")


def _check_tensor_fields(fqn: str, md: TensorStorageMetadata, source: str) -> None:
    """A tensor entry's properties, size and chunk list, each of its type (the chunks themselves apart)."""
    props, size, chunks = (getattr(md, f, None) for f in ("properties", "size", "chunks"))
    if type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
        raise _bad(source, f"tensor {fqn!r} has invalid properties")
    if not _size_ok(size):  # (a torch.Size past int64 fails its own repr)
        text = f"({', '.join(str(d) for d in size)})" if isinstance(size, tuple) else repr(size)
        raise _bad(source, f"tensor {fqn!r} has an invalid size {text}"[:200])
    if type(chunks) is not list:
        raise _bad(source, f"tensor {fqn!r} has chunks of type {type(chunks).__name__}, not a list")


def _check_entries(sdm: dict, source: str, chunks: bool = True) -> None:
    """Every entry of DCP's tensor table of its type; a tensor's chunks too (``chunks``)."""
    check = _check_tensor_md if chunks else _check_tensor_fields
    for fqn, item in sdm.items():
        if type(item) is TensorStorageMetadata:
            check(fqn, item, source)
        elif type(item) is not BytesStorageMetadata:
            raise _bad(source, f"entry {fqn!r} of state_dict_metadata is a {type(item).__name__}")


def _check_fields(md: Metadata, source: str) -> None:
    """``storage_meta`` and ``version``: what DCP's planner and the writer set beside the tables."""
    _check_storage_meta(getattr(md, "storage_meta", None), source)
    version = getattr(md, "version", None)
    if not (version is None or type(version) is str):
        raise _bad(source, "version is not a string")


def tensor_chunks_problem(size: torch.Size, chunks: list) -> "str | None":
    """What is wrong with a tensor's chunks: a malformed chunk, one outside the tensor, or chunks that do not
    tile it exactly (part of it would never be loaded); None if nothing.  The readers' rule, which a save
    checks before its commit."""
    arrays = _chunk_arrays(size, chunks)
    if arrays is None:  # the per-chunk checks name what is wrong
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if type(chunk) is not ChunkStorageMetadata or not _size_ok(offsets) or not _size_ok(sizes):
                if type(chunk) is ChunkStorageMetadata and type(offsets) is type(sizes) is torch.Size \
                        and len(offsets) == len(sizes) <= MAX_DIMS:
                    return f"chunk {tuple(offsets)}+{tuple(sizes)} has an offset or size that is negative or at least 2**62"
                return "an invalid chunk"
            if not len(offsets) == len(sizes) == len(size) or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
                return f"chunk {tuple(offsets)}+{tuple(sizes)} outside its size {tuple(size)}"
        problem = tiling_problem(size, [(c.offsets, c.sizes) for c in chunks])
    else:
        problem = array_tiling_problem(size, *arrays)
    return problem


def _chunk_arrays(size: Any, chunks: list) -> "tuple[np.ndarray, np.ndarray] | None":
    """The chunks' offsets and sizes as ``(chunks, dims)`` int64 arrays when every chunk is a well-formed
    ``ChunkStorageMetadata`` inside ``size`` (checked over the columns); None otherwise."""
    dims = len(size)
    if not chunks:
        return np.zeros((0, dims), dtype=np.int64), np.zeros((0, dims), dtype=np.int64)
    if set(map(type, chunks)) != {ChunkStorageMetadata}:
        return None
    offs, sizes = [c.offsets for c in chunks], [c.sizes for c in chunks]
    if set(map(type, offs)) | set(map(type, sizes)) != {torch.Size} or set(map(len, offs)) | set(map(len, sizes)) != {dims}:
        return None
    try:
        o = np.array(offs, dtype=np.int64).reshape(len(chunks), dims)
        n = np.array(sizes, dtype=np.int64).reshape(len(chunks), dims)
        d = np.array(size, dtype=np.int64).reshape(dims)
    except (OverflowError, ValueError, TypeError):
        return None
    if (o < 0).any() or (n < 0).any() or (o > d).any() or (n > d - o).any():
        return None
    return o, n


def _check_stock(fqn: str, rec: _StorageInfo, source: str, is_bytes: bool, max_object_bytes: "int | None") -> None:
    path, offset, length, transforms = (getattr(rec, f, None) for f in ("relative_path", "offset", "length", "transform_descriptors"))
    safe_relative_name(path, f"record of {fqn!r} in {source}")
    if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
        raise _bad(source, f"record of {fqn!r} has invalid offset/length")
    if transforms is not None and (
        type(transforms) not in (list, tuple) or len(transforms) > _MAX_TRANSFORMS or any(type(t) is not str for t in transforms)
    ):
        raise _bad(source, f"record of {fqn!r} has invalid transform descriptors")
    if is_bytes and max_object_bytes is not None and length > max_object_bytes:
        raise CorruptCheckpointError(
            f"record of {fqn!r} in {source}: non-tensor item is {length} bytes, above the {max_object_bytes}-byte limit "
            "(raise max_object_bytes if this checkpoint is trusted)"
        )


def _check_stock_length(fqn: str, index: MetadataIndex, rec: _StorageInfo, entry: TensorStorageMetadata,
                        sizes: dict, source: str) -> None:
    """An uncompressed stock chunk is a ``torch.save`` of it: at least a byte per element fits in its
    record, so a tensor's declared size (which loads allocate) is bounded by the bytes on disk.  Per
    element, not per byte of the declared dtype: a planner may store another dtype than the one the
    metadata declares (``DowncastSavePlanner`` stores 16-bit values of fp32 tensors)."""
    chunk = sizes.get((fqn, tuple(index.offset))) if index.offset is not None else None
    if chunk is None:
        return
    elements = int(np.prod(chunk, dtype=object))
    if elements > rec.length:
        raise _bad(source, f"record of {fqn!r} holds {rec.length} bytes for a chunk of {elements} elements, at "
                           "least one raw byte each")


#: Longest planner path (names and indices from the state-dict root to a leaf).
MAX_PATH_PARTS = 64
#: The most list slots ``planner_data`` may leave without a path (each an empty dict in a list),
#: which rebuilding a state dict from it allocates.
MAX_LIST_GAPS = 1 << 16


def _check_planner_data(pd: Any, source: str, sdm: dict) -> None:
    """``planner_data`` maps each flattened key to its path in the state dict, which ``convert`` and the
    CLI rebuild nested dicts from (DCP's ``set_element``).  Each path must be what DCP's flattening makes:
    non-empty names and indices that spell their key (so no two share one), a name under the root, in
    each container only names (a dict: DCP makes every mapping key a name) or only non-negative
    indices (a list; a slot without a path is an empty dict DCP wrote nothing for, at most
    :data:`MAX_LIST_GAPS` of them), none inside another.  So rebuilding drops nothing, swaps nothing
    and allocates by the item count plus that bound."""
    if pd is None:
        return
    if type(pd) is not dict:
        raise _bad(source, f"planner_data is a {type(pd).__name__}, not a dict")
    for key, path in pd.items():
        if type(key) is not str or key not in sdm:
            raise _bad(source, f"planner_data names {str(key)[:80]!r}, which state_dict_metadata does not list")
        if type(path) not in (tuple, list) or not 0 < len(path) <= MAX_PATH_PARTS or not set(map(type, path)) <= {str, int}:
            raise _bad(source, f"planner_data of {key!r} is not a path of at most {MAX_PATH_PARTS} names and indices")
        if ".".join(map(str, path)) != key:
            raise _bad(source, f"planner_data gives {key!r} the path {str(tuple(path))[:80]}, which does not spell it")
    children, leaves = _containers(pd)
    gaps = 0  # list slots no item fills (an empty dict in a list leaves no path): rebuilding allocates them
    for prefix, inside in children.items():
        if prefix in leaves:
            raise _bad(source, f"planner_data puts items inside {leaves[prefix]!r}, which is a leaf")
        kinds = set(map(type, inside))
        if kinds == {str}:
            continue
        name = ".".join(map(str, prefix)) or "the root"
        if prefix == () or len(kinds) > 1 or min(inside) < 0:
            raise _bad(source, f"planner_data makes {name[:80]!r} a list with negative indices, or a mix of a list "
                               "and a dict")
        gaps += max(inside) + 1 - len(inside)
        if gaps > MAX_LIST_GAPS:
            raise _bad(source, f"planner_data leaves over {MAX_LIST_GAPS} list slots empty (the list {name[:80]!r} "
                               f"has indices up to {max(inside)} for {len(inside)} items)")


def _containers(pd: dict) -> tuple[dict[tuple, set], dict[tuple, str]]:
    """Each container's path in ``pd``'s paths with the names or indices directly inside it, and each leaf's
    path with its key."""
    children: dict[tuple, set] = {}
    leaves: dict[tuple, str] = {}
    for key, path in pd.items():
        path = tuple(path)
        leaves[path] = key
        for n in range(len(path)):
            children.setdefault(path[:n], set()).add(path[n])
    return children, leaves


def rebuild_problem(md: Metadata) -> "str | None":
    """Why DCP cannot rebuild ``md``'s state dict from its (checked) ``planner_data`` alone (``convert``:
    its rebuild leaves None in a list slot no path fills, then fails 'Missing key'), or None."""
    pd = getattr(md, "planner_data", None)
    if not pd:
        return None
    for prefix, inside in _containers(pd)[0].items():
        if inside and type(next(iter(inside))) is int and max(inside) + 1 != len(inside):
            missing = sorted(set(range(max(inside) + 1)) - inside)
            return (f"the list {'.'.join(map(str, prefix))[:80]!r} has no item at {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''} (an empty dict there saves nothing)")
    return None


def _check_storage_meta(meta: Any, source: str) -> None:
    if meta is None:
        return
    if type(meta) is not StorageMeta:
        raise _bad(source, f"storage_meta is a {type(meta).__name__}")
    cid = getattr(meta, "checkpoint_id", None)
    if not (cid is None or isinstance(cid, (str, os.PathLike))):
        raise _bad(source, "storage_meta.checkpoint_id is not a path")
    if any(not (getattr(meta, f, None) is None or type(getattr(meta, f)) is str) for f in ("save_id", "load_id")):
        raise _bad(source, "storage_meta has a non-string id")
    modules = getattr(meta, "modules", [])
    if type(modules) is not list or any(type(m) is not str for m in modules):
        raise _bad(source, "storage_meta.modules is not a list of names")


def check_metadata(md: Metadata, source: str, max_object_bytes: "int | None" = None) -> None:
    """Check every table and record of ``md`` for types and ranges; raise :class:`CorruptCheckpointError`.

    ``source`` names the file in messages; ``max_object_bytes`` caps non-tensor items.
    """
    if type(getattr(md, "storage_data", None)) is RecordTable:  # its tensor table may have been replaced
        md = copy.copy(md)
        md.storage_data = dict(md.storage_data)
    _check_tables(md, source)
    _check_records(md, source, max_object_bytes)


def _check_tables(md: Metadata, source: str, tensors_checked: bool = False) -> None:
    """Everything but the storage records: DCP's tensor table, planner data, storage meta, version.
    ``tensors_checked``: the tensor table was built from a format-2 item table, which checked it."""
    sdm, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if type(sdm) is not dict or type(storage) is not dict:
        raise CorruptCheckpointError(f"{source} lacks DCP's state_dict_metadata or storage_data tables")
    if not tensors_checked:
        _check_entries(sdm, source)
    _check_planner_data(getattr(md, "planner_data", None), source, sdm)
    _check_fields(md, source)


def _check_records(md: Metadata, source: str, max_object_bytes: "int | None", skip: int = 0) -> None:
    """Every storage record, against the (already checked) tensor table; the first ``skip`` were checked
    as rows of the record table (``unpack_storage``)."""
    sdm, storage = md.state_dict_metadata, md.storage_data
    checkpoint = _checkpoint_of(source)
    rest = storage.rest.items() if type(storage) is RecordTable else itertools.islice(storage.items(), skip, None)
    sizes = chunk_sizes(sdm) if skip < len(storage) else {}
    files: set[str] = set()  # data file names already checked
    for index, record in rest:
        if type(index) is not MetadataIndex:
            raise _bad(source, f"storage_data has a key of type {type(index).__name__}, not MetadataIndex")
        fqn = getattr(index, "fqn", None)
        entry = sdm.get(fqn) if type(fqn) is str else None
        if entry is None:
            raise _bad(source, f"storage_data has a record for {fqn!r}, which state_dict_metadata does not list")
        if is_native_record(record):
            check_record(record, fqn, checkpoint, max_object_bytes)
            if record["file"] not in files:
                safe_relative_name(record["file"], f"record of {fqn!r} in {checkpoint}")
                files.add(record["file"])
            if (record["kind"] == "bytes") != (type(entry) is BytesStorageMetadata):
                raise _bad(source, f"record of {fqn!r} is a {record['kind']} item, but state_dict_metadata says otherwise")
            check_against_chunks(record, index, sizes, checkpoint)
            check_against_properties(record, entry, fqn, checkpoint)
        elif type(record) is _StorageInfo:
            _check_stock(fqn, record, source, type(entry) is BytesStorageMetadata, max_object_bytes)
            if type(entry) is TensorStorageMetadata and not record.transform_descriptors:
                _check_stock_length(fqn, index, record, entry, sizes, source)
        else:
            raise _bad(source, f"record of {fqn!r} is a {type(record).__name__}")
    _check_every_item_stored(sdm, storage, source)


def _check_every_item_stored(sdm: dict, storage: dict, source: str) -> None:
    """Every chunk of every tensor, and every non-tensor item, has a record saying where it is."""
    if type(storage) is RecordTable:  # the items whose every chunk has a row, found over the columns
        stored = {(i.fqn, i.offset) for i in storage.rest}

        def has(fqn: str, offset: Any) -> bool:  # in the records apart, or (a tensor's chunk) in a row
            return (fqn, offset) in stored or (offset is not None and MetadataIndex(fqn, offset) in storage)

        for fqn, covered in zip(sdm, storage.covered().tolist()):
            missing = None if covered else unstored(fqn, sdm[fqn], has)
            if missing is not None:
                raise _bad(source, f"{missing} has no storage record")
        return
    missing = first_unstored(sdm, storage)
    if missing is not None:
        raise _bad(source, f"{missing} has no storage record")


def committed_save_id(storage: Storage) -> str | None:
    """The save id of the checkpoint committed in ``storage`` ("" if it has none), None if uncommitted."""
    try:
        md = load_metadata(storage)
    except MissingFileError:
        return None
    return getattr(md.storage_meta, "save_id", None) or ""
