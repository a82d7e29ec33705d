"""Bytes in, bytes out: codecs, the byte-group filter, frames and checksums.

This layer knows nothing of torch, fsspec or DCP.  Codecs are classes registered by id
(:func:`register_codec`); a spec string such as ``"zstd:3"`` names one with its config.
"""

from dcp_tiered.codecs.bytegroup import FILTERS, filter_for
from dcp_tiered.codecs.checksum import CHECKSUM_ALGORITHM, checksum
from dcp_tiered.codecs.compressors import make_compressor
from dcp_tiered.codecs.frames import DEFAULT_FRAME_SIZE, EncodedFrame, FrameCodec, frame_bounds, verify_frame
from dcp_tiered.codecs.registry import Codec, get_codec, register_codec, registered_codecs, unregister_codec, valid_specs

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_FRAME_SIZE",
    "FILTERS",
    "Codec",
    "EncodedFrame",
    "FrameCodec",
    "checksum",
    "filter_for",
    "frame_bounds",
    "get_codec",
    "make_compressor",
    "register_codec",
    "registered_codecs",
    "unregister_codec",
    "valid_specs",
    "verify_frame",
]
