"""Rows of a format-2 record table that name one index twice are refused, not merged."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader, CompressedWriter, CorruptCheckpointError
from dcp_tiered.codecs import checksum

_MAGIC = b"\x00dcp_tiered.md1"


def _column(table, name, values):
    width = len(table[name]) // table["n"]
    table[name] = np.array(values, dtype=np.uint64).astype(f"<u{width}").tobytes()


def test_two_rows_for_one_index_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4), "v": torch.zeros(4)}, storage_writer=CompressedWriter(path, sync_files=False),
             no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes()[:-len(_MAGIC) - 8])
    table = next(iter(md.storage_data.values()))["table"]
    item = np.frombuffer(table["item"], dtype=f"<u{len(table['item']) // table['n']}").tolist()
    _column(table, "item", [item[0]] * len(item))  # both rows: the first item's only chunk
    body = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    (path / ".metadata").write_bytes(body + _MAGIC + checksum((body,)).to_bytes(8, "little"))
    with pytest.raises(CorruptCheckpointError, match="two records for"):
        CompressedReader(path)
