"""Found by ``tools/crash_harness --hostile`` (class ``table``): format-2 ``.metadata`` (written by
``CompressedWriter``) edited and re-written with a valid integrity trailer, then opened by
``CompressedReader`` / ``dcp.load`` / ``dcp_tiered.inspect.load_any``."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader, CompressedWriter, CorruptCheckpointError
from dcp_tiered.codecs import checksum
from dcp_tiered.dcp.metadata_io import _packed, unpack_metadata
from dcp_tiered.inspect import load_any
from dcp_tiered.tiers.events import root_cause

_MAGIC = b"\x00dcp_tiered.md1"


def _save(path, sd, codec="none"):
    dcp.save(sd, storage_writer=CompressedWriter(path, codec=codec, sync_files=False), no_dist=True)


def _write(path, md) -> None:
    """``md`` as ``.metadata`` with a correct trailer (the checksum is not what should stop it)."""
    body = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    (path / ".metadata").write_bytes(body + _MAGIC + checksum((body,)).to_bytes(8, "little"))


def _head(path):
    md = pickle.loads((path / ".metadata").read_bytes()[:-len(_MAGIC) - 8])
    return md, next(iter(md.storage_data.values()))


# found by crash_harness --hostile, fixed: record_table._last_lo: a row's raw size of 2**64-1 (codec none) makes stored_frame_bounds return a bound above 2**64, stored into a uint64 array: builtin OverflowError from CompressedReader()
def test_a_raw_size_near_2_64_in_the_record_table_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    _save(path, {"w": torch.ones(8), "v": torch.zeros(4)})
    md, head = _head(path)
    table = head["table"]
    raw = np.frombuffer(table["raw"], dtype=f"<u{len(table['raw']) // table['n']}").astype(np.uint64)
    raw[1] = 2**64 - 1  # not the first row of its combination of codec, dtype and sizes (checked whole first)
    table["raw"] = raw.tobytes()
    _write(path, md)
    with pytest.raises(CorruptCheckpointError):
        CompressedReader(path)


# found by crash_harness --hostile, fixed: the item table's TensorProperties dtype is never compared with the records' dtype: load_any/convert build the tensor in the dtype the properties say and DCP casts the stored float32 values into it (int64: truncated), no error
def test_tensor_properties_that_disagree_with_the_records_dtype_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    w = torch.tensor([0.25, 1.5, -2.75])
    _save(path, {"w": w})
    md, head = _head(path)
    props = list(head["item_table"]["props"])
    props[0] = copy.copy(props[0])
    props[0].dtype = torch.int64
    head["item_table"]["props"] = tuple(props)
    _write(path, md)
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        load_any(path)  # gives tensor([0, 1, -2])
    assert isinstance(root_cause(info.value), CorruptCheckpointError), repr(root_cause(info.value))


# found by crash_harness --hostile, fixed: two records naming the same bytes of a data file (b's record a copy of a's, under b's index) are accepted: a's values load as b, every checksum valid (the harness found it as one chunk's record copied onto another chunk's)
def test_two_records_on_the_same_bytes_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    sd = {"a": torch.arange(8, dtype=torch.float32), "b": -torch.arange(8, dtype=torch.float32)}
    _save(path, sd)
    md = unpack_metadata((path / ".metadata").read_bytes())
    index = {i.fqn: i for i in md.storage_data}
    md.storage_data[index["b"]] = dict(md.storage_data[index["a"]])
    _write(path, _packed(md))
    out = {"a": torch.zeros(8), "b": torch.zeros(8)}
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)  # loads a's values into b
    assert isinstance(root_cause(info.value), CorruptCheckpointError), repr(root_cause(info.value))


def test_records_on_the_same_bytes_are_refused_with_an_empty_record_between(tmp_path):
    """Found by the Hypothesis test of the column checks: an empty record sorted between two that overlap
    hid the overlap from a check of neighbours only."""
    path = tmp_path / "ckpt"
    sd = {"a": torch.arange(8, dtype=torch.float32), "e": torch.zeros(0), "b": -torch.arange(8, dtype=torch.float32)}
    _save(path, sd)
    md = unpack_metadata((path / ".metadata").read_bytes())
    index = {i.fqn: i for i in md.storage_data}
    a = md.storage_data[index["a"]]
    md.storage_data[index["e"]] = {**md.storage_data[index["e"]], "offset": a["offset"]}
    md.storage_data[index["b"]] = {**a, "offset": a["offset"] + 1, "frames": a["frames"], "length": a["length"]}
    _write(path, _packed(md))
    with pytest.raises(CorruptCheckpointError):
        CompressedReader(path)
