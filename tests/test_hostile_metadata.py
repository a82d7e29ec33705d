"""Hostile ``.metadata``: no crash, no hang, no process poisoning, no unbounded memory.

Every hostile load runs in a child process (``tests/isolated.py``) with a timeout and a
memory limit, so a segfault, a quadratic stall or a runaway allocation fails one test.
The children load each crafted checkpoint with ``CompressedReader`` and ``dcp.load`` and
report what was raised; most then save and load a fresh checkpoint to prove that the
process was not poisoned.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.metadata import MetadataIndex

from isolated import run_isolated
from dcp_tiered import CompressedReader, CompressedWriter, CorruptCheckpointError
from dcp_tiered.dcp.metadata_io import unpack_metadata

FRAME = 4096
DCP_MD = "torch.distributed.checkpoint.metadata"

# Child: load every checkpoint in CASES (name -> path), report the error of each, then prove
# that a normal save and load still round-trips in this very process.
_CHILD = """
import io, json, resource, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from dcp_tiered import CompressedReader, CompressedWriter, DcpTieredError
from torch.distributed.checkpoint.api import CheckpointException

def attempt(path, **kw):
    out = {"w": torch.zeros(4096), "ids": torch.zeros(1000, dtype=torch.int64), "note": ""}
    try:
        dcp.load(out, storage_reader=CompressedReader(path, threads=1, **kw), no_dist=True)
    except CheckpointException as exc:
        err = next(iter(exc.failures.values()))
        err = err[0] if isinstance(err, tuple) else err
    except Exception as exc:
        err = exc
    else:
        return {"ok": True}
    return {"ok": False, "cls": type(err).__name__, "dcp": isinstance(err, DcpTieredError),
            "value": isinstance(err, ValueError), "msg": str(err)[:400]}

results = {}
for name, path in CASES.items():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results[name] = attempt(path, **KW)
    results[name]["grew_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
sd = {"w": torch.arange(5000, dtype=torch.float32), "meta": {"k": 1}}
dcp.save(sd, storage_writer=CompressedWriter(FRESH, sync_files=False), no_dist=True)
back = {"w": torch.zeros(5000), "meta": {"k": 0}}
try:
    dcp.load(back, storage_reader=CompressedReader(FRESH), no_dist=True)
    results["@poisoned"] = not (torch.equal(back["w"], sd["w"]) and back["meta"] == sd["meta"])
except Exception as exc:
    results["@poisoned"] = f"{type(exc).__name__}: {exc}"[:400]
emit(results)
"""


def run_cases(tmp_path: Path, cases: dict[str, Path], *, timeout: float = 240, memory_mb: int = 6144, **reader_kw) -> dict:
    """Load each case in one child; return its per-case outcomes (fails on crash, hang or poisoning)."""
    code = f"CASES = {json.dumps({k: str(v) for k, v in cases.items()})}\nKW = {reader_kw!r}\nFRESH = {str(tmp_path / 'fresh')!r}\n" + _CHILD
    res = run_isolated(code, timeout=timeout, memory_mb=memory_mb)
    assert res.result is not None, res.describe()
    assert res.result.pop("@poisoned") is False, f"the process was poisoned: {res.result}"
    return res.result


def assert_refused(outcomes: dict, *needles: str, cls: tuple[str, ...] = ()) -> None:
    bad = {}
    for name, out in outcomes.items():
        if out["ok"] or not out["dcp"] or not out["value"] or (cls and out["cls"] not in cls):
            bad[name] = out
        elif not all(n in out["msg"] for n in needles):
            bad[name] = out
    assert not bad, json.dumps(bad, indent=1)


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4096, generator=g), "ids": torch.arange(1000), "note": "a string item"}


def save(path: Path, codec: str = "zstd") -> Path:
    dcp.save(state(), storage_writer=CompressedWriter(path, codec=codec, frame_size=FRAME, sync_files=False), no_dist=True)
    return path


def plain_metadata(path: Path):
    return unpack_metadata((path / ".metadata").read_bytes())


def write_metadata(path: Path, md, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))  # no trailer: read as a stock file


def index_of(md, fqn: str) -> MetadataIndex:
    return next(i for i in md.storage_data if i.fqn == fqn)


# --------------------------------------------------------------------------- pickle-level attacks


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def with_prefix(path: Path, prefix: bytes) -> None:
    """Rewrite ``.metadata`` as a protocol-2 pickle with ``prefix`` run first (its result popped)."""
    body = pickle.dumps(plain_metadata(path), protocol=2)
    assert body[:2] == b"\x80\x02"
    (path / ".metadata").write_bytes(body[:2] + prefix + b"0" + body[2:])


def test_build_on_an_allowed_class_cannot_poison_the_process(tmp_path):
    """BUILD with slot state on the Metadata *class* monkeypatches it process-wide on plain pickle.

    Here ``Metadata.__getstate__ = dict``: every later save pickles an empty Metadata, which
    no reader can load.  The load must be refused and the next save and load must work.
    """
    cases = {}
    for name, target in [("class", _global(DCP_MD, "Metadata")), ("function", _global("torch.serialization", "_get_layout")),
                         ("torch.Size", _global("torch", "Size"))]:
        path = save(tmp_path / name)
        slot = b"}" + _str("__getstate__") + _global("builtins", "dict") + b"s"
        with_prefix(path, target + b"N" + slot + b"\x86b")
        cases[name] = path
    # slot state on a fresh instance, and a second BUILD on one, are refused too
    for name, prefix in [
        ("slotstate-on-instance", _global(DCP_MD, "StorageMeta") + b")\x81" + b"N}" + _str("save_id") + _str("x") + b"s\x86b"),
        ("build-twice", _global(DCP_MD, "StorageMeta") + b")\x81" + b"}b" + b"}" + _str("save_id") + _str("x") + b"sb"),
        ("newobj-with-args", _global("builtins", "frozenset") + b"(" + b"K\x01" + b"t\x81"),
        ("reduce-dataclass", _global(DCP_MD, "Metadata") + b"}\x85R"),
    ]:
        path = save(tmp_path / name)
        with_prefix(path, prefix)
        cases[name] = path
    assert_refused(run_cases(tmp_path, cases), ".metadata", cls=("UnsafeCheckpointError",))


def test_a_million_nested_tuples_as_a_key_do_not_crash(tmp_path):
    """1e6 nested tuples used as a dict key or frozenset member overflowed the C stack in hash()."""
    n = 1_000_000
    deep = b"N" + b"\x85" * n  # None, then TUPLE1 a million times
    cases = {
        "dict-key": b"\x80\x04}" + deep + b"Ns.",
        "frozenset-member": b"\x80\x04(" + deep + b"\x91.",
        "nested-lists": b"\x80\x04" + b"]" * n + b"a" * (n - 1) + b".",
        "marks": b"\x80\x04" + b"(" * n + b"N" + b"t" * n + b".",
    }
    paths = {}
    for name, data in cases.items():
        path = save(tmp_path / name)
        (path / ".metadata").write_bytes(data)
        paths[name] = path
    assert_refused(run_cases(tmp_path, paths), ".metadata")


def _colliding_offsets(fqn_count: int) -> list[tuple[int, int]]:
    """``fqn_count`` 2-tuples of ints whose tuple hashes are all equal (CPython's xxHash-based tuple hash)."""
    m64 = (1 << 64) - 1
    p1, p2, p5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
    inv_p2 = pow(p2, -1, 1 << 64)
    rotl = lambda x: ((x << 31) | (x >> 33)) & m64  # noqa: E731
    target = 0x1234_5678_9ABC_DEF0
    out, a = [], 0
    while len(out) < fqn_count:
        a += 1
        acc = rotl((p5 + a * p2) & m64) * p1 & m64
        lane = (target - acc) * inv_p2 & m64  # the hash b must have
        if lane < (1 << 61) - 1:
            out.append((a, lane))
        elif lane > (1 << 64) - (1 << 61) + 1:
            out.append((a, -((1 << 64) - lane)))
    assert len({hash(o) for o in out}) == 1
    return out


class _PairsPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pickles the dict ``target`` with the key/value ``pairs`` instead: keys that collide never meet a dict here."""

    def __init__(self, file, target: dict, pairs: list) -> None:
        super().__init__(file, protocol=4)
        self.target, self.pairs = target, pairs
        self.dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
        self.dispatch[dict] = _PairsPickler._save_dict

    def _save_dict(self, obj: dict) -> None:
        if obj is not self.target:
            return pickle._Pickler.save_dict(self, obj)  # type: ignore[attr-defined]
        self.write(pickle.EMPTY_DICT)
        self.memoize(obj)
        self._batch_setitems(iter(self.pairs))


def test_hash_colliding_keys_are_cut_off_quickly(tmp_path):
    """Keys that all hash alike made dict insertion quadratic: 760 KiB took 28 s.

    Crafted here: 200,000 int keys all hashing to 0 (multiples of 2**61-1), and 20,000
    MetadataIndex keys whose offsets collide.  Both must be refused well inside the timeout.
    """
    mod = (1 << 61) - 1
    ints = b"".join(b"\x8a\x0b" + (k * mod).to_bytes(11, "little", signed=True) + b"N" for k in range(1, 200_001))
    int_path = save(tmp_path / "ints")
    (int_path / ".metadata").write_bytes(b"\x80\x04}(" + ints + b"u.")
    md_path = save(tmp_path / "index")
    md = plain_metadata(md_path)
    rec = md.storage_data[index_of(md, "note")]
    pairs = [*md.storage_data.items(), *((MetadataIndex("note", (a, b)), rec) for a, b in _colliding_offsets(20_000))]
    with open(md_path / ".metadata", "wb") as f:
        _PairsPickler(f, md.storage_data, pairs).dump(md)
    assert_refused(run_cases(tmp_path, {"int-keys": int_path, "index-keys": md_path}, timeout=90), ".metadata")


def test_oversized_metadata_is_refused_before_it_is_read(tmp_path):
    path = save(tmp_path / "sparse")
    with open(path / ".metadata", "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of zeros costs no disk
    out = run_cases(tmp_path, {"sparse-1GiB": path})
    assert_refused(out, "limit", ".metadata")
    assert out["sparse-1GiB"]["grew_mb"] < 200, out


# --------------------------------------------------------------------------- schema of tables and records


def _edit(path: Path, fn) -> Path:
    md = plain_metadata(path)
    fn(md)
    write_metadata(path, md)
    return path


def _rec(md, fqn: str) -> dict:
    return md.storage_data[index_of(md, fqn)]


SCHEMA_CASES = {
    "str-key-in-storage_data": lambda md: md.storage_data.__setitem__("w", _rec(md, "w")),
    "chunks=5": lambda md: setattr(md.state_dict_metadata["w"], "chunks", 5),
    "offsets=None": lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", None),
    "str-dtype": lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32"),
    "negative-length": lambda md: _rec(md, "w").update(length=-5),
    "negative-offset": lambda md: _rec(md, "w").update(offset=-1),
    "str-raw": lambda md: _rec(md, "w").update(raw="16384"),
    "shape-mismatch": lambda md: _rec(md, "w").update(shape=(4095,)),
    "frames-list": lambda md: _rec(md, "w").update(frames=list(_rec(md, "w")["frames"])),
    "frame-count-mismatch": lambda md: _rec(md, "w").update(frames=_rec(md, "w")["frames"][:-1], sums=_rec(md, "w")["sums"][:-1]),
    "frame-size-1": lambda md: _rec(md, "w").update(frame=1),
    "frame-size-huge": lambda md: _rec(md, "w").update(frame=1 << 40),
    "itemsize-3": lambda md: _rec(md, "ids").update(itemsize=3),
    "bool-fmt": lambda md: _rec(md, "w").update(fmt=True, kind=["tensor"]),
    "kind-list": lambda md: _rec(md, "w").update(kind=["tensor"]),
    "dtype-lazy-module": lambda md: _rec(md, "w").update(dtype="_dynamo"),
    "bytes-record-for-tensor": lambda md: _rec(md, "w").update(kind="bytes"),
    "record-of-unknown-key": lambda md: md.storage_data.__setitem__(MetadataIndex("ghost"), _rec(md, "note")),
    "planner_data-not-paths": lambda md: setattr(md, "planner_data", {"w": 5}),
    "storage_meta-str": lambda md: setattr(md, "storage_meta", "x"),
    "size-negative": lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([-1])),
    "chunk-outside-tensor": lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", torch.Size([9])),
}


def test_schema_violations_raise_corrupt_checkpoint_errors_naming_file_and_key(tmp_path):
    """Type confusion escaped as builtin AttributeError/TypeError (the CLI then exited 1)."""
    cases = {name: _edit(save(tmp_path / name), fn) for name, fn in SCHEMA_CASES.items()}
    assert_refused(run_cases(tmp_path, cases), str(tmp_path))


def _huge_frame_table(md) -> None:
    """2M one-byte frames (took 67 s and 4.5 GB): a 2M-frame record of a float32 tensor."""
    n = 2_000_000
    rec = _rec(md, "w")
    raw = n * FRAME
    rec.update(raw=raw, shape=(raw // 4,), frames=(1,) * n, sums=(0,) * n, length=n)
    md.state_dict_metadata["w"].size = torch.Size([raw // 4])
    md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([raw // 4])


def _four_tib_in_four_kib(md) -> None:
    """A record claiming a 4 TiB tensor stored in 4 KiB (verify used to pass it)."""
    rec = _rec(md, "w")
    numel = (4 << 40) // 4
    rec.update(raw=4 << 40, shape=(numel,), frame=1 << 30, frames=(1,) * 4096, sums=(0,) * 4096, length=4096)
    md.state_dict_metadata["w"].size = torch.Size([numel])
    md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([numel])


def _bytes_bomb_record(md) -> None:
    rec = _rec(md, "note")
    rec.update(raw=200 << 20, frame=1 << 30, frames=(64,), sums=(0,), length=64)


def test_impossible_frame_tables_are_refused_before_reading(tmp_path):
    cases = {
        "2M-one-byte-frames": _edit(save(tmp_path / "frames"), _huge_frame_table),
        "4TiB-in-4KiB": _edit(save(tmp_path / "4tib"), _four_tib_in_four_kib),
        "200MiB-bytes-item-in-64-bytes": _edit(save(tmp_path / "bytes"), _bytes_bomb_record),
    }
    out = run_cases(tmp_path, cases, timeout=180)
    # the 2M-item frame tuple is now refused earlier, by the pickle structure scan (stack cap)
    assert_refused(out, str(tmp_path), cls=("CorruptCheckpointError", "UnsafeCheckpointError"))
    assert all(o["grew_mb"] < 1500 for o in out.values()), out


# --------------------------------------------------------------------------- format 3 record table


def _u(values, width: int = 8) -> bytes:
    return np.array(values, dtype=np.uint64).astype(f"<u{width}").tobytes()


def _col(table: dict, name: str) -> list:
    from dcp_tiered.dcp.record_table import _read

    return _read(table, name, table["n"], "test", one_value=True).tolist()


def _edit_table(path: Path, fn) -> Path:
    """Edit the record table of ``.metadata`` as written (``fn(head, table, md)``) and write it back."""
    md = pickle.loads((path / ".metadata").read_bytes()[:-23])  # our own checkpoint: plain pickle is fine here
    head = next(iter(md.storage_data.values()))
    assert set(head) == {"fmt", "table", "item_table", "path_table"} and head["table"]["n"] == 3
    fn(head, head["table"], md)
    write_metadata(path, md)
    return path


def _set_col(name: str, fn):
    return lambda head, t, md: t.__setitem__(name, _u(fn(_col(t, name), t)))


def _two_million_frames(head, t, md) -> None:
    counts = _col(t, "nframes")
    counts[0] = 2_000_000
    t["nframes"], t["frames"], t["sums"] = _u(counts, 4), b"\1" * sum(counts), bytes(8 * sum(counts))


def _max_rows_of_one_value(head, t, md) -> None:
    """A kilobyte that declares the most rows a table may have, each column one value, no frames: the
    rows are more than the tensor table's chunks, refused before any column is expanded to them."""
    from dcp_tiered.dcp.format import MAX_METADATA_RECORDS
    from dcp_tiered.dcp.record_table import _ROW

    for c in _ROW:
        t[c] = _col(t, c)[0]
    t.update(n=MAX_METADATA_RECORDS, nframes=0, raw=0, frames=b"", sums=b"")


def _six_million_chunks(head, t, md) -> None:
    """12 MB of item table declaring 6M chunks of one tensor, over the records a save may write: refused
    from the declared counts, before a chunk is built."""
    items, n = head["item_table"], 6_000_000
    items.update(nchunks=_u([n, 1, 0]), offsets=bytes(n + 1), chunk_sizes=b"\1" * (n + 1))


TABLE_CASES = {
    "max-rows-of-one-value": _max_rows_of_one_value,
    "items-six-million-chunks": _six_million_chunks,
    "n-huge": lambda head, t, md: t.__setitem__("n", 1 << 40),
    "n-zero": lambda head, t, md: t.__setitem__("n", 0),
    "n-bool": lambda head, t, md: t.__setitem__("n", True),
    "width-5": lambda head, t, md: t.__setitem__("offset", bytes(15)),
    "one-value-name-id-out-of-range": lambda head, t, md: t.__setitem__("codec", 200),
    "one-value-2^64": lambda head, t, md: t.__setitem__("frame", 1 << 64),
    "one-value-negative": lambda head, t, md: t.__setitem__("fmt", -1),
    "one-value-bool": lambda head, t, md: t.__setitem__("fmt", True),
    "one-value-frame-counts": lambda head, t, md: t.__setitem__("nframes", 1 << 20),
    "column-missing": lambda head, t, md: t.pop("raw"),
    "column-str": lambda head, t, md: t.__setitem__("raw", "abc"),
    "not-a-dict": lambda head, t, md: head.__setitem__("table", [t]),
    "names-not-str": lambda head, t, md: t.__setitem__("names", (b"x", "zstd:1")),
    "names-not-utf8": lambda head, t, md: t.__setitem__("names", b"\xff\xfe\0" + t["names"]),
    "names-not-nul-ended": lambda head, t, md: t.__setitem__("names", t["names"][:-1]),
    "names-a-list": lambda head, t, md: t.__setitem__("names", t["names"].split(b"\0")),
    "item-out-of-range": _set_col("item", lambda v, t: [v[0], v[1], 99]),
    "name-id-out-of-range": _set_col("file", lambda v, t: [200, *v[1:]]),
    "dtype-id-is-a-codec": _set_col("dtype", lambda v, t: [_col(t, "codec")[0]] * 3),
    "kind-2": _set_col("kind", lambda v, t: [2, *v[1:]]),
    "kind-swapped": _set_col("kind", lambda v, t: [1 - k for k in v]),
    "chunk-out-of-range": _set_col("chunk", lambda v, t: [c and 5 for c in v]),
    "nframes-above-limit": _set_col("nframes", lambda v, t: [1 << 21, *v[1:]]),
    "frames-column-short": lambda head, t, md: t.__setitem__("frames", t["frames"][:-1]),
    "sums-column-long": lambda head, t, md: t.__setitem__("sums", t["sums"] + bytes(16)),
    "frame-lengths-2^64": lambda head, t, md: t.__setitem__("frames", b"\xff" * len(t["frames"])),
    "duplicate-rows": _set_col("item", lambda v, t: [v[0]] * 3),
    "same-index-as-a-dict-record": lambda head, t, md: md.storage_data.update(
        {MetadataIndex(i.fqn, i.offset): {"fmt": 2} for i in list(md.storage_data)[:1]}),
    "two-million-frames": _two_million_frames,
    # the item table (DCP's state_dict_metadata) and the path table (planner_data)
    "items-not-a-dict": lambda head, t, md: head.__setitem__("item_table", 5),
    "items-duplicate-names": lambda head, t, md: head["item_table"].__setitem__("fqns", ("w", "w", "note")),
    "items-props-not-properties": lambda head, t, md: head["item_table"].__setitem__("props", ("float32",)),
    "items-prop-id-out-of-range": lambda head, t, md: head["item_table"].__setitem__("prop", _u([9, 9, 9])),
    "items-ndim-65": lambda head, t, md: head["item_table"].__setitem__("ndim", _u([65, 65, 65])),
    "items-billion-chunks-of-a-scalar": lambda head, t, md: head["item_table"].update(
        ndim=_u([0, 0, 0]), nchunks=_u([1 << 30] * 3), size=b"", offsets=b"", chunk_sizes=b""),
    "items-huge-chunk-count": lambda head, t, md: head["item_table"].__setitem__("nchunks", _u([1 << 40] * 3)),
    "items-size-column-short": lambda head, t, md: head["item_table"].__setitem__("size", head["item_table"]["size"][:-1]),
    "items-size-2^63": lambda head, t, md: head["item_table"].__setitem__(
        "size", b"\xff" * len(head["item_table"]["size"])),
    "items-chunk-outside": lambda head, t, md: head["item_table"].__setitem__(
        "offsets", b"\x07" * len(head["item_table"]["offsets"])),
    "items-bytes-with-dims": lambda head, t, md: head["item_table"].__setitem__("kind", _u([1, 1, 1])),
    "items-duplicate-names-as-one-string": lambda head, t, md: head["item_table"].__setitem__("fqns", b"w\0w\0note\0"),
    "items-names-not-utf8": lambda head, t, md: head["item_table"].__setitem__("fqns", b"\xc3\0w\0note\0"),
    "fmt-2-with-format-3-tables": lambda head, t, md: head.__setitem__("fmt", 2),
}


#: Path-table cases, on a nested state (a flat one's paths are the names alone: no parts)
PATH_CASES = {
    "paths-part-kind-2": lambda head, t, md: head["path_table"].__setitem__(
        "part_kind", b"\2" * len(head["path_table"]["part_kind"])),
    "paths-name-marked-int": lambda head, t, md: head["path_table"].__setitem__(
        "part_kind", b"\1" * len(head["path_table"]["part_kind"])),
    "paths-kind-column-missing": lambda head, t, md: head["path_table"].pop("part_kind"),
    "paths-int-of-400-digits": lambda head, t, md: head["path_table"].update(
        parts=b"9" * 400 + b"\0" + b"\0".join(head["path_table"]["parts"].split(b"\0")[1:]),
        part_kind=b"\1" + head["path_table"]["part_kind"][1:]),
    "paths-int-of-two-signs": lambda head, t, md: head["path_table"].update(
        parts=b"--5\0" + b"\0".join(head["path_table"]["parts"].split(b"\0")[1:]),
        part_kind=b"\1" + head["path_table"]["part_kind"][1:]),
    "paths-parts-float": lambda head, t, md: head["path_table"].__setitem__("parts", (1.5,) * 9),
    "paths-id-out-of-range": lambda head, t, md: head["path_table"].__setitem__("ids", b"\x63" * len(head["path_table"]["ids"])),
    "paths-4097-parts": lambda head, t, md: head["path_table"].update(nparts=_u([4097] * 3), ids=bytes(3 * 4097)),
    "paths-not-a-dict": lambda head, t, md: head.__setitem__("path_table", ()),
}


def save_nested(path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    sd = {"m": {"w": torch.randn(4096, generator=g), "layers": [torch.arange(1000)]}, "note": "a string item"}
    dcp.save(sd, storage_writer=CompressedWriter(path, frame_size=FRAME, sync_files=False), no_dist=True)
    return path


def test_crafted_record_tables_are_refused_in_bounded_memory(tmp_path):
    """Format 3's columnar tables: every shape and range is checked before a record is built."""
    cases = {name: _edit_table(save(tmp_path / name), fn) for name, fn in TABLE_CASES.items()}
    cases |= {name: _edit_table(save_nested(tmp_path / name), fn) for name, fn in PATH_CASES.items()}
    out = run_cases(tmp_path, cases, timeout=240)
    assert_refused(out, str(tmp_path), cls=("CorruptCheckpointError", "UnsupportedFormatError"))
    assert all(o["grew_mb"] < 300 for o in out.values()), out


def test_a_newer_table_format_asks_for_an_upgrade(tmp_path):
    cases = {"fmt-4": _edit_table(save(tmp_path / "fmt4"), lambda head, t, md: head.__setitem__("fmt", 4))}
    assert_refused(run_cases(tmp_path, cases), "upgrade dcp_tiered", cls=("UnsupportedFormatError",))


# --------------------------------------------------------------------------- stock items


def test_stock_zstd_bytes_item_is_bounded_by_max_object_bytes(tmp_path):
    """A 32 KiB stock zstd bytes item inflating to 1 GiB was decoded despite max_object_bytes=1 MiB."""
    path = tmp_path / "stock"
    dcp.save(state(), storage_writer=FileSystemWriter(path, sync_files=False, _extensions=[ZStandard()]), no_dist=True)
    bomb = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = bytes(16 << 20)
    payload = b"".join(bomb.compress(zeros) for _ in range(64)) + bomb.flush()
    assert len(payload) < 64 << 10
    md = plain_metadata(path)
    info = md.storage_data[index_of(md, "note")]
    data_file = path / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload)
    md.storage_data[index_of(md, "note")] = dataclasses.replace(info, offset=offset, length=len(payload))
    write_metadata(path, md)
    out = run_cases(tmp_path, {"stock-bomb": path}, max_object_bytes=1 << 20)
    assert_refused(out, "note", "1048576", cls=("CorruptCheckpointError",))
    assert out["stock-bomb"]["grew_mb"] < 256, out


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none"])
def test_real_checkpoints_still_load(tmp_path, codec):
    """The checks refuse nothing a writer produces (every codec, frames of the smallest size)."""
    out = run_cases(tmp_path, {codec: save(tmp_path / codec, codec)})
    assert out[codec]["ok"], out


# --------------------------------------------------------------------------- pickle structure scan
#
# Every pickle from a checkpoint is scanned (``check_pickle_structure``) before it is unpickled:
# ``.metadata`` and also the ``torch.save`` payloads of non-tensor and stock tensor items, which
# ``torch.load(weights_only=True)`` unpickles with no depth cap at all.

_DEEP = 1_000_000


def _deep_pickles() -> dict[str, bytes]:
    """data.pkl bodies whose loading overflowed the C stack (hash()/recursion of 1e6 nested values)."""
    deep = pickle.EMPTY_TUPLE + pickle.TUPLE1 * _DEEP
    return {
        "dict-key": b"\x80\x02" + pickle.EMPTY_DICT + deep + pickle.NONE + pickle.SETITEM + pickle.STOP,
        "set-member": b"\x80\x04" + pickle.EMPTY_SET + pickle.MARK + deep + pickle.ADDITEMS + pickle.STOP,
        "nested-lists": b"\x80\x02" + pickle.EMPTY_LIST * (_DEEP + 1) + pickle.APPEND * _DEEP + pickle.STOP,
    }


def _torch_payload_with(pkl: bytes, like: object) -> bytes:
    """``torch.save(like)`` with its data.pkl replaced by ``pkl`` (stored, as torch writes it)."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save(like, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, pkl if info.filename.endswith("data.pkl") else src.read(info.filename))
    return out.getvalue()


def test_deep_non_tensor_items_are_refused_before_torch_load(tmp_path):
    """A 1 MB data.pkl of 1e6 nested tuples as a non-tensor item killed the reader with SIGSEGV."""
    import io

    paths = {}
    for name, pkl in _deep_pickles().items():
        sd = state()
        sd["note"] = io.BytesIO(_torch_payload_with(pkl, {"a": 1}))
        path = tmp_path / name
        dcp.save(sd, storage_writer=CompressedWriter(path, frame_size=FRAME, sync_files=False), no_dist=True)
        md = plain_metadata(path)
        md.storage_data[index_of(md, "note")].pop("object")  # read it as a torch.save payload
        write_metadata(path, md)
        paths[name] = path
    out = run_cases(tmp_path, paths, timeout=240)
    assert_refused(out, "'note'", "refusing to unpickle it", cls=("UnsafeCheckpointError",))
    assert "nests objects more than 100 deep" in out["dict-key"]["msg"], out


def test_deep_stock_tensor_payload_is_refused_before_torch_load(tmp_path):
    """A stock (FileSystemWriter) tensor item whose data.pkl hashes 1e6 nested tuples: SIGSEGV."""
    path = tmp_path / "stock"
    dcp.save(state(), storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    md = plain_metadata(path)
    info = md.storage_data[index_of(md, "w")]
    bomb = _torch_payload_with(_deep_pickles()["dict-key"], torch.zeros(4))
    (path / "bomb.distcp").write_bytes(bomb)
    info.relative_path, info.offset, info.length = "bomb.distcp", 0, len(bomb)
    write_metadata(path, md)
    out = run_cases(tmp_path, {"stock-tensor": path}, timeout=240)
    assert_refused(out, "'w'", "nests objects more than 100 deep", cls=("UnsafeCheckpointError",))


def _lget(i: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", i)


def _lput(i: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", i)


def _top_down(n: int, kind: str) -> bytes:
    """A value nested ``n`` deep built top-down: each new container goes into the previous one,
    fetched back from the memo after it was already placed (depth was only tracked upwards)."""
    base = 5_000_000
    if kind == "list":
        step = lambda i: _lget(base + i) + pickle.EMPTY_LIST + _lput(base + i + 1) + pickle.APPEND + pickle.POP  # noqa: E731
        head = pickle.EMPTY_LIST + _lput(base)
    elif kind == "dict":
        step = lambda i: (_lget(base + i) + pickle.SHORT_BINUNICODE + b"\x01k" + pickle.EMPTY_DICT  # noqa: E731
                          + _lput(base + i + 1) + pickle.SETITEM + pickle.POP)
        head = pickle.EMPTY_DICT + _lput(base)
    else:  # the hostile review's form: one memo slot re-stored each step
        step = lambda i: (_lget(base) + pickle.EMPTY_LIST + _lput(base + 1) + pickle.APPEND + pickle.POP  # noqa: E731
                          + _lget(base + 1) + _lput(base) + pickle.POP)
        head = pickle.EMPTY_LIST + _lput(base)
    return head + b"".join(step(i) for i in range(n))


def _with_extra_attr(path: Path, fragment: bytes) -> None:
    """Rewrite ``.metadata`` with an extra Metadata attribute whose value is ``fragment`` (unframed protocol 4)."""
    import pickletools

    md = plain_metadata(path)
    md.zz_extra = "PLACEHOLDER_XYZ"
    body = pickle.dumps(md, protocol=4)
    token = pickle.SHORT_BINUNICODE + bytes([15]) + b"PLACEHOLDER_XYZ" + pickle.MEMOIZE
    assert body.count(token) == 1
    ops = list(pickletools.genops(body))
    unframed = b"".join(
        body[pos:(ops[k + 1][2] if k + 1 < len(ops) else len(body))] for k, (op, _, pos) in enumerate(ops) if op.name != "FRAME"
    )
    (path / ".metadata").write_bytes(unframed.replace(token, fragment))


def test_depth_built_top_down_through_the_memo_is_refused(tmp_path):
    """APPEND/SETITEM into a memoised container already inside another one bypassed the depth cap:
    a 100,000-deep list loaded (the promoter then died re-pickling it with RecursionError)."""
    cases = {}
    for kind in ("list", "dict", "restored-slot"):
        path = save(tmp_path / kind)
        _with_extra_attr(path, _top_down(100_000, kind))
        cases[kind] = path
    out = run_cases(tmp_path, cases, timeout=240)
    assert_refused(out, ".metadata", cls=("UnsafeCheckpointError",))
    assert "after placing it inside another object" in out["list"]["msg"], out
    assert "after placing it inside another object" in out["dict"]["msg"], out


def test_objects_left_on_the_stack_or_in_the_memo_are_bounded(tmp_path):
    """8 MiB of 1-byte opcodes built 1.4 GB (EMPTY_DICT left on the stack) or 0.9 GB (MEMOIZE) before failing."""
    size = 8 << 20
    bodies = {
        "empty-dicts": pickle.EMPTY_DICT * size,
        "memoize": pickle.NONE + pickle.MEMOIZE * size,
        "dict-memoize-pop": (pickle.EMPTY_DICT + pickle.MEMOIZE + pickle.POP) * (size // 3),
        "marks": pickle.MARK * size,
        "none-pop": (pickle.NONE + pickle.POP) * (size // 2),
    }
    cases = {}
    for name, body in bodies.items():
        path = save(tmp_path / name)
        (path / ".metadata").write_bytes(b"\x80\x04" + body + pickle.NONE + pickle.STOP)
        cases[name] = path
    out = run_cases(tmp_path, cases, timeout=300)
    assert_refused(out, ".metadata")
    assert sum(o["grew_mb"] for o in out.values()) < 600, out


def test_structure_scan_refusals_and_real_pickles():
    """The scan alone, in-process (it builds nothing): each refusal, and real pickles of every protocol pass."""
    import io

    import numpy as np

    from dcp_tiered import CorruptCheckpointError as Corrupt
    from dcp_tiered import UnsafeCheckpointError as Unsafe
    from dcp_tiered.dcp.pickle_scan import check_pickle_structure, check_torch_payload

    def refused(data: bytes, needle: str, cls: type = Unsafe) -> None:
        with pytest.raises(cls, match=needle):
            check_pickle_structure(data, "x.pkl")

    refused(b"\x80\x04" + pickle.NONE + pickle.TUPLE1 * 101 + pickle.STOP, "more than 100 deep")
    refused(b"\x80\x04" + _top_down(3, "list") + pickle.STOP, "after placing it inside")
    refused(b"\x80\x04" + pickle.EMPTY_LIST + pickle.MEMOIZE + pickle.MEMOIZE + pickle.STOP, "memoizes a value twice")
    refused(b"\x80\x04" + pickle.NONE * ((1 << 20) + (1 << 16) + 1), "on the unpickler's stack")
    refused(b"\x80\x04" + (pickle.EMPTY_DICT + pickle.POP) * 30_000 + pickle.NONE + pickle.STOP, "creates more than")
    refused(b"\x80\x04" + pickle.BINGET + b"\x07" + pickle.STOP, "not a readable pickle", Corrupt)
    refused(b"\x80\x04" + pickle.BINUNICODE + b"\xff\xff\xff\x00ab.", "runs past the end", Corrupt)
    refused(b"\x80\x04" + pickle.NONE, "ends without STOP", Corrupt)

    shared = [1, 2]
    value = {"a": [shared, shared, (1, "x", b"y", 2.5, None, True)], "s": {1, 2}, "f": frozenset({3}), "big": 1 << 100}
    for protocol in range(6):
        data = pickle.dumps(value, protocol=protocol)
        assert check_pickle_structure(data, "x.pkl") == len(data)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
    real = {
        "adam": opt.state_dict(),
        "sched": sched.state_dict(),
        "model": model.state_dict(),
        "numpy-rng": np.random.get_state(),
        "trainer": {"epoch": 1, "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}}, "cb": [{"k": [1.0]}]},
    }
    for name, obj in real.items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        check_torch_payload(buf.getvalue(), name)
        legacy = io.BytesIO()
        torch.save(obj, legacy, _use_new_zipfile_serialization=False)
        check_torch_payload(legacy.getvalue(), name)
        legacy.seek(0)
        check_torch_payload(legacy, name)  # a file object: left where it was
        assert legacy.tell() == 0

    # a crafted .pt file (``dcp-tiered convert x.pt``): checked from the open file, member by member
    bomb = io.BytesIO(_torch_payload_with(_deep_pickles()["dict-key"], {"a": 1}))
    with pytest.raises(Unsafe, match="bomb.pt nests objects more than 100 deep"):
        check_torch_payload(bomb, "bomb.pt")
    assert bomb.tell() == 0


def test_convert_of_a_crafted_torch_save_file_is_refused_before_torch_load(tmp_path):
    """`dcp-tiered convert bomb.pt OUT`: the .pt's data.pkl hashes 1e6 nested tuples (SIGSEGV before)."""
    bomb = tmp_path / "bomb.pt"
    bomb.write_bytes(_torch_payload_with(_deep_pickles()["dict-key"], {"a": 1}))
    res = run_isolated(f"""
        import sys
        from dcp_tiered.cli.__main__ import main
        sys.argv = ["dcp-tiered", "convert", {str(bomb)!r}, {str(tmp_path / "out")!r}]
        try:
            emit(main())
        except SystemExit as exc:
            emit(exc.code)
    """, timeout=240, memory_mb=4096)
    assert not res.crashed and not res.timed_out, res.describe()
    assert res.result == 4, res.describe()  # corrupt or unsafe checkpoint, one line
    assert "Traceback" not in res.stderr and "bomb.pt" in res.stderr, res.stderr


def test_stock_record_smaller_than_its_declared_chunk_is_refused(tmp_path):
    """A stock (uncompressed) `.metadata` claiming a 64 TiB tensor over a 1.5 KiB data file: loads and
    `export` allocated what it declared; the record's bytes now bound the chunk's raw size."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    path = tmp_path / "stock"
    dcp.save({"w": torch.ones(4, 4)}, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes())
    huge = torch.Size([1 << 22, 1 << 22])
    md.state_dict_metadata["w"] = dataclasses.replace(
        md.state_dict_metadata["w"], size=huge, chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=huge)])
    (path / ".metadata").write_bytes(pickle.dumps(md))
    assert MetadataIndex("w", torch.Size([0, 0])) in md.storage_data
    with pytest.raises(CorruptCheckpointError, match="elements, at least one raw byte each"):
        CompressedReader(path)


@pytest.mark.parametrize("dim", [1 << 62, 1 << 63])
def test_a_stock_tensor_dimension_past_the_readers_limit_is_refused_at_open(tmp_path, dim):
    """One rule for a shape readers accept (dimensions below ``MAX_DIM``, as the writer refuses them): a
    stock ``.metadata`` declaring a (0, 2**62) tensor was accepted, one of (0, 2**63) refused."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path = tmp_path / "stock"
    dcp.save({"w": torch.ones(4, 4)}, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes())
    huge = torch.Size([0, dim])
    md.state_dict_metadata["w"] = dataclasses.replace(
        md.state_dict_metadata["w"], size=huge, chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=huge)])
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match="'w' has an invalid size"):
        CompressedReader(path)
