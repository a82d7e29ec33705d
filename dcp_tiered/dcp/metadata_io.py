"""Reading and writing ``.metadata``: a DCP ``Metadata`` pickle plus an integrity trailer.

The trailer (a magic string and the xxh3-64 of the pickle) lets this package detect a
damaged ``.metadata`` before trusting any size in it.  ``pickle.load`` stops at the
pickle's STOP opcode, so stock DCP readers still read the file; files without the
trailer (written by stock DCP) are read without the integrity check.
"""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.metadata import Metadata

from dcp_tiered.codecs import checksum
from dcp_tiered.dcp.safe_pickle import safe_loads
from dcp_tiered.errors import CorruptCheckpointError, UnsafeCheckpointError

_MAGIC = b"\x00dcp_tiered.md1"
_TRAILER = len(_MAGIC) + 8


def encode_metadata(metadata: Metadata) -> bytes:
    """Pickle ``metadata`` and append the integrity trailer."""
    body = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return body + _MAGIC + checksum((body,)).to_bytes(8, "little")


def decode_metadata(data: bytes, source: str) -> Metadata:
    """Verify the trailer (when present), unpickle through the allow-list, check the shape."""
    body = data
    if len(data) >= _TRAILER and data[-_TRAILER:-8] == _MAGIC:
        body = data[:-_TRAILER]
        if checksum((body,)) != int.from_bytes(data[-8:], "little"):
            raise CorruptCheckpointError(f"{source} is damaged: its checksum does not match; restore from another tier or step")
    md = safe_loads(body, source)
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{source} holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(getattr(md, "state_dict_metadata", None), dict) or not isinstance(getattr(md, "storage_data", None), dict):
        raise CorruptCheckpointError(f"{source} lacks DCP's state_dict_metadata or storage_data tables")
    return md
