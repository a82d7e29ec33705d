"""DCP glue: storage writer and reader, on-disk format, safe metadata loading, planners."""

from dcp_tiered.dcp.reader import CompressedReader
from dcp_tiered.dcp.writer import CompressedWriter

__all__ = ["CompressedReader", "CompressedWriter"]
