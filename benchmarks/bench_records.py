"""Size and open time of ``.metadata`` with many tensors, and the cost of validating item records.

Run:  .venv/bin/python -m benchmarks.bench_records [--items 20000] [--runs 7] [--quick]

Writes the section "records" of docs/benchmarks.md and the results "records".

First saves ``--items`` small tensors (16 floats each) with ``CompressedWriter`` and stock
``FileSystemWriter`` and prints ``.metadata`` bytes per tensor, ours (format 3: records, items
and planner paths as column tables) against stock and against format 1 (the same Metadata
pickled as it is, what format-1 writers stored).  Then times opening each ``.metadata``
(``decode_metadata``: allow-list unpickler, structure scan, every check; stock: DCP's plain
``pickle.load``), best of ``--runs``.

Builds a ``Metadata`` with ``--items`` native records (1 to 5 frames each, zstd, byte-grouped
fp32) and times, best of ``--runs``: ``check_record`` on every record (the validation
``check_metadata`` runs for each), ``check_metadata`` (every table), ``ItemRecord.from_builtin``
(validate and build the typed record) and ``record_view`` (the typed record of an already
validated dict, what the reader builds once per requested item).
"""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import random
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from benchmarks.common import machine_line, md_table, save_results, write_section
from dcp_tiered import CompressedWriter
from dcp_tiered.codecs import checksum
from dcp_tiered.dcp.format import METADATA_FILE, ItemRecord, check_record, record_view
from dcp_tiered.dcp import metadata_io
from dcp_tiered.dcp.metadata_io import _MAGIC, check_metadata, decode_metadata, encode_metadata


def build(items: int) -> Metadata:
    rng = random.Random(0)
    sdm, storage, offset, frame = {}, {}, 0, 4 << 20
    for i in range(items):
        numel = rng.choice([256, 4096, 1 << 20, 3 << 20, 5 << 20])
        raw = numel * 4
        frames = tuple(max(12, min(frame, raw - k * frame) // 2) for k in range(-(-raw // frame)))
        fqn = f"model.layers.{i}.weight"
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([numel]),
                                         [ChunkStorageMetadata(torch.Size([0]), torch.Size([numel]))])
        storage[MetadataIndex(fqn, torch.Size([0]), 0)] = ItemRecord(
            version=1, kind="tensor", file="__0_0.distcp", offset=offset, length=sum(frames), raw_length=raw,
            codec="zstd:3", filter_name="bytegroup-signswap", itemsize=4, frame_size=frame, frame_lengths=frames,
            frame_sums=tuple(rng.getrandbits(64) for _ in frames), checksum="xxh3_64", dtype="float32",
            orig_dtype="float32", shape=(numel,)).to_builtin()
        offset += sum(frames)
    return Metadata(sdm, storage_data=storage)


def cold(decode: Callable[..., object], *args: object) -> object:
    """``decode(*args)`` as a first open in the process: the cache of decoded ``.metadata`` emptied first."""
    metadata_io._DECODED.clear()
    return decode(*args)


def best_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def format1_bytes(md: Metadata) -> bytes:
    """``md`` as a format-1 writer stored it: the Metadata pickled as it is (its records a plain dict),
    plus the trailer."""
    md = copy.copy(md)
    md.storage_data = dict(md.storage_data)
    body = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    return body + _MAGIC + checksum((body,)).to_bytes(8, "little")


def _save_both(state: dict, d: str) -> tuple[bytes, bytes, bytes]:
    """``.metadata`` bytes: ours (format 3), ours as format 1 stored it, stock."""
    dcp.save(state, storage_writer=CompressedWriter(os.path.join(d, "ours")), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(d, "stock")), no_dist=True)
    ours, stock = (open(os.path.join(d, k, METADATA_FILE), "rb").read() for k in ("ours", "stock"))
    md = decode_metadata(ours, "ours")
    assert pickle.loads(encode_metadata(md)[:-len(_MAGIC) - 8]) == pickle.loads(ours[:-len(_MAGIC) - 8])
    return ours, format1_bytes(md), stock


SIZE_NAMES = ("ours, format 3", "ours, format 1", "stock FileSystemWriter")


def _sizes(label: str, sizes: tuple[bytes, bytes, bytes], items: int) -> dict:
    """Bytes per tensor of each ``.metadata`` (printed as well)."""
    print(f".metadata of {label}: bytes per tensor")
    out = {"data": label, "tensors": items}
    for name, data in zip(SIZE_NAMES, sizes):
        out[name] = len(data) / items
        print(f"  {name:28s} {len(data) / items:8.1f}")
    return out


def minilm_sizes() -> dict | None:
    try:
        from benchmarks.common import minilm_weights

        state = {k: v.to(torch.bfloat16) for k, v in minilm_weights().items()}
    except ImportError as exc:
        print(f"MiniLM not installed ({exc}); skipped")
        return None
    with tempfile.TemporaryDirectory() as d:
        return _sizes(f"MiniLM bf16 ({len(state)} tensors)", _save_both(state, d), len(state))


def metadata_sizes_and_open_times(items: int, runs: int) -> tuple[dict, dict[str, float]]:
    """Bytes per tensor and open times (ms, best of ``runs``) of ``items`` tiny tensors' ``.metadata``."""
    state = {f"model.layers.{i}.mlp.weight": torch.full((16,), float(i)) for i in range(items)}
    with tempfile.TemporaryDirectory() as d:
        ours, v1, stock = _save_both(state, d)
        stock_path = os.path.join(d, "stock")
        sizes = _sizes(f"{items} tensors of 16 floats", (ours, v1, stock), items)
        print(f"open .metadata of {items} tensors (best of {runs})")
        cases = {  # a first open: the process's decode cache emptied before each run
            "ours, format 3 (decode_metadata)": lambda: cold(decode_metadata, ours, "ours"),
            "ours, format 1 (decode_metadata)": lambda: cold(decode_metadata, v1, "v1"),
            "stock (FileSystemReader)": lambda: dcp.FileSystemReader(stock_path).read_metadata(),
            "ours, format 3, opened again (cached decode)": lambda: decode_metadata(ours, "ours"),
        }
        opens = {}
        for name, fn in cases.items():
            opens[name] = best_ms(fn, runs)
            print(f"  {name:34s} {opens[name]:9.1f} ms")
    return sizes, opens


def write_doc(cmd: str, sizes: list[dict], opens: dict[str, float], items: int, checks: dict[str, float]) -> None:
    """The "records" section of docs/benchmarks.md and its raw results."""
    save_results("records", {"sizes": sizes, "open_ms": opens, "items": items, "check_ms": checks})
    size_rows = [[s["data"], *(f"{s[n]:.1f}" for n in SIZE_NAMES), f"{s[SIZE_NAMES[0]] / s[SIZE_NAMES[2]]:.2f}"]
                 for s in sizes]
    open_rows = [[name, f"{ms:.1f}"] for name, ms in opens.items()]
    check_rows = [[name, f"{ms:.1f}", f"{ms * 1e3 / items:.2f}"] for name, ms in checks.items()]
    write_section("records", (
        f"## `.metadata` size and open time\n\n`{cmd}` — {machine_line()}.\n\n"
        "Bytes per tensor of the `.metadata` that `CompressedWriter` writes (format 3: records, items and planner "
        "paths as column tables), the same Metadata pickled as format-1 writers stored it, and stock "
        "`FileSystemWriter`'s, for the same state saved by each:\n\n"
        + md_table(["state", *SIZE_NAMES, "ours ÷ stock"], size_rows)
        + f"\n\nOpening the `.metadata` of {items} tensors (ours: allow-list unpickler, structure scan and every "
        "check; stock: DCP's plain `pickle.load`), best of the runs, each a first open in the process; the last "
        "row opens the same bytes again, which the decode cache serves), ms:\n\n" + md_table(["open", "ms"], open_rows)
        + f"\n\nValidating {items} synthetic records in memory (1 to 5 frames each), best of the runs:\n\n"
        + md_table(["check", "ms", "us per record"], check_rows)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smoke run: 500 tensors, 2 runs; writes no results")
    args = ap.parse_args()
    if args.quick:
        args.items, args.runs = 500, 2
    cmd = f".venv/bin/python -m benchmarks.bench_records --items {args.items} --runs {args.runs}"
    small = minilm_sizes()
    big, opens = metadata_sizes_and_open_times(args.items, args.runs)
    print("validating records (in memory)")
    md = build(args.items)
    recs = [(i.fqn, r) for i, r in md.storage_data.items()]
    cases = {
        "check_record (each record)": lambda: [check_record(r, k, "ckpt") for k, r in recs],
        "check_metadata (all tables)": lambda: check_metadata(md, "ckpt/.metadata"),
        "ItemRecord.from_builtin": lambda: [ItemRecord.from_builtin(r, k, "ckpt") for k, r in recs],
        "record_view (validated dict)": lambda: [record_view(r) for _, r in recs],
    }
    checks = {}
    for name, fn in cases.items():
        ms = checks[name] = best_ms(fn, args.runs)
        print(f"  {name:30s} {ms:8.1f} ms  {ms * 1e3 / args.items:6.2f} us/record")
    if not args.quick:  # a smoke run's numbers are no results
        write_doc(cmd, [s for s in (small, big) if s], opens, args.items, checks)


if __name__ == "__main__":
    main()
