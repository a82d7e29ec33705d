"""On-disk formats 1 and 2: the per-item record kept in ``Metadata.storage_data``.

Records hold plain builtins only (str, int, tuple, dict) so that ``.metadata`` stays
loadable by the allow-list unpickler without importing anything from this package.
:class:`ItemRecord` is their typed view (validation, frame arithmetic, conversions), and
:func:`record_view` shows stock DCP records the same way (:class:`StockRecord`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcp_tiered.codecs import FILTERS
from dcp_tiered.codecs.frames import MAX_FRAME_SIZE, MAX_FRAMES_PER_RECORD, MIN_FRAME_SIZE, frame_step, stored_frame_bounds
from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError
from dcp_tiered.names import DATA_SUFFIX, METADATA_FILE  # noqa: F401 - re-exported for the dcp layer

#: Format the writer emits.  Format 2 records are format 1's; only ``.metadata`` stores them
#: as one record table (``dcp.record_table``).  Readers accept every version in READ_VERSIONS.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
KIND_TENSOR = "tensor"
KIND_BYTES = "bytes"
_REQUIRED = ("fmt", "kind", "file", "offset", "length", "raw", "codec", "filter", "itemsize", "frame", "frames", "sums")


_DTYPES = {n: v for n in dir(torch) if isinstance(v := getattr(torch, n, None), torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "checkpoint metadata") -> torch.dtype:
    """Inverse of :func:`dtype_name`, refusing anything that is not a torch dtype."""
    # A fixed table, not getattr(torch, name): that could import one of torch's lazy submodules.
    value = _DTYPES.get(name) if type(name) is str else None
    if value is None:
        raise UnsupportedFormatError(f"unknown dtype {name!r} in {where}")
    return value


def is_native_record(record: Any) -> bool:
    """Whether a ``storage_data`` value was written by this package (a dict with ``fmt``)."""
    return isinstance(record, dict) and "fmt" in record


#: Default cap on the decoded size of one non-tensor item (its size is not in DCP's metadata).
MAX_OBJECT_BYTES = 256 << 20
#: Largest ``.metadata`` read; its size is checked before reading it.
MAX_METADATA_BYTES = 256 << 20
#: Most storage records (items) and tensor chunks a ``.metadata`` may hold: what a reader decodes is
#: bounded in time by this as its memory is by the bytes.  A save over either limit fails before its
#: commit (:func:`~dcp_tiered.dcp.metadata_io.encode_metadata`).
MAX_METADATA_RECORDS = 1 << 22
#: Most dimensions of a tensor (and of a chunk's offsets and sizes) readers accept.
MAX_DIMS = 64
#: Readers accept a tensor's dimensions below this (a shape's product is then checked exactly).
MAX_DIM = 1 << 62
_U64 = 1 << 64
_OPTIONAL = {"checksum": str, "dtype": str, "orig_dtype": str, "shape": tuple}
_TYPED = (("kind", str), ("filter", str), ("codec", str), ("file", str), ("frames", tuple), ("sums", tuple), *_OPTIONAL.items())
#: Field of bytes items naming how their raw bytes are a value (``dcp.objects.OBJECT_FIELD``).
OBJECT_FIELD = "object"
_KNOWN = frozenset((*_REQUIRED, *_OPTIONAL, OBJECT_FIELD))


def _is_uint(v: object) -> bool:
    return type(v) is int and v >= 0


def _uints(values: tuple, limit: int = _U64) -> bool:
    """All exact ints in ``[0, limit)`` (C-speed checks: frame tables can be long)."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0 and max(values) < limit)


def shape_ok(shape: Any) -> bool:
    """The one rule of a shape readers accept (a tensor's size, a chunk's offsets and sizes, a record's
    shape): at most :data:`MAX_DIMS` exact ints, each in ``[0, MAX_DIM)``."""
    return isinstance(shape, tuple) and len(shape) <= MAX_DIMS and all(type(d) is int and 0 <= d < MAX_DIM for d in shape)


def _check_fields(record: dict, where: str) -> None:
    missing = [f for f in _REQUIRED if f not in record]
    if missing:
        raise CorruptCheckpointError(f"{where} lacks fields {missing}")
    for name, typ in _TYPED:
        if name in record and type(record[name]) is not typ:
            raise CorruptCheckpointError(f"{where}: field {name!r} is a {type(record[name]).__name__}, not a {typ.__name__}")
    if record["kind"] not in (KIND_TENSOR, KIND_BYTES) or record["filter"] not in FILTERS:
        raise UnsupportedFormatError(f"{where} has kind {record['kind']!r} / filter {record['filter']!r}")
    try:
        stored_frame_bounds(record["codec"], record["filter"], 1, 0)  # validates the codec (cached)
    except ValueError as exc:
        raise UnsupportedFormatError(f"{where} uses codec {record['codec']!r}, which this version cannot read: {exc}") from exc


def _check_sizes(record: dict, where: str) -> None:
    if not all(_is_uint(record[f]) for f in ("offset", "length", "raw", "itemsize", "frame")):
        raise CorruptCheckpointError(f"{where} has invalid sizes (not non-negative integers)")
    if max(record["offset"], record["length"], record["raw"]) >= 1 << 62:
        raise CorruptCheckpointError(f"{where} has impossible sizes")
    itemsize, frame, raw = record["itemsize"], record["frame"], record["raw"]
    if not MIN_FRAME_SIZE <= frame <= MAX_FRAME_SIZE:
        raise CorruptCheckpointError(f"{where} has frame size {frame}, outside {MIN_FRAME_SIZE}..{MAX_FRAME_SIZE}")
    if itemsize not in (1, 2, 4, 8, 16) or (record["filter"] != FILTERS[0] and itemsize not in (2, 4, 8)):
        raise CorruptCheckpointError(f"{where} has an invalid item size {itemsize} for filter {record['filter']!r}")
    if raw % itemsize:
        raise CorruptCheckpointError(f"{where}: {raw} raw bytes is not a whole number of {itemsize}-byte items")


def _check_frames(record: dict, key: str, checkpoint: str, where: str) -> None:
    frames, sums, itemsize, raw = record["frames"], record["sums"], record["itemsize"], record["raw"]
    if len(frames) != len(sums):
        raise CorruptCheckpointError(f"{where} has {len(frames)} frame sizes but {len(sums)} checksums")
    if len(frames) > MAX_FRAMES_PER_RECORD:
        raise CorruptCheckpointError(f"{where} has {len(frames)} frames, above the limit of {MAX_FRAMES_PER_RECORD}")
    if not _uints(frames, 1 << 62) or not _uints(sums):
        raise CorruptCheckpointError(f"{where} has a frame table with entries that are not 64-bit unsigned integers")
    if sum(frames) != record["length"]:
        raise CorruptCheckpointError(f"frame table of {key!r} in {checkpoint} does not add up to its stored length")
    step = frame_step(record["frame"], itemsize)
    if len(frames) != -(-raw // step):
        raise CorruptCheckpointError(f"{where} has {len(frames)} frames for {raw} raw bytes in frames of {step}")
    if frames:
        bounds = lambda n: stored_frame_bounds(record["codec"], record["filter"], itemsize, n)  # noqa: E731
        full, last = frames[:-1], frames[-1]
        lo, hi = bounds(step) if full else (0, 0)  # one frame (most small tensors): one bounds lookup
        lo_last, hi_last = bounds(raw - (len(frames) - 1) * step)
        if (full and (min(full) < lo or max(full) > hi)) or not lo_last <= last <= hi_last:
            raise CorruptCheckpointError(
                f"{where} has a frame whose stored size is impossible for its raw size and codec "
                f"{record['codec']} (the sizes are damaged or crafted)"
            )


def _check_contents(record: dict, where: str, max_object_bytes: "int | None") -> None:
    raw, itemsize = record["raw"], record["itemsize"]
    if record["kind"] == KIND_BYTES:
        if max_object_bytes is not None and raw > max_object_bytes:
            raise CorruptCheckpointError(
                f"{where}: non-tensor item claims {raw} bytes, above the {max_object_bytes}-byte limit "
                "(raise max_object_bytes if this checkpoint is trusted)"
            )
        return
    stored = dtype_from_name(record.get("dtype", ""), where)
    if "orig_dtype" in record:
        dtype_from_name(record["orig_dtype"], where)
    if stored.itemsize != itemsize:
        raise CorruptCheckpointError(f"{where}: dtype {stored} does not match item size {itemsize}")
    shape = record.get("shape")
    if type(shape) is not tuple or not shape_ok(shape):
        raise CorruptCheckpointError(f"{where} has an invalid shape {shape!r}"[:300])
    numel = 1
    for d in shape:
        numel *= d
    if numel * itemsize != raw:
        raise CorruptCheckpointError(f"{where}: shape {shape} does not match {raw} raw bytes")


@dataclass(frozen=True, slots=True)
class ItemRecord:
    """One item of a native checkpoint (format 1): where its frames are and how to decode them.

    On disk (``Metadata.storage_data``, promotion intents) a record is the plain-builtin dict
    of :meth:`to_builtin`, so ``.metadata`` loads without this package; this is its typed view.
    ``offset``/``length`` are stored bytes in the data file ``file``; raw positions count the
    item's ``raw_length`` decoded bytes, cut into frames of :attr:`frame_step` bytes.
    """

    version: int
    kind: str
    file: str
    offset: int
    length: int
    raw_length: int
    codec: str
    filter_name: str
    itemsize: int
    frame_size: int
    frame_lengths: tuple[int, ...]
    frame_sums: tuple[int, ...]
    checksum: str | None = None
    dtype: str | None = None
    orig_dtype: str | None = None
    shape: tuple[int, ...] | None = None
    object_kind: str | None = None  # bytes items: "bytesio" (raw BytesIO content) or None (torch.save payload)
    extra: tuple[tuple[str, Any], ...] = ()  # fields this version does not know, kept as they are
    _starts: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    native: ClassVar[bool] = True

    # -- plain builtins <-> typed ----------------------------------------------------

    @staticmethod
    def validate(record: Any, key: str, checkpoint: str, max_object_bytes: "int | None" = MAX_OBJECT_BYTES) -> None:
        """Check a plain-builtin record's types and ranges (see :func:`check_record`)."""
        fmt = record.get("fmt")
        if type(fmt) is not int or fmt not in READ_VERSIONS:
            raise UnsupportedFormatError(
                f"tensor {key!r} in {checkpoint} uses dcp_tiered format version {fmt!r}; "
                f"this version reads {' and '.join(map(str, READ_VERSIONS))}: upgrade dcp_tiered"
            )
        where = f"record of {key!r} in {checkpoint}"
        _check_fields(record, where)
        _check_sizes(record, where)
        _check_frames(record, key, checkpoint, where)
        _check_contents(record, where, max_object_bytes)

    @classmethod
    def from_builtin(cls, record: Any, key: str, checkpoint: str,
                     max_object_bytes: "int | None" = MAX_OBJECT_BYTES) -> "ItemRecord":
        """Validate ``record`` (untrusted) and return its typed view."""
        cls.validate(record, key, checkpoint, max_object_bytes)
        return cls.from_checked(record)

    @classmethod
    def from_checked(cls, record: dict) -> "ItemRecord":
        """The typed view of a record that already passed validation (e.g. through ``check_metadata``)."""
        get = record.get
        extra = () if record.keys() <= _KNOWN else tuple((k, v) for k, v in record.items() if k not in _KNOWN)
        return cls(record["fmt"], record["kind"], record["file"], record["offset"], record["length"], record["raw"],
                   record["codec"], record["filter"], record["itemsize"], record["frame"], record["frames"],
                   record["sums"], get("checksum"), get("dtype"), get("orig_dtype"), get("shape"), get(OBJECT_FIELD), extra)

    def to_builtin(self) -> dict:
        """The record as stored in ``.metadata``: plain builtins, in the writer's field order."""
        rec: dict[str, Any] = {"fmt": self.version, "file": self.file, "offset": self.offset, "length": self.length,
                               "raw": self.raw_length, "codec": self.codec, "frames": self.frame_lengths,
                               "sums": self.frame_sums}
        for name, value in (("checksum", self.checksum), ("kind", self.kind), ("itemsize", self.itemsize),
                            ("filter", self.filter_name), ("dtype", self.dtype), ("orig_dtype", self.orig_dtype),
                            ("shape", self.shape), (OBJECT_FIELD, self.object_kind), ("frame", self.frame_size)):
            if value is not None:
                rec[name] = value
        rec.update(self.extra)
        return rec

    def to_json(self) -> dict:
        """:meth:`to_builtin` with lists for tuples (promotion intents and fragments are JSON)."""
        return {k: list(v) if type(v) is tuple else v for k, v in self.to_builtin().items()}

    @classmethod
    def from_json(cls, doc: dict, key: str, where: str, max_object_bytes: "int | None" = MAX_OBJECT_BYTES) -> "ItemRecord":
        """Validate a record read back from JSON (untrusted) and return its typed view."""
        return cls.from_builtin(builtin_from_json(doc), key, where, max_object_bytes)

    def reencoded(self, codec: str, filter_name: str, offset: int, frame_lengths: Sequence[int],
                  frame_sums: Sequence[int]) -> "ItemRecord":
        """The same item stored with another codec/filter at ``offset`` (promotion re-encoding)."""
        return dataclasses.replace(self, codec=codec, filter_name=filter_name, offset=offset,
                                   length=sum(frame_lengths), frame_lengths=tuple(frame_lengths),
                                   frame_sums=tuple(frame_sums))

    def same_item_as(self, other: "ItemRecord") -> bool:
        """Whether ``other`` describes the same item, however it is encoded and wherever it is stored
        (all fields equal but codec, filter, offset, length and the frame table)."""
        return other.reencoded(self.codec, self.filter_name, self.offset, self.frame_lengths, self.frame_sums) == self

    # -- where the bytes are -------------------------------------------------------

    @property
    def end(self) -> int:
        """File offset just past the item's stored bytes."""
        return self.offset + self.length

    @property
    def frame_step(self) -> int:
        """Raw bytes per frame: ``frame_size`` cut to whole items (the last frame may be shorter)."""
        return frame_step(self.frame_size, self.itemsize)

    def frame_range(self, start: int, end: int) -> range:
        """Indices of the frames holding raw bytes ``[start, end)`` (empty when ``end <= start``)."""
        step = self.frame_step
        first = start // step
        return range(first, -(-end // step) if end > start else first)

    def raw_span(self, frames: range) -> tuple[int, int]:
        """Raw bytes ``(start, end)`` that the consecutive ``frames`` decode to."""
        step = self.frame_step
        start = frames.start * step
        return start, (min(self.raw_length, frames.stop * step) if frames else start)

    def frame_starts(self) -> tuple[int, ...]:
        """File offset of every frame, then :attr:`end` (computed once per record)."""
        starts = self._starts
        if starts is None:
            starts = tuple(itertools.accumulate(self.frame_lengths, initial=self.offset))
            object.__setattr__(self, "_starts", starts)
        return starts

    def frame_slices(self, frames: "range | None" = None) -> Iterator[tuple[int, int, int, int, int]]:
        """Per frame of ``frames`` (default: all): index, file offset, stored length, raw start, raw end."""
        step, raw, starts, lengths = self.frame_step, self.raw_length, self.frame_starts(), self.frame_lengths
        for i in frames if frames is not None else range(len(lengths)):
            yield i, starts[i], lengths[i], i * step, min(raw, (i + 1) * step)

    def read_batches(self, limit: int) -> Iterator[range]:
        """Runs of consecutive frames whose stored bytes fit in ``limit`` (a larger frame is a run alone)."""
        starts, n, i = self.frame_starts(), len(self.frame_lengths), 0
        while i < n:
            j = i + 1
            while j < n and starts[j + 1] - starts[i] <= limit:
                j += 1
            yield range(i, j)
            i = j

    # -- what the bytes are --------------------------------------------------------

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the stored elements (tensor items)."""
        return dtype_from_name(self.dtype)

    @property
    def downcast(self) -> bool:
        """Whether a tensor was stored in a narrower dtype than its original one."""
        return is_downcast(self.kind, self.dtype, self.orig_dtype)

    @property
    def orig_raw_length(self) -> int:
        """Raw bytes in the original dtype (before any downcast)."""
        return _orig_raw(self.raw_length, self.itemsize, self.kind, self.dtype, self.orig_dtype)


def is_downcast(kind: Any, dtype: Any, orig_dtype: Any) -> bool:
    """Whether a record's tensor was stored in a narrower dtype than its original one."""
    return kind == KIND_TENSOR and orig_dtype is not None and orig_dtype != dtype


def orig_itemsize(itemsize: int, kind: Any, dtype: Any, orig_dtype: Any) -> int:
    """Bytes per element of a record's item in its original dtype: its stored item size unless downcast."""
    return dtype_from_name(orig_dtype).itemsize if is_downcast(kind, dtype, orig_dtype) else itemsize


def _orig_raw(raw: int, itemsize: int, kind: Any, dtype: Any, orig_dtype: Any) -> int:
    """A record's raw bytes in its original dtype (``record_table.packed_totals`` applies this to columns)."""
    if not is_downcast(kind, dtype, orig_dtype):
        return raw
    return raw // itemsize * orig_itemsize(itemsize, kind, dtype, orig_dtype)


def record_sizes(value: Any) -> tuple[str, int, int, int, bool]:
    """``(file, length, raw_length, orig_raw_length, downcast)`` of one validated native record, plain or
    typed: what a save's totals and file sizes need, without building a typed view of a plain record
    (a coordinator sums hundreds of thousands of them)."""
    if type(value) is dict:
        get = value.get
        kind, raw, dtype, orig = value["kind"], value["raw"], get("dtype"), get("orig_dtype")
        return (value["file"], value["length"], raw, _orig_raw(raw, value["itemsize"], kind, dtype, orig),
                is_downcast(kind, dtype, orig))
    return value.file, value.length, value.raw_length, value.orig_raw_length, value.downcast


@dataclass(frozen=True, slots=True)
class StockRecord:
    """A record of stock DCP (``_StorageInfo``) seen like an :class:`ItemRecord`: file, offset, length."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()  # DCP's stream transforms, outermost last

    native: ClassVar[bool] = False

    @property
    def end(self) -> int:
        """File offset just past the item's stored bytes."""
        return self.offset + self.length

    @classmethod
    def from_storage_info(cls, info: Any) -> "StockRecord":
        return cls(info.relative_path, info.offset, info.length, tuple(getattr(info, "transform_descriptors", None) or ()))


#: An item's record, native or stock: both have ``file``, ``offset``, ``length``, ``end`` and ``native``.
ItemView = Union[ItemRecord, StockRecord]


def record_view(value: Any) -> ItemView:
    """The typed view of one validated ``Metadata.storage_data`` value (a native dict or a ``_StorageInfo``)."""
    if type(value) is ItemRecord:
        return value
    if is_native_record(value):
        return ItemRecord.from_checked(value)
    return StockRecord.from_storage_info(value)


def expected_sizes(records: "Iterable[Any]", holds: "Callable[[str], bool] | None" = None) -> dict[str, int]:
    """The one rule of a checkpoint's file sizes: each data file the ``records`` (``storage_data`` values,
    native or stock) name must be as long as the furthest end of a record in it.  ``holds`` keeps only
    the files it accepts (a node directory: its ranks' files).  The values of a packed record table
    (``record_table.PackedRecords``) give theirs over its columns (``file_ends``)."""
    fast = getattr(records, "file_ends", None)
    ends = fast() if fast is not None else None
    if ends is not None:
        return {f: end for f, end in ends.items() if holds is None or holds(f)}
    out: dict[str, int] = {}
    for value in records:
        if type(value) is dict:  # a native record as stored: no typed view needed
            file, end = value["file"], value["offset"] + value["length"]
        else:
            rec = record_view(value)
            file, end = rec.file, rec.end
        if (holds is None or holds(file)) and out.get(file, -1) < end:
            out[file] = end
    return out


def records_in_file(storage_data: Mapping[Any, Any], file: str) -> dict[Any, dict]:
    """The native records (plain, by index) of ``storage_data`` whose bytes are in the data file ``file``."""
    return {i: r for i, r in storage_data.items() if is_native_record(r) and r["file"] == file}


def native_files(storage_data: Mapping[Any, Any]) -> list[str]:
    """The data files that native records of ``storage_data`` name, sorted."""
    return sorted({r["file"] for r in storage_data.values() if is_native_record(r)})


def builtin_from_json(doc: dict) -> dict:
    """A record read back from JSON as the plain builtins of ``.metadata`` (lists back to tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()}


def check_record(record: dict, key: str, checkpoint: str, max_object_bytes: "int | None" = MAX_OBJECT_BYTES) -> dict:
    """Validate one native record (types and ranges) so that no size in it can be trusted blindly.

    Raises :class:`CorruptCheckpointError` (or :class:`UnsupportedFormatError` for a newer
    format) naming the key and the checkpoint.  ``max_object_bytes=None`` skips the
    non-tensor size cap (the caller applies its own).  Returns ``record`` itself; use
    :meth:`ItemRecord.from_builtin` for the typed record.
    """
    ItemRecord.validate(record, key, checkpoint, max_object_bytes)
    return record


def chunk_sizes(state_dict_metadata: dict) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """``(fqn, chunk offsets) -> chunk sizes`` for every tensor chunk DCP's metadata lists."""
    out: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for fqn, md in state_dict_metadata.items():
        if type(md) is not TensorStorageMetadata:
            continue
        for chunk in md.chunks:
            out[(fqn, tuple(chunk.offsets))] = tuple(chunk.sizes)
    return out


def check_against_properties(record: dict, entry: Any, key: str, checkpoint: str) -> None:
    """A tensor record's dtype (its original one, for a downcast record) must be the one DCP's tensor
    table gives: else the load would build the tensor in that dtype and cast the stored values into it."""
    if record["kind"] != KIND_TENSOR or type(entry) is not TensorStorageMetadata:
        return
    saved, declared = record.get("orig_dtype") or record.get("dtype"), dtype_name(entry.properties.dtype)
    if saved != declared:
        raise CorruptCheckpointError(f"record of {key!r} in {checkpoint} holds {saved} values, but the checkpoint's "
                                     f"tensor table says {declared}: the metadata is inconsistent")


def check_against_chunks(record: dict, index: Any, sizes: dict, checkpoint: str) -> None:
    """A tensor record's shape must be the chunk DCP's metadata says it is."""
    if record["kind"] != KIND_TENSOR:
        return
    key = (index.fqn, tuple(index.offset or ()))
    expected = sizes.get(key)
    if expected is None or tuple(expected) != record["shape"]:
        raise CorruptCheckpointError(
            f"record of {index.fqn!r} in {checkpoint} has shape {record['shape']}, but the checkpoint's "
            f"tensor table says {expected}: the metadata is inconsistent"
        )
