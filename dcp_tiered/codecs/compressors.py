"""Block compressors (zstd, lz4, none) with bounded decompression.

Each compressor turns one buffer into one block and back.  Decompression never produces
more than the raw length the caller expects, so a lying or hostile block cannot allocate
unbounded memory.  zstd and lz4 release the GIL, so callers parallelise with threads.
"""

from __future__ import annotations

import threading
from typing import Protocol

import lz4.block
import zstandard

from dcp_tiered.codecs.spec import CodecSpec, parse_codec
from dcp_tiered.errors import CorruptCheckpointError

# lz4.block cannot take inputs above this size; frames are far smaller.
_LZ4_MAX_INPUT = 0x7E000000


class Compressor(Protocol):
    """One-shot block compression with a known raw length on the way back."""

    spec: CodecSpec

    def compress(self, data: object) -> bytes: ...

    def decompress(self, data: object, raw_len: int) -> bytes: ...


class NoneCompressor:
    """Stores bytes as they are."""

    def __init__(self) -> None:
        self.spec = CodecSpec("none")

    def compress(self, data: object) -> bytes:
        return bytes(memoryview(data).cast("B"))

    def decompress(self, data: object, raw_len: int) -> bytes:
        out = bytes(memoryview(data).cast("B"))
        if len(out) != raw_len:
            raise CorruptCheckpointError(f"stored block has {len(out)} bytes, expected {raw_len}")
        return out


class Lz4Compressor:
    """lz4 block format, raw size kept by the caller."""

    def __init__(self) -> None:
        self.spec = CodecSpec("lz4")

    def compress(self, data: object) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def decompress(self, data: object, raw_len: int) -> bytes:
        if raw_len > _LZ4_MAX_INPUT:
            raise CorruptCheckpointError(f"lz4 block claims {raw_len} raw bytes, above the frame limit")
        try:
            out = lz4.block.decompress(data, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptCheckpointError(f"lz4 block does not decode: {exc}") from exc
        if len(out) != raw_len:
            raise CorruptCheckpointError(f"lz4 block decoded to {len(out)} bytes, expected {raw_len}")
        return out


class ZstdCompressor:
    """zstd at a given level; ``for_planes`` tunes match finding for byte-grouped planes.

    Exponent planes are low-entropy byte streams with few useful matches: at the fast
    levels a tiny hash table (``hash_log=6``) leaves them to the entropy coder, which is
    both faster (~2.5x) and smaller (0.331 vs 0.364 on MiniLM exponents, entropy 0.333).
    Higher levels find more short, useless matches that cost the entropy coder more than
    they save (untuned zstd:3 stores MiniLM bf16 at 0.704 vs 0.664 for zstd:1), so they also
    get small tables and long minimum matches: every level is then at least as small as
    zstd:1, and zstd:15 runs ~15x faster than untuned for the same size.
    """

    def __init__(self, level: int, for_planes: bool = False) -> None:
        self.spec = CodecSpec("zstd", level)
        self._for_planes = for_planes
        overrides: dict[str, int] = {}
        if for_planes:
            overrides = {"hash_log": 6} if level <= 2 else {"hash_log": 6, "chain_log": 6, "min_match": 7}
        self._params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True, **overrides)
        self._local = threading.local()

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
        if len(out) != raw_len:
            raise CorruptCheckpointError(f"zstd block decoded to {len(out)} bytes, expected {raw_len}")
        return out

    def __getstate__(self) -> dict:
        return {"level": self.spec.level, "for_planes": self._for_planes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["level"], state["for_planes"])  # type: ignore[misc]


def make_compressor(spec: "str | CodecSpec", for_planes: bool = False) -> Compressor:
    """Return the compressor for a codec spec (validated)."""
    parsed = parse_codec(spec)
    if parsed.name == "zstd":
        return ZstdCompressor(parsed.level, for_planes=for_planes)
    if parsed.name == "lz4":
        return Lz4Compressor()
    return NoneCompressor()
