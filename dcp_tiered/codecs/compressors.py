"""The built-in block codecs (none, lz4, zstd) with bounded decompression.

Each codec turns one buffer into one block and back.  Decompression never produces more
than the raw length the caller expects, so a lying or hostile block cannot allocate
unbounded memory.  zstd and lz4 release the GIL, so callers parallelise with threads.
"""

from __future__ import annotations

import threading
from typing import Any

import lz4.block
import zstandard

from dcp_tiered.codecs.registry import Codec, check_block_len, get_codec, register_builtins
from dcp_tiered.errors import CorruptCheckpointError

#: Level used when a spec names zstd without a level.  On weights and optimizer state no higher
#: level stores more than 0.4% less than level 1, while levels 15-19 compress 8-35x slower
#: (codec table in docs/benchmarks.md), so the default is 1.
DEFAULT_ZSTD_LEVEL = 1
ZSTD_LEVELS = range(1, 23)
# lz4.block cannot take inputs above this size; frames are far smaller.
_LZ4_MAX_INPUT = 0x7E000000


class NoneCodec(Codec):
    """Stores bytes as they are."""

    codec_id = "none"
    compresses = False

    def compress(self, data: object) -> bytes:
        return bytes(memoryview(data).cast("B"))

    def decompress(self, data: object, raw_len: int) -> bytes:
        out = bytes(memoryview(data).cast("B"))
        if len(out) != raw_len:
            raise CorruptCheckpointError(f"stored block has {len(out)} bytes, expected {raw_len}")
        return out


class Lz4Codec(Codec):
    """lz4 block format, raw size kept by the caller."""

    codec_id = "lz4"
    # lz4 encodes at most 255 bytes per byte of match length.
    max_ratio = 256

    def compress(self, data: object) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def decompress(self, data: object, raw_len: int) -> bytes:
        if raw_len > _LZ4_MAX_INPUT:
            raise CorruptCheckpointError(f"lz4 block claims {raw_len} raw bytes, above the frame limit")
        try:
            out = lz4.block.decompress(data, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptCheckpointError(f"lz4 block does not decode: {exc}") from exc
        return check_block_len(out, raw_len, self)


class ZstdCodec(Codec):
    """zstd at a level in 1..22 (spec ``"zstd:N"``; ``"zstd"`` is level 1).

    ``for_planes`` (see :meth:`tuned_for_planes`) tunes match finding for byte-grouped
    planes; it changes only the compressed bytes, never how they decode.  Exponent planes
    are low-entropy byte streams with few useful matches: at the fast levels a tiny hash
    table (``hash_log=6``) leaves them to the entropy coder, which is both faster (~2.5x)
    and smaller (0.331 vs 0.364 on MiniLM exponents, entropy 0.333).  Higher levels find
    more short, useless matches that cost the entropy coder more than they save (untuned
    zstd:3 stores MiniLM bf16 at 0.704 vs 0.664 for zstd:1), so they also get small tables
    and long minimum matches: every level is then at least as small as zstd:1, and zstd:15
    runs ~15x faster than untuned for the same size.
    """

    codec_id = "zstd"
    # zstd blocks hold at most 128 KiB and take at least 4 bytes (3 header, 1 RLE byte).
    max_ratio = 32768
    spec_help = f"zstd, zstd:N (N in {ZSTD_LEVELS.start}..{ZSTD_LEVELS.stop - 1})"

    def __init__(self, level: int = DEFAULT_ZSTD_LEVEL, for_planes: bool = False) -> None:
        if type(level) is not int or level not in ZSTD_LEVELS:
            raise ValueError(f"unknown zstd level {level!r}: use an integer 1..22, e.g. 'zstd:3'")
        self.level = level
        self._for_planes = for_planes
        overrides: dict[str, int] = {}
        if for_planes:
            # Swept again (MiniLM fp32/bf16 exponent planes, interleaved runs): level 1 already
            # uses the fast strategy with min_match 7; smaller windows, hash_log 8, min_match 6
            # or the dfast strategy are all slower and larger.  The plane is bound by Huffman coding.
            overrides = {"hash_log": 6} if level <= 2 else {"hash_log": 6, "chain_log": 6, "min_match": 7}
        self._params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True, **overrides)
        self._local = threading.local()

    @classmethod
    def config_from_arg(cls, arg: str | None) -> dict[str, Any]:
        if arg is None:
            return {"level": DEFAULT_ZSTD_LEVEL}
        try:
            return {"level": int(arg)}
        except ValueError:
            raise ValueError(f"unknown zstd level {arg!r}: use an integer 1..22, e.g. 'zstd:3'") from None

    def spec_arg(self) -> str:
        return str(self.level)

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "level": self.level}

    def tuned_for_planes(self) -> ZstdCodec:
        return ZstdCodec(self.level, for_planes=True)

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(compression_params=self._params)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def compress(self, data: object) -> bytes:
        return self._compressor().compress(data)

    def decompress(self, data: object, raw_len: int) -> bytes:
        try:
            declared = zstandard.frame_content_size(data)
            if declared not in (-1, raw_len):
                raise CorruptCheckpointError(f"zstd block declares {declared} raw bytes, metadata says {raw_len}")
            out = self._decompressor().decompress(data, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"zstd block does not decode: {exc}") from exc
        return check_block_len(out, raw_len, self)

    def __getstate__(self) -> dict:
        return {"level": self.level, "for_planes": self._for_planes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["level"], state["for_planes"])  # type: ignore[misc]


#: Registered when this module is imported (``dcp_tiered.codecs`` imports it before anything else uses the registry).
BUILTIN_CODECS: tuple[type[Codec], ...] = (NoneCodec, Lz4Codec, ZstdCodec)
register_builtins(BUILTIN_CODECS)


def make_compressor(spec: str | Codec, for_planes: bool = False) -> Codec:
    """Return the codec for a spec (validated), tuned for byte-grouped planes if ``for_planes``."""
    codec = get_codec(spec)
    return codec.tuned_for_planes() if for_planes else codec
