"""Checksums of stored bytes: xxh3-64, which hashes at tens of GB/s (close to free)."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"


def checksum(buffers: Iterable[object]) -> int:
    """Return the xxh3-64 digest of the concatenation of ``buffers`` (any buffer-protocol objects)."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()
