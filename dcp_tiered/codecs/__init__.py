"""Bytes in, bytes out: codecs, the byte-group filter, frames and checksums.

This layer knows nothing of torch, fsspec or DCP.
"""

from dcp_tiered.codecs.bytegroup import FILTERS, filter_for
from dcp_tiered.codecs.checksum import CHECKSUM_ALGORITHM, checksum
from dcp_tiered.codecs.compressors import make_compressor
from dcp_tiered.codecs.frames import DEFAULT_FRAME_SIZE, EncodedFrame, FrameCodec, frame_bounds, verify_frame
from dcp_tiered.codecs.spec import VALID_SPECS, CodecSpec, parse_codec

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_FRAME_SIZE",
    "FILTERS",
    "VALID_SPECS",
    "CodecSpec",
    "EncodedFrame",
    "FrameCodec",
    "checksum",
    "filter_for",
    "frame_bounds",
    "make_compressor",
    "parse_codec",
    "verify_frame",
]
