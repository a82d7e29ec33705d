"""Codec spec strings: ``"none"``, ``"lz4"``, ``"zstd"``, ``"zstd:N"`` (N in 1..22), and those of registered codecs.

``parse_codec`` and ``CodecSpec`` are the names the writer, tiers and CLI use; a parsed spec
is the codec itself (:class:`~dcp_tiered.codecs.registry.Codec`), and ``str()`` of it is the
canonical spec string that records store.
"""

from __future__ import annotations

from dcp_tiered.codecs.registry import Codec, get_codec

#: A parsed codec spec is a registered codec instance.
CodecSpec = Codec


def parse_codec(spec: str | Codec) -> Codec:
    """Parse and validate a codec spec string; raise :class:`CodecError` listing the valid ones.

    Same as :func:`~dcp_tiered.codecs.registry.get_codec` (which also takes a config dict).
    """
    return get_codec(spec)
