"""Hostile-input case classes of ``tools/crash_harness.py --hostile`` beyond the ``.metadata`` pickle.

Each class builds its fixture once per child process (lazily, :class:`Fixtures`), then a case
mutates one input a user's entry point reads and drives that entry point:

* ``table``: a format-3 ``.metadata`` written by ``CompressedWriter`` for tensors saved in 600 to
  1,100 chunks (a planner that cuts them, as sharded saves do), its record, item and path tables
  mutated as columns (a chunk listed twice and another left out, overlapping chunks, offsets past the
  size, wrong widths, huge counts, frames that do not add up, names, properties, rows) or its chunk
  lists and records edited and re-packed; loaded with ``CompressedReader`` + ``dcp.load`` into a
  fresh state dict;
* ``paths``: ``planner_data`` (format 3's path table) mutated (huge and negative indexes, empty,
  colliding, nested and deep paths, wrong part types), then ``dcp_tiered.inspect.convert`` to a
  ``.pt`` file;
* ``marker``: replica markers ``.replica-{owner}.json`` of a replicated ``{rank}`` tier mutated as
  JSON (Infinity, NaN, huge numbers, deep nesting, wrong types, huge lists, other names), then
  ``dcp-tiered ls --replicas`` and ``gc --dry-run`` through the CLI's ``main``, ``list_tier``,
  ``read_markers`` and ``Retention.plan``;
* ``lightning_ref``: the reference file of ``CompressedCheckpointIO(checkpointer=...)`` mutated (the
  step as a string, null, a list, a float, huge; deep JSON; padding past the 4 KiB read), loaded
  with ``load_checkpoint``;
* ``accelerate``: the newest step written by ``dcp_tiered.integrations.accelerate.save_state`` replaced
  by one whose scheduler JSON, random states, registered objects or optimizer state are mutated (or
  whose data file is damaged), then ``load_state``; a failed load must leave the live model and
  optimizer as they were;
* ``deepdir``: a directory 1,100 to 3,000 deep (short or long names) inside an old step, a
  non-step directory or a leftover of a tier, then ``list_tier``, ``dcp-tiered gc --dry-run``/``gc``
  and ``TieredCheckpointer.restore`` of the intact newer step.

A case returns ``detected`` (refused with a ``DcpTieredError`` or a documented exit code),
``loaded`` (succeeded, and what it gave was checked exactly), ``KNOWN_...`` (a known limit or a bug
already filed), or ``FAIL builtin ...`` (an error that is no ``DcpTieredError``, or exit 70) or
``FAIL wrong ...`` (succeeded with other values, lost a step, or changed the live state).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import itertools
import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_tiered import (
    CompressedReader,
    CompressedWriter,
    DcpTieredError,
    Tier,
    TieredCheckpointer,
)
from dcp_tiered.codecs import checksum
from dcp_tiered.dcp.record_table import pack_strings, read_strings
from tools.crash_harness import FAST_RETRY, _error_of, _from_dcp_planner, _mutate

class _Note(dict):
    """What the running case does (``how``: its mutation), for the journal when the case must be
    interrupted; setting ``how`` marks the case's entry point (``entry_t``), where its clock starts."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "how" and "entry_t" not in self:
            super().__setitem__("entry_t", time.monotonic())
        super().__setitem__(key, value)


NOTE: dict[str, Any] = _Note()
_MAGIC = b"\x00dcp_tiered.md1"
_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
_HUGE = (2**31, 2**32, 2**40, 2**62, 2**63, 2**64 - 1)


# --------------------------------------------------------------------------- shared helpers


def _split_body(raw: bytes) -> bytes:
    return raw[: -len(_MAGIC) - 8] if raw[-len(_MAGIC) - 8:-8] == _MAGIC else raw


def _with_trailer(body: bytes, rng: random.Random) -> bytes:
    """A correct integrity trailer half the time, none otherwise: the checksum never stops a case."""
    return body + _MAGIC + checksum((body,)).to_bytes(8, "little") if rng.random() < 0.5 else body


def _outcome_of(exc: BaseException, *, planner_ok: bool = False) -> str:
    """``detected`` for a ``DcpTieredError`` (inside DCP's ``CheckpointException`` too), else a failure."""
    err = _error_of(exc)
    if isinstance(err, DcpTieredError):
        return "detected"
    if planner_ok and _from_dcp_planner(err):
        return "KNOWN_dcp_planner_mismatch"
    return f"FAIL builtin {type(err).__name__}: {' '.join(str(err).split())[:160]}"


def _equal(a: Any, b: Any) -> bool:
    """Exact equality of nested state (tensors bit for bit, with dtype and shape)."""
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _zeros_like(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    return None if not isinstance(sd, (int, float, str)) else type(sd)()


def remove_deep(path: Path) -> None:
    """Delete ``path`` however deep its tree (``shutil.rmtree`` recurses, so it gives up past ~1,000 levels)."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        os.unlink(path)
        return
    stack = [os.open(path, os.O_RDONLY | os.O_DIRECTORY)]
    names: list[str] = []
    try:
        while stack:
            fd = stack[-1]
            sub = None
            for entry in os.scandir(fd):
                if entry.is_dir(follow_symlinks=False):
                    sub = entry.name
                    break
                os.unlink(entry.name, dir_fd=fd)
            if sub is not None:
                stack.append(os.open(sub, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd))
                names.append(sub)
                continue
            os.close(stack.pop())
            if names:
                os.rmdir(names.pop(), dir_fd=stack[-1])
    finally:
        for fd in stack:
            os.close(fd)
    os.rmdir(path)


def copy_tree(src: Path, dst: Path) -> None:
    remove_deep(dst)
    shutil.copytree(src, dst, symlinks=True)


@contextlib.contextmanager
def _quiet_cli():
    """The CLI's output swallowed (``main`` prints its listing and its one-line errors)."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        yield out, err


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from dcp_tiered.cli.__main__ import main

    with _quiet_cli() as (out, err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


#: Exit codes ``dcp-tiered`` documents for hostile input (70 is "internal error": a bug).
CLI_CODES = (0, 1, 2, 3, 4, 5)


# --------------------------------------------------------------------------- fixtures


class Fixtures:
    """The fixture of each class, built on its first case in this child."""

    builders: dict[str, Any]

    def __init__(self, work: Path) -> None:
        self.work = work
        self.builders = _BUILDERS
        self._built: dict[str, Any] = {}

    def get(self, kind: str) -> Any:
        if kind not in self._built:
            d = self.work / kind
            remove_deep(d)
            d.mkdir(parents=True)
            self._built[kind] = _BUILDERS[kind](d)
        return self._built[kind]


class ChunkedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with some tensors cut into chunks of a given shape (as a sharded save of
    many ranks records them), so that one process writes a tensor of hundreds of chunks."""

    def __init__(self, chunk_shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.chunk_shapes = chunk_shapes

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            shape = self.chunk_shapes.get(item.index.fqn)
            if shape is None or item.type != WriteItemType.TENSOR:
                items.append(item)
                continue
            size = item.tensor_data.size
            for corner in itertools.product(*(range(0, d, c) for d, c in zip(size, shape))):
                offsets = torch.Size(corner)
                sizes = torch.Size(min(c, d - o) for o, c, d in zip(corner, shape, size))
                items.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                                   properties=item.tensor_data.properties, size=size)))
        self.plan = plan = dataclasses.replace(plan, items=items)
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type != WriteItemType.SHARD:
            return super().resolve_data(write_item)
        t = self.lookup_object(dataclasses.replace(write_item.index, offset=None))
        chunk = write_item.tensor_data.chunk
        for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
            t = t.narrow(dim, o, n)
        return t.contiguous()


def _table_fixture(d: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(23)
    bases = {
        # 640 row chunks of a 2-D tensor, a small one in one chunk, a non-tensor item
        "rows": ({"w": torch.randn(640, 4, generator=g), "b": torch.randn(9, generator=g), "meta": {"k": 3}},
                 {"w": (1, 4)}, "lz4"),
        # 1,100 one-element chunks of int64, a bfloat16 tensor in two
        "flat": ({"e": torch.randint(0, 1000, (1100,), generator=g), "h": torch.randn(8, 8, generator=g).to(torch.bfloat16)},
                 {"e": (1,), "h": (4, 8)}, "zstd"),
        # a 2-D grid of 30 x 20 chunks of (1, 2)
        "grid": ({"g": torch.randn(30, 40, generator=g), "n": torch.arange(5)}, {"g": (1, 2)}, "none"),
    }
    out = {}
    for name, (sd, shapes, codec) in bases.items():
        path = d / name
        dcp.save(sd, storage_writer=CompressedWriter(path, codec=codec, frame_size=4096, threads=1, sync_files=False),
                 planner=ChunkedSavePlanner(shapes), no_dist=True)
        raw = (path / ".metadata").read_bytes()
        head = next(iter(pickle.loads(_split_body(raw)).storage_data.values()))
        assert head.get("fmt") == 3 and "item_table" in head and "path_table" in head, f"{name}: not a format-3 table"
        back = _zeros_like(sd)
        dcp.load(back, storage_reader=CompressedReader(path, threads=1), no_dist=True)
        assert _equal(back, sd), f"{name}: the base does not round-trip"
        out[name] = (path, raw, sd)
    return out


def _paths_fixture(d: Path) -> dict[str, Any]:
    from dcp_tiered.inspect import convert

    g = torch.Generator().manual_seed(29)
    sd = {"model": {"layers": [{"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)},
                               {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}],
                    "emb": torch.randn(5, 3, generator=g)},
          "opt": {"lr": 0.25, "buf": [torch.arange(4), torch.ones(4)]},
          "step": 7, "name": "run"}
    path = d / "ckpt"
    dcp.save(sd, storage_writer=CompressedWriter(path, codec="zstd", threads=1, sync_files=False), no_dist=True)
    raw = (path / ".metadata").read_bytes()
    head = next(iter(pickle.loads(_split_body(raw)).storage_data.values()))
    assert "path_table" in head, "the base has no path table"
    convert(path, d / "check.pt")
    assert _equal(torch.load(d / "check.pt", weights_only=True), sd), "the base does not convert exactly"
    return {"path": path, "raw": raw, "sd": sd, "out": d / "out.pt"}


#: Each class's fixture builder, registered after its case function below.
_BUILDERS: dict[str, Any] = {}


# --------------------------------------------------------------------------- table: format-3 tables


def _col(raw: Any, count: int) -> list[int]:
    """Column ``raw`` of ``count`` entries as ints (bytes, their width their length over the count, or one
    int for every entry)."""
    from dcp_tiered.dcp.record_table import _read

    if not count:
        return []
    return _read({"c": raw}, "c", count, "harness", one_value=True).astype(np.uint64).tolist()


def _strings(names: list, rng: random.Random) -> Any:
    """``names`` stored as format 3 stores them (one string; a tuple where they do not pack), or, now and
    then, that string damaged: a NUL lost, a byte that is no UTF-8."""
    packed = pack_strings(tuple(names)) if all(type(v) is str for v in names) else tuple(names)
    if type(packed) is bytes and packed and rng.random() < 0.1:
        packed = rng.choice((packed[:-1], b"\xff" + packed, packed.replace(b"\0", b"", 1)))
    return packed


def _enc(values: list[int], width: int | None = None) -> bytes:
    top = max(values, default=0)
    width = width or next(w for w in _WIDTHS if top < 1 << (8 * w))
    return np.array(values, dtype=np.uint64).astype(_WIDTHS[width]).tobytes()


class _Tables:
    """The head record of a plain-unpickled format-3 ``Metadata``, its columns decoded, edited, encoded back."""

    def __init__(self, md: Any) -> None:
        from dcp_tiered.dcp.item_table import _ITEM_ROW
        from dcp_tiered.dcp.record_table import _ROW

        self.md = md
        self.head = next(iter(md.storage_data.values()))
        t, it = self.head["table"], self.head["item_table"]
        self.n, self.fqns = t["n"], list(read_strings(it["fqns"], "harness", "names"))
        self.rows = {c: _col(t[c], self.n) for c in _ROW}
        total = sum(self.rows["nframes"])
        self.frames, self.sums = _col(t["frames"], total), _col(t["sums"], total)
        m = len(self.fqns)
        self.items = {c: _col(it[c], m) for c in _ITEM_ROW}
        self.size = _col(it["size"], sum(self.items["ndim"]))
        count = sum(a * b for a, b in zip(self.items["ndim"], self.items["nchunks"]))
        self.offsets, self.chunk_sizes = _col(it["offsets"], count), _col(it["chunk_sizes"], count)
        self._row_names, self._item_names = _ROW, _ITEM_ROW

    def tensors(self) -> list[int]:
        return [i for i, k in enumerate(self.items["kind"]) if k == 0 and self.items["nchunks"][i] > 0]

    def chunk_base(self, item: int) -> int:
        """Where ``item``'s chunks start in the flat offsets/chunk_sizes columns."""
        return sum(self.items["ndim"][j] * self.items["nchunks"][j] for j in range(item))

    def size_base(self, item: int) -> int:
        return sum(self.items["ndim"][:item])

    def frame_base(self, row: int) -> int:
        return sum(self.rows["nframes"][:row])

    def write(self) -> None:
        t, it = self.head["table"], self.head["item_table"]
        for c in self._row_names:
            t[c] = _enc(self.rows[c])
        t["frames"], t["sums"] = _enc(self.frames), _enc(self.sums)
        for c in self._item_names:
            it[c] = _enc(self.items[c])
        it["size"], it["offsets"], it["chunk_sizes"] = _enc(self.size), _enc(self.offsets), _enc(self.chunk_sizes)


def mutate_table(md: Any, rng: random.Random) -> str:
    """One column-level mutation of a format-2 head record (see the module doc); returns its name."""
    tb = _Tables(md)
    how = rng.choice(("dup_chunk", "dup_chunk", "overlap", "past", "size", "nchunks", "ndim", "width", "width", "n",
                      "rowchunk", "rowchunk", "rowitem", "nframes", "frames", "offset", "raw", "names", "hint",
                      "props", "fqns", "kind"))
    tensors = tb.tensors()
    item = max(tensors, key=lambda k: tb.items["nchunks"][k]) if rng.random() < 0.8 else rng.choice(tensors)
    nd, nc = tb.items["ndim"][item], tb.items["nchunks"][item]
    base = tb.chunk_base(item)
    i, j = rng.sample(range(nc), 2) if nc > 1 else (0, 0)
    rows_of = [r for r in range(tb.n) if tb.rows["item"][r] == item]
    r = rng.choice(rows_of) if rows_of else rng.randrange(tb.n)
    if how == "dup_chunk":  # chunk j becomes a copy of chunk i: i listed twice, j left out
        tb.offsets[base + j * nd:base + (j + 1) * nd] = tb.offsets[base + i * nd:base + (i + 1) * nd]
        tb.chunk_sizes[base + j * nd:base + (j + 1) * nd] = tb.chunk_sizes[base + i * nd:base + (i + 1) * nd]
    elif how == "overlap":  # a chunk one larger, or one earlier, along a dimension
        dim = rng.randrange(nd)
        if rng.random() < 0.5 or tb.offsets[base + j * nd + dim] == 0:
            tb.chunk_sizes[base + j * nd + dim] += rng.choice((1, 2, 100))
        else:
            tb.offsets[base + j * nd + dim] -= 1
    elif how == "past":  # an offset at or past the tensor's size, or a huge chunk size
        dim = rng.randrange(nd)
        size = tb.size[tb.size_base(item) + dim]
        target = tb.offsets if rng.random() < 0.6 else tb.chunk_sizes
        target[base + j * nd + dim] = rng.choice((size, size + 1, 2**62 - 1, 2**62, 2**63, 2**64 - 1))
    elif how == "size":  # the tensor's size changed under its chunks
        at = tb.size_base(item) + rng.randrange(nd)
        tb.size[at] = rng.choice((tb.size[at] + 1, max(0, tb.size[at] - 1), tb.size[at] * 2, 0, 2**62, 2**64 - 1))
    elif how == "nchunks":  # the chunk count changed; sometimes with the columns grown to match (a repeated chunk)
        tb.items["nchunks"][item] = new = rng.choice((nc + 1, max(0, nc - 1), 0, nc * 2, *_HUGE))
        if new == nc + 1 and rng.random() < 0.5:
            at = base + nc * nd
            tb.offsets[at:at] = tb.offsets[base + i * nd:base + (i + 1) * nd]
            tb.chunk_sizes[at:at] = tb.chunk_sizes[base + i * nd:base + (i + 1) * nd]
    elif how == "ndim":
        tb.items["ndim"][item] = rng.choice((0, nd + 1, max(0, nd - 1), 64, 65, 2**32))
    elif how == "n":
        tb.write()
        md.storage_data[next(iter(md.storage_data))]["table"]["n"] = rng.choice(
            (tb.n + 1, tb.n - 1, 0, -1, 2**31, 10**9, 2**64, True, "3", None, 1.5))
        return how
    elif how == "rowchunk":  # a row names another row's chunk (that chunk's record twice, this one's none), or none
        others = [s for s in rows_of if s != r]
        tb.rows["chunk"][r] = (tb.rows["chunk"][rng.choice(others)] if others and rng.random() < 0.6
                               else rng.choice((0, nc + 1, 2**32, 2**64 - 1)))
    elif how == "rowitem":
        tb.rows["item"][r] = rng.choice((*(k for k in range(len(tb.fqns)) if k != item), len(tb.fqns), 2**40))
    elif how == "nframes":  # a frame count changed; sometimes with a frame added or dropped to match
        old = tb.rows["nframes"][r]
        tb.rows["nframes"][r] = new = rng.choice((old + 1, max(0, old - 1), 0, 2**20, 2**20 + 1, 2**40))
        at = tb.frame_base(r)
        if new == old + 1 and rng.random() < 0.6:
            tb.frames.insert(at, rng.choice((tb.frames[at], 0, 1)))
            tb.sums.insert(at, tb.sums[at])
        elif new == old - 1 and old and rng.random() < 0.6:
            del tb.frames[at], tb.sums[at]
    elif how == "frames":  # one frame's stored length, or checksum, changed
        at = tb.frame_base(r) + rng.randrange(max(1, tb.rows["nframes"][r]))
        if at < len(tb.frames):
            if rng.random() < 0.7:
                tb.frames[at] = rng.choice((tb.frames[at] + 1, max(0, tb.frames[at] - 1), 0, 2**31, 2**62, 2**64 - 1))
            else:
                tb.sums[at] ^= 1 << rng.randrange(64)
    elif how == "offset":  # where the row's bytes start in the data file
        other = tb.rows["offset"][rng.randrange(tb.n)]
        tb.rows["offset"][r] = rng.choice((tb.rows["offset"][r] + 1, max(0, tb.rows["offset"][r] - 1), other,
                                           2**31, 2**62, 2**64 - 1))
    elif how == "raw":
        isz = max(1, tb.rows["itemsize"][r])
        tb.rows["raw"][r] = rng.choice((tb.rows["raw"][r] + isz, max(0, tb.rows["raw"][r] - isz), 0, 2**62, 2**64 - 1))
    elif how == "names":  # the shared strings: a dtype, codec, filter, file or checksum name, or the tuple itself
        t = tb.head["table"]
        tb.write()
        names = list(read_strings(t["names"], "harness", "names"))
        k = rng.randrange(len(names))
        names[k] = rng.choice(("float32", "int64", "int32", "bfloat16", "float16", "bool", "uint8", "float64", "x",
                               "lz4", "zstd", "none", "zstd:99", "bytegroup", "__1_0.distcp", "../__0_0.distcp",
                               "/etc/passwd", ".metadata", "", "xxh3", "tensor", names[(k + 1) % len(names)]))
        if rng.random() < 0.15:
            names = rng.choice((names[:-1], names + ["extra"], names + [5], [None] + names[1:]))
        t["names"] = _strings(names, rng)
        return how
    elif how == "hint":  # DCP's index hint: never where anything is read from
        tb.rows["index"][r] = rng.choice((0, 1, 7, 2**32, 2**64 - 1))
    elif how == "props":  # a tensor's properties: another dtype, or another item's
        from torch.distributed.checkpoint.metadata import TensorProperties

        tb.write()
        it = tb.head["item_table"]
        props = list(it["props"])
        if rng.random() < 0.6:
            k = rng.randrange(len(props))
            p = copy.copy(props[k])
            p.dtype = rng.choice((torch.float32, torch.int64, torch.int32, torch.bfloat16, torch.float16, torch.uint8,
                                  torch.float64, torch.bool, torch.complex64))
            props[k] = p
            it["props"] = tuple(props)
        else:
            tb.items["prop"][item] = rng.choice((0, len(props), len(props) + 1, 1 if len(props) > 1 else 2))
            it["prop"] = _enc(tb.items["prop"])
        if rng.random() < 0.05:
            it["props"] = (TensorProperties(torch.float32),) * 0
        return how
    elif how == "fqns":  # a name repeated (another left out) or another name
        tb.write()
        it = tb.head["item_table"]
        fqns = list(read_strings(it["fqns"], "harness", "names"))
        k = rng.randrange(len(fqns))
        fqns[k] = rng.choice((fqns[(k + 1) % len(fqns)], fqns[k] + "x", "", "meta.k", "a\0b"))
        it["fqns"] = _strings(fqns, rng)
        return how
    elif how == "kind":  # a tensor item called a non-tensor one, or a row's kind flipped
        if rng.random() < 0.5:
            tb.items["kind"][item] = rng.choice((1, 2, 255))
        else:
            tb.rows["kind"][r] = rng.choice((0, 1, 2, 255)) ^ tb.rows["kind"][r]
    tb.write()
    if how == "width" or rng.random() < 0.05:
        _mutate_width(tb.head, rng)
    return how


def _mutate_width(head: dict, rng: random.Random) -> None:
    """One column of one table made the wrong length or width, or no bytes at all."""
    table = rng.choice([t for t in (head.get("table"), head.get("item_table"), head.get("path_table"))
                        if isinstance(t, dict)])
    cols = [k for k, v in table.items() if type(v) is bytes]
    if not cols:
        return
    c = rng.choice(cols)
    raw = table[c]
    how = rng.randrange(6)
    if how == 0:
        table[c] = raw[:-1]
    elif how == 1:
        table[c] = raw + b"\x00"
    elif how == 2 and raw:  # the same values at another width: twice or half the bytes
        width = next(w for w in (1, 2, 4, 8) if len(raw) % w == 0 and w != 3)
        values = np.frombuffer(raw, dtype=_WIDTHS[width]).astype(np.uint64).tolist()
        table[c] = _enc(values, rng.choice([w for w in _WIDTHS if w != width]))
    elif how == 3:
        table[c] = rng.choice(("x" * len(raw), None, list(raw), bytearray(raw), len(raw), b""))
    elif how == 4:
        table[c] = raw * rng.choice((2, 3))
    else:
        table.pop(c)


def mutate_chunk_lists(md: Any, rng: random.Random) -> str:
    """Edit the unpacked chunk lists and records of a trusted ``Metadata`` (re-packed by the caller)."""
    sdm, storage = md.state_dict_metadata, md.storage_data
    fqn = rng.choice([k for k, v in sdm.items() if len(getattr(v, "chunks", ())) > 1])
    item = sdm[fqn]
    chunks = item.chunks
    i, j = rng.sample(range(len(chunks)), 2)
    recs = {idx.offset: idx for idx in storage if idx.fqn == fqn}
    how = rng.choice(("drop_chunk", "dup_chunk", "reverse", "split", "extra", "drop_record", "record_twice",
                      "shuffle_records", "record_of_other"))
    if how == "drop_chunk":
        del chunks[j]
    elif how == "dup_chunk":  # chunk i in the list twice, in place of chunk j (whose record stays)
        chunks[j] = chunks[i]
    elif how == "reverse":  # the same chunks in another order: harmless
        chunks.reverse()
    elif how == "split":  # a chunk cut in two along its first dimension, one record for both
        c = chunks[j]
        if c.sizes[0] > 1:
            half = c.sizes[0] // 2
            chunks[j] = ChunkStorageMetadata(c.offsets, torch.Size([half, *c.sizes[1:]]))
            chunks.insert(j + 1, ChunkStorageMetadata(torch.Size([c.offsets[0] + half, *c.offsets[1:]]),
                                                      torch.Size([c.sizes[0] - half, *c.sizes[1:]])))
        else:
            chunks[j] = ChunkStorageMetadata(c.offsets, torch.Size([2, *c.sizes[1:]]))
    elif how == "extra":  # a chunk past the end of the tensor, with a copy of another's record
        c = chunks[i]
        off = torch.Size([item.size[0], *c.offsets[1:]])
        chunks.append(ChunkStorageMetadata(off, c.sizes))
        storage[MetadataIndex(fqn, off)] = dict(storage[recs[c.offsets]])
    elif how == "drop_record":
        del storage[recs[chunks[j].offsets]]
    elif how == "record_twice":  # chunk j's record replaced by a copy of chunk i's (same bytes, j's place)
        if chunks[i].sizes == chunks[j].sizes:
            storage[recs[chunks[j].offsets]] = dict(storage[recs[chunks[i].offsets]])
        else:
            del storage[recs[chunks[j].offsets]]
    elif how == "shuffle_records":  # the records in another order: harmless
        keys = list(storage)
        rng.shuffle(keys)
        md.storage_data = {k: storage[k] for k in keys}
    else:  # chunk j's record keeps its bytes but names chunk i's place
        rj, ri = recs[chunks[j].offsets], recs[chunks[i].offsets]
        storage[ri] = storage.pop(rj)
    return how


def table_case(fx: Fixtures, rng: random.Random) -> str:
    from dcp_tiered.dcp.metadata_io import _packed, unpack_metadata

    bases = fx.get("table")
    name = rng.choice(sorted(bases))
    path, raw, sd = bases[name]
    if rng.random() < 0.75:
        md = pickle.loads(_split_body(raw))
        how = "col_" + mutate_table(md, rng)
    else:
        md = unpack_metadata(raw)
        how = "list_" + mutate_chunk_lists(md, rng)
        md = _packed(md)
    try:
        body = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an unpicklable value: nothing to test
        return "skipped"
    NOTE["how"] = f"{how} {name}"
    (path / ".metadata").write_bytes(_with_trailer(body, rng))
    whole = rng.random() < 0.25  # as dcp-tiered convert/inspect load: a state dict built from the metadata
    try:
        if whole:
            from dcp_tiered.inspect import load_any

            out = load_any(path)
        else:
            out = _zeros_like(sd)
            dcp.load(out, storage_reader=CompressedReader(path, threads=1, max_object_bytes=64 << 20), no_dist=True)
    except BaseException as exc:  # noqa: BLE001
        result = _outcome_of(exc, planner_ok=not whole)
        return f"{result} [{how} {name}{' load_any' if whole else ''}]" if result.startswith("FAIL") else result
    finally:
        (path / ".metadata").write_bytes(raw)
    if _equal(out, sd):
        return "loaded"
    return f"FAIL wrong values loaded [{how} {name}{' load_any' if whole else ''}]"


_BUILDERS["table"] = _table_fixture


# --------------------------------------------------------------------------- paths: planner_data


def _rename_item(md: Any, old: str, new: str) -> None:
    """Item ``old`` of a trusted, unpacked ``Metadata`` renamed ``new`` everywhere (tables, records, paths)."""
    md.state_dict_metadata = {new if k == old else k: v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {(dataclasses.replace(i, fqn=new) if i.fqn == old else i): r for i, r in md.storage_data.items()}
    md.planner_data = {new if k == old else k: v for k, v in md.planner_data.items()}


def mutate_paths(md: Any, rng: random.Random) -> str:
    """One hostile edit of ``planner_data`` (flattened key -> path in the state dict) of a trusted ``Metadata``."""
    pd = md.planner_data
    keys = list(pd)
    k, other = rng.sample(keys, 2)
    path = list(pd[k])
    ints = [n for n, part in enumerate(path) if type(part) is int]
    how = rng.choice(("huge_index", "spelled_index", "negative_index", "empty", "collide", "inside", "deep", "deep",
                      "respell", "part_type", "container", "ghost", "drop", "swap", "duplicate_part"))
    if how in ("huge_index", "spelled_index"):  # an index far past the list (a list of that many slots would be built)
        at = rng.choice(ints) if ints and rng.random() < 0.7 else len(path)
        value = rng.choice((3, 100, 10**4, 10**6, 10**8, 2**31, 10**12, 2**62, 2**63, 2**64, 10**30))
        path[at:at + 1] = [value]
        if how == "spelled_index":  # the key spelled as the path, as DCP would flatten it: only the index lies
            pd[k] = tuple(path)
            _rename_item(md, k, ".".join(map(str, path)))
            return how
    elif how == "negative_index":
        at = rng.choice(ints) if ints else len(path) - 1
        if path:  # an earlier mutation of this case may have emptied it
            path[at] = rng.choice((-1, -2, -10**9, -2**63))
        else:
            path = [rng.choice((-1, -2))]
    elif how == "empty":
        path = []
    elif how == "collide":  # two items on one path
        path = list(pd[other])
    elif how == "inside":  # an item under another item (a leaf where a container is)
        path = [*pd[other], rng.choice(("x", 0, "w"))]
    elif how == "deep":
        n = rng.choice((10, 63, 64, 65, 200, 5000))
        path = path + [rng.choice(("a", 0)) for _ in range(n)]
    elif how == "respell":  # a path that does not spell its key
        at = rng.randrange(len(path))
        path[at] = rng.choice(("x", "", "0", "model", "layers", 0, 1, "a.b", "..", "/"))
    elif how == "part_type":
        at = rng.randrange(len(path))
        path[at] = rng.choice((True, False, 1.0, None, b"w", ("w",), float("nan"), 2**70))
    elif how == "container":  # the path as another container, or no container
        pd[k] = rng.choice((path, "".join(map(str, path)), None, {"a": 1}, set(map(str, path)), 5))
        return how
    elif how == "ghost":  # a key that is no item
        pd[rng.choice(("ghost", "", k + ".x", "model"))] = tuple(path)
        return how
    elif how == "drop":
        del pd[k]
        return how
    elif how == "swap":  # two items' paths exchanged
        pd[k], pd[other] = pd[other], pd[k]
        return how
    else:
        path = path + path[-1:]
    pd[k] = tuple(path)
    return how


def _flat(sd: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state dict as its flattened keys (DCP's spelling), for comparing what ``convert`` wrote."""
    out: dict[str, Any] = {}
    items = sd.items() if isinstance(sd, dict) else enumerate(sd) if isinstance(sd, list) and any(
        isinstance(v, (torch.Tensor, dict, list)) for v in sd) else None
    if items is None:
        out[prefix] = sd
        return out
    for k, v in items:
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def paths_case(fx: Fixtures, rng: random.Random) -> str:
    from dcp_tiered.dcp.metadata_io import _packed, unpack_metadata
    from dcp_tiered.inspect import convert

    f = fx.get("paths")
    path, raw, sd, out = f["path"], f["raw"], f["sd"], f["out"]
    if rng.random() < 0.8:
        md = unpack_metadata(raw)
        how = mutate_paths(md, rng)
        if rng.random() < 0.1:
            how += "+" + mutate_paths(md, rng)
        try:
            md = _packed(md)  # as format 2 writes it: the path table where every path fits it, else the dict
        except Exception:  # noqa: BLE001 - what the writer cannot pack is left as it is
            how += " (unpacked)"
    else:  # the path table itself
        md = pickle.loads(_split_body(raw))
        head = next(iter(md.storage_data.values()))
        how = "table_" + _mutate_path_table(head["path_table"], len(read_strings(head["item_table"]["fqns"], "harness", "names")), rng)
    try:
        body = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        return "skipped"
    NOTE["how"] = how
    (path / ".metadata").write_bytes(_with_trailer(body, rng))
    out.unlink(missing_ok=True)
    try:
        convert(path, out)
        got = torch.load(out, weights_only=True)
    except BaseException as exc:  # noqa: BLE001
        result = _outcome_of(exc)
        return f"{result} [{how}]" if result.startswith("FAIL") else result
    finally:
        (path / ".metadata").write_bytes(raw)
    if _equal(got, sd):
        return "loaded"
    flat_got, flat_sd = _flat(got), _flat(sd)
    if flat_got.keys() == flat_sd.keys() and all(_equal(flat_got[k], flat_sd[k]) for k in flat_sd):
        return "KNOWN_flattened_without_planner_data"  # every value under its key, nested otherwise: what the file says
    lost = sorted(set(flat_sd) - set(flat_got))[:3]
    return f"FAIL wrong: convert wrote other items (lost {lost}, added {sorted(set(flat_got) - set(flat_sd))[:3]}) [{how}]"


def _mutate_path_table(paths: dict, nitems: int, rng: random.Random) -> str:
    from dcp_tiered.dcp.item_table import _typed_parts

    parts = list(_typed_parts(paths, read_strings(paths["parts"], "harness", "parts"), "harness"))
    counts = _col(paths["nparts"], nitems)
    ids = _col(paths["ids"], sum(counts))
    how = rng.choice(("part", "part", "count", "ids", "width"))
    if how == "part":
        at = rng.randrange(len(parts))
        parts[at] = rng.choice((10**6, 10**12, 2**62, -1, "", "x" * 70000, "0", parts[(at + 1) % len(parts)], 1.5, None,
                                10**30, "-0", "a\0b"))
        if rng.random() < 0.5 and all(type(v) in (str, int) for v in parts):  # as format 3 writes them
            paths["parts"], paths["part_kind"] = (pack_strings(tuple(map(str, parts))),
                                                  _enc([int(type(v) is int) for v in parts]))
        else:  # as a tuple (a name holding a NUL)
            paths["parts"] = tuple(parts)
            paths.pop("part_kind", None)
    elif how == "count":
        at = rng.randrange(nitems)
        counts[at] = rng.choice((0, counts[at] + 1, max(0, counts[at] - 1), 64, 65, 4096, 4097, 2**32))
        paths["nparts"] = _enc(counts)
    elif how == "ids":
        at = rng.randrange(len(ids))
        ids[at] = rng.choice((0, ids[(at + 1) % len(ids)], len(parts), 2**40))
        paths["ids"] = _enc(ids)
    else:
        _mutate_width({"path_table": paths}, rng)
    return how


_BUILDERS["paths"] = _paths_fixture


# --------------------------------------------------------------------------- marker: replica markers


def _marker_fixture(d: Path) -> dict[str, Any]:
    """A replicated ``{rank}`` tier of two ranks (cliques [0, 1]), steps 1 and 2 committed in both rank
    directories, each holding its own data file, its peer's as a replica and the peer's marker: what a
    2-rank job with ``Tier(replicas=2)`` leaves (built in one process: rank 1's records name its file)."""
    import xxhash

    from dcp_tiered.dcp.metadata_io import encode_metadata, unpack_metadata
    from dcp_tiered.tiers.replicas.markers import marker_name, new_marker

    root = d / "pristine"
    for step in (1, 2):
        sd = {"a": torch.full((300,), float(step)), "b": torch.arange(200) * step}
        tmp = d / f"build{step}"
        dcp.save(sd, storage_writer=CompressedWriter(tmp, codec="lz4", threads=1, sync_files=False), no_dist=True)
        md = unpack_metadata((tmp / ".metadata").read_bytes())
        for index, rec in md.storage_data.items():
            if index.fqn == "b":
                rec["file"] = "__1_0.distcp"
        data = (tmp / "__0_0.distcp").read_bytes()
        save_id = md.storage_meta.save_id
        meta = encode_metadata(md)
        digest = xxhash.xxh3_64(data).hexdigest()
        for rank in (0, 1):
            step_dir = root / str(rank) / f"step_{step:09d}"
            step_dir.mkdir(parents=True)
            for name in ("__0_0.distcp", "__1_0.distcp"):
                (step_dir / name).write_bytes(data)
            peer = 1 - rank
            (step_dir / marker_name(peer)).write_bytes(
                new_marker(peer, save_id, step, [(f"__{peer}_0.distcp", len(data), digest)], world=2, per_node=1))
            (step_dir / ".metadata").write_bytes(meta)
        remove_deep(tmp)
    fx = {"pristine": root, "root": d / "tier", "tier": Tier("local", str(d / "tier" / "{rank}"), keep=1, replicas=2)}
    copy_tree(root, fx["root"])
    state = _marker_verdicts(fx)
    assert state == {1: True, 2: True}, f"the pristine replicated tier is not listed as fully replicated: {state}"
    return fx


def _marker_verdicts(fx: dict) -> dict[int, bool]:
    rc, out, err = _cli(["ls", "--local-path", str(fx["root"] / "{rank}"), "--replicas", "2", "--json"])
    assert rc == 0, err
    return {row["step"]: row["replication"]["replicated"] for row in json.loads(out) if "replication" in row}


def _deep_json(n: int) -> str:
    return "[" * n + "]" * n


def mutate_marker_text(doc: dict, rng: random.Random) -> tuple[str, str, bool | None]:
    """A hostile version of a marker's JSON: (how, text, whether it may still vouch: False = must not, None = either)."""
    doc = json.loads(json.dumps(doc))
    how = rng.choice(("owner", "owner", "files", "files", "entry", "world", "save_id", "step", "deep", "huge_list",
                      "text", "extra"))
    vouch: bool | None = False
    if how == "owner":
        value = rng.choice(("Infinity", "-Infinity", "NaN", "1e400", '"1"', "[1]", "null", "true", "1.0", "1.5",
                            "9" * 5000, "-1", "0", "18446744073709551617", '{"a": 1}', _deep_json(100_000)))
        text = json.dumps({**doc, "owner": "@@"}).replace('"@@"', value)
        try:  # a value that int() turns into the owner (1.0, true, "1"): the marker may still be read as the owner's
            vouch = None if int(json.loads(value)) == doc["owner"] else False
        except (ValueError, TypeError, OverflowError, RecursionError):
            vouch = False
        return how, text, vouch
    if how == "files":
        doc["files"] = rng.choice(([], None, {}, "x", 5, [None], [[]], [{"file": None}], [doc["files"][0]] * 2,
                                   {"file": doc["files"][0]["file"]}))
        vouch = None if isinstance(doc["files"], list) and len(doc["files"]) == 2 else False
        if doc["files"] == []:
            vouch = None
    elif how == "entry":  # one file entry: another size, name or digest
        entry = doc["files"][0]
        field = rng.choice(("file", "size", "xxh3"))
        old_value = entry[field]
        entry[field] = rng.choice({
            "file": ("../__1_0.distcp", "/etc/passwd", "__0_0.distcp", "__2_0.distcp", "__1_0.distcp/..", "", None, 5,
                     "__" + "1" * 5000 + "_0.distcp", "__\u0661_0.distcp", ".metadata"),
            "size": (entry["size"] + 1, 2**64, 10**400, -1, "10", None, True, 1.5, float("inf")),
            "xxh3": ("0", None, 5, [], "x" * 100_000)}[field])
        vouch = None if field == "xxh3" else False  # digests are checked on receipt, not when listing
        if type(entry[field]) is type(old_value) and entry[field] == old_value:
            vouch = None  # the value it had: nothing changed
    elif how == "world":
        doc[rng.choice(("world", "per_node"))] = rng.choice((0, -1, 2**17, 2**17 + 1, 10**18, 2**64, 10**400, 1.5, "2",
                                                            None, [2], float("nan"), 3, 1))
        vouch = None
    elif how == "save_id":
        doc["save_id"] = rng.choice((None, "", "other", 5, [doc["save_id"]], {"a": 1}, doc["save_id"] + "x"))
    elif how == "step":
        doc["step"] = rng.choice((None, -1, "2", 2**70, [1], 1.5))
        vouch = None
    elif how == "deep":
        doc[rng.choice(("files", "save_id", "extra", "world"))] = json.loads("0")
        text = json.dumps(doc)[:-1] + ', "nest": ' + _deep_json(rng.choice((100, 1000, 100_000))) + "}"
        return how, text, None
    elif how == "huge_list":  # many entries (other ranks' files, malformed ones), up to the 1 MiB read limit and past it
        n = rng.choice((1000, 20_000, 60_000))
        doc["files"] = doc["files"] + [{"file": f"__{i % 7}_0.distcp", "size": i, "xxh3": "0"} for i in range(n)]
        vouch = None
    elif how == "text":  # not JSON, or JSON of another kind
        text = rng.choice(("", "{", "[]", "null", "5", '"x"', "\x00" * 10, "\ufeff" + json.dumps(doc),
                           json.dumps(doc) + "x", json.dumps(doc)[:-3], " " * (1 << 20) + json.dumps(doc)))
        return how, text, None if text.startswith("\ufeff") else False  # JSON read from bytes may start with a BOM
    else:  # what a reader ignores: an extra field, another key order
        doc["extra"] = rng.choice((None, [1] * 1000, {"owner": 99}, "x"))
        doc = dict(reversed(list(doc.items())))
        vouch = True
    return how, json.dumps(doc), vouch


def marker_case(fx: Fixtures, rng: random.Random) -> str:
    from dcp_tiered.storage import Storage
    from dcp_tiered.tiers.catalog import list_tier
    from dcp_tiered.tiers.replicas.markers import read_markers
    from dcp_tiered.tiers.retention import Retention

    f = fx.get("marker")
    root = f["root"]
    copy_tree(f["pristine"], root)
    rank, step = rng.choice((0, 1)), rng.choice((1, 2, 2))
    step_dir = root / str(rank) / f"step_{step:09d}"
    name = f".replica-{1 - rank}.json"
    roll = rng.random()
    must_not_vouch: bool | None
    if roll < 0.8:
        how, text, vouch = mutate_marker_text(json.loads((step_dir / name).read_text()), rng)
        (step_dir / name).write_text(text)
        must_not_vouch = vouch is False
    elif roll < 0.9:  # another file that looks like a marker (an alias of the owner, or none), with a valid copy
        how = "alias"
        alias = rng.choice((".replica-+1.json", ".replica- 1.json", ".replica-\u0661.json", ".replica-01.json",
                            ".replica-1_0.json", ".replica-.json", ".replica-99999999999999999999.json",
                            ".replica--1.json", ".replica-" + "1" * 5000 + ".json"))
        other = json.loads((step_dir / name).read_text())
        other["save_id"] = "crafted"
        with contextlib.suppress(OSError):  # a name too long for the file system
            (step_dir / alias[:255]).write_text(json.dumps(other))
        must_not_vouch = None  # the genuine marker is intact: either verdict is safe
    else:  # the marker is no regular file
        how = rng.choice(("dir", "link_zero", "link_out", "fifo", "big"))
        target = step_dir / name
        target.unlink()
        if how == "dir":
            target.mkdir()
        elif how == "link_zero":
            target.symlink_to("/dev/zero")
        elif how == "link_out":
            (root / "outside.json").write_text((f["pristine"] / str(rank) / f"step_{step:09d}" / name).read_text())
            target.symlink_to(root / "outside.json")
        elif how == "fifo":
            os.mkfifo(target)
        else:
            target.write_bytes(b" " * (2 << 20))
        must_not_vouch = True
    tier = f["tier"]
    NOTE["how"] = how
    try:
        rc, out, err = _cli(["ls", "--local-path", str(root / "{rank}"), "--replicas", "2", "--json"])
        if rc not in CLI_CODES:
            return f"FAIL builtin ls exit {rc}: {err.strip()[-200:]} [{how}]"
        if rc == 0:
            rows = {row["step"]: row for row in json.loads(out)}
            if step not in rows:
                return f"FAIL wrong: ls lost step {step} [{how}]"
            rep = rows[step].get("replication") or {}
            if must_not_vouch and rep.get("replicated"):
                return f"FAIL wrong: step {step} listed as fully replicated with rank {1 - rank}'s marker damaged [{how}]"
            other = 3 - step if step in (1, 2) else 1
            if not (rows.get(other, {}).get("replication") or {}).get("replicated"):
                return f"FAIL wrong: the intact step {other} is not listed as replicated [{how}]"
        rc2, _, err2 = _cli(["gc", "--local-path", str(root / "{rank}"), "--keep-local", "1", "--dry-run", "--json"])
        if rc2 not in CLI_CODES:
            return f"FAIL builtin gc exit {rc2}: {err2.strip()[-200:]} [{how}]"
        markers = read_markers(Storage(str(step_dir)))
        for owner, marker in markers.items():
            if not (type(owner) is int and isinstance(marker, dict) and isinstance(marker.get("files"), list)):
                return f"FAIL wrong: read_markers returned a malformed marker {str(marker)[:100]} [{how}]"
        infos = {i.step: i for i in list_tier(tier, rank=rank)}
        if not (infos.get(2) and infos[2].committed):
            return f"FAIL wrong: list_tier lost step 2 [{how}]"
        plan = Retention([tier], rank=rank, leftover_grace=0).plan(tier)
        if any(v.step == 2 for v in plan.victims):
            return f"FAIL wrong: retention would delete the newest step [{how}]"
    except BaseException as exc:  # noqa: BLE001
        result = _outcome_of(exc)
        return f"{result} [{how}]" if result.startswith("FAIL") else result
    return "loaded" if rc == 0 else "detected"


_BUILDERS["marker"] = _marker_fixture


# --------------------------------------------------------------------------- lightning_ref: the plugin's references


def _lightning_checkpoint(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + step)
    return {"state_dict": {"layer.weight": torch.randn(8, 4, generator=g), "layer.bias": torch.randn(8, generator=g)},
            "optimizer_states": [{"state": {0: {"momentum_buffer": torch.randn(8, 4, generator=g)}},
                                  "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
            "global_step": step, "epoch": step // 2, "loops": {"fit_loop": {"batches": step * 3}},
            "pytorch-lightning_version": "2.x"}


def _lightning_fixture(d: Path) -> dict[str, Any]:
    from dcp_tiered.integrations.lightning_io import CompressedCheckpointIO

    tiers = [Tier("local", str(d / "tiers" / "local"), keep=5, codec="lz4")]
    io_ = CompressedCheckpointIO(checkpointer=lambda: TieredCheckpointer(tiers, retry=FAST_RETRY, threads=1))
    saved = {}
    for step in (1, 2):
        saved[step] = _lightning_checkpoint(step)
        io_.save_checkpoint(saved[step], str(d / f"ref{step}.ckpt"))
    io_.teardown()
    io_._ck.close()
    ref = json.loads((d / "ref2.ckpt").read_text())
    assert ref.get("step") == 2, ref
    fx = {"tiers": tiers, "saved": saved, "ref": ref, "path": d / "case.ckpt"}
    fx["path"].write_text(json.dumps(ref))
    got = _lightning_load(fx, routed=True)
    assert _equal(got, saved[2]), "the pristine reference does not load exactly"
    return fx


def _lightning_load(fx: dict, routed: bool) -> Any:
    from dcp_tiered.integrations.lightning_io import CompressedCheckpointIO

    tiers = fx["tiers"]
    io_ = (CompressedCheckpointIO(checkpointer=lambda: TieredCheckpointer(tiers, retry=FAST_RETRY, threads=1,
                                                                         resume_promotions=False))
           if routed else CompressedCheckpointIO())
    try:
        return io_.load_checkpoint(str(fx["path"]))
    finally:
        if io_._ck is not None:
            io_._ck.close()


def mutate_ref(ref: dict, rng: random.Random) -> tuple[str, bytes]:
    """A hostile version of a reference file ``{"dcp_tiered_tier_ref": 1, "step": N}``."""
    key = "dcp_tiered_tier_ref"
    how = rng.choice(("step", "step", "step", "marker", "deep", "huge", "extra", "text", "dup"))
    doc = dict(ref)
    if how == "step":
        value = rng.choice(('"2"', "null", "[2]", "2.0", "2.5", "true", "false", "-1", "1", "3", "0", "1e400", "Infinity",
                            "NaN", "-0", "18446744073709551616", "9" * 5000, '{"step": 2}', "[[[[2]]]]"))
        return how, json.dumps({**doc, "step": "@@"}).replace('"@@"', value).encode()
    if how == "marker":
        value = rng.choice(("1.0", "true", "2", '"1"', "null", "[1]"))
        return how, json.dumps({**doc, key: "@@"}).replace('"@@"', value).encode()
    if how == "deep":
        n = rng.choice((100, 1000, 100_000))
        where = rng.random()
        nest = "[" * n + "]" * n
        if where < 0.4:
            return how, json.dumps({**doc, "x": 0}).replace("0}", nest + "}").encode()
        if where < 0.7:
            return how, ("{" + json.dumps(key) + ": 1, \"step\": " + "[" * n + "2" + "]" * n + "}").encode()
        return how, ('{"x": ' + nest + ", " + json.dumps(key)[0:] + ": 1, \"step\": 2}").encode()
    if how == "huge":  # past the 4 KiB the plugin reads first: the key before or after the padding
        pad = "x" * rng.choice((4000, 5000, 1 << 20))
        if rng.random() < 0.5:
            return how, json.dumps({**doc, "pad": pad}).encode()
        return how, json.dumps({"pad": pad, **doc}).encode()
    if how == "extra":
        return how, json.dumps({**doc, rng.choice(("extra", "path", "tier")): rng.choice((None, "../x", [1], 5))}).encode()
    if how == "dup":  # JSON keeps the last of repeated keys
        return how, (json.dumps(doc)[:-1] + ', "step": ' + rng.choice(("1", '"x"', "3", "null")) + "}").encode()
    text = json.dumps(doc).encode()
    return how, rng.choice((text[:-1], text + b"x", b" " + text, b"\xef\xbb\xbf" + text, text.replace(b'"', b"'"),
                            text + b"\x00" * 10, b"{", b"{}", b"{\"" + key.encode() + b"\": 1"))


def lightning_ref_case(fx: Fixtures, rng: random.Random) -> str:
    f = fx.get("lightning_ref")
    how, data = mutate_ref(f["ref"], rng)
    f["path"].write_bytes(data)
    NOTE["how"] = how
    routed = rng.random() < 0.85
    try:
        got = _lightning_load(f, routed)
    except BaseException as exc:  # noqa: BLE001
        result = _outcome_of(exc)
        if result.startswith("FAIL") and b"dcp_tiered_tier_ref" not in data:
            # no reference: the plugin hands the file to Lightning's own loader, as any stock .ckpt
            return "KNOWN_not_a_reference_stock_loader_error"
        return f"{result} ({data[:60]!r}) [{how}{'' if routed else ' unrouted'}]" if result.startswith("FAIL") else result
    step = got.get("global_step") if isinstance(got, dict) else None
    if step in f["saved"] and _equal(got, f["saved"][step]):
        try:
            named = json.loads(data)
        except (ValueError, RecursionError):
            named = None
        if not (isinstance(named, dict) and type(named.get("step")) is int and named["step"] == step):
            return f"FAIL wrong: loaded step {step} from a reference naming {data[:60]!r}. [{how}]"
        return "loaded"
    return f"FAIL wrong: loaded {str(got)[:80]} ({data[:60]!r}) [{how}]"


_BUILDERS["lightning_ref"] = _lightning_fixture


# --------------------------------------------------------------------------- accelerate: save_state / load_state


class Tally:
    """An object registered with ``accelerator.register_for_checkpointing`` (a user's own, strict as most are)."""

    def __init__(self) -> None:
        self.count, self.history = 0, [0.0]

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        count, history = int(sd["count"]), [float(x) for x in sd["history"]]
        self.count, self.history = count, history


def _acc_objects(acc: Any) -> tuple[Any, Any, Any, Tally]:
    from dcp_tiered.integrations.accelerate import _models, _optimizers, _schedulers

    return _models(acc)[0], _optimizers(acc)[0], _schedulers(acc)[0], acc._custom_objects[0]


def _acc_snapshot(acc: Any) -> dict[str, Any]:
    """Everything a restore may change, copied."""
    model, opt, sched, tally = _acc_objects(acc)
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict()), "sched": copy.deepcopy(sched.state_dict()),
            "tally": copy.deepcopy(tally.state_dict())}


def _acc_set(acc: Any, snap: dict[str, Any]) -> None:
    model, opt, sched, tally = _acc_objects(acc)
    model.load_state_dict(snap["model"])
    opt.load_state_dict(copy.deepcopy(snap["opt"]))
    sched.load_state_dict(copy.deepcopy(snap["sched"]))
    tally.load_state_dict(copy.deepcopy(snap["tally"]))


def _acc_changed(acc: Any, snap: dict[str, Any]) -> list[str]:
    """What differs from ``snap`` now: ``weights``, ``optimizer``, ``scheduler``, ``custom``."""
    now = _acc_snapshot(acc)
    out = []
    if not _equal(now["model"], snap["model"]):
        out.append("weights")
    if not _equal(now["opt"], snap["opt"]):
        out.append("optimizer")
    if now["sched"] != snap["sched"]:
        out.append("scheduler")
    if now["tally"] != snap["tally"]:
        out.append("custom")
    return out


def _acc_train(acc: Any, step: int) -> None:
    model, opt, sched, tally = _acc_objects(acc)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
    with torch.enable_grad():
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        acc.backward(loss)
    opt.step()
    sched.step()
    tally.count += 1
    tally.history.append(float(loss))


def _accelerate_fixture(d: Path) -> dict[str, Any]:
    from accelerate import Accelerator

    from dcp_tiered.integrations.accelerate import save_state

    acc = Accelerator(cpu=True)
    acc.free_memory()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    acc.prepare(net, opt, sched)
    acc.register_for_checkpointing(Tally())
    tier = Tier("local", str(d / "tier"), keep=10, codec="zstd")
    snaps = {}
    with TieredCheckpointer([tier], retry=FAST_RETRY, threads=1) as ck:
        for step in (1, 2, 3, 4):
            _acc_train(acc, step)
            snaps[step] = _acc_snapshot(acc)
            if step <= 2:
                assert save_state(acc, ck, step, force=True).ok
    copy_tree(d / "tier", d / "pristine")
    return {"acc": acc, "tier": tier, "snaps": snaps, "root": d / "tier", "pristine": d / "pristine"}


def mutate_acc_payload(sd: dict[str, Any], rng: random.Random) -> str:
    """One hostile edit of what ``save_state`` saves (scheduler JSON, random states, registered objects,
    optimizer values, the model's tensors)."""
    rng_key = next(k for k in sd if k.startswith("rng_"))
    part = rng.choice(("scheduler", "scheduler", "rng", "rng", "custom", "optim", "model", "missing"))
    if part == "scheduler":
        state = json.loads(sd["scheduler"])
        text = rng.choice((
            json.dumps(state).replace(str(state[0]["step_size"]), "Infinity", 1), "[" * 100_000 + "]" * 100_000,
            "x", "", "null", "{}", "[]", json.dumps(state * 2), json.dumps([{"last_epoch": "x"}]),
            json.dumps([{**state[0], "last_epoch": 1e400}]), json.dumps([{**state[0], "_last_lr": "x"}]),
            json.dumps([{**state[0], "base_lrs": [1, 2, 3]}]), json.dumps([{**state[0], "gamma": None}]),
            json.dumps([{k: v for k, v in state[0].items() if k != "last_epoch"}]), json.dumps([[1, 2]]),
            '[{"step_size": 1' + "0" * 5000 + "}]"))
        sd["scheduler"] = text if rng.random() < 0.9 else rng.choice((5, None, b"[]", ["[]"]))
        return "scheduler"
    if part == "rng":
        (state,) = sd[rng_key]
        state = dict(state)
        field = rng.choice(("python", "numpy", "torch", "step", "wrap", "missing"))
        if field == "python":
            version, internal, gauss = state["python"]
            state["python"] = rng.choice(((version, internal[:-1], gauss), ("x", internal, gauss), (version, internal, "x"),
                                          (version, internal.float(), gauss), (version,), None, "x",
                                          (version, internal * 0 + 2**40, gauss)))
        elif field == "numpy":
            kind, keys, pos, has_gauss, cached = state["numpy"]
            state["numpy"] = rng.choice(((kind, keys[:-1], pos, has_gauss, cached), ("x", keys, pos, has_gauss, cached),
                                         (kind, keys, 10**6, has_gauss, cached), (kind, keys.float(), pos, has_gauss, cached),
                                         (kind, keys, pos, has_gauss, "x"), None))
        elif field == "torch":
            state["torch"] = rng.choice((state["torch"][:-1], state["torch"].float(), torch.zeros(3, dtype=torch.uint8),
                                         "x", None, state["torch"].view(-1, 8)))
        elif field == "step":
            state["step"] = rng.choice(("x", None, 2**70, -5, 1.5, [1]))
        elif field == "missing":
            del state[rng.choice(("python", "numpy", "torch"))]
        sd[rng_key] = (state,) if field != "wrap" else rng.choice(((state, state), state, [state], None, ()))
        return f"rng_{field}"
    if part == "custom":
        sd["custom"]["0"] = rng.choice(({"count": "x", "history": [1.0]}, {"count": 1}, {"count": 2, "history": "ab"},
                                        {"count": 2**70, "history": []}, {"count": 1, "history": [None]}, {}))
        return "custom"
    if part == "optim":
        opt = sd["optim"]["0"]
        groups = opt.get("param_groups")
        if groups and rng.random() < 0.6:
            key = rng.choice(("lr", "momentum", "weight_decay", "nesterov"))
            groups[0][key] = rng.choice(("x", None, -1.0, float("nan"), [0.1], 10**400 if key == "lr" else 2**70))
        else:
            state = opt.get("state", {})
            if state:
                k = rng.choice(sorted(state))
                buf = state[k].get("momentum_buffer")
                if isinstance(buf, torch.Tensor):
                    state[k]["momentum_buffer"] = rng.choice((buf[:-1], buf.double(), buf.reshape(-1)[:1], torch.zeros(0)))
        return "optim"
    if part == "model":
        key = rng.choice(sorted(sd["model"]))
        t = sd["model"][key]
        sd["model"][key] = rng.choice((t.double(), t[:-1], t.reshape(-1), t.to(torch.bfloat16), t.int()))
        return "model"
    victim = rng.choice(("scheduler", "custom", rng_key, "optim"))
    sd.pop(victim, None)
    return f"missing_{victim.split('_')[0]}"


def accelerate_case(fx: Fixtures, rng: random.Random) -> str:
    from dcp_tiered.integrations.accelerate import _payload, load_state

    f = fx.get("accelerate")
    acc, snaps, tier = f["acc"], f["snaps"], f["tier"]
    copy_tree(f["pristine"], f["root"])
    if rng.random() < 0.8:  # the newest step (3) saved by save_state's own builder, then one part of it mutated
        _acc_set(acc, snaps[3])
        payload = _payload(acc, None, None)
        how = mutate_acc_payload(payload, rng)
        try:
            with TieredCheckpointer([tier], retry=FAST_RETRY, threads=1) as ck:
                if not ck.save_now(3, payload).ok:
                    return "skipped"
        except Exception:  # noqa: BLE001 - a value the writer refuses to save: nothing to load
            return "skipped"
    else:  # a damaged file of step 2
        victim = rng.choice(sorted(p for p in (f["root"] / "step_000000002").iterdir() if p.is_file()))
        victim.write_bytes(bytes(_mutate(bytearray(victim.read_bytes()), rng)))
        how = f"bytes_{victim.name}"
    NOTE["how"] = how
    _acc_set(acc, snaps[4])  # the live state: step 4, saved nowhere
    live = _acc_snapshot(acc)
    try:
        with TieredCheckpointer([tier], retry=FAST_RETRY, threads=1, resume_promotions=False) as ck:
            step = load_state(acc, ck)
    except BaseException as exc:  # noqa: BLE001
        changed = _acc_changed(acc, live)
        if changed:
            # issue 23 item 11, fixed on another branch: the weights are loaded before a later part fails
            return f"KNOWN_issue23_item11_partial_restore ({'+'.join(changed)} changed)"
        result = _outcome_of(exc)
        if result.startswith("FAIL") and _raised_by_user_object(_error_of(exc)):
            return "detected_by_user_object"  # the registered object refused its state; nothing changed
        return f"{result} [{how}]" if result.startswith("FAIL") else result
    if step is None:
        return "loaded" if not _acc_changed(acc, live) else f"FAIL wrong: nothing restored but the live state changed [{how}]"
    want = dict(snaps[step]["model"]) if step in snaps else None
    if step == 3 and how == "model":  # a tensor saved in another dtype: loaded into the model's, as DCP casts
        want = {k: v.to(want[k].dtype) if v.shape == want[k].shape else v for k, v in payload["model"].items()}
    if want is None or not _equal(_acc_snapshot(acc)["model"], want):
        return f"FAIL wrong: restored step {step} with other weights [{how}]"
    return "loaded"


def _raised_by_user_object(err: BaseException) -> bool:
    import traceback

    return any(fr.name == "load_state_dict" and fr.filename == __file__ for fr in traceback.extract_tb(err.__traceback__))


_BUILDERS["accelerate"] = _accelerate_fixture


# --------------------------------------------------------------------------- deepdir: deep trees in a tier


def nest(directory: Path, depth: int, name: str = "a", leaf: str | None = "f", loop: bool = False) -> None:
    """A chain of ``depth`` directories ``name`` under ``directory`` (made relative to open directories, so
    its full path may be far longer than PATH_MAX), a file ``leaf`` (or a link loop) at the bottom."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        if loop:
            os.symlink(".", "loop", dir_fd=fd)
        if leaf:
            with open(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
                f.write(b"x" * 10)
    finally:
        os.close(fd)


def _deepdir_fixture(d: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(31)
    states = {s: {"w": torch.randn(64, generator=g), "n": {"k": s}} for s in (1, 3)}
    tier = Tier("local", str(d / "tier"), keep=1, codec="lz4")
    for s, sd in states.items():
        dcp.save(sd, storage_writer=CompressedWriter(d / "tier" / f"step_{s:09d}", codec="lz4", threads=1,
                                                     sync_files=False), no_dist=True)
    (d / "tier" / "step_000000002").mkdir()  # a leftover: a save killed before its commit
    (d / "tier" / "step_000000002" / "__0_0.distcp").write_bytes(b"partial")
    copy_tree(d / "tier", d / "pristine")
    return {"tier": tier, "states": states, "root": d / "tier", "pristine": d / "pristine"}


def deepdir_case(fx: Fixtures, rng: random.Random) -> str:
    from dcp_tiered.tiers.catalog import list_tier
    from dcp_tiered.tiers.retention import Retention

    f = fx.get("deepdir")
    root, tier, states = f["root"], f["tier"], f["states"]
    copy_tree(f["pristine"], root)
    where = rng.choice(("step_000000001", "step_000000001", "step_000000001/sub", "step_000000002", "junk",
                        "step_000000003"))
    depth = rng.choice((1100, 1100, 1500, 3000))
    name = rng.choice(("a", "a", "dir_0001", "n" * 60))
    leaf = rng.choice(("f", ".metadata", "__0_0.distcp", ".promote-0.json", ".replica-1.json", None))
    how = f"{where} depth {depth} name {len(name)} leaf {leaf}"
    t0 = time.monotonic()
    try:
        nest(root / where, depth, name, leaf, loop=rng.random() < 0.2)
        if rng.random() < 0.2:  # a second tree elsewhere
            nest(root / rng.choice(("step_000000001", "junk2")), rng.choice((1100, 2000)), "b", "g")
    except OSError as exc:
        return f"skipped ({exc.strerror})"
    # Deleting the trees costs the filesystem about what making them did (1-2 ms a directory here):
    # that time is the filesystem's, granted on top of the case's clock, which starts at ``how``; a walk
    # that is not linear in the directories still runs past it.
    NOTE["extra_s"] = 2 * (time.monotonic() - t0)
    NOTE["how"] = how
    try:
        infos = {i.step: i for i in list_tier(tier)}
        if not (3 in infos and infos[3].committed and infos[3].complete and 1 in infos and infos[1].committed):
            return f"FAIL wrong: list_tier shows {sorted((s, i.committed, i.complete) for s, i in infos.items())} [{how}]"
        rc, out, err = _cli(["gc", "--local-path", str(root), "--keep-local", "1", "--leftover-grace", "0",
                             "--dry-run", "--json"])
        if rc != 0:
            return (f"FAIL builtin gc --dry-run exit {rc}: {err.strip()[-200:]} [{how}]" if rc not in CLI_CODES
                    else f"FAIL wrong: gc --dry-run gave up on the tier (exit {rc}: {err.strip()[-160:]}) [{how}]")
        would = {row["step"] for row in json.loads(out)["would_delete"]}
        if would != {1, 2}:
            return f"FAIL wrong: gc --dry-run would delete steps {sorted(would)}, not [1, 2] [{how}]"
        state = {"w": torch.zeros(64), "n": {"k": -1}}
        with TieredCheckpointer([tier], retry=FAST_RETRY, threads=1, resume_promotions=False) as ck:
            step = ck.restore(state)
        if step != 3 or not _equal(state, states[3]):
            return f"FAIL wrong: restore gave step {step} [{how}]"
        roll = rng.random()
        if roll < 0.3:
            rc, out, err = _cli(["gc", "--local-path", str(root), "--keep-local", "1", "--leftover-grace", "0"])
            if rc != 0:
                return f"FAIL {'builtin' if rc not in CLI_CODES else 'wrong:'} gc exit {rc}: {err.strip()[-200:]} [{how}]"
        elif roll < 0.5:
            Retention([tier], leftover_grace=0).run(tier)
        else:
            return "loaded"
        left = sorted(p.name for p in root.iterdir())
        if "step_000000001" in left or "step_000000002" in left or "step_000000003" not in left:
            return f"FAIL wrong: after retention the tier holds {left} [{how}]"
        back = {"w": torch.zeros(64), "n": {"k": -1}}
        dcp.load(back, storage_reader=CompressedReader(root / "step_000000003", threads=1), no_dist=True)
        if not _equal(back, states[3]):
            return f"FAIL wrong: step 3 changed by retention [{how}]"
    except BaseException as exc:  # noqa: BLE001
        result = _outcome_of(exc)
        return f"{result} [{how}]" if result.startswith("FAIL") else f"FAIL wrong: gave up on the tier: {result} [{how}]"
    return "loaded"


_BUILDERS["deepdir"] = _deepdir_fixture
