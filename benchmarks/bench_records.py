"""Cost of validating and parsing item records: ``.metadata`` of many tensors is checked on every load.

Run:  .venv/bin/python -m benchmarks.bench_records [--items 20000] [--runs 7]

Builds a ``Metadata`` with ``--items`` native records (1 to 5 frames each, zstd, byte-grouped
fp32) and times, best of ``--runs``: ``check_record`` on every record (the validation
``check_metadata`` runs for each), ``check_metadata`` (every table), ``ItemRecord.from_builtin``
(validate and build the typed record) and ``record_view`` (the typed record of an already
validated dict, what the reader builds once per requested item).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_tiered.dcp.format import ItemRecord, check_record, record_view
from dcp_tiered.dcp.metadata_io import check_metadata


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


def best_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    md = build(args.items)
    recs = [(i.fqn, r) for i, r in md.storage_data.items()]
    cases = {
        "check_record (each record)": lambda: [check_record(r, k, "ckpt") for k, r in recs],
        "check_metadata (all tables)": lambda: check_metadata(md, "ckpt/.metadata"),
        "ItemRecord.from_builtin": lambda: [ItemRecord.from_builtin(r, k, "ckpt") for k, r in recs],
        "record_view (validated dict)": lambda: [record_view(r) for _, r in recs],
    }
    for name, fn in cases.items():
        ms = best_ms(fn, args.runs)
        print(f"{name:30s} {ms:8.1f} ms  {ms * 1e3 / args.items:6.2f} us/record")


if __name__ == "__main__":
    main()
