"""ItemRecord: the typed view of a native item record, StockRecord for stock DCP records, and the
format-2 record table that stores native records in ``.metadata``."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

import dcp_tiered.dcp.format as format_mod
from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.codecs import FILTERS
from dcp_tiered.codecs.frames import stored_frame_bounds
from dcp_tiered.dcp.format import (
    KIND_BYTES,
    KIND_TENSOR,
    METADATA_FILE,
    READ_VERSIONS,
    ItemRecord,
    StockRecord,
    check_record,
    dtype_from_name,
    native_files,
    record_view,
    expected_sizes,
    record_sizes,
    records_in_file,
)
from dcp_tiered.dcp.save_stats import stats_from_records
from dcp_tiered.dcp.metadata_io import decode_metadata, encode_metadata
from dcp_tiered.dcp.item_table import pack_items, pack_paths, unpack_items, unpack_paths
from dcp_tiered.dcp import record_table
from dcp_tiered.dcp.record_table import TABLE_VERSION, is_table, pack_storage, unpack_storage
from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError

GOLDEN = Path(__file__).parent / "golden" / "v1"
_DTYPES = ["float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"]


@st.composite
def records(draw: st.DrawFn) -> dict:
    """A valid native record of plain builtins, in the writer's field order."""
    codec = draw(st.sampled_from(["none", "lz4", "zstd:1", "zstd:3"]))
    frame = draw(st.integers(4096, 3 * 4096 + 5))
    if draw(st.booleans()):
        kind, dtype = KIND_TENSOR, draw(st.sampled_from(_DTYPES))
        itemsize = dtype_from_name(dtype).itemsize
        filt = draw(st.sampled_from(FILTERS)) if itemsize in (2, 4, 8) else "none"
        shape = (*draw(st.lists(st.integers(0, 6), max_size=2)), draw(st.integers(0, 4000)))
        raw = itemsize
        for d in shape:
            raw *= d
    else:
        kind, itemsize, filt, dtype, shape = KIND_BYTES, 1, "none", None, None
        raw = draw(st.integers(0, 40000))
    step = frame - frame % itemsize
    seed = draw(st.integers(0, 2**64 - 1))
    frames, sums = [], []
    for i in range(-(-raw // step)):
        lo, hi = stored_frame_bounds(codec, filt, itemsize, min(step, raw - i * step))
        frames.append(lo + (seed + 7919 * i) % (hi - lo + 1))
        sums.append((seed * (i + 3)) % 2**64)
    rec = {"fmt": 1, "file": "__0_0.distcp", "offset": draw(st.integers(0, 1 << 40)), "length": sum(frames),
           "raw": raw, "codec": codec, "frames": tuple(frames), "sums": tuple(sums)}
    if draw(st.booleans()):
        rec["checksum"] = "xxh3_64"
    rec.update(kind=kind, itemsize=itemsize, filter=filt)
    if kind == KIND_TENSOR:
        rec.update(dtype=dtype, orig_dtype=draw(st.sampled_from([dtype, "float32", "float64"])), shape=shape)
    elif draw(st.booleans()):
        rec["object"] = "bytesio"
    rec["frame"] = frame
    return rec


@settings(max_examples=200, deadline=None)
@given(records())
def test_builtin_and_json_round_trip(rec: dict) -> None:
    item = ItemRecord.from_builtin(rec, "w", "ckpt")
    assert check_record(rec, "w", "ckpt") is rec
    back = item.to_builtin()
    assert back == rec and list(back) == list(rec)  # same fields, same order: .metadata bytes unchanged
    assert ItemRecord.from_json(json.loads(json.dumps(item.to_json())), "w", "intent") == item
    assert record_view(rec) == item and record_view(item) is item
    assert item.native and item.end == rec["offset"] + rec["length"]


@settings(max_examples=200, deadline=None)
@given(st.lists(records(), min_size=1, max_size=5))
def test_sizes_of_plain_records_are_those_of_their_typed_views(recs: list) -> None:
    """A coordinator sums plain records without typed views: the same sizes, totals and file ends."""
    typed = [ItemRecord.from_checked(r) for r in recs]
    for rec, item in zip(recs, typed):
        assert record_sizes(rec) == record_sizes(item) == (
            item.file, item.length, item.raw_length, item.orig_raw_length, item.downcast)
    keyed = [(f"k{i}", r) for i, r in enumerate(recs)]
    assert stats_from_records(keyed) == stats_from_records((k, ItemRecord.from_checked(r)) for k, r in keyed)
    assert expected_sizes(recs) == expected_sizes(typed)


@settings(max_examples=100, deadline=None)
@given(records(), st.sampled_from(["none", "lz4", "zstd:7"]), st.integers(0, 1 << 40))
def test_same_item_whatever_its_encoding(rec: dict, codec: str, offset: int) -> None:
    item = ItemRecord.from_checked(rec)
    moved = item.reencoded(codec, "none", offset, (5,) * len(rec["frames"]), (1,) * len(rec["frames"]))
    assert moved.same_item_as(item) and item.same_item_as(moved) and item.same_item_as(item)
    assert moved.length == 5 * len(rec["frames"]) and moved.frame_starts()[0] == offset
    other = ItemRecord.from_checked({**rec, "raw": rec["raw"] + 1, "file": "__1_0.distcp"})
    assert not other.same_item_as(item)
    data = {"a": rec, "b": {**rec, "file": "__1_0.distcp"}, "c": _StorageInfo("__0_0.distcp", 0, 1)}
    assert records_in_file(data, "__0_0.distcp") == {"a": rec}
    assert native_files(data) == ["__0_0.distcp", "__1_0.distcp"]


def test_unknown_fields_are_kept() -> None:
    rec = {"fmt": 1, "file": "a.distcp", "offset": 0, "length": 0, "raw": 0, "codec": "zstd:3", "frames": (),
           "sums": (), "kind": KIND_BYTES, "itemsize": 1, "filter": "none", "frame": 4096, "future": [1, 2]}
    item = ItemRecord.from_builtin(rec, "k", "ckpt")
    assert item.extra == (("future", [1, 2]),)
    assert item.to_builtin() == rec
    assert item.reencoded("lz4", "none", 10, (), ()).to_builtin() == {**rec, "codec": "lz4", "offset": 10}


@settings(max_examples=300, deadline=None)
@given(records(), st.data())
def test_frame_range_covers_exactly_the_requested_bytes(rec: dict, data: st.DataObject) -> None:
    item = ItemRecord.from_checked(rec)
    start = data.draw(st.integers(0, item.raw_length))
    end = data.draw(st.integers(start, item.raw_length))
    frames = item.frame_range(start, end)
    lo, hi = item.raw_span(frames)
    if start == end:
        assert not frames and lo == hi
        return
    assert lo <= start and end <= hi <= item.raw_length
    spans = [(s, e) for _, _, _, s, e in item.frame_slices(frames)]
    assert spans[0][0] == lo and spans[-1][1] == hi
    assert all(s < end and e > start for s, e in spans)  # no frame that the request does not touch
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@settings(max_examples=150, deadline=None)
@given(records(), st.integers(1, 40000))
def test_frames_tile_the_item_and_batches_tile_the_frames(rec: dict, limit: int) -> None:
    item = ItemRecord.from_checked(rec)
    slices = list(item.frame_slices())
    assert [i for i, *_ in slices] == list(range(len(rec["frames"])))
    assert [(at, n) for _, at, n, _, _ in slices] == [
        (rec["offset"] + sum(rec["frames"][:i]), n) for i, n in enumerate(rec["frames"])]
    raw_edges = [(s, e) for *_, s, e in slices]
    assert all(a[1] == b[0] for a, b in zip(raw_edges, raw_edges[1:]))
    assert (raw_edges[0][0], raw_edges[-1][1]) == (0, rec["raw"]) if slices else rec["raw"] == 0
    assert all(e - s == item.frame_step for s, e in raw_edges[:-1])
    starts = item.frame_starts()
    batches = list(item.read_batches(limit))
    assert [i for b in batches for i in b] == list(range(len(rec["frames"])))
    assert all(len(b) == 1 or starts[b.stop] - starts[b.start] <= limit for b in batches)


_BAD = [  # (mutation, expected error)
    (lambda r: r.update(fmt=3), UnsupportedFormatError),
    (lambda r: r.update(fmt="1"), UnsupportedFormatError),
    (lambda r: r.pop("fmt"), UnsupportedFormatError),
    (lambda r: r.pop("sums"), CorruptCheckpointError),
    (lambda r: r.update(kind="blob"), UnsupportedFormatError),
    (lambda r: r.update(filter="rle"), UnsupportedFormatError),
    (lambda r: r.update(codec="brotli"), UnsupportedFormatError),
    (lambda r: r.update(codec=3), CorruptCheckpointError),
    (lambda r: r.update(offset=-1), CorruptCheckpointError),
    (lambda r: r.update(offset=True), CorruptCheckpointError),
    (lambda r: r.update(raw=1 << 62), CorruptCheckpointError),
    (lambda r: r.update(frame=100), CorruptCheckpointError),
    (lambda r: r.update(itemsize=3), CorruptCheckpointError),
    (lambda r: r.update(frames=list(r["frames"])), CorruptCheckpointError),
    (lambda r: r.update(sums=r["sums"] + (1,)), CorruptCheckpointError),
    (lambda r: r.update(length=r["length"] + 1), CorruptCheckpointError),
    (lambda r: r.update(frames=r["frames"] + (0,), sums=r["sums"] + (0,)), CorruptCheckpointError),
]
_BAD_TENSOR = [
    (lambda r: r.update(dtype="float128"), UnsupportedFormatError),
    (lambda r: r.update(orig_dtype="nope"), UnsupportedFormatError),
    (lambda r: r.update(shape=list(r["shape"])), CorruptCheckpointError),
    (lambda r: r.update(shape=(*r["shape"], 2)), CorruptCheckpointError),
]


@settings(max_examples=300, deadline=None)
@given(records(), st.data())
def test_invalid_records_raise_this_packages_errors(rec: dict, data: st.DataObject) -> None:
    mutate, error = data.draw(st.sampled_from(_BAD + (_BAD_TENSOR if rec["kind"] == KIND_TENSOR and rec["raw"] else [])))
    bad = dict(rec)
    mutate(bad)
    for parse in (lambda: ItemRecord.from_builtin(bad, "w", "ckpt"), lambda: check_record(bad, "w", "ckpt")):
        with pytest.raises((CorruptCheckpointError, UnsupportedFormatError)) as info:
            parse()
        assert info.type is error and "'w'" in str(info.value) and "ckpt" in str(info.value), (bad, info.value)


def test_bytes_item_size_cap() -> None:
    rec = {"fmt": 1, "file": "a.distcp", "offset": 0, "length": 8204, "raw": 8192, "codec": "none",
           "frames": (4102, 4102), "sums": (1, 2), "kind": KIND_BYTES, "itemsize": 1, "filter": "none", "frame": 4096}
    ItemRecord.from_builtin(rec, "k", "ckpt")
    with pytest.raises(CorruptCheckpointError, match="max_object_bytes"):
        ItemRecord.from_builtin(rec, "k", "ckpt", max_object_bytes=4096)
    ItemRecord.from_json(rec, "k", "intent", max_object_bytes=None)


def test_stock_records_have_the_same_view(tmp_path: Path) -> None:
    info = _StorageInfo(relative_path="__0_0.distcp", offset=5, length=10, transform_descriptors=["stream.zstd/1"])
    view = record_view(info)
    assert view == StockRecord("__0_0.distcp", 5, 10, ("stream.zstd/1",))
    assert (view.file, view.offset, view.length, view.end, view.native) == ("__0_0.distcp", 5, 10, 15, False)
    dcp.save({"w": torch.arange(100.0), "step": 3}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    md = decode_metadata((tmp_path / METADATA_FILE).read_bytes(), "stock")
    views = [record_view(r) for r in md.storage_data.values()]
    assert views and all(not v.native and v.end <= (tmp_path / v.file).stat().st_size for v in views)


_HEAD = ["fmt", "file", "offset", "length", "raw", "codec", "frames", "sums", "checksum", "kind", "itemsize", "filter"]
#: The field order of records written today (pickled into .metadata as is).
_WRITTEN = {"w": [*_HEAD, "dtype", "orig_dtype", "shape", "frame"], "step": [*_HEAD, "frame"],
            "b": [*_HEAD, "object", "frame"]}


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.iterdir()))
def test_golden_records_round_trip(name: str) -> None:
    md = decode_metadata((GOLDEN / name / METADATA_FILE).read_bytes(), name)
    for index, rec in md.storage_data.items():
        item = ItemRecord.from_builtin(rec, index.fqn, name)
        assert item.to_builtin() == rec and record_view(rec) == item


def test_writer_records_keep_their_fields_and_order(tmp_path: Path) -> None:
    state = {"w": torch.arange(5000.0), "step": 3, "b": io.BytesIO(b"abc")}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path), no_dist=True)
    md = decode_metadata((tmp_path / METADATA_FILE).read_bytes(), "new")
    assert {i.fqn: list(r) for i, r in md.storage_data.items()} == _WRITTEN


# --------------------------------------------------------------------------- format 2 record table


def _layout(recs: list, data: st.DataObject) -> tuple[dict, dict]:
    """``(state_dict_metadata, storage_data)`` holding ``recs``: tensors as one chunk of a drawn
    chunk grid, index hints drawn, some records not fit for the table (unknown field, stock)."""
    sdm, storage = {}, {}
    for i, rec in enumerate(recs):
        rec = {**rec, "fmt": data.draw(st.sampled_from(READ_VERSIONS))}
        fqn = f"model.{i}"
        if rec["kind"] == KIND_TENSOR:
            shape, count = rec["shape"], data.draw(st.integers(1, 3))
            pos = data.draw(st.integers(0, count - 1))
            chunks = [ChunkStorageMetadata(torch.Size([j * shape[0], *[0] * (len(shape) - 1)]), torch.Size(shape))
                      for j in range(count)]
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                             torch.Size([count * shape[0], *shape[1:]]), chunks)
            index = MetadataIndex(fqn, chunks[pos].offsets, data.draw(st.sampled_from([None, pos, 7])))
        else:
            sdm[fqn] = BytesStorageMetadata()
            index = MetadataIndex(fqn, None, data.draw(st.sampled_from([None, 0])))
        odd = data.draw(st.sampled_from([None, None, None, "extra", "stock", "float", "bool", "negative", "length",
                                         "list", "shape", "listname"]))
        if odd == "extra":
            rec["future_field"] = 1
        elif odd == "negative":
            rec["offset"] = -1
        elif odd == "length":  # not the sum of its frames
            rec["length"] += 1
        elif odd == "list":
            rec["frames"] = list(rec["frames"])
        elif odd == "listname":  # a name field that is no string (and not hashable)
            rec["codec"] = [rec["codec"]]
        elif odd == "shape":  # not its chunk's shape (a non-tensor item: any shape)
            rec["shape"] = (7, 7, 7)
        elif odd in ("float", "bool"):  # equal as a number, not an int: kept as it is, not in the table
            rec["frame" if odd == "float" else "fmt"] = float(rec["frame"]) if odd == "float" else True
        storage[index] = _StorageInfo("__0_0.distcp", 0, 1) if odd == "stock" else rec
    return sdm, storage


@settings(max_examples=150, deadline=None)
@given(st.lists(records(), min_size=1, max_size=6), st.data())
def test_record_table_round_trips_exactly(recs: list, data: st.DataObject) -> None:
    sdm, storage = _layout(recs, data)
    packed = pickle.loads(pickle.dumps(pack_storage(sdm, storage)))
    back = unpack_storage(sdm, packed, "ckpt/.metadata")
    assert back == storage
    assert {i: (i.index, list(r) if type(r) is dict else r) for i in back for r in [back[i]]} == \
        {i: (i.index, list(r) if type(r) is dict else r) for i in storage for r in [storage[i]]}
    fits = [r for r in storage.values() if type(r) is dict and "future_field" not in r
            and type(r["frame"]) is int and type(r["fmt"]) is int and r["offset"] >= 0
            and r["length"] == sum(r["frames"]) and type(r["frames"]) is tuple and r.get("shape") != (7, 7, 7)
            and type(r["codec"]) is str]
    assert is_table(packed) == bool(fits) and len(packed) == len(storage) - max(len(fits) - 1, 0)


@settings(max_examples=150, deadline=None)
@given(st.lists(records(), min_size=1, max_size=6), st.data())
def test_a_packed_tables_totals_over_its_columns_are_those_of_its_records(recs: list, data: st.DataObject) -> None:
    """A coordinator's file sizes and save totals come from the table's columns, not record by record:
    the same as over the records it holds (table rows in their order, then the records kept apart)."""
    recs = [{**r, "file": data.draw(st.sampled_from(["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]))} for r in recs]
    sdm, storage = _layout(recs, data)
    storage = {i: r for i, r in storage.items() if type(r) is dict}  # a save's own records: all native
    if not storage:
        return
    packed = pack_storage(sdm, storage)
    back = unpack_storage(sdm, packed, "ckpt/.metadata")
    ends, stats = record_table.packed_totals(sdm, packed)
    assert ends == expected_sizes(back.values())
    assert stats == stats_from_records((i.fqn, r) for i, r in back.items())


def test_golden_v1_metadata_reencodes_as_a_table_with_the_same_records() -> None:
    for d in sorted(GOLDEN.iterdir()):
        md = decode_metadata((d / METADATA_FILE).read_bytes(), d.name)
        data = encode_metadata(md)
        assert is_table(pickle.loads(data[:-23]).storage_data)
        assert decode_metadata(data, d.name).storage_data == md.storage_data


def test_metadata_is_no_larger_than_stock_per_tensor(tmp_path: Path) -> None:
    """Issue 15: ``.metadata`` bytes per tensor, ours against stock FileSystemWriter, on many small tensors."""
    state = {f"model.layers.{i}.mlp.weight": torch.full((16,), float(i)) for i in range(2000)}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ours"), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    ours, stock = ((tmp_path / d / METADATA_FILE).stat().st_size for d in ("ours", "stock"))
    assert ours <= stock, (ours / 2000, stock / 2000)
    back = {k: torch.zeros(16) for k in state}
    dcp.load(back, storage_reader=CompressedReader(tmp_path / "ours"), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_a_format_1_reader_refuses_a_table_asking_for_an_upgrade(tmp_path: Path, monkeypatch) -> None:
    dcp.save({"w": torch.arange(10.0)}, storage_writer=CompressedWriter(tmp_path), no_dist=True)
    raw = pickle.loads((tmp_path / METADATA_FILE).read_bytes()[:-23])
    head = next(iter(raw.storage_data.values()))
    assert head["fmt"] == TABLE_VERSION == 3
    monkeypatch.setattr(format_mod, "READ_VERSIONS", (1,))  # what format 1 readers check first
    with pytest.raises(UnsupportedFormatError, match="format version 3.*upgrade dcp_tiered"):
        check_record(head, "w", str(tmp_path))


def test_a_format_2_reader_refuses_a_format_3_table_asking_for_an_upgrade(tmp_path: Path, monkeypatch) -> None:
    """Format 3 renamed the head's item and path tables: a format-2 reader skips them (it looks for
    ``items``), reaches the table's version check and asks for an upgrade, not calls the file damaged."""
    dcp.save({"w": torch.arange(10.0), "lr": 0.1}, storage_writer=CompressedWriter(tmp_path), no_dist=True)
    head = next(iter(pickle.loads((tmp_path / METADATA_FILE).read_bytes()[:-23]).storage_data.values()))
    assert {"items", "paths"}.isdisjoint(head) and type(head["table"]["names"]) is bytes
    monkeypatch.setattr(record_table, "HEAD_TABLES", {2: ("items", "paths")})
    with pytest.raises(UnsupportedFormatError, match="format 3; this version reads 2: upgrade dcp_tiered"):
        CompressedReader(tmp_path).read_metadata()


@st.composite
def _entries(draw) -> tuple[dict, dict]:
    """A random ``state_dict_metadata`` (tensors of 0-3 dims cut into 1-3 chunks, bytes items) and planner paths."""
    sdm, paths = {}, {}
    for i in range(draw(st.integers(1, 6))):
        fqn = f"opt.state.{i}.exp_avg" if i % 2 else f"m.w{i}"
        parts = st.one_of(st.sampled_from(["opt", "state", "m", fqn, "a\0b", "\udc80"]), st.integers(-3, 1 << 80))
        paths[fqn] = tuple(draw(st.lists(parts, min_size=1, max_size=5)))  # an empty path is no DCP path
        if draw(st.booleans()):
            sdm[fqn] = BytesStorageMetadata()
            continue
        dims = draw(st.lists(st.integers(0, 1 << 33), max_size=3))
        cuts = draw(st.integers(1, 3)) if dims else 1
        chunks = [ChunkStorageMetadata(torch.Size([j * (dims[0] // cuts), *[0] * (len(dims) - 1)]),
                                       torch.Size([dims[0] // cuts, *dims[1:]])) for j in range(cuts)] if dims else \
            [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
        props = TensorProperties(dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64])),
                                 requires_grad=draw(st.booleans()))
        sdm[fqn] = TensorStorageMetadata(props, torch.Size(dims), chunks)
    return sdm, paths


@settings(max_examples=150, deadline=None)
@given(_entries())
def test_item_and_path_tables_round_trip_exactly(case: tuple) -> None:
    sdm, paths = case
    items = pickle.loads(pickle.dumps(pack_items(sdm)))
    back = unpack_items(items, "ckpt/.metadata")
    assert back == sdm and list(back) == list(sdm)
    props = [e.properties for e in back.values() if type(e) is TensorStorageMetadata]
    assert len({id(p) for p in props}) == len(props)  # one TensorProperties per item, as unpickling gives
    table = pickle.loads(pickle.dumps(pack_paths(paths, list(sdm))))
    assert unpack_paths(table, list(sdm), "ckpt/.metadata") == paths
    assert pack_paths({**paths, next(iter(sdm)): ()}, list(sdm)) is None  # readers refuse it: left to the checks
    # planner_data in another order than the items (DCP's dedup moves replicated items): packed too, read back
    # in the items' order
    table = pickle.loads(pickle.dumps(pack_paths(paths, list(reversed(sdm)))))
    back_paths = unpack_paths(table, list(reversed(sdm)), "ckpt/.metadata")
    assert back_paths == paths and list(back_paths) == list(reversed(sdm))


def test_nested_state_round_trips_through_all_three_tables(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
             "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 4)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]},
             "epoch": 7}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ours"), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    ours = decode_metadata((tmp_path / "ours" / METADATA_FILE).read_bytes(), "ours")
    stock = dcp.FileSystemReader(str(tmp_path / "stock")).read_metadata()
    assert ours.state_dict_metadata == stock.state_dict_metadata and ours.planner_data == stock.planner_data
    on_disk = pickle.loads((tmp_path / "ours" / METADATA_FILE).read_bytes()[:-23])
    assert on_disk.planner_data is None and len(on_disk.state_dict_metadata) == 1
    back = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
            "optim": {"state": {0: {"step": torch.tensor(0.0), "exp_avg": torch.ones(3, 4)}},
                      "param_groups": [{"lr": 0.0, "params": []}]}, "epoch": 0}
    dcp.load(back, storage_reader=CompressedReader(tmp_path / "ours"), no_dist=True)
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["epoch"] == 7
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"]


_MUTABLE = {
    "raw": st.one_of(st.integers(0, 1 << 20), st.sampled_from([1 << 62, 2**64 - 1])),
    "offset": st.sampled_from([0, (1 << 62) - 1, 1 << 62, 2**64 - 1]),
    "itemsize": st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32]),
    "frame": st.sampled_from([0, 1, 4095, 4096, 4097, 1 << 40]),
    "frames": st.integers(0, 2**64 - 1),
    "dtype": st.sampled_from(["float32", "bfloat16", "int8", "float128", "nonsense"]),
    "codec": st.sampled_from(["none", "lz4", "zstd:1", "zstd:99", "gzip"]),
    "filter": st.sampled_from([*FILTERS, "nonsense"]),
    "file": st.sampled_from(["__1_0.distcp", "../escape.distcp", "/abs.distcp", "a/../../b"]),
    "fmt": st.sampled_from([1, 2, 3]),
}


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), min_size=1, max_size=5), st.data())
def test_the_table_row_checks_refuse_what_the_record_checks_refuse(recs: list, data: st.DataObject) -> None:
    """``unpack_storage(..., checkpoint=)`` checks a table's rows over its columns; it must refuse a table
    exactly when one of its records fails the per-record checks (``check_record``, the file name, the kind
    against the tensor table): one mutated field of one record, any value that still packs."""
    from dcp_tiered.dcp.format import check_against_chunks, chunk_sizes
    from dcp_tiered.dcp.record_table import _check_one

    sdm, storage = _layout(recs, data)
    tabled = [i for i, r in storage.items() if type(r) is dict and "future_field" not in r]
    if not tabled:
        return
    index = data.draw(st.sampled_from(tabled))
    rec = dict(storage[index])
    field = data.draw(st.sampled_from(sorted(_MUTABLE)))
    value = data.draw(_MUTABLE[field])
    if field == "frames":
        if not rec["frames"]:
            return
        at = data.draw(st.integers(0, len(rec["frames"]) - 1))
        rec["frames"] = (*rec["frames"][:at], value, *rec["frames"][at + 1:])
        rec["length"] = sum(rec["frames"])
    elif field == "dtype" and "dtype" not in rec:
        return
    else:
        rec[field] = value
    storage[index] = rec
    packed = pack_storage(sdm, storage)
    if not is_table(packed):
        return
    rows = list(unpack_storage(sdm, packed, "ckpt/.metadata").items())[:next(iter(packed.values()))["table"]["n"]]
    try:
        for row in rows:
            _check_one(row, sdm, "ckpt", None)
            check_against_chunks(row[1], row[0], chunk_sizes(sdm), "ckpt")
        spans = sorted((r["file"], r["offset"], r["offset"] + r["length"]) for _i, r in rows if r["length"])
        for (f1, _s1, e1), (f2, s2, _e2) in zip(spans, spans[1:]):  # no two records on the same bytes
            if f1 == f2 and s2 < e1:
                raise CorruptCheckpointError("records share bytes")
        slow = None
    except (CorruptCheckpointError, UnsupportedFormatError) as exc:
        slow = str(exc)
    try:
        unpack_storage(sdm, packed, "ckpt/.metadata", checkpoint="ckpt")
        fast = None
    except (CorruptCheckpointError, UnsupportedFormatError) as exc:
        fast = str(exc)
    assert (fast is None) == (slow is None), (field, value, fast, slow)


def test_the_metadata_a_save_returns_pickles_its_items_as_the_table(tmp_path: Path) -> None:
    """What DCP broadcasts to every rank after a save (the ``Metadata`` ``dcp.save`` returns): its
    ``state_dict_metadata`` pickles as the item table, a few bytes a chunk where DCP's dataclasses cost
    ~60, and unpickles as the plain dict DCP built, in its order.  Encoded again (a node leader commits
    what it received), it makes a ``.metadata`` readers accept: the table's reduction is never in a file."""
    state = {f"w{i}": torch.randn(8, 4) for i in range(50)} | {"epoch": 3}
    md = dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ours", sync_files=False), no_dist=True)
    stock = dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    back = pickle.loads(pickle.dumps(md))
    assert type(back.state_dict_metadata) is dict and back.state_dict_metadata == stock.state_dict_metadata
    assert list(back.state_dict_metadata) == list(stock.state_dict_metadata)
    assert 2 * len(pickle.dumps(md.state_dict_metadata)) < len(pickle.dumps(stock.state_dict_metadata))
    rebuilt = type(md.state_dict_metadata)(md.state_dict_metadata.items())  # as dict-copying code makes one
    assert pickle.loads(pickle.dumps(rebuilt)) == stock.state_dict_metadata
    for received in (md, back):
        again = decode_metadata(encode_metadata(received), "again/.metadata")
        assert again.state_dict_metadata == stock.state_dict_metadata and again.planner_data == stock.planner_data


def _sharded_metadata(tmp_path: Path, chunks: int):
    """The ``Metadata`` of a save whose first tensor is cut in ``chunks`` row chunks, followed by a
    non-tensor item."""
    md = decode_metadata(_saved_metadata(tmp_path), "ckpt/.metadata")
    records = {i.fqn: (i, r) for i, r in md.storage_data.items()}
    (_emb_index, emb), (lr_index, lr) = records["emb"], records["lr"]
    entry = md.state_dict_metadata["emb"]
    entry.size = torch.Size([chunks, 4])
    entry.chunks = [ChunkStorageMetadata(torch.Size([k, 0]), torch.Size([1, 4])) for k in range(chunks)]
    md.storage_data = {MetadataIndex("emb", torch.Size([k, 0]), k): {**emb, "file": "__1_0.distcp", "offset": k * emb["length"]}
                       for k in range(chunks)} | {lr_index: lr}
    return md


def _saved_metadata(tmp_path: Path) -> bytes:
    path = tmp_path / f"save{len(list(tmp_path.iterdir()))}"
    dcp.save({"emb": torch.arange(4.0).reshape(1, 4), "lr": 0.1}, storage_writer=CompressedWriter(path), no_dist=True)
    return (path / METADATA_FILE).read_bytes()


def test_the_head_record_is_of_the_item_with_the_fewest_chunks(tmp_path: Path) -> None:
    """On disk ``state_dict_metadata`` keeps the head record's item as DCP's dataclasses (a format-1 reader
    reaches it): the head is the record of the item with the fewest chunks, so what the allow-list unpickler
    steps through does not grow with the chunks of the first tensor (16,000 ranks: 16,000 chunks)."""
    import pickletools

    opcodes = []
    for chunks in (4, 400):
        md = _sharded_metadata(tmp_path, chunks)
        data = encode_metadata(md)
        assert list(pickle.loads(data[:-23]).state_dict_metadata) == ["lr"]
        again = decode_metadata(data, "ckpt/.metadata")
        assert again.storage_data == md.storage_data and again.state_dict_metadata == md.state_dict_metadata
        opcodes.append(sum(1 for _ in pickletools.genops(data[:-23])))
    assert opcodes[1] - opcodes[0] < 20, opcodes


def test_a_record_column_of_one_value_is_one_int_and_frame_lengths_take_three_bytes(tmp_path: Path) -> None:
    """Format 3's record table stores a column whose every row holds the same value (the codec, the frame
    size, the format of every record of a save) as that int, and columns of values below 2**24 (the stored
    lengths of 4 MiB frames) in 3 bytes each: what every rank reads and DCP broadcasts shrinks with them."""
    md = _sharded_metadata(tmp_path, 300)
    for rec in md.storage_data.values():  # stored lengths of frames up to 16 MiB, as 4 MiB frames have
        rec["frames"] = tuple(min(v * 5000, (1 << 24) - 1) for v in rec["frames"])
        rec["length"] = sum(rec["frames"])
    packed = pack_storage(md.state_dict_metadata, md.storage_data)
    table = next(iter(packed.values()))["table"]
    assert type(table["codec"]) is int and type(table["frame"]) is int and type(table["item"]) is bytes
    assert len(table["frames"]) == 3 * sum(len(r["frames"]) for r in md.storage_data.values())
    back = unpack_storage(md.state_dict_metadata, pickle.loads(pickle.dumps(packed)), "ckpt/.metadata")
    assert back == md.storage_data
