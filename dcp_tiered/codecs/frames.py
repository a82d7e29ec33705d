"""Frames: the unit of compression, checksumming and partial reads.

A buffer is cut into frames of at most ``frame_size`` raw bytes (a multiple of the item
size).  Each frame is filtered into planes and every plane is compressed on its own; a
plane that does not shrink is stored raw, so decoding it costs a copy.  A plane whose sampled
byte entropy says it cannot shrink (see :func:`predict_raw`) is stored raw without calling the
compressor at all: the mantissa planes of floats, half of the bytes, cost nothing to encode.

Stored frame layout (little endian)::

    u8 plane_count, then per plane: u8 mode (0 raw, 1 compressed), u32 stored length
    followed by the plane payloads in order.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field

import numpy as np

from dcp_tiered.codecs.bytegroup import FILTER_NONE, FILTERS, merge_planes, plane_count, sample_entropy, split_planes
from dcp_tiered.codecs.checksum import checksum
from dcp_tiered.codecs.compressors import make_compressor
from dcp_tiered.checks import MAX_FRAME_SIZE, MIN_FRAME_SIZE  # noqa: F401  (importable from here too)
from dcp_tiered.codecs.registry import Codec, check_block_len, get_codec
from dcp_tiered.errors import CodecError, ConfigError, CorruptCheckpointError, DcpTieredError, UnsupportedFormatError

DEFAULT_FRAME_SIZE = 4 << 20
#: Most frames one record may have: 4 TiB at the default frame size, 4 GiB at the smallest.
MAX_FRAMES_PER_RECORD = 1 << 20
MODE_RAW = 0
MODE_COMPRESSED = 1
_HEAD = struct.Struct("<B")
_PLANE = struct.Struct("<BI")
# A compressed plane must save at least this fraction, else it is stored raw: decoding a
# raw plane is a copy, decoding a compressed one costs far more for a 1% gain.
_MIN_SAVING = 0.01
#: A plane whose sample has at least this many bits of order-0 entropy per byte is stored raw
#: without trying the compressor.  Entropy coding it would save at most 1.25% (zstd's fast
#: levels do not Huffman-code literals for a gain under 1.6%), and the byte-grouped planes of
#: weights and optimizer state that sample above it never shrank in the codec benchmark's data
#: sets.  Data with long repeats but uniform bytes (rare in tensors) would lose those matches.
RAW_ENTROPY_BITS = 7.9


def predict_raw(plane: np.ndarray) -> bool:
    """Whether ``plane`` (contiguous uint8) will not shrink, judged from a 16 KiB sample's byte entropy."""
    return sample_entropy(plane) >= RAW_ENTROPY_BITS


def stored_frame_bounds(codec: str | Codec, filter_name: str, itemsize: int, raw_len: int) -> tuple[int, int]:
    """Smallest and largest stored size a frame of ``raw_len`` raw bytes can have.

    A declared frame size outside these bounds is a lie: checking them before reading lets
    a reader refuse a record that claims a huge tensor stored in a few bytes (no codec
    expands that much, see ``Codec.min_stored_size``) or millions of one-byte frames.  A plane
    that does not shrink is stored raw, so the largest is the raw size plus the header.
    Raises ``CodecError`` for an unknown codec.
    """
    smallest = get_codec(codec).min_stored_size  # cached lookup for spec strings
    header, planes = _frame_layout(filter_name, itemsize)
    plane_len = raw_len // planes
    return header + planes * min(smallest(plane_len), plane_len), header + raw_len


@functools.lru_cache(maxsize=64)
def _frame_layout(filter_name: str, itemsize: int) -> tuple[int, int]:
    planes = plane_count(filter_name, itemsize)
    return _HEAD.size + planes * _PLANE.size, planes


def frame_step(frame_size: int, itemsize: int) -> int:
    """The raw bytes of each frame but the last: ``frame_size`` cut to whole elements (at least one)."""
    unit = max(itemsize, 1)
    return max(unit, frame_size - frame_size % unit)


def record_frame_size(raw_len: int, frame_size: int, itemsize: int = 1) -> int:
    """The frame size to use for one item of ``itemsize``-byte elements: ``frame_size``, enlarged for an item
    so large that it would need more than ``MAX_FRAMES_PER_RECORD`` frames (readers refuse such records),
    to a whole number of elements (:func:`frame_bounds` cuts frames there)."""
    if -(-raw_len // frame_step(frame_size, itemsize)) <= MAX_FRAMES_PER_RECORD:
        return frame_size
    unit, least = max(itemsize, 1), -(-raw_len // MAX_FRAMES_PER_RECORD)
    return -(-least // unit) * unit


def frame_bounds(raw_len: int, frame_size: int, itemsize: int) -> list[tuple[int, int]]:
    """Return the ``(start, end)`` raw byte ranges of the frames of a ``raw_len`` buffer."""
    if frame_size <= 0:
        raise ConfigError(f"frame_size must be positive, got {frame_size}")
    step = frame_step(frame_size, itemsize)
    if raw_len == 0:
        return []
    return [(s, min(s + step, raw_len)) for s in range(0, raw_len, step)]


@dataclass(frozen=True)
class EncodedFrame:
    """One encoded frame: the pieces to write in order, their total length and checksum."""

    pieces: tuple[object, ...]
    stored_len: int
    digest: int


@dataclass
class FrameCodec:
    """Encodes and decodes frames for one codec, filter and item size."""

    codec: str | Codec
    filter_name: str = FILTER_NONE
    itemsize: int = 1
    _compressor: Codec = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.codec = get_codec(self.codec)
        if self.filter_name not in FILTERS:
            raise UnsupportedFormatError(f"unknown filter {self.filter_name!r}; this version reads {FILTERS}")
        if self.itemsize < 1 or (self.filter_name != FILTER_NONE and self.itemsize not in (2, 4, 8)):
            raise UnsupportedFormatError(f"filter {self.filter_name!r} cannot take item size {self.itemsize}")
        self._compressor = make_compressor(self.codec, for_planes=self.filter_name != FILTER_NONE)

    @property
    def planes(self) -> int:
        return plane_count(self.filter_name, self.itemsize)

    def encode(self, raw: np.ndarray) -> EncodedFrame:
        """Encode one frame of raw bytes (a contiguous uint8 array)."""
        header = [_HEAD.pack(self.planes)]
        payloads: list[object] = []
        for plane in split_planes(raw, self.filter_name, self.itemsize):
            if not self.codec.compresses or predict_raw(plane):
                mode, payload = MODE_RAW, plane
            else:
                packed = self._compressor.compress(plane)
                if len(packed) < self.codec.min_stored_size(plane.nbytes):
                    # Readers refuse such a frame as crafted: fail the save, never commit it.
                    raise CodecError(f"codec {self.codec.spec} compressed {plane.nbytes} bytes to {len(packed)}, below "
                                     "its declared smallest block (set max_ratio or min_stored_size)")
                if len(packed) <= plane.nbytes * (1 - _MIN_SAVING):
                    mode, payload = MODE_COMPRESSED, packed
                else:
                    mode, payload = MODE_RAW, plane
            header.append(_PLANE.pack(mode, memoryview(payload).nbytes))
            payloads.append(payload)
        pieces = (b"".join(header), *payloads)
        return EncodedFrame(pieces, sum(memoryview(p).nbytes for p in pieces), checksum(pieces))

    def decode(self, stored: object, out: np.ndarray) -> None:
        """Decode one stored frame into ``out`` (uint8, exactly the frame's raw length)."""
        view = memoryview(stored).cast("B")
        raw_len = out.nbytes
        n = self.planes
        if raw_len % n:
            raise CorruptCheckpointError(f"frame raw length {raw_len} is not a multiple of {n} planes")
        if len(view) < _HEAD.size or view[0] != n:
            raise CorruptCheckpointError(f"frame header says {view[0] if len(view) else 'nothing'} planes, expected {n}")
        pos = _HEAD.size + n * _PLANE.size
        if len(view) < pos:
            raise CorruptCheckpointError("frame is shorter than its header")
        plane_len = raw_len // n
        planes = []
        for k in range(n):
            mode, length = _PLANE.unpack_from(view, _HEAD.size + k * _PLANE.size)
            payload = view[pos : pos + length]
            if len(payload) != length:
                raise CorruptCheckpointError(f"frame plane {k} is truncated: {len(payload)} of {length} bytes")
            pos += length
            if mode == MODE_RAW:
                if length != plane_len:
                    raise CorruptCheckpointError(f"raw plane {k} has {length} bytes, expected {plane_len}")
                planes.append(payload)
            elif mode == MODE_COMPRESSED:
                planes.append(self._decompress(payload, plane_len))
            else:
                raise CorruptCheckpointError(f"frame plane {k} has unknown mode {mode}")
        if pos != len(view):
            raise CorruptCheckpointError(f"frame has {len(view) - pos} trailing bytes")
        merge_planes(planes, self.filter_name, self.itemsize, out)


    def _decompress(self, payload: memoryview, plane_len: int) -> object:
        # Registered codecs may come from plugins: whatever a hostile block makes them
        # raise, or a wrong length, is reported as corruption
        # (struct.error, zlib.error, RuntimeError, a non-buffer result...); only an
        # out-of-memory error passes through as itself.
        try:
            return check_block_len(self._compressor.decompress(payload, plane_len), plane_len, self.codec)
        except (DcpTieredError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - plugin code on untrusted bytes
            raise CorruptCheckpointError(f"{self.codec.spec} block does not decode: {type(exc).__name__}: {exc}") from exc


def verify_frame(stored: object, expected: int) -> bool:
    """Return whether a stored frame's checksum matches ``expected``."""
    return checksum((stored,)) == expected
