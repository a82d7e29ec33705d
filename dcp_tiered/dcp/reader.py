"""``CompressedReader``: a DCP ``StorageReader`` for checkpoints of this package and of stock DCP.

Reads are planned as frames: each requested tensor chunk needs only the frames that cover
it.  Adjacent frames are fetched with one ranged read, the next read is prefetched while
the current frames are verified and decoded in parallel, and a whole contiguous tensor is
decoded straight into its destination.  ``.metadata`` goes through the allow-list unpickler.
"""

from __future__ import annotations

import io
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_tiered.dcp.protocol import UrlCheckpointId, completed
from dcp_tiered.codecs import FrameCodec, verify_frame
from dcp_tiered.codecs.bytegroup import FILTER_NONE
from dcp_tiered.dcp.format import (
    KIND_BYTES,
    MAX_OBJECT_BYTES,
    METADATA_FILE,
    ItemRecord,
    ItemView,
    StockRecord,
    chunk_sizes,
    record_view,
)
from dcp_tiered.dcp.dropin import refuse_positional, storage_options_with
from dcp_tiered.dcp.metadata_io import check_metadata, load_metadata
from dcp_tiered.dcp.objects import SafeGlobals, deliver, normalize_safe_globals
from dcp_tiered.dcp.pickle_scan import check_torch_payload
from dcp_tiered.dcp.raw_frames import read_raw_frames
from dcp_tiered.dcp.record_table import RecordTable
from dcp_tiered.dcp.stock import decode_stock_item, stock_raw_bound
from dcp_tiered.dcp.tensors import writable_bytes
from dcp_tiered.checks import check_count
from dcp_tiered.ranks import default_threads
from dcp_tiered.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_tiered.storage import MissingFileError, Storage, safe_relative_name

# Largest ranged read that merges frames (a larger frame is read alone); two such buffers bound the host
# memory a load's reads hold. Local reads are cheap per call, so small chunks let decoding start after the
# first few MiB (a 91 MB MiniLM cold load took 2x as long with 64 MiB chunks as with 4 MiB ones: the first
# chunk was read before any decode), and a chunk of 4 MiB per decoder thread keeps every thread busy;
# remote stores pay a request's latency per chunk, so they keep large ones.
LOCAL_READ_PER_THREAD = 4 << 20
REMOTE_READ_CHUNK = 64 << 20
# Smallest ``none``-codec tensor read straight into its destination (two reads per frame, no copy).
RAW_DIRECT_MIN = 64 << 10


@dataclass
class _Request:
    """One read item of a native record, with where its frames decode to."""

    req: ReadItem
    record: ItemRecord
    key: str
    buf: np.ndarray | None  # uint8 destination: the raw bytes of ``frames`` (made when its first frame is read)
    tensor: torch.Tensor | None  # tensor whose bytes are ``buf`` (None for bytes items)
    direct: bool  # ``tensor`` is the planner's destination itself, decoded into in place
    elem_skip: int  # elements of ``buf`` before the first requested element
    frames: range  # the record's frames to decode into ``buf``
    frames_left: int = 0
    # ``tensor`` is the destination (another dtype or device), each frame decoded apart and copied into it
    streamed: bool = False
    size: int = 0  # bytes of ``buf`` to make


@dataclass
class _FrameTask:
    file_offset: int
    stored_len: int
    index: int
    owner: _Request
    raw_start: int  # within owner.buf
    raw_end: int


@dataclass
class _ReadChunk:
    file: str
    start: int
    end: int
    tasks: list[_FrameTask] = field(default_factory=list)


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


class CompressedReader(UrlCheckpointId, StorageReader):
    """Read a checkpoint written by :class:`CompressedWriter`, ``FileSystemWriter`` or ``FsspecWriter``.

    Args:
        path: checkpoint directory: a local path or any fsspec URL.
        storage_options: passed to fsspec.
        verify: check every frame's checksum before decoding it (on by default).
        threads: decompression threads (default: cores of this node divided by its ranks).
        max_object_bytes: largest decoded non-tensor item accepted (their size is not in
            DCP's metadata, so a hostile checkpoint could otherwise claim any size).
        safe_globals: classes/functions that non-tensor values may need beyond ``torch.load``'s
            ``weights_only`` allow-list (numpy values: :func:`~dcp_tiered.dcp.objects.numpy_safe_globals`,
            user classes), as for ``torch.serialization.add_safe_globals``; applied only around
            this reader's own loads.  Objects needing anything else raise
            :class:`UnsafeCheckpointError` naming the key and the missing globals.
            ``io.BytesIO`` values need nothing (stored as raw bytes, or a stock pickled ``BytesIO``).

    Drop-in for stock ``FileSystemReader``/``FsspecReader``: everything after ``path`` is
    keyword-only (a positional argument is a TypeError naming the keyword form), and fsspec
    storage options may also be given as keywords, as ``FsspecReader(path, **kwargs)`` takes them.

    The constructor reads and validates ``.metadata``, so a path that is not a checkpoint,
    or a damaged or hostile ``.metadata``, raises here with this package's error (inside
    ``dcp.load`` DCP would re-wrap it in an ``AssertionError``).
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *args: Any,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        threads: int | None = None,
        max_object_bytes: int = MAX_OBJECT_BYTES,
        safe_globals: SafeGlobals | None = None,
        **fsspec_options: Any,
    ) -> None:
        super().__init__()
        refuse_positional("CompressedReader", args, "CompressedReader(path, threads=4, verify=True)")
        self.storage_options = storage_options_with("CompressedReader", path, storage_options, fsspec_options,
                                                    ("storage_options", "verify", "threads", "max_object_bytes", "safe_globals"))
        self.safe_globals = normalize_safe_globals(safe_globals, "CompressedReader")
        check_count(threads, "CompressedReader threads", optional=True)
        self.max_object_bytes = check_count(max_object_bytes, "CompressedReader max_object_bytes", minimum=0)
        self._metadata: Metadata | None = None
        self.storage = self._open(path)
        self.verify = verify
        self.threads = threads
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
        self._tensor_dtypes: dict[str, torch.dtype] = {}
        self._items: dict[MetadataIndex, ItemView] = {}  # typed records, parsed once per load when first read
        self._codecs: dict[tuple[str, str, int], FrameCodec] = {}

    # -- DCP protocol ---------------------------------------------------------------

    def _open(self, path: "str | os.PathLike[str]") -> Storage:
        # Read and validated here, not only in read_metadata: DCP turns read_metadata failures
        # into an AssertionError, while errors from the constructor and reset() reach the caller.
        storage = Storage(path, self.storage_options)
        try:
            metadata = load_metadata(storage, max_object_bytes=self.max_object_bytes)
        except MissingFileError:
            storage.check_reachable()
            raise CheckpointNotFoundError(
                f"{storage.url} is not a committed checkpoint: {METADATA_FILE} is missing "
                "(wrong path, or the save was interrupted before it committed)"
            ) from None
        self._metadata = metadata
        return storage

    def _validate(self, metadata: Metadata, url: str) -> None:
        """Type and range checks of every table and record (metadata DCP handed us, not ours)."""
        check_metadata(metadata, url.rstrip("/") + "/" + METADATA_FILE, self.max_object_bytes)

    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        if checkpoint_id and os.fspath(checkpoint_id) != self.storage.url:
            self.storage = self._open(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data = {}
        self._items = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self.storage = self._open(self.storage.url)
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata is not self._metadata:
            if not isinstance(getattr(metadata, "storage_data", None), (dict, RecordTable)):
                raise CorruptCheckpointError(f"{self.storage.url}/{METADATA_FILE} has no storage records")
            self._validate(metadata, self.storage.url)
        self.storage_data = metadata.storage_data
        self._items = {}
        self._chunk_sizes = chunk_sizes(metadata.state_dict_metadata)
        self._tensor_dtypes = {
            fqn: md.properties.dtype for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return completed(lambda: self._read(plan, planner))

    # -- reading --------------------------------------------------------------------

    def _record(self, req: ReadItem) -> Any:
        try:
            return self.storage_data[req.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{METADATA_FILE} has no storage record for {req.storage_index.fqn!r}"
            ) from None

    def _item(self, req: ReadItem) -> ItemView:
        """The typed record of ``req`` (validated with the metadata; parsed on first use)."""
        item = self._items.get(req.storage_index)
        if item is None:
            item = self._items[req.storage_index] = record_view(self._record(req))
        return item

    def _check_files(self, reqs: list[ReadItem]) -> None:
        """Every requested item must lie inside its data file: checked before anything is allocated."""
        by_file: dict[str, list[tuple[str, int]]] = {}
        for req in reqs:
            item = self._item(req)
            by_file.setdefault(item.file, []).append((req.storage_index.fqn, item.end))
        for name, items in by_file.items():
            try:
                size = self.storage.size(name)
            except MissingFileError:
                keys = sorted({k for k, _ in items})
                raise CheckpointNotFoundError(
                    f"data file {self.storage.url_of(name)} of checkpoint {self.storage.url} is missing (it holds "
                    f"{', '.join(repr(k) for k in keys[:3])}{'...' if len(keys) > 3 else ''}); "
                    "restore from another tier or an older step"
                ) from None
            for key, end in items:
                if end > size:
                    raise CorruptCheckpointError(
                        f"data file {self.storage.url_of(name)} is truncated: {key!r} needs {end} bytes, the file has {size}; "
                        "restore from another tier or an older step"
                    )

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        native, stock = [], []
        for req in plan.items:
            (native if self._item(req).native else stock).append(req)
        self._check_files(plan.items)
        for req in stock:
            self._read_stock(req, planner)
        if not native:
            return
        requests = [self._plan_request(req, planner) for req in native]
        raw = [r for r in requests if self._reads_raw(r)]
        requests = [r for r in requests if not self._reads_raw(r)]
        tasks = [t for r in requests for t in self._frame_tasks(r)]
        chunks = self._chunks(tasks)
        for r in requests:
            if r.frames_left == 0:
                self._finish(r, planner)
        # Two read buffers alternate: one is decoded while the next chunk is fetched into the other.
        size = max((c.end - c.start for c in chunks), default=0)
        buffers = [bytearray(size), bytearray(size if len(chunks) > 1 else 0)]
        with ThreadPoolExecutor(1, thread_name_prefix="dcp_tiered-read") as reader, ThreadPoolExecutor(
            self._threads(), thread_name_prefix="dcp_tiered-decode"
        ) as pool:
            for r in pool.map(self._read_raw, raw):
                self._finish(r, planner)
            pending = reader.submit(self._fetch, chunks[0], buffers[0]) if chunks else None
            for i, chunk in enumerate(chunks):
                for t in chunk.tasks:
                    if t.owner.buf is None and not t.owner.streamed:
                        self._make_buffer(t.owner)
                data = pending.result()
                if i + 1 < len(chunks):
                    pending = reader.submit(self._fetch, chunks[i + 1], buffers[(i + 1) % 2])
                done = list(pool.map(lambda t: self._decode(t, chunk, data), chunk.tasks))
                for owner in done:
                    owner.frames_left -= 1
                    if owner.frames_left == 0:
                        self._finish(owner, planner)

    def _plan_request(self, req: ReadItem, planner: LoadPlanner) -> _Request:
        record = self._item(req)
        key = req.storage_index.fqn
        if record.kind == KIND_BYTES:
            return _Request(req, record, key, None, None, False, 0, range(len(record.frame_lengths)),
                            size=record.raw_length)
        shape = record.shape
        itemsize = record.itemsize
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if len(offsets) != len(shape) or any(o + n > d for o, n, d in zip(offsets, lengths, shape)):
            raise CorruptCheckpointError(
                f"read of {key!r} asks {offsets}+{lengths}, outside the stored chunk {shape} in {self.storage.url}"
            )
        strides = _strides(shape)
        numel = 1
        for n in lengths:
            numel *= n
        if numel == 0:
            first = last = 0
        else:
            first = sum(o * s for o, s in zip(offsets, strides))
            last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides)) + 1
        frames = record.frame_range(first * itemsize, last * itemsize)
        dtype = record.stored_dtype
        target = planner.resolve_tensor(req).detach()
        if numel * itemsize == record.raw_length and target.is_contiguous() and tuple(target.shape) == tuple(lengths):
            if target.device.type == "cpu" and target.dtype == dtype:
                return _Request(req, record, key, writable_bytes(target), target, True, 0, frames)
            return _Request(req, record, key, None, target, False, 0, frames, streamed=True)
        covered_start, covered_end = record.raw_span(frames)
        return _Request(req, record, key, None, None, False, first - covered_start // itemsize, frames,
                        size=covered_end - covered_start)

    @staticmethod
    def _make_buffer(r: _Request) -> None:
        """The buffer ``r``'s frames decode into, made as its first frame is read (so a load holds the
        buffers of the items its reads reach, not of every item at once)."""
        if r.record.kind == KIND_BYTES:
            r.buf = np.empty(r.size, dtype=np.uint8)
        else:
            r.tensor = torch.empty(r.size // r.record.itemsize, dtype=r.record.stored_dtype)
            r.buf = writable_bytes(r.tensor)

    def _frame_tasks(self, r: _Request) -> list[_FrameTask]:
        base = r.frames.start * r.record.frame_step
        tasks = [_FrameTask(at, n, i, r, s - base, e - base) for i, at, n, s, e in r.record.frame_slices(r.frames)]
        r.frames_left = len(tasks)
        return tasks

    def _threads(self) -> int:
        return self.threads or default_threads()

    def _chunks(self, tasks: list[_FrameTask]) -> list[_ReadChunk]:
        limit = LOCAL_READ_PER_THREAD * self._threads() if self.storage.is_local else REMOTE_READ_CHUNK
        out: list[_ReadChunk] = []
        for t in sorted(tasks, key=lambda t: (t.owner.record.file, t.file_offset)):
            file = t.owner.record.file
            last = out[-1] if out else None
            end = t.file_offset + t.stored_len
            if last is not None and last.file == file and last.start <= t.file_offset <= last.end and end - last.start <= limit:
                last.end = max(last.end, end)
                last.tasks.append(t)
            else:
                out.append(_ReadChunk(file, t.file_offset, end, [t]))
        return out

    def _fetch(self, chunk: _ReadChunk, buf: bytearray) -> memoryview:
        view = memoryview(buf)[: chunk.end - chunk.start]
        got = self.storage.read_range_into(chunk.file, chunk.start, view)
        if got != len(view):
            raise CorruptCheckpointError(
                f"data file {self.storage.url_of(chunk.file)} is truncated: needed bytes {chunk.start}..{chunk.end}, "
                f"got {got}; restore from another tier or an older step"
            )
        return view

    def _reads_raw(self, r: _Request) -> bool:
        """Whether ``r`` takes the raw fast path: a whole tensor of ``none``-codec frames (one raw plane
        each) on a local file, read straight into its destination tensor with no buffer in between.
        Small tensors keep the batched path: one read for many of them costs less than a copy."""
        rec = r.record
        return (r.direct and self.storage.is_local and rec.raw_length >= RAW_DIRECT_MIN and rec.filter_name == FILTER_NONE
                and not self._codec(rec).codec.compresses)

    def _read_raw(self, r: _Request) -> _Request:
        read_raw_frames(self.storage, r.record, r.frames, r.buf, r.key, self.verify)
        return r

    def _decode(self, t: _FrameTask, chunk: _ReadChunk, data: memoryview) -> _Request:
        r = t.owner
        rec = r.record
        stored = data[t.file_offset - chunk.start : t.file_offset - chunk.start + t.stored_len]
        where = f"frame {t.index} of {r.key!r} in {self.storage.url_of(rec.file)}"
        if self.verify and not verify_frame(stored, rec.frame_sums[t.index]):
            raise CorruptCheckpointError(
                f"checksum mismatch in {where}: the file is corrupted; restore from another tier or an older step"
            )
        codec = self._codec(rec)
        out = np.empty(t.raw_end - t.raw_start, dtype=np.uint8) if r.streamed else r.buf[t.raw_start : t.raw_end]
        try:
            codec.decode(stored, out)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{where} does not decode: {exc}") from exc
        if r.streamed:  # frames hold whole elements: each is copied (converted, moved) into its place
            size = rec.itemsize
            r.tensor.view(-1)[t.raw_start // size : t.raw_end // size].copy_(torch.from_numpy(out).view(rec.stored_dtype))
        return r

    def _codec(self, rec: ItemRecord) -> FrameCodec:
        key = (rec.codec, rec.filter_name, rec.itemsize)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs.setdefault(key, FrameCodec(*key))
        return codec

    def _finish(self, r: _Request, planner: LoadPlanner) -> None:
        if r.buf is None and not (r.direct or r.streamed):  # no frames to read: an empty item
            self._make_buffer(r)
        if r.record.kind == KIND_BYTES:
            self._load_bytes(r.req, r.buf.tobytes(), planner, self._record(r.req))
        elif r.direct or r.streamed:
            planner.commit_tensor(r.req, r.tensor)
        else:
            lengths = tuple(r.req.lengths)
            view = (r.tensor[r.elem_skip :].as_strided(lengths, _strides(r.record.shape)) if r.tensor.numel()
                    else r.tensor.reshape(lengths))
            self._copy_into(r.req, view, planner)
        r.buf = r.tensor = None  # its buffer goes as soon as it is copied

    def _copy_into(self, req: ReadItem, tensor: torch.Tensor, planner: LoadPlanner) -> None:
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(tensor.shape):
            raise CorruptCheckpointError(
                f"tensor {req.storage_index.fqn!r} in {self.storage.url} has shape {tuple(tensor.shape)} "
                f"but the destination expects {tuple(target.shape)}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _load_bytes(self, req: ReadItem, data: bytes, planner: LoadPlanner, record: Any) -> None:
        deliver(planner, req, data, record, self.safe_globals, self.storage.url)

    def _read_stock(self, req: ReadItem, planner: LoadPlanner) -> None:
        info: StockRecord = self._item(req)  # type: ignore[assignment]
        key = req.storage_index.fqn
        name = safe_relative_name(info.file, f"record of {key!r}")
        data = self.storage.read_range(name, info.offset, info.end)
        if len(data) != info.length:
            raise CorruptCheckpointError(
                f"data file {self.storage.url_of(name)} is truncated at item {key!r}: {len(data)} of {info.length} bytes"
            )
        bound = stock_raw_bound(req, self._chunk_sizes, self._tensor_dtypes, info.length, self.max_object_bytes)
        raw = decode_stock_item(data, info.transforms, bound, f"{key!r} in {self.storage.url_of(name)}")
        if req.type == LoadItemType.BYTE_IO:
            self._load_bytes(req, raw, planner, self._record(req))
            return
        check_torch_payload(raw, f"tensor {key!r} in {self.storage.url_of(name)}")
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CorruptCheckpointError(f"tensor {key!r} in {self.storage.url_of(name)} does not load: {exc}") from exc
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"item {key!r} in {self.storage.url_of(name)} is not a tensor")
        for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            tensor = tensor.narrow(dim, off, n)
        self._copy_into(req, tensor, planner)

