"""Codec spec strings: ``"none"``, ``"lz4"``, ``"zstd"``, ``"zstd:N"`` (N in 1..22)."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_tiered.errors import CodecError

#: Level used when a spec names zstd without a level.  On weights and optimizer state no higher
#: level stores more than 0.4% less than level 1, while levels 15-19 compress 8-35x slower
#: (codec table in docs/benchmarks.md), so the default is 1.
DEFAULT_ZSTD_LEVEL = 1
ZSTD_LEVELS = range(1, 23)
VALID_SPECS = ("none", "lz4", "zstd", "zstd:N (N in 1..22)")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec: the codec name and, for zstd, its level."""

    name: str
    level: int = 0

    def __str__(self) -> str:
        return f"zstd:{self.level}" if self.name == "zstd" else self.name


def parse_codec(spec: "str | CodecSpec") -> CodecSpec:
    """Parse and validate a codec spec string; raise :class:`CodecError` listing the valid ones."""
    if isinstance(spec, CodecSpec):
        return spec
    if not isinstance(spec, str):
        raise CodecError(f"codec must be a string such as 'zstd:3', got {spec!r}; valid: {', '.join(VALID_SPECS)}")
    text = spec.strip().lower()
    name, sep, level_text = text.partition(":")
    if name in ("none", "lz4") and not sep:
        return CodecSpec(name)
    if name == "zstd":
        if not sep:
            return CodecSpec("zstd", DEFAULT_ZSTD_LEVEL)
        try:
            level = int(level_text)
        except ValueError:
            level = -1
        if level in ZSTD_LEVELS:
            return CodecSpec("zstd", level)
        raise CodecError(f"unknown zstd level in codec {spec!r}: use an integer 1..22, e.g. 'zstd:3'")
    raise CodecError(f"unknown codec {spec!r}; valid: {', '.join(VALID_SPECS)}")
