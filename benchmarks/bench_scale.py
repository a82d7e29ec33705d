"""The coordinator's work at 8 to 16,384 ranks: this library's coordinator code next to stock DCP's.

Run:  .venv/bin/python -m benchmarks.bench_scale [--models 7b,70b] [--ranks 8,32,128,512,2048,4096,8192,16384]
      [--layers 1] [--quick]      (defaults shown; about 9 minutes on 2 cores, peak RSS about 2.5 GiB)

Writes the section "scale" of docs/benchmarks.md and the results "scale".

One process plays the coordinator of an FSDP2 job of N ranks: it builds every rank's DCP
``SavePlan`` from DCP's own types (no tensors, no process group) and runs, on the same plans,
the coordinator steps of ``CompressedWriter``, ``TieredWriter`` and the memory-tier budget
next to stock ``FileSystemWriter``/``FileSystemReader``.  Each rank holds, for every parameter
of a slice of Llama-7B or Llama-70B (``--layers`` decoder layers plus the embedding, the final
norm and ``lm_head``), its ``Shard(0)`` of the parameter and of Adam's ``exp_avg`` and
``exp_avg_sq`` (dim 0 cut in ``ceil(d0 / N)`` rows, as DTensor does; ranks past dim 0 hold
nothing), a replicated scalar ``step`` per parameter (on every rank: DCP's dedup keeps one) and
the param group's values as BYTE_IO items (on every rank).

Each rank's write results are built as its writer would return them (ours: ``ItemRecord``
records with frame tables of ``DEFAULT_FRAME_SIZE`` frames stored at 0.8x their raw bytes;
stock: ``_StorageInfo``), pickled as that rank would send them, and unpickled by the
coordinator (the gather, timed).  Data files exist (sparse files of the right length) where a
restore checks their sizes (each rank checks its own at ``write_data``).  Steps timed in CPU
seconds (``time.process_time``, every thread of the process), best of a few runs where short:

- DCP's own global planning (``DefaultSavePlanner.create_global_plan``, with dedup): DCP's, not ours;
- ``prepare_global_plan``; the gather of the write results; ``finish``;
- pickling the ``Metadata`` that DCP broadcasts to every rank after ``finish`` (and its bytes),
  and the committed ``.metadata`` bytes;
- opening ``.metadata`` (ours: ``CompressedReader(path).read_metadata()``, a first open in the
  process: the decode cache emptied first; stock: ``FileSystemReader(path).read_metadata()``);
- ``TieredWriter.prepare_global_plan`` and ``finish`` (with the retention job it queues) on a
  shared tier in a local directory, against stock's; the memory-tier budget decision over
  the N gathered plans (``budget._coordinator_answer``, no stock counterpart); how many times a
  ``TieredCheckpointer.restore`` of that checkpoint decodes its ``.metadata`` (the restore
  asks for no items: the sparse data files hold no real frames).

Growth exponents are slopes of log(CPU) over log(N), between successive N, over all of them and
over N >= 512 (least squares); the growth bars are judged over N >= 512, the issue's range (the fixed
costs at small N flatten a fit over all N).  Absolute times drift on a shared machine; ratios within one process are what
counts.  A finish that refuses (``MetadataTooLargeError``: more records or bytes than readers
accept) is reported as refused; the full model's record count (not run) is computed and
checked against the readers' limits.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import itertools
import io
import math
import os
import pickle
import random
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any, Self

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.common import machine_line, md_table, save_results, write_section
from dcp_tiered.codecs import CHECKSUM_ALGORITHM, DEFAULT_FRAME_SIZE, filter_for, get_codec
from dcp_tiered.codecs.frames import stored_frame_bounds
from dcp_tiered.dcp import metadata_io, record_table
from dcp_tiered.dcp.format import FORMAT_VERSION, KIND_BYTES, KIND_TENSOR, MAX_METADATA_BYTES, MAX_METADATA_RECORDS, ItemRecord
from dcp_tiered.dcp.reader import CompressedReader
from dcp_tiered.dcp.writer import CompressedWriter, RankFilePrefix
from dcp_tiered.errors import MetadataTooLargeError
from dcp_tiered.names import METADATA_FILE, data_file, node_copies_prefix, rank_prefix
from dcp_tiered.tiers.checkpointer import TieredCheckpointer
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.promote.promoter import Promoter
from dcp_tiered.tiers.save import budget
from dcp_tiered.tiers.save.node_commit import node_view
from dcp_tiered.tiers.save.writer import TieredWriter

#: 8 to 16,384 ranks, every fourfold step and the last doubling (``--ranks`` takes any list, e.g. every doubling)
RANKS = (8, 32, 128, 512, 2048, 4096, 8192, 16384)
STEP = "step_000000100"
#: Stored bytes of a compressed frame, as a fraction of its raw bytes.
RATIO = 0.8
#: Raw bytes of one param-group value (``torch.save`` of a float, a tuple or a list of names).
GROUP_VALUE_BYTES = 1100
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
              "differentiable", "fused", "decoupled_weight_decay", "params")


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    kv: int  # rows of k_proj and v_proj (GQA)
    intermediate: int
    vocab: int

    def params(self, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """``(fqn, shape)`` of the embedding, ``layers`` decoder layers (all by default), the norm and lm_head."""
        h, kv, f = self.hidden, self.kv, self.intermediate
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers if layers is None else min(layers, self.layers)):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                    (p + "post_attention_layernorm.weight", (h,))]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


MODELS = {
    "7b": Model("Llama-7B", 32, 4096, 4096, 11008, 32000),
    "70b": Model("Llama-70B", 80, 8192, 1024, 28672, 32000),
}


def shard(d0: int, n: int, rank: int) -> tuple[int, int] | None:
    """Rows ``(start, length)`` of dim 0 that ``rank`` holds under ``Shard(0)`` over ``n`` ranks, or None."""
    chunk = -(-d0 // n)
    start = rank * chunk
    return None if start >= d0 else (start, min(d0, start + chunk) - start)


def shards_of(d0: int, n: int) -> int:
    """How many of ``n`` ranks hold a non-empty ``Shard(0)`` of a dim 0 of ``d0`` rows."""
    return -(-d0 // -(-d0 // n))


def record_count(model: Model, n: int, layers: int | None = None) -> int:
    """Storage records of one save (after DCP's dedup): 3 shards per holding rank per parameter, one
    ``step`` per parameter, one item per param-group value."""
    params = model.params(layers)
    return sum(3 * shards_of(shape[0], n) for _f, shape in params) + len(params) + len(GROUP_KEYS)


# -- the ranks' local plans -------------------------------------------------------------------------


def local_plans(model: Model, layers: int, n: int) -> list[SavePlan]:
    """Every rank's local ``SavePlan`` (DefaultSavePlanner's, flattened keys, ``planner_data`` the paths).

    Each rank's shard items are objects of their own (as unpickled from the gather); the items every
    rank holds alike (``step``, param groups) are one object each, shared by the ranks' plans."""
    f32 = torch.float32
    sharded, replicated, paths = [], [], {}
    for fqn, shape in model.params(layers):
        paths[fqn] = (fqn,)
        for key in (fqn, f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            sharded.append((key, shape, TensorProperties(dtype=f32), torch.Size(shape)))
            if key != fqn:
                paths[key] = ("optim", "state", fqn, key.rsplit(".", 1)[1])
        step = f"optim.state.{fqn}.step"
        paths[step] = ("optim", "state", fqn, "step")
        empty = torch.Size([])
        replicated.append(WriteItem(index=MetadataIndex(step, empty), type=WriteItemType.TENSOR,
                                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(empty, empty),
                                                                properties=TensorProperties(dtype=f32), size=empty)))
    for key in GROUP_KEYS:
        fqn = f"optim.param_groups.0.{key}"
        paths[fqn] = ("optim", "param_groups", 0, key)
        replicated.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
    plans = []
    for rank in range(n):
        items = []
        for key, shape, props, size in sharded:
            rows = shard(shape[0], n, rank)
            if rows is None:
                continue
            offsets = torch.Size((rows[0], *(0 for _ in shape[1:])))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((rows[1], *shape[1:])))
            items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size)))
        plans.append(SavePlan(items + replicated, planner_data=dict(paths)))
    return plans


# -- the ranks' write results -------------------------------------------------------------------------


class Results:
    """Each rank's write results as its writer returns them: ours (``ItemRecord``) and stock (``_StorageInfo``)."""

    def __init__(self, codec: str) -> None:
        self.codec = str(get_codec(codec))
        self.rng = random.Random(0)
        self.float_filter = filter_for(True, 4)
        self.bytes_filter = filter_for(False, 1)
        self._bounds: dict[tuple[str, int, int], tuple[int, int]] = {}
        self.stock_tensor_overhead = _torch_save_overhead()

    def _stored(self, filter_name: str, itemsize: int, raw: int) -> int:
        key = (filter_name, itemsize, raw)
        b = self._bounds.get(key)
        if b is None:
            b = self._bounds[key] = stored_frame_bounds(self.codec, filter_name, itemsize, raw)
        return min(b[1], max(b[0], int(raw * RATIO)))

    def ours(self, items: Iterable[WriteItem], file: str) -> tuple[list[WriteResult], int]:
        """Rank results in the writer's order (bytes items first) and the data file's size."""
        out, offset = [], 0
        ordered = sorted(items, key=lambda it: 0 if it.type == WriteItemType.BYTE_IO else 1)
        for item in ordered:
            if item.type == WriteItemType.BYTE_IO:
                raw, itemsize, fields = GROUP_VALUE_BYTES, 1, {"kind": KIND_BYTES, "filter_name": self.bytes_filter}
            else:
                shape = tuple(item.tensor_data.chunk.sizes)
                raw, itemsize = math.prod(shape) * 4, 4
                fields = {"kind": KIND_TENSOR, "filter_name": self.float_filter, "dtype": "float32",
                          "orig_dtype": "float32", "shape": shape}
            step = DEFAULT_FRAME_SIZE - DEFAULT_FRAME_SIZE % itemsize
            full, last = divmod(raw, step)
            frames = [self._stored(fields["filter_name"], itemsize, step)] * full
            if last or not frames:
                frames.append(self._stored(fields["filter_name"], itemsize, last))
            rec = ItemRecord(version=FORMAT_VERSION, file=file, offset=offset, length=sum(frames), raw_length=raw,
                             codec=self.codec, itemsize=itemsize, frame_size=DEFAULT_FRAME_SIZE,
                             frame_lengths=tuple(frames), frame_sums=tuple(self.rng.getrandbits(64) for _ in frames),
                             checksum=CHECKSUM_ALGORITHM, **fields)
            out.append(WriteResult(index=item.index, size_in_bytes=rec.length, storage_data=rec.to_builtin()))
            offset += rec.length
        return out, offset

    def stock(self, items: Iterable[WriteItem], file: str) -> list[WriteResult]:
        """FileSystemWriter's results (one file per rank, torch.save of each tensor, BytesIO as it is)."""
        out, offset = [], 0
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                length = GROUP_VALUE_BYTES
            else:
                length = math.prod(item.tensor_data.chunk.sizes) * 4 + self.stock_tensor_overhead
            out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(file, offset, length)))
            offset += length
        return out


def _torch_save_overhead() -> int:
    buf = io.BytesIO()
    torch.save(torch.zeros(16), buf)
    return buf.tell() - 64


def gathered(per_rank: Iterable[list[WriteResult]]) -> tuple[list[list[WriteResult]], float, int]:
    """The coordinator's side of DCP's gather: each rank's results pickled (as the rank sends them, not
    timed) and unpickled (timed).  Returns the results, the unpickling CPU seconds and the bytes sent."""
    out, cpu, sent = [], 0.0, 0
    gc.collect()
    for results in per_rank:
        blob = pickle.dumps(results)
        sent += len(blob)
        gc.freeze()  # as in cpu(): each rank's unpickling pays the collections of its own objects
        t0 = time.process_time()
        out.append(pickle.loads(blob))
        cpu += time.process_time() - t0
    return out, cpu, sent


def make_files(root: str, sizes: dict[str, int]) -> None:
    """Sparse data files of the given sizes (what ``finish`` checks)."""
    os.makedirs(root, exist_ok=True)
    for name, size in sizes.items():
        path = os.path.join(root, name)
        with open(path, "ab"):
            pass
        os.truncate(path, size)


# -- timing -----------------------------------------------------------------------------------------


def cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of ``fn()`` (every thread of the process) and its value.

    Collected and frozen out of the collector first (``gc.freeze``): ``fn`` pays the collections its own
    objects cause, not full collections of the benchmark's heap (the plans of every rank) that land on
    whichever step happens to trigger one."""
    gc.collect()
    gc.freeze()
    t0 = time.process_time()
    value = fn()
    return time.process_time() - t0, value


class Best:
    """The least CPU seconds seen per step over the runs."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}

    def add(self, step: str, seconds: float) -> None:
        self.cpu[step] = min(seconds, self.cpu.get(step, math.inf))

    def time(self, step: str, fn: Callable[[], Any]) -> Any:
        seconds, value = cpu(fn)
        self.add(step, seconds)
        return value


class DecodeCounter:
    """Counts the decodes of ``.metadata`` bytes (``metadata_io._decode``, the work behind every
    ``decode_metadata`` the cache does not answer), as tests/test_metadata_decodes.py does."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> Self:
        self.original = metadata_io._decode

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self.original(*args, **kwargs)

        metadata_io._DECODED.clear()
        metadata_io._decode = counted
        return self

    def __exit__(self, *exc: object) -> None:
        metadata_io._decode = self.original


class PlannedSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` whose global plan was made already: the budget decision's own work, timed
    without the second run of DCP's planning it makes."""

    def __init__(self, planned: tuple[list[SavePlan], Metadata]) -> None:
        super().__init__()
        self.planned = planned

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return self.planned


class _Objects:
    """The rank-side planner ``local_item_bytes`` asks for non-tensor values (a param-group value)."""

    @staticmethod
    def lookup_object(index: MetadataIndex) -> Any:
        return 1e-4


def runs_for(records: int, quick: bool) -> int:
    if quick:
        return 1
    return 5 if records < 2_000 else 3 if records < 20_000 else 2 if records < 100_000 else 1


# -- one N ------------------------------------------------------------------------------------------


def run_one(model: Model, layers: int, n: int, base: str, quick: bool) -> dict:
    """Every step at ``n`` ranks for a slice of ``model``; returns the row (CPU seconds, bytes, counts)."""
    t_wall = time.perf_counter()
    plans = local_plans(model, layers, n)
    best = Best()
    runs = runs_for(record_count(model, n, layers), quick)
    for _ in range(runs):
        planned = best.time("dcp_plan", lambda: DefaultSavePlanner().create_global_plan(plans))
    row: dict[str, Any] = {"N": n, "records": sum(len(p.items) for p in planned[0]),
                           "full_records": record_count(model, n)}
    row.update(writers(planned, base, best, runs))
    row.update(budget_decision(plans, planned, n, os.path.join(base, "mem"), best, runs))
    row["cpu"] = dict(best.cpu)
    row["wall_s"] = time.perf_counter() - t_wall
    row["rss_gib"] = peak_rss_gib()
    return row


def writers(planned: tuple[list[SavePlan], Metadata], base: str, best: Best, runs: int) -> dict:
    """CompressedWriter and stock FileSystemWriter on the global plan: prepare_global_plan, the gather of the
    ranks' results, finish, the broadcast Metadata, the committed ``.metadata`` and its open; then TieredWriter."""
    glob, metadata = planned
    row: dict[str, Any] = {}
    ours_dir, stock_dir = os.path.join(base, "ours"), os.path.join(base, "stock")
    os.makedirs(stock_dir)  # what stock's prepare_local_plan does on the ranks
    # each rank's prepare_local_plan gives our plans its data file prefix
    ours_in = [dataclasses.replace(p, storage_data=RankFilePrefix(rank_prefix(i))) for i, p in enumerate(glob)]
    ours, stock = CompressedWriter(ours_dir), FileSystemWriter(stock_dir)
    ours.set_up_storage_writer(True, rank=0)
    stock.set_up_storage_writer(True, rank=0, use_collectives=True)
    results = Results(ours.codec)
    stock_plans = best.time("stock.prepare", lambda: stock.prepare_global_plan(glob))
    ours_plans = best.time("ours.prepare", lambda: ours.prepare_global_plan(ours_in))
    sizes: dict[str, int] = {}

    def ours_rank(plan: SavePlan) -> list[WriteResult]:
        name = data_file(plan.storage_data.prefix)
        out, sizes[name] = results.ours(plan.items, name)
        return out

    ours_results, seconds, row["ours.gather_bytes"] = gathered(ours_rank(p) for p in ours_plans)
    best.add("ours.gather", seconds)
    stock_results, seconds, row["stock.gather_bytes"] = gathered(
        results.stock(p.items, f"{p.storage_data.prefix}0.distcp") for p in stock_plans)
    best.add("stock.gather", seconds)
    make_files(ours_dir, sizes)
    row["refused"] = None
    for run in range(runs):
        if run:  # a fresh claim for each run of ours; stock overwrites
            os.remove(os.path.join(ours_dir, METADATA_FILE))
            best.time("ours.prepare", lambda: ours.prepare_global_plan(ours_in))
            best.time("stock.prepare", lambda: stock.prepare_global_plan(glob))
        finished = {"stock": copy.copy(metadata), "ours": copy.copy(metadata)}
        best.time("stock.finish", functools.partial(stock.finish, finished["stock"], stock_results))
        try:
            best.time("ours.finish", functools.partial(ours.finish, finished["ours"], ours_results))
        except MetadataTooLargeError as exc:
            row["refused"] = str(exc)
            return row
    for who, md in finished.items():  # what DCP broadcasts to every rank after finish: pickled once, unpickled by each
        blob = best.time(f"{who}.bcast_pickle", functools.partial(pickle.dumps, md))
        row[f"{who}.bcast_bytes"] = len(blob)
        received = best.time(f"{who}.bcast_unpickle", functools.partial(pickle.loads, blob))
    copies, leader = node_copies(received, n_ranks=len(glob))  # what a node leader's ranks listed
    for _ in range(runs):  # a node leader of a node-local tier: its view (node copies) and the bytes it commits
        best.time("node_commit", lambda: metadata_io.encode_metadata(
            node_view(received, range(leader, leader + 8), copies)[0]))
    del finished, blob
    row["ours.file_bytes"] = os.path.getsize(os.path.join(ours_dir, METADATA_FILE))
    row["stock.file_bytes"] = os.path.getsize(os.path.join(stock_dir, METADATA_FILE))
    for _ in range(runs):
        best.time("stock.open", lambda: FileSystemReader(stock_dir).read_metadata())
        metadata_io._DECODED.clear()  # a first open in the process
        best.time("ours.open", lambda: CompressedReader(ours_dir).read_metadata())
    metadata_io._DECODED.clear()
    row.update(tiered(planned, ours_results, sizes, os.path.join(base, "tiers"), best, runs))
    return row


def node_copies(received: Metadata, n_ranks: int) -> tuple[list, int]:
    """The node copies the ranks of the second node's directory list for its leader after a save to a
    node-local tier (each replicated item, one chunk covering its tensor or a non-tensor value, copied
    into that leader's node-copies file), and the leader's rank (a rank past the first 8)."""
    sdm, leader = received.state_dict_metadata, min(8, n_ranks - 1)
    plain = record_table.PackedRecords(sdm, received.storage_data.packed)
    copies = []
    for fqn, entry in sdm.items():
        if not hasattr(entry, "chunks") or (len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.size):
            index = MetadataIndex(fqn, entry.chunks[0].offsets if hasattr(entry, "chunks") else None)
            if index in plain:
                copies.append((index, {**plain[index], "file": data_file(node_copies_prefix(rank_prefix(leader)))}))
    return copies, leader


def tiered(planned: tuple[list[SavePlan], Metadata], results: list[list[WriteResult]], sizes: dict[str, int],
           root: str, best: Best, runs: int) -> dict:
    """TieredWriter's coordinator: prepare_global_plan and finish (with its retention job) on a shared tier
    in a local directory, then how many decodes one restore of the committed step runs."""
    glob, metadata = planned
    tier = Tier(name="shared", url=root, kind="storage")
    step_dir = os.path.join(root, STEP)
    writer = TieredWriter([tier], due=["shared"])
    writer.reset(STEP)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    out: dict[str, Any] = {}
    try:
        for run in range(runs):
            if run:
                os.remove(os.path.join(step_dir, METADATA_FILE))
            plans = best.time("tiered.prepare", lambda: writer.prepare_global_plan(glob))
            # rank 0's write_data with no items: it builds the rank's inner writer and its (empty) data
            # file, which then gets the size its records say, like every other rank's
            writer.write_data(dataclasses.replace(plans[0], items=[]), None).wait()  # type: ignore[arg-type]
            make_files(step_dir, sizes)
            # the retention job finish queues is part of the coordinator's finish
            best.time("tiered.finish", functools.partial(_finish_and_wait, writer, copy.copy(metadata), results))
    finally:
        writer.close()
    ckpt = TieredCheckpointer([tier])
    try:
        with DecodeCounter() as counter:
            restored = best.time("restore_open", lambda: ckpt.restore({}))
        out["restore_decodes"] = counter.count
        out["restored_step"] = restored
    finally:
        ckpt.close()
    metadata_io._DECODED.clear()
    return out


def _finish_and_wait(writer: TieredWriter, metadata: Metadata, results: list[list[WriteResult]]) -> None:
    writer.finish(metadata, results)
    writer.wait()


def budget_decision(plans: list[SavePlan], planned: tuple[list[SavePlan], Metadata], n: int, root: str, best: Best,
                    runs: int) -> dict:
    """The memory-tier budget check's coordinator decision over the N gathered plans and sizes, without the
    global plan it makes with DCP's planner (``planned``: made already; step 1 times it)."""
    os.makedirs(root, exist_ok=True)
    tier = Tier(name="mem", url=root, kind="storage", memory_budget=1 << 60)
    sizes = [budget.local_item_bytes(p, _Objects, None, None) for p in plans]  # each rank's, not timed
    gathered_plans = [(p, s, None) for p, s in zip(plans, sizes)]
    promoter = Promoter([tier], rank=0, node=0, is_coordinator=True)
    try:
        for _ in range(runs):
            answer = best.time("budget", lambda: budget._coordinator_answer(
                tier, gathered_plans, STEP, planner=PlannedSavePlanner(planned), promoter=promoter, frame_size=None,
                rank=0, world=n))
    finally:
        promoter.close()
    return {"budget_answer": "fits" if answer is None else type(answer).__name__ if not isinstance(answer, str) else answer}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


# -- growth and the report ---------------------------------------------------------------------------


def slopes(ns: list[int], values: list[float]) -> tuple[list[float], float]:
    """Slopes of log(value) over log(N) between successive N, and the least-squares slope over all."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v > 0]
    succ = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(pts)]
    if len(pts) < 2:
        return succ, math.nan
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return succ, sum((p[0] - mx) * (p[1] - my) for p in pts) / den


#: (column, our step, stock's step or None, bar on ours/stock CPU or None)
CPU_STEPS = (
    ("prepare_global_plan", "ours.prepare", "stock.prepare", None),
    ("results gather", "ours.gather", "stock.gather", None),
    ("finish", "ours.finish", "stock.finish", 1.2),
    ("broadcast pickle", "ours.bcast_pickle", "stock.bcast_pickle", None),
    ("broadcast unpickle (each rank)", "ours.bcast_unpickle", "stock.bcast_unpickle", None),
    ("open .metadata", "ours.open", "stock.open", 1.2),
    ("TieredWriter prepare_global_plan", "tiered.prepare", "stock.prepare", None),
    ("TieredWriter finish + retention", "tiered.finish", "stock.finish", 1.2),
    ("budget decision (less DCP planning)", "budget", None, None),
    ("node leader's commit (view + encode)", "node_commit", None, None),
    ("restore of no items (list, agree, open)", "restore_open", None, None),
)
EXPONENT_BAR = 1.1
BYTES_BAR = 1.0
#: Growth is judged over the issue's range, from this N up (fixed costs at small N flatten a fit over all N).
GROWTH_FROM = 512


def ratio(row: dict, ours: str, stock: str | None) -> float | None:
    c = row["cpu"]
    if stock is None or ours not in c or stock not in c or c[stock] <= 0:
        return None
    return c[ours] / c[stock]


def _cell(row: dict, ours: str, stock: str | None) -> str:
    c = row["cpu"]
    if ours not in c:
        return "refused" if row.get("refused") else "—"
    r = ratio(row, ours, stock)
    return f"{c[ours]:.3g} s" + ("" if r is None else f" ({r:.2f}x)")


def exponents(rows: list[dict]) -> dict[str, dict]:
    """Per step (ours, DCP's planning and stock's): successive and overall slopes over the rows that have it."""
    out = {}
    steps = {"dcp_plan"} | {s for _c, o, st, _b in CPU_STEPS for s in (o, st) if s}
    for step in sorted(steps):
        pts = [(r["N"], r["cpu"][step]) for r in rows if step in r["cpu"]]
        if len(pts) >= 2:
            succ, overall = slopes([p[0] for p in pts], [p[1] for p in pts])
            top = [p for p in pts if p[0] >= GROWTH_FROM]
            upper = slopes([p[0] for p in top], [p[1] for p in top])[1] if len(top) >= 2 else math.nan
            out[step] = {"ns": [p[0] for p in pts], "successive": succ, "overall": overall, "upper": upper}
    return out


def bars(model: Model, rows: list[dict], exps: dict[str, dict]) -> list[list[str]]:
    """The issue's bars: growth of our steps, finish and open CPU against stock's, broadcast bytes."""
    out = []
    for col, ours, stock, bar in CPU_STEPS:
        e = exps.get(ours)
        if e is not None:
            top = e["successive"][-1] if e["successive"] else math.nan
            judged = e["upper"] if not math.isnan(e.get("upper", math.nan)) else e["overall"]
            verdict = "met" if judged <= EXPONENT_BAR else f"**missed: N^{judged:.2f} from N={GROWTH_FROM}**"
            measured = f"N^{judged:.2f} from N={GROWTH_FROM}, N^{e['overall']:.2f} overall, N^{top:.2f} at the top"
            out.append([model.name, f"{col}: growth ≤ N^{EXPONENT_BAR}", measured, verdict])
        if bar is not None:
            rs = [(r["N"], ratio(r, ours, stock)) for r in rows]
            out += _ratio_bar(model, f"{col}: CPU ≤ {bar}x stock", [(n, x) for n, x in rs if x is not None], bar)
    rs = [(r["N"], r["ours.bcast_bytes"] / r["stock.bcast_bytes"]) for r in rows if "ours.bcast_bytes" in r]
    out += _ratio_bar(model, f"broadcast Metadata bytes ≤ {BYTES_BAR}x stock", rs, BYTES_BAR)
    e = exps.get("dcp_plan")
    if e is not None:
        out.append([model.name, "DCP's own global planning (DCP's code: no bar)",
                    f"N^{e['overall']:.2f} overall, N^{e['successive'][-1]:.2f} at the top", "—"])
    refused = [r["N"] for r in rows if r.get("refused")]
    if refused:
        out.append([model.name, "finish commits", f"refused at N={refused}", "**refused**"])
    full = [r["N"] for r in rows if full_verdict(r).startswith("refused")]
    limit = _first_refused_n(model)
    out.append([model.name, "the full model's save commits (within the readers' limits)",
                f"refused from about N={limit:,} (at N={full})" if full else "fits at every N",
                f"**refused from N≈{limit:,}** (before the commit, MetadataTooLargeError)" if full else "met"])
    return out


def _first_refused_n(model: Model) -> int:
    """The smallest N at which the full model's records pass the readers' record limit (bisected)."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi) // 2
        if record_count(model, mid) > MAX_METADATA_RECORDS:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _ratio_bar(model: Model, what: str, by_n: list[tuple[int, float]], bar: float) -> list[list[str]]:
    """A bar on ours ÷ stock: the worst N and the largest N."""
    if not by_n:
        return []
    n, worst = max(by_n, key=lambda t: t[1])
    top_n, top = by_n[-1]
    verdict = "met" if worst <= bar else f"**missed: {worst:.2f}x stock (N={n})**"
    return [[model.name, what, f"worst {worst:.2f}x (N={n}), {top:.2f}x at N={top_n}", verdict]]


def _per_record(row: dict, key: str) -> str:
    """Bytes per record of ``key``, ours / stock (ours ÷ stock)."""
    if f"ours.{key}" not in row:
        return "refused"
    ours, stock, n = row[f"ours.{key}"], row[f"stock.{key}"], row["records"]
    return f"{ours / n:.0f} / {stock / n:.0f} ({ours / stock:.2f}x)"


def model_section(model: Model, layers: int, rows: list[dict], exps: dict[str, dict]) -> str:
    ours_steps = ("dcp_plan", *(o for _c, o, _s, _b in CPU_STEPS))
    stock_steps = (None, *(s for _c, _o, s, _b in CPU_STEPS))
    cpu_rows = [[r["N"], f"{r['records']:,}", f"{r['cpu']['dcp_plan']:.3g} s", *(_cell(r, o, s) for _c, o, s, _b in CPU_STEPS)]
                for r in rows]
    overall = lambda step: f"{exps[step]['overall']:.2f}" if step in exps else "—"
    cpu_rows.append(["exponent (overall)", "", *(overall(s) for s in ours_steps)])
    cpu_rows.append(["stock's exponent", "", "", *(overall(s) if s else "—" for s in stock_steps[1:])])
    ns = [r["N"] for r in rows]
    succ, total = slopes(ns, [r["records"] for r in rows])
    growth_rows = [["records (of the slice)", *(f"{x:.2f}" for x in succ), f"{total:.2f}"]]
    for (col, ours, stock, _b) in (("DCP planning (DCP's)", "dcp_plan", None, None), *CPU_STEPS):
        for who, step in (("ours", ours), ("stock", stock)):
            e = exps.get(step) if step else None
            if e is None or (who == "stock" and col.startswith("TieredWriter")):
                continue
            by_n = dict(zip(e["ns"][1:], e["successive"]))
            growth_rows.append([col if who == "ours" else f"{col}, stock", *(f"{by_n[n]:.2f}" if n in by_n else "—"
                                                                            for n in ns[1:]), f"{e['overall']:.2f}"])
    byte_rows = []
    for r in rows:
        byte_rows.append([r["N"], f"{r['records']:,}", *(_per_record(r, k) for k in ("gather_bytes", "bcast_bytes", "file_bytes")),
                          r.get("restore_decodes", "—"), r.get("budget_answer", "—"), f"{r['full_records']:,}",
                          full_verdict(r)])
    return (
        f"### {model.name}: {layers} of {model.layers} decoder layers (+ embedding, norm, lm_head)\n\n"
        "CPU seconds of this library's step at each N and, in brackets, ours ÷ stock's CPU on the same plans "
        "(the TieredWriter columns against stock `FileSystemWriter`'s same step); the exponent rows are the "
        "least-squares slopes of log(CPU) over log(N):\n\n"
        + md_table(["N", "records", "DCP planning (DCP's)", *(c for c, *_ in CPU_STEPS)], cpu_rows)
        + "\n\nGrowth exponent between each N and the one before it (slope of log(CPU) over log(N)), and over "
        "all N; the first row is the records' own (they grow like N until N passes a tensor's rows, then "
        "slower):\n\n"
        + md_table(["step", *(f"→{n}" for n in ns[1:]), "overall"], growth_rows)
        + "\n\nBytes per record, ours / stock (ours ÷ stock): the write results the ranks send the coordinator, "
        "the `Metadata` DCP broadcasts to every rank after `finish`, the committed `.metadata`; decodes of "
        "`.metadata` in one `TieredCheckpointer.restore`; the budget decision's answer; the full model's "
        f"records at that N against the readers' limits ({MAX_METADATA_RECORDS:,} records, "
        f"{MAX_METADATA_BYTES >> 20} MiB; bytes projected from the slice's bytes per record):\n\n"
        + md_table(["N", "records", "results gathered", "broadcast Metadata", ".metadata file", "decodes per restore",
                    "budget decision", "full model records", "full model: our finish"], byte_rows)
    )


def full_verdict(row: dict) -> str:
    """Whether our finish would refuse the full model at this N: its record count, and its ``.metadata``
    bytes projected from the slice's bytes per record (a projection, marked so)."""
    full = row["full_records"]
    if full > MAX_METADATA_RECORDS:
        return f"refused ({full:,} records > {MAX_METADATA_RECORDS:,})"
    if "ours.file_bytes" in row:
        projected = row["ours.file_bytes"] / row["records"] * full
        if projected > MAX_METADATA_BYTES:
            return f"refused (projected {projected / (1 << 20):.0f} MiB)"
        return f"fits (projected {projected / (1 << 20):.0f} MiB)"
    return "—"


def write_doc(cmd: str, models: list[tuple[Model, list[dict], dict]], layers: int, wall: float, rss: float) -> None:
    save_results("scale", {"layers": layers, "wall_s": wall, "peak_rss_gib": rss,
                           "models": {m.name: {"rows": rows, "exponents": exps} for m, rows, exps in models}})
    bar_rows = [b for m, rows, exps in models for b in bars(m, rows, exps)]
    body = (
        "## The coordinator at 8 to 16,384 ranks\n\n"
        f"`{cmd}` — {machine_line()}; the run took {wall:.0f} s, peak RSS {rss:.2f} GiB.\n\n"
        "One process plays the coordinator of an FSDP2 job (each parameter and Adam's two moments `Shard(0)` "
        "over N ranks, a replicated `step` per parameter, the param group's values as BYTE_IO items on every "
        "rank), with DCP's own plan types, and runs this library's coordinator code next to stock DCP's on the "
        "same plans: CPU seconds (`time.process_time`, best of up to 5 runs where short; each step starts after "
        "a collection, with older objects frozen out of the collector, so it pays the collections of its own "
        "objects only), ratios from one process. DCP's own global planning (`create_global_plan` with dedup) is DCP's, shown apart; the budget "
        "decision runs it once more inside, which its column leaves out (its whole cost adds the planning column). "
        "Frames are `DEFAULT_FRAME_SIZE`, stored at 0.8x raw. The records "
        "are the slice's; the last columns count the full model's. See `benchmarks/bench_scale.py` for each "
        "step.\n\n"
        "Against the bars of issue 22 (our steps grow at most like N^1.1, fitted from N=512; `finish` and open at "
        "most 1.2x stock's CPU; the broadcast `Metadata` at most stock's bytes; the full model's save within the "
        "readers' limits):\n\n"
        + md_table(["model", "bar", "measured", "verdict"], bar_rows)
        + "\n\n" + "\n\n".join(model_section(m, layers, rows, exps) for m, rows, exps in models))
    write_section("scale", body)


def run(models: list[str], ranks: list[int], layers: int, quick: bool, cmd: str) -> dict:
    """Every model at every N; prints each row, writes the section; returns the results."""
    t0 = time.perf_counter()
    done = []
    for key in models:
        model = MODELS[key]
        rows = []
        for n in ranks:
            base = tempfile.mkdtemp(prefix="dcp_tiered_scale_")
            try:
                row = run_one(model, layers, n, base, quick)
            finally:
                shutil.rmtree(base, ignore_errors=True)
                if not quick:  # back to the collector: whatever cycles this N left (a full pass, seconds at scale)
                    gc.unfreeze()
                    gc.collect()
            rows.append(row)
            c = row["cpu"]
            print(f"{model.name} N={n:6d} records={row['records']:8d}  dcp plan {c['dcp_plan']:.3f}s  "
                  + "  ".join(f"{col} {_cell(row, o, s)}" for col, o, s, _b in CPU_STEPS)
                  + f"  bcast {row.get('ours.bcast_bytes', 0) / max(1, row.get('stock.bcast_bytes', 1)):.2f}x"
                  + f"  decodes {row.get('restore_decodes', '-')}  refused {bool(row['refused'])}"
                  + f"  [{row['wall_s']:.0f} s, peak {row['rss_gib']:.2f} GiB]", flush=True)
        done.append((model, rows, exponents(rows)))
    wall, rss = time.perf_counter() - t0, peak_rss_gib()
    write_doc(cmd, done, layers, wall, rss)
    for m, rows, exps in done:
        for b in bars(m, rows, exps):
            print(" | ".join(b))
    return {"models": {m.name: {"rows": rows, "exponents": exps} for m, rows, exps in done}, "wall_s": wall,
            "peak_rss_gib": rss}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="7b,70b", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)), help="comma-separated N")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers in the slice (plus embedding, norm, lm_head)")
    ap.add_argument("--quick", action="store_true", help="smoke run: N=8,16, one layer, one run per step")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.layers = "8,16", 1
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    ranks = [int(x) for x in args.ranks.split(",")]
    # the command as given: the options that differ from the defaults
    cmd = ".venv/bin/python -m benchmarks.bench_scale" + (" --quick" if args.quick else "")
    for flag, value in (("--models", args.models), ("--ranks", None if args.quick else args.ranks),
                        ("--layers", None if args.quick else args.layers)):
        if value is not None and value != ap.get_default(flag.lstrip("-")):
            cmd += f" {flag} {value}"
    return run(models, ranks, args.layers, args.quick, cmd)


if __name__ == "__main__":
    main()
