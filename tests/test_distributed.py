"""Multi-rank DCP save/load through ``CompressedWriter``/``CompressedReader`` with gloo.

Spawning ranks is the expensive part, so each world size is spawned once (a module-scoped
fixture) and runs several checks; every check records ``ok`` or its traceback per rank,
and one parametrized test per check reads those records.  Loads on a single process
(``no_dist=True``, plain full tensors: resharding N ranks -> 1) run in the pytest process.

Layouts: sharded tensors are ``DTensor``s (``distribute_tensor``) on a 1-D CPU mesh,
``Shard(0)``, ``Shard(1)`` (and ``Shard(2)`` for a 3-D tensor), with shapes that do not
divide evenly by 2 or 4.  Loading with another shard dimension (or on another world size)
makes reads partial reads of stored chunks, and the ``Shard(0)`` -> ``Shard(1)`` swaps make
those reads non-contiguous.  Each rank also saves a key of its own, and replicated plain
tensors of every dtype (0-d, empty, non-contiguous views), ints, strings, nested dicts.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gloo_ranks import read_records, record, run_ranks_recording
from tensor_values import hard_values
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_tiered import (
    CheckpointExistsError,
    CompressedReader,
    CompressedWriter,
    DowncastSavePlanner,
)

CODECS = ["none", "lz4", "zstd", "zstd:3"]
FRAME = 4096  # smallest allowed frame: small tensors still span many frames
SPAWN_TIMEOUT = 300.0  # seconds; a hung collective fails the tests instead of hanging them

# Frame sizes of the 4-rank saves: not all powers of two nor multiples of every item size.
FRAMES_WS4 = {"none": 4096, "lz4": 4099, "zstd": 5000, "zstd:3": 6144}

# name -> (dtype, shape, shard dim in the "saved" layout); the "swapped" layout shards
# dimension (d + 1) % ndim instead.
SHARDED = {
    "f32_big": (torch.float32, (513, 130), 0),  # ~260 KiB: ~65 frames
    "f32_row": (torch.float32, (67, 45), 0),
    "f32_col": (torch.float32, (67, 45), 1),
    "bf16_col": (torch.bfloat16, (67, 45), 1),
    "f16_row": (torch.float16, (67, 45), 0),
    "f64_col": (torch.float64, (67, 45), 1),
    "i64_row": (torch.int64, (67, 45), 0),
    "i32_col": (torch.int32, (67, 45), 1),
    "bool_row": (torch.bool, (67, 45), 0),
    "f32_3d": (torch.float32, (7, 19, 23), 1),
    "tiny_row": (torch.float32, (3, 5), 0),  # 4 ranks: the last rank's shard is empty
    "tiny_col": (torch.bfloat16, (5, 3), 1),
}


def shard_dim(name: str, swapped: bool) -> int:
    _, shape, d = SHARDED[name]
    return (d + 1) % len(shape) if swapped else d


def own_state(rank: int) -> dict[str, torch.Tensor]:
    """A key only this rank saves (its items live only in this rank's data file)."""
    return {f"r{rank}": hard_values(torch.float32, (1500 + rank,), 900 + rank)}


# -- deterministic data (identical in every process) ------------------------------------


def full_sharded() -> dict[str, torch.Tensor]:
    return {name: hard_values(dt, shape, 100 + i) for i, (name, (dt, shape, _)) in enumerate(SHARDED.items())}


def plain_state() -> dict:
    """Replicated (identical on every rank) tensors and non-tensor values, nested."""
    base = hard_values(torch.float32, (12, 20), 7)
    return {
        "plain": {
            "f32": hard_values(torch.float32, (3000,), 1),
            "f16": hard_values(torch.float16, (2049,), 2),
            "bf16": hard_values(torch.bfloat16, (2051,), 3),
            "f64": hard_values(torch.float64, (700,), 4),
            "i64": hard_values(torch.int64, (999,), 5),
            "i16": hard_values(torch.int16, (1001,), 6),
            "u8": torch.arange(5000, dtype=torch.int64).remainder(251).to(torch.uint8),
            "bool": hard_values(torch.bool, (4097,), 8),
            "scalar_f32": torch.tensor(-2.5),
            "scalar_i64": torch.tensor(2**40 + 3),
            "scalar_bool": torch.tensor(True),
            "empty": torch.empty(0, 5),
            "empty_1d": torch.empty(0, dtype=torch.int32),
            "nc_t": base.t(),
            "nc_step": base[:, ::3],
            "nc_slice": base[2:9, 4:17],
            "list": [hard_values(torch.float32, (40,), 9), hard_values(torch.int32, (3, 3), 10)],
        },
        "meta": {"step": 42, "name": "run-\u00e9\u4e2d", "nested": {"lr": 3e-4, "betas": [0.9, 0.999], "flag": True}},
        "epoch": 7,
    }


def plain_template() -> tuple[dict, dict[str, torch.Tensor]]:
    """A load destination shaped like :func:`plain_state`, zero-filled; non-contiguous
    entries are views of zero bases (returned too, to check the load wrote through)."""
    ref = plain_state()
    bases = {"nc": torch.zeros(12, 20)}
    plain = {}
    for k, v in ref["plain"].items():
        if k == "list":
            plain[k] = [torch.zeros_like(x) for x in v]
        elif not k.startswith("nc_"):
            plain[k] = torch.zeros_like(v)
    plain["nc_t"] = bases["nc"].t()
    # two views of one base would alias; give each its own base
    bases["nc_step"] = torch.zeros(12, 20)
    bases["nc_slice"] = torch.zeros(12, 20)
    plain["nc_step"] = bases["nc_step"][:, ::3]
    plain["nc_slice"] = bases["nc_slice"][2:9, 4:17]
    tmpl = {
        "plain": plain,
        "meta": {"step": None, "name": None, "nested": {"lr": None, "betas": None, "flag": None}},
        "epoch": None,
    }
    return tmpl, bases


# -- comparison ----------------------------------------------------------------------------

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_diff(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` equals ``want`` exactly (dtype, shape and every bit)."""
    if not isinstance(got, torch.Tensor):
        return f"{name}: got {type(got).__name__}, want a tensor"
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{name}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    a, b = got.detach().contiguous(), want.detach().contiguous()
    if a.dtype.is_floating_point:
        a, b = a.view(_INT_OF[a.element_size()]), b.view(_INT_OF[b.element_size()])
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        return f"{name}: {len(bad)} of {a.numel()} elements differ, first at {bad[0].tolist()}"
    return None


def plain_diffs(got: dict, bases: dict[str, torch.Tensor]) -> list[str]:
    want = plain_state()
    errs = []
    for k, v in want["plain"].items():
        if k == "list":
            for i, (g, w) in enumerate(zip(got["plain"][k], v)):
                errs.append(tensor_diff(f"plain.list.{i}", g, w))
        else:
            errs.append(tensor_diff(f"plain.{k}", got["plain"][k], v))
    # the non-contiguous destinations were written in place, through the views
    errs.append(tensor_diff("base of plain.nc_t", bases["nc"], want["plain"]["nc_t"].t()))
    wb = torch.zeros(12, 20)
    wb[:, ::3] = want["plain"]["nc_step"]
    errs.append(tensor_diff("base of plain.nc_step", bases["nc_step"], wb))
    wb = torch.zeros(12, 20)
    wb[2:9, 4:17] = want["plain"]["nc_slice"]
    errs.append(tensor_diff("base of plain.nc_slice", bases["nc_slice"], wb))
    for path in (("meta",), ("epoch",)):
        g, w = got[path[0]], want[path[0]]
        if g != w or type(g) is not type(w):
            errs.append(f"{path[0]}: got {g!r}, want {w!r}")
    return [e for e in errs if e]


def check_equal(errs: list[str]) -> None:
    if errs:
        raise AssertionError("loaded state differs from the saved state:\n  " + "\n  ".join(errs))


# -- process spawning --------------------------------------------------------------------------


# -- code that runs on every rank ---------------------------------------------------------------


def _mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def _sharded_state(mesh, swapped: bool) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = full_sharded()
    return {name: distribute_tensor(full[name].clone(), mesh, [Shard(shard_dim(name, swapped))]) for name in SHARDED}


def _sharded_template(mesh, swapped: bool) -> dict:
    from torch.distributed.tensor import Shard, zeros

    return {
        name: zeros(shape, dtype=dt, device_mesh=mesh, placements=[Shard(shard_dim(name, swapped))])
        for name, (dt, shape, _) in SHARDED.items()
    }


def _sharded_diffs(got: dict, rank: int, world_size: int, swapped: bool) -> list[str]:
    """Compare each rank's local shard with the same rows/columns of the full tensor (no collectives)."""
    from torch.distributed.tensor import DTensor, Shard

    full = full_sharded()
    errs = []
    for name in SHARDED:
        dim = shard_dim(name, swapped)
        t = got[name]
        if not isinstance(t, DTensor) or tuple(t.placements) != (Shard(dim),):
            errs.append(f"{name}: destination is no longer a DTensor sharded on dim {dim}: {type(t).__name__}")
            continue
        chunks = torch.chunk(full[name], world_size, dim)  # DTensor's Shard splits like torch.chunk
        want = chunks[rank] if rank < len(chunks) else full[name].narrow(dim, full[name].shape[dim], 0)
        errs.append(tensor_diff(f"{name} (rank {rank} shard)", t.to_local(), want))
        if tuple(t.shape) != tuple(full[name].shape):
            errs.append(f"{name}: global shape {tuple(t.shape)}, want {tuple(full[name].shape)}")
    return [e for e in errs if e]


def _full_state(mesh, swapped: bool = False) -> dict:
    sd = plain_state()
    sd["dt"] = _sharded_state(mesh, swapped)
    sd["own"] = own_state(dist.get_rank())
    return sd


def _load_and_compare(path: Path, mesh, rank: int, world_size: int, swapped: bool) -> None:
    tmpl, bases = plain_template()
    tmpl["dt"] = _sharded_template(mesh, swapped)
    dcp.load(tmpl, storage_reader=CompressedReader(path))
    check_equal(plain_diffs(tmpl, bases) + _sharded_diffs(tmpl["dt"], rank, world_size, swapped))


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """What a bf16 round trip leaves of ``t`` (wider floats only; others untouched)."""
    return t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() and t.element_size() > 2 else t


def _downcast_check(root: Path, mesh, rank: int, world_size: int, save: bool, swapped: bool) -> None:
    """Sharded save through DowncastSavePlanner(bf16) on 2 ranks; loads (resharded) give the
    original dtypes with bf16-rounded values."""
    path = root / "ws2_downcast"
    if save:
        planner = DowncastSavePlanner(torch.bfloat16)
        dcp.save({"dt": _sharded_state(mesh, False)}, storage_writer=CompressedWriter(path, codec="zstd", frame_size=FRAME),
                 planner=planner)
        wide = {f"dt.{n}" for n, (dt, _, _) in SHARDED.items() if dt.is_floating_point and dt.itemsize > 2}
        assert wide <= set(planner.report.downcast), (wide, planner.report.downcast)
    tmpl = {"dt": _sharded_template(mesh, swapped)}
    dcp.load(tmpl, storage_reader=CompressedReader(path))
    full = full_sharded()
    errs = []
    for name, (dtype, _, _) in SHARDED.items():
        dim = shard_dim(name, swapped)
        got = tmpl["dt"][name].to_local()
        chunks = torch.chunk(_rounded(full[name]), world_size, dim)
        want = chunks[rank] if rank < len(chunks) else full[name].narrow(dim, full[name].shape[dim], 0)
        if got.dtype != dtype:
            errs.append(f"{name}: loaded as {got.dtype}, saved as {dtype}")
        errs.append(tensor_diff(f"{name} (rank {rank}, downcast)", got, want))
    check_equal([e for e in errs if e])


def _scramble_(sd: dict) -> None:
    """Overwrite every tensor of ``sd`` in place (DTensors through their local shard)."""
    from torch.distributed.tensor import DTensor

    def visit(x):
        if isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, list):
            for v in x:
                visit(v)
        elif isinstance(x, torch.Tensor):
            t = x.to_local() if isinstance(x, DTensor) else x
            with torch.no_grad():
                t.fill_(True if t.dtype == torch.bool else 7)

    visit(sd)


def _async_check(root: Path, name: str, mesh, rank: int, world_size: int, mode) -> None:
    path = root / name
    sd = _full_state(mesh)
    writer = CompressedWriter(path, codec="zstd", frame_size=FRAME)
    fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=mode)
    _scramble_(sd)  # training goes on at once: the saved values must be the ones at the call
    fut.result()
    _load_and_compare(path, mesh, rank, world_size, swapped=False)


def _overwrite_check(root: Path, mesh, rank: int, world_size: int) -> None:
    path = root / "ws2_overwrite"
    first = {"x": torch.full((1000,), 1.0), "dt": _sharded_state(mesh, swapped=False)}
    dcp.save(first, storage_writer=CompressedWriter(path, codec="lz4", frame_size=FRAME))
    try:
        dcp.save(first, storage_writer=CompressedWriter(path, codec="lz4", frame_size=FRAME))
    except CheckpointException as exc:
        errors = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        assert errors and all(isinstance(e, CheckpointExistsError) for e in errors), exc.failures
    else:
        raise AssertionError("saving over a committed checkpoint without overwrite=True did not fail")
    _load_and_compare_overwrite(path, mesh, rank, world_size, 1.0, swapped=False)
    second = {"x": torch.full((1000,), 2.0), "dt": _sharded_state(mesh, swapped=True)}
    dcp.save(second, storage_writer=CompressedWriter(path, codec="zstd", frame_size=FRAME, overwrite=True))
    _load_and_compare_overwrite(path, mesh, rank, world_size, 2.0, swapped=False)


def _load_and_compare_overwrite(path: Path, mesh, rank: int, world_size: int, x: float, swapped: bool) -> None:
    tmpl = {"x": torch.zeros(1000), "dt": _sharded_template(mesh, swapped)}
    dcp.load(tmpl, storage_reader=CompressedReader(path))
    check_equal([e for e in [tensor_diff("x", tmpl["x"], torch.full((1000,), x))] if e]
                + _sharded_diffs(tmpl["dt"], rank, world_size, swapped))


def _no_collectives_check(root: Path, mesh, rank: int, world_size: int) -> None:
    """``dcp.save(..., use_collectives=False)``: every rank plans, writes and finishes alone.

    Acceptable outcomes: every rank refuses with this package's error, or the checkpoint
    loads back equal.  Not acceptable: "success" with a checkpoint that lost ranks' data.
    """
    from dcp_tiered import DcpTieredError

    path = root / "ws2_no_collectives"
    sd = _full_state(mesh)
    # DCP ends this mode with a barrier; on its own group with a short timeout, so that a rank
    # that failed before it cannot leave the other rank waiting on the default group.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=scaled(20)))
    try:
        dcp.save(sd, storage_writer=CompressedWriter(path, codec="zstd", frame_size=FRAME),
                 process_group=group, use_collectives=False)
        outcome = "saved"
    except CheckpointException as exc:
        errors = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        outcome = "refused" if errors and all(isinstance(e, DcpTieredError) for e in errors) else repr(exc)
    except DcpTieredError:
        outcome = "refused"
    except BaseException as exc:  # noqa: BLE001 - reported below, after the ranks met again
        outcome = f"{type(exc).__name__}: {exc}"
    outcomes: list = [None] * world_size
    dist.all_gather_object(outcomes, outcome)
    assert len(set(outcomes)) == 1 and outcomes[0] in ("saved", "refused"), f"outcome per rank: {outcomes}"
    if outcomes[0] == "saved":
        _load_and_compare(path, mesh, rank, world_size, swapped=False)


WS2_CHECKS = (
    [f"save_load[{c}]" for c in CODECS]
    + [f"reshard_swapped[{c}]" for c in CODECS]
    + ["async_thread", "async_process", "overwrite", "downcast_bf16", "use_collectives_false"]
)


def _ws2_worker(rank: int, world_size: int, root: str, out: str) -> None:
    root_p, out_p = Path(root), Path(out)
    mesh = _mesh(world_size)
    for codec in CODECS:
        path = root_p / f"ws2_{codec}"

        def save_load(path=path, codec=codec):
            dcp.save(_full_state(mesh), storage_writer=CompressedWriter(path, codec=codec, frame_size=FRAME))
            _load_and_compare(path, mesh, rank, world_size, swapped=False)

        record(out_p, f"save_load[{codec}]", rank, save_load)
        record(out_p, f"reshard_swapped[{codec}]", rank,
                lambda path=path: _load_and_compare(path, mesh, rank, world_size, swapped=True))
    record(out_p, "async_thread", rank,
            lambda: _async_check(root_p, "ws2_async_thread", mesh, rank, world_size, AsyncCheckpointerType.THREAD))
    record(out_p, "async_process", rank,
            lambda: _async_check(root_p, "ws2_async_process", mesh, rank, world_size, AsyncCheckpointerType.PROCESS))
    record(out_p, "overwrite", rank, lambda: _overwrite_check(root_p, mesh, rank, world_size))
    record(out_p, "downcast_bf16", rank, lambda: _downcast_check(root_p, mesh, rank, world_size, True, True))
    # last: if this mode misbehaves the ranks may leave DCP's closing barrier unmatched
    record(out_p, "use_collectives_false", rank, lambda: _no_collectives_check(root_p, mesh, rank, world_size))


WS4_CHECKS = (
    [f"load_ws2_same_layout[{c}]" for c in CODECS]
    + [f"load_ws2_swapped[{c}]" for c in CODECS]
    + [f"save_load[{c}]" for c in CODECS]
    + ["async_thread", "load_ws2_downcast"]
)


def _ws4_worker(rank: int, world_size: int, root: str, out: str) -> None:
    root_p, out_p = Path(root), Path(out)
    mesh = _mesh(world_size)
    for codec in CODECS:
        src = root_p / f"ws2_{codec}"
        record(out_p, f"load_ws2_same_layout[{codec}]", rank,
                lambda src=src: _load_and_compare(src, mesh, rank, world_size, swapped=False))
        record(out_p, f"load_ws2_swapped[{codec}]", rank,
                lambda src=src: _load_and_compare(src, mesh, rank, world_size, swapped=True))
        path = root_p / f"ws4_{codec}"

        def save_load(path=path, codec=codec):
            # Saved with the swapped layout (Shard(1) where ws2 used Shard(0)), loaded back
            # with the other one: 4-way non-contiguous partial reads.
            writer = CompressedWriter(path, codec=codec, frame_size=FRAMES_WS4[codec])
            dcp.save(_full_state(mesh, swapped=True), storage_writer=writer)
            _load_and_compare(path, mesh, rank, world_size, swapped=False)

        record(out_p, f"save_load[{codec}]", rank, save_load)
    record(out_p, "async_thread", rank,
            lambda: _async_check(root_p, "ws4_async_thread", mesh, rank, world_size, AsyncCheckpointerType.THREAD))
    record(out_p, "load_ws2_downcast", rank, lambda: _downcast_check(root_p, mesh, rank, world_size, False, False))


# -- fixtures: one spawn per world size ------------------------------------------------------------


def _spawn_checks(worker, world_size: int, root: Path) -> tuple[Path, str | None]:
    return run_ranks_recording(worker, world_size, root, str(root), root / f"records_ws{world_size}", timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def ws2(root: Path) -> tuple[Path, str | None]:
    return _spawn_checks(_ws2_worker, 2, root)


@pytest.fixture(scope="module")
def ws4(root: Path, ws2) -> tuple[Path, str | None]:
    return _spawn_checks(_ws4_worker, 4, root)


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("check", WS2_CHECKS)
def test_two_ranks(ws2, check: str) -> None:
    """2 gloo ranks: save/load per codec, resharded Shard(0)<->Shard(1) load, async thread and
    process saves (with tensors scrambled right after the call), overwrite protocol,
    ``use_collectives=False`` (must refuse on every rank or load back equal)."""
    read_records(ws2[0], check, 2, ws2[1])


@pytest.mark.parametrize("check", WS4_CHECKS)
def test_four_ranks(ws4, check: str) -> None:
    """4 gloo ranks: load the 2-rank checkpoints (same and swapped shard dims), save/load with
    4-way Shard(1) chunks read as Shard(0), async thread save."""
    read_records(ws4[0], check, 4, ws4[1])


def _load_on_one_process(path: Path, world_size: int) -> None:
    """Load a multi-rank checkpoint as plain full tensors in this (non-distributed) process."""
    full = full_sharded()
    own = {k: v for r in range(world_size) for k, v in own_state(r).items()}
    tmpl, bases = plain_template()
    tmpl["dt"] = {name: torch.zeros(shape, dtype=dt) for name, (dt, shape, _) in SHARDED.items()}
    tmpl["own"] = {k: torch.zeros_like(v) for k, v in own.items()}
    dcp.load(tmpl, storage_reader=CompressedReader(path), no_dist=True)
    errs = plain_diffs(tmpl, bases) + [tensor_diff(f"dt.{n}", tmpl["dt"][n], full[n]) for n in SHARDED]
    errs += [tensor_diff(f"own.{k}", tmpl["own"][k], v) for k, v in own.items()]
    check_equal([e for e in errs if e])


@pytest.mark.parametrize("codec", CODECS)
def test_two_rank_checkpoint_loads_on_one_process(ws2, root: Path, codec: str) -> None:
    read_records(ws2[0], f"save_load[{codec}]", 2, ws2[1])
    _load_on_one_process(root / f"ws2_{codec}", 2)


@pytest.mark.parametrize("codec", CODECS)
def test_four_rank_checkpoint_loads_on_one_process(ws4, root: Path, codec: str) -> None:
    read_records(ws4[0], f"save_load[{codec}]", 4, ws4[1])
    _load_on_one_process(root / f"ws4_{codec}", 4)


@pytest.mark.parametrize("name", ["ws2_async_thread", "ws2_async_process", "ws4_async_thread"])
def test_async_multi_rank_checkpoint_loads_on_one_process(ws2, ws4, root: Path, name: str) -> None:
    ws, spawned = (4, ws4) if name.startswith("ws4") else (2, ws2)
    read_records(spawned[0], name.split("_", 1)[1], ws, spawned[1])
    _load_on_one_process(root / name, ws)


@pytest.mark.parametrize("ws", [2, 4])
def test_each_rank_writes_its_own_data_file(ws2, ws4, root: Path, ws: int) -> None:
    spawned = ws2 if ws == 2 else ws4
    read_records(spawned[0], "save_load[zstd]", ws, spawned[1])
    names = {p.name for p in (root / f"ws{ws}_zstd").iterdir()}
    assert ".metadata" in names
    assert {n for n in names if n.endswith(".distcp")} == {f"__{r}_0.distcp" for r in range(ws)}


def test_partial_key_load_on_one_process(ws2, root: Path) -> None:
    """Loading a subset of the keys (and of the dtypes) reads only what was asked."""
    read_records(ws2[0], "save_load[zstd:3]", 2, ws2[1])
    full = full_sharded()
    tmpl = {"dt": {"bf16_col": torch.zeros(67, 45, dtype=torch.bfloat16)}, "meta": {"step": None}, "epoch": None}
    dcp.load(tmpl, storage_reader=CompressedReader(root / "ws2_zstd:3"), no_dist=True)
    check_equal([e for e in [tensor_diff("dt.bf16_col", tmpl["dt"]["bf16_col"], full["bf16_col"])] if e])
    assert tmpl["meta"] == {"step": 42} and tmpl["epoch"] == 7


def test_one_process_overwrites_a_four_rank_checkpoint(ws4, root: Path, tmp_path: Path) -> None:
    """An overwrite by fewer ranks replaces the checkpoint: the old ranks' files go away."""
    import shutil

    read_records(ws4[0], "save_load[lz4]", 4, ws4[1])
    path = tmp_path / "ck"
    shutil.copytree(root / "ws4_lz4", path)
    sd = {"x": hard_values(torch.float32, (3000,), 77), "meta": {"step": 43}}
    dcp.save(sd, storage_writer=CompressedWriter(path, codec="zstd", frame_size=FRAME, overwrite=True), no_dist=True)
    assert {p.name for p in path.iterdir() if p.name.endswith(".distcp")} == {"__0_0.distcp"}
    out = {"x": torch.zeros(3000), "meta": {"step": None}}
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    check_equal([e for e in [tensor_diff("x", out["x"], sd["x"])] if e])
    assert out["meta"] == {"step": 43}
