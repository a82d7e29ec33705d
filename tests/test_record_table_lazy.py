"""A decoded format-2 ``.metadata`` holds its records as a ``RecordTable``: the same records, keys
and order as the eager unpacking, built only when asked for, pickled as a plain dict, and saved
again as a record table."""

from __future__ import annotations

import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.dcp.metadata_io import check_metadata, decode_metadata, encode_metadata, unpack_metadata
from dcp_tiered.dcp.record_table import RecordTable, is_table


def _checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    sd = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(5), "note": {"lr": 0.1}, "s": torch.tensor(3)}
    dcp.save(sd, storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    return path, (path / ".metadata").read_bytes()


def test_the_lazy_table_equals_the_eager_records(tmp_path):
    _path, data = _checkpoint(tmp_path)
    eager = unpack_metadata(data).storage_data
    lazy = decode_metadata(data, "ckpt/.metadata").storage_data
    assert type(lazy) is RecordTable and type(eager) is dict
    assert list(lazy) == list(eager) and len(lazy) == len(eager)
    assert [lazy[i] for i in eager] == list(eager.values())
    assert dict(lazy.items()) == eager and lazy == eager
    assert all(i in lazy for i in eager)
    assert MetadataIndex("w", (1, 0)) not in lazy and MetadataIndex("nothing") not in lazy
    assert lazy.get(MetadataIndex("nothing")) is None


def test_the_lazy_table_pickles_as_a_dict_and_saves_again_as_a_table(tmp_path):
    _path, data = _checkpoint(tmp_path)
    md = decode_metadata(data, "ckpt/.metadata")
    back = pickle.loads(pickle.dumps(md.storage_data))
    assert type(back) is dict and back == dict(md.storage_data)
    check_metadata(md, "ckpt/.metadata")  # a decoded metadata handed back in is checked in full
    again = encode_metadata(md)
    assert is_table(pickle.loads(again[:-23]).storage_data)
    assert decode_metadata(again, "again").storage_data == md.storage_data


def test_a_reader_loads_through_the_lazy_table(tmp_path):
    path, _data = _checkpoint(tmp_path)
    sd = {"w": torch.zeros(4, 3), "b": torch.zeros(5), "note": {"lr": 0.0}, "s": torch.tensor(0)}
    dcp.load(sd, storage_reader=CompressedReader(path), no_dist=True)
    assert torch.equal(sd["w"], torch.arange(12.0).reshape(4, 3)) and sd["note"] == {"lr": 0.1} and sd["s"] == 3


def test_a_record_kept_apart_from_the_table_is_found_beside_the_rows(tmp_path):
    """A record the table cannot hold (an unknown field) stays apart; its index must not be taken for a
    row of another item (the rows' keys leave room for every chunk of every item)."""
    path = tmp_path / "ckpt"
    dcp.save({"a": torch.ones(3), "b": 7}, storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    md = unpack_metadata((path / ".metadata").read_bytes())
    tensor = next(i for i, r in md.storage_data.items() if r["kind"] == "tensor")  # item 0, chunk 1; b: item 1
    md.storage_data[tensor] = {**md.storage_data[tensor], "future_field": 1}
    decoded = decode_metadata(encode_metadata(md), "ckpt/.metadata").storage_data
    assert type(decoded) is RecordTable and len(decoded.rest) == 1
    assert dict(decoded) == md.storage_data


def test_listing_a_checkpoint_builds_none_of_its_records(tmp_path, monkeypatch):
    """A restore lists every committed step of every tier (on every rank for node-local ones): its file
    sizes and codecs come from the table's columns, so no record is built beyond the one per distinct
    combination of fields the decode checks (at 16k ranks a step's records are hundreds of thousands,
    in 16k files) -- and they equal what the records say."""
    from dcp_tiered.dcp.format import expected_sizes, record_view
    from dcp_tiered.tiers.catalog import list_tier
    from dcp_tiered.tiers.config import Tier

    tier = Tier("t", str(tmp_path / "tier"))
    sd = {f"w{i}": torch.full((64,), float(i)) for i in range(40)} | {"note": {"lr": 0.1}}
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "tier" / "step_000000001", codec="lz4", sync_files=False),
             no_dist=True)
    built = []
    record = RecordTable.record
    monkeypatch.setattr(RecordTable, "record", lambda self, r: (built.append(r), record(self, r))[1])
    (info,) = list_tier(tier)
    assert info.committed and info.complete and info.codec == "lz4" and len(set(built)) == 2, built  # tensors, bytes
    monkeypatch.undo()
    md = CompressedReader(tmp_path / "tier" / "step_000000001").read_metadata()
    assert type(md.storage_data) is RecordTable
    assert expected_sizes(md.storage_data.values()) == expected_sizes(list(md.storage_data.values()))
    assert not md.storage_data.rest and md.storage_data.row_codecs() == {record_view(r).codec for r in md.storage_data.values()}


def test_a_callers_edit_of_its_records_stays_its_own(tmp_path):
    """The same bytes are decoded once per process, and each caller gets records of its own: a tool that
    rewrites a record in place does not change what the next load of that checkpoint reads."""
    path, data = _checkpoint(tmp_path)
    mine = decode_metadata(data, "ckpt/.metadata").storage_data
    w = next(i for i in mine if i.fqn == "w")
    b = next(i for i in mine if i.fqn == "b")
    mine[w].clear()
    mine[w].update(mine[b])
    again = decode_metadata(data, "ckpt/.metadata").storage_data
    assert again[w]["shape"] == (4, 3) and again[w] != again[b]
    out = {"w": torch.zeros(4, 3), "b": torch.zeros(5), "note": {"lr": 0.0}, "s": torch.tensor(0)}
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    assert torch.equal(out["w"], torch.arange(12.0).reshape(4, 3))


def test_a_callers_edit_of_a_stock_record_stays_its_own(tmp_path):
    """Stock records (``_StorageInfo``, mutable) are the caller's own too: pointing one at another item's
    bytes does not change the next load of the checkpoint in the process."""
    from torch.distributed.checkpoint import FileSystemWriter

    from dcp_tiered.dcp.metadata_io import load_metadata
    from dcp_tiered.storage import Storage

    path = tmp_path / "stock"
    sd = {"a": torch.tensor([100.0, 101.0]), "b": torch.tensor([200.0, 201.0])}
    dcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    mine = load_metadata(Storage(str(path))).storage_data
    a, b = (next(i for i in mine if i.fqn == k) for k in "ab")
    mine[a].offset, mine[a].length = mine[b].offset, mine[b].length
    out = {"a": torch.zeros(2), "b": torch.zeros(2)}
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])
