"""The encode-and-write pipeline of one data file: frames encoded on a pool, written in order.

Large frames are one pool job each; frames smaller than :data:`SMALL_FRAME` and than the frame size
(the items of a state with thousands of small tensors) are encoded in batches of about
:data:`BATCH_BYTES` (at most a frame size: the in-flight bound counts frames, so a batch larger than
the bound's share of a job would leave one batch running at a time), so that a pool hand-off (queue,
wake-up, GIL switch) is paid per batch, not per tensor.  Every
frame stays its own frame and every item its own record: the bytes written are the same.

The pieces of finished frames are gathered and written with one vectored call
(:func:`~dcp_tiered.storage.write_pieces`: ``os.writev`` on local files, which releases the GIL)
instead of one ``write`` per piece, and never joined into one buffer first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO


from dcp_tiered.codecs import FrameCodec, frame_bounds
from dcp_tiered.codecs.frames import EncodedFrame, record_frame_size
from dcp_tiered.dcp.tensors import DeviceBytes
from dcp_tiered.errors import DcpTieredError, SaveError, SaveMemoryError
from dcp_tiered.storage.base import write_pieces
from dcp_tiered.storage.writeback import IOV_MAX

#: Frames below this many raw bytes are encoded in batches (one pool job per batch).
SMALL_FRAME = 256 << 10
#: Raw bytes (and frames) per batch of small frames.
BATCH_BYTES = 1 << 20
BATCH_FRAMES = 512
#: Encoded bytes gathered before they are written (a large frame is written at once).
FLUSH_BYTES = 1 << 20


class _JobFailed(Exception):
    """A frame of a batch failed: which item's (``key``), and the error."""

    def __init__(self, key: str, exc: Exception) -> None:
        super().__init__(key)
        self.key, self.exc = key, exc


def _encode_all(jobs: list[tuple[FrameCodec, Any, int, int, str]]) -> list[EncodedFrame]:
    out = []
    for fc, data, s, e, key in jobs:
        try:
            out.append(_encode(fc, data, s, e))
        except DcpTieredError:
            raise
        except Exception as exc:
            raise _JobFailed(key, exc) from exc
    return out


def _encode(fc: FrameCodec, data: Any, s: int, e: int) -> EncodedFrame:
    """Encode bytes ``s:e`` of ``data``, sliced on the pool's thread: for a device tensor's bytes
    (:class:`~dcp_tiered.dcp.tensors.DeviceBytes`) the slice is its copy to a host buffer, given back
    once encoded."""
    raw = data[s:e]
    if not isinstance(data, DeviceBytes):
        return fc.encode(raw)
    frame = None
    try:
        frame = fc.encode(raw)
    finally:  # a failed encode gives its buffer back too
        data.release(raw, frame.pieces if frame is not None else ())
    return frame


class GatedPool:
    """A pool whose jobs each hold one of ``slots`` while they run: coders shared with other
    background work (promotion re-encodes) so that together they stay within one budget."""

    def __init__(self, pool: ThreadPoolExecutor, slots: threading.Semaphore) -> None:
        self._pool, self._slots = pool, slots

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._slots:
            return fn(*args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(self._run, fn, *args)


class _Batch:
    """Small frames encoded by one pool job; ``future`` is set when the batch is submitted."""

    __slots__ = ("jobs", "raw", "future")

    def __init__(self) -> None:
        self.jobs: list[tuple[FrameCodec, Any, int, int, str]] = []
        self.raw = 0
        self.future: Future | None = None


@dataclasses.dataclass
class ItemSource:
    """One item to write: its raw bytes (a uint8 array, or a device tensor's ``DeviceBytes``), what keeps
    them alive, and its record fields."""

    item: Any
    arr: Any
    keep: Any
    fields: dict


class _Item:
    """An item being written: its frames' stored lengths and checksums so far."""

    __slots__ = ("source", "start", "lengths", "sums", "left", "queued")

    def __init__(self, source: ItemSource) -> None:
        self.source = source
        self.start: int | None = None
        self.lengths: list[int] = []
        self.sums: list[int] = []
        self.left = 0  # frames queued and not written yet
        self.queued = False  # every frame of the item is queued


class PieceWriter:
    """Writes the pieces of finished frames in order, gathered into few vectored writes."""

    def __init__(self, f: BinaryIO, flush_bytes: int = FLUSH_BYTES) -> None:
        self._f = f
        self._flush_bytes = flush_bytes
        self._pieces: list[object] = []
        self._bytes = 0

    def add(self, frame: EncodedFrame) -> None:
        self._pieces.extend(frame.pieces)
        self._bytes += frame.stored_len
        if self._bytes >= self._flush_bytes or len(self._pieces) >= IOV_MAX:
            self.flush()

    def flush(self) -> None:
        if self._pieces:
            pieces, self._pieces, self._bytes = self._pieces, [], 0
            write_pieces(self._f, pieces)


#: Called per finished item: (source, start offset, frame lengths, frame checksums).
OnItem = Callable[[ItemSource, int, list, list], None]


def encode_error(key: str, where: str, exc: BaseException) -> SaveError:
    """What a save raises when item ``key`` could not be read or encoded for the data file ``where`` (a
    device copy, an allocation), as its own error, not as a failed write of the file; a
    :class:`SaveMemoryError` when memory ran out."""
    cls = SaveMemoryError if isinstance(exc, MemoryError) else SaveError
    return cls(f"saving {key!r} to {where} failed while reading or encoding it: {type(exc).__name__}: {exc}; "
               "nothing was committed. Free memory (host or device) or fix the tensor and save again")


def write_items(
    f: BinaryIO,
    sources: Iterable[ItemSource],
    codec_for: Callable[[dict], FrameCodec],
    frame_size: int,
    pool: "ThreadPoolExecutor | GatedPool",
    max_inflight_bytes: int,
    on_item: OnItem,
    where: str = "the data file",
) -> None:
    """Encode every item's frames on ``pool`` and write them to ``f`` (the data file ``where``) in item order.

    At most about ``max_inflight_bytes`` raw bytes are submitted and not yet written, counted per
    frame: the extra memory of a save is bounded by its frames in flight, whatever its largest item.
    ``fields["frame_size"]`` is set on each item's fields before its frames are cut.  A frame whose
    encode fails raises :func:`encode_error` naming its item (this package's own errors, a codec's, pass
    as they are), as do errors of ``f`` itself.
    """
    out = PieceWriter(f)
    small, batch_bytes = min(SMALL_FRAME, frame_size), min(BATCH_BYTES, frame_size)
    # frames in file order: (item, the job encoding it or None for an item without frames, index, raw bytes)
    pending: collections.deque[tuple[_Item, Any, int, int]] = collections.deque()
    batch: _Batch | None = None
    inflight = 0
    offset = 0

    def submit_batch() -> None:
        nonlocal batch
        if batch is not None:
            batch.future = pool.submit(_encode_all, batch.jobs)
            batch = None

    def drain_one() -> None:
        """Write the oldest queued frame; an item is reported once its last frame is written."""
        nonlocal inflight, offset
        item, job, index, raw = pending.popleft()
        if item.start is None:
            item.start = offset
        if job is not None:
            fut = job.future if isinstance(job, _Batch) else job
            if not fut.done():
                out.flush()  # hand the gathered bytes to the kernel while the encoders finish
            try:
                enc = fut.result()[index] if index >= 0 else fut.result()
            except DcpTieredError:
                raise
            except _JobFailed as failed:
                raise encode_error(failed.key, where, failed.exc) from failed.exc
            except Exception as exc:
                raise encode_error(item.source.item.index.fqn, where, exc) from exc
            out.add(enc)
            offset += enc.stored_len
            item.lengths.append(enc.stored_len)
            item.sums.append(enc.digest)
            inflight -= raw
            item.left -= 1
        if item.queued and item.left == 0:
            on_item(item.source, item.start, item.lengths, item.sums)

    def bound(coming: int) -> None:
        """Write frames (oldest first) until what is queued and a frame of ``coming`` raw bytes are within
        ``max_inflight_bytes``: per frame, so one large item never has all its frames encoded and held at once."""
        while inflight + coming > max_inflight_bytes and pending:
            if batch is not None and pending[0][1] is batch:
                submit_batch()  # only when the oldest frame waits on it: batches stay full
            drain_one()

    try:
        for src in sources:
            fc = codec_for(src.fields)
            fields = src.fields
            fields["frame_size"] = record_frame_size(src.arr.nbytes, frame_size, fields["itemsize"])
            item = _Item(src)
            key = src.item.index.fqn
            for s, e in frame_bounds(src.arr.nbytes, fields["frame_size"], fields["itemsize"]):
                raw = max(e - s, 1 << 12)  # tiny frames still count toward the bound
                bound(raw)  # before the frame is submitted: never one more in flight than the bound
                if e - s < small:
                    if batch is None:
                        batch = _Batch()
                    pending.append((item, batch, len(batch.jobs), raw))
                    batch.jobs.append((fc, src.arr, s, e, key))
                    batch.raw += e - s
                    if batch.raw >= batch_bytes or len(batch.jobs) >= BATCH_FRAMES:
                        submit_batch()
                else:
                    submit_batch()
                    pending.append((item, pool.submit(_encode, fc, src.arr, s, e), -1, raw))
                item.left += 1
                inflight += raw
            item.queued = True
            if item.left == 0:  # no frames, or all written already: reported in file order all the same
                pending.append((item, None, -1, 0))
        submit_batch()
        while pending:
            drain_one()
        out.flush()
    except BaseException:
        for _item, job, _index, _raw in pending:
            fut = job.future if isinstance(job, _Batch) else job
            if fut is not None:
                fut.cancel()
        raise
