"""``dcp.async_save`` with ``CompressedWriter``: thread mode in this process (``no_dist=True``)
and process mode inside a spawned single-rank gloo group (a FileStore).

The saved values must be the values at the call: DCP's default stager copies the state
dict before ``async_save`` returns, so tensors mutated right after the call must not leak
into the checkpoint.  Multi-rank async saves (thread and process) are in test_distributed.py.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from tensor_values import hard_values
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from dcp_tiered import CheckpointExistsError, CompressedReader, CompressedWriter

CODECS = ["none", "lz4", "zstd", "zstd:3"]
FRAME = 4096
SPAWN_TIMEOUT = 300.0

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- state --------------------------------------------------------------------------------------


def make_state(seed: int = 0) -> dict:
    """Every kind of value a training state dict holds; ``seed`` changes every tensor."""
    base = hard_values(torch.float32, (24, 33), seed + 11)
    return {
        "model": {
            "w_f32": hard_values(torch.float32, (96, 70), seed + 1),  # ~26 KiB: 7 frames
            "w_bf16": hard_values(torch.bfloat16, (129, 65), seed + 2),
            "w_f16": hard_values(torch.float16, (4099,), seed + 3),
            "w_f64": hard_values(torch.float64, (31, 29), seed + 4),
            "i64": hard_values(torch.int64, (1500,), seed + 5),
            "i32": hard_values(torch.int32, (1025,), seed + 6),
            "u8": hard_values(torch.uint8, (5000,), seed + 7),
            "mask": hard_values(torch.bool, (4100,), seed + 8),
            "scalar": torch.tensor(float(seed) - 0.5),
            "scalar_i": torch.tensor(2**40 + seed),
            "empty": torch.empty(0, 7),
            "nc_t": base.t(),
            "nc_step": base[::2, 1::3],
        },
        "optim": {"state": {"0": {"step": torch.tensor(float(seed + 3)), "exp_avg": hard_values(torch.float32, (96, 70), seed + 9)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["0"]}]},
        "step": 1000 + seed,
        "run": f"run-{seed}-\u00e9",
        "extra": {"list": [1, 2, 3], "nested": {"flag": True}},
    }


def template_like(sd: dict) -> dict:
    """Zero tensors of the same dtype and shape (contiguous), ``None`` for every other value."""
    if isinstance(sd, dict):
        return {k: template_like(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return [template_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    return None


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def diffs(got, want, path: str = "") -> list[str]:
    """Differences between two state dicts: tensors bit for bit, everything else by ==."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"]
        return [d for k in want for d in diffs(got[k], want[k], f"{path}.{k}" if path else k)]
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: got {type(got).__name__}"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"]
        a, b = got.contiguous(), want.contiguous()
        if a.dtype.is_floating_point:
            a, b = a.view(_INT_OF[a.element_size()]), b.view(_INT_OF[b.element_size()])
        return [] if torch.equal(a, b) else [f"{path}: {(a != b).sum().item()} of {a.numel()} elements differ"]
    if isinstance(want, list) and any(isinstance(v, (dict, torch.Tensor)) for v in want):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: got {got!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in diffs(g, w, f"{path}.{i}")]
    return [] if (got == want and type(got) is type(want)) else [f"{path}: got {got!r}, want {want!r}"]


def load(path: Path, like: dict, no_dist: bool = True) -> dict:
    out = template_like(like)
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=no_dist)
    return out


def assert_loads_equal(path: Path, want: dict, no_dist: bool = True) -> None:
    errs = diffs(load(path, want, no_dist), want)
    assert not errs, "loaded state differs from the saved state:\n  " + "\n  ".join(errs)


def scramble_(sd) -> None:
    """Overwrite every tensor in place, as an optimizer step would."""
    if isinstance(sd, dict):
        for v in sd.values():
            scramble_(v)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            scramble_(v)
    elif isinstance(sd, torch.Tensor):
        with torch.no_grad():
            sd.fill_(True if sd.dtype == torch.bool else 7)


def exists_failures(exc: CheckpointException) -> list[BaseException]:
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


# -- thread mode, no_dist -----------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_thread_async_save_round_trip(tmp_path: Path, codec: str) -> None:
    sd = make_state()
    fut = dcp.async_save(sd, storage_writer=CompressedWriter(tmp_path / "ck", codec=codec, frame_size=FRAME), no_dist=True)
    assert isinstance(fut, Future)
    md = fut.result(timeout=scaled(120))
    assert isinstance(md, Metadata)
    assert (tmp_path / "ck" / ".metadata").is_file()
    assert_loads_equal(tmp_path / "ck", make_state())


def test_tensors_mutated_after_async_save_keep_the_values_at_the_call(tmp_path: Path) -> None:
    sd = make_state()
    fut = dcp.async_save(sd, storage_writer=CompressedWriter(tmp_path / "ck", codec="zstd", frame_size=FRAME), no_dist=True)
    scramble_(sd)  # right after the call returns, before the save has finished
    fut.result(timeout=scaled(120))
    assert sd["model"]["w_f32"].eq(7).all()  # the mutation did happen
    assert_loads_equal(tmp_path / "ck", make_state())


def test_async_staging_response_then_mutation(tmp_path: Path) -> None:
    """A stager with asynchronous staging: ``async_save`` returns an ``AsyncSaveResponse``;
    once ``staging_completion`` is done the state may be mutated."""
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=False))
    try:
        sd = make_state(5)
        resp = dcp.async_save(sd, storage_writer=CompressedWriter(tmp_path / "ck", codec="lz4", frame_size=FRAME),
                              async_stager=stager, no_dist=True)
        assert isinstance(resp, AsyncSaveResponse)
        resp.staging_completion.result(timeout=scaled(120))
        scramble_(sd)
        resp.upload_completion.result(timeout=scaled(120))
    finally:
        stager.close()
    assert_loads_equal(tmp_path / "ck", make_state(5))


def test_two_async_saves_in_flight(tmp_path: Path) -> None:
    dcp.save(make_state(0), storage_writer=CompressedWriter(tmp_path / "ck0", frame_size=FRAME), no_dist=True)
    futs = [
        dcp.async_save(make_state(seed), storage_writer=CompressedWriter(tmp_path / f"ck{seed}", codec=codec, frame_size=FRAME),
                       no_dist=True)
        for seed, codec in ((1, "zstd"), (2, "lz4"))
    ]
    assert_loads_equal(tmp_path / "ck0", make_state(0))  # a load while both saves may still run
    for f in futs:
        f.result(timeout=scaled(120))
    assert_loads_equal(tmp_path / "ck1", make_state(1))
    assert_loads_equal(tmp_path / "ck2", make_state(2))


def test_one_writer_reused_with_checkpoint_ids(tmp_path: Path) -> None:
    """One writer object, async saves to successive steps through ``checkpoint_id``."""
    writer = CompressedWriter(tmp_path / "step_1", codec="zstd:3", frame_size=FRAME)
    for step in (1, 2, 3):
        sd = make_state(step)
        fut = dcp.async_save(sd, checkpoint_id=tmp_path / f"step_{step}", storage_writer=writer, no_dist=True)
        scramble_(sd)
        fut.result(timeout=scaled(120))
    for step in (1, 2, 3):
        assert_loads_equal(tmp_path / f"step_{step}", make_state(step))
    # one reader, moved along the same steps by checkpoint_id
    reader = CompressedReader(tmp_path / "step_1")
    for step in (3, 2, 1):
        out = template_like(make_state(step))
        dcp.load(out, checkpoint_id=tmp_path / f"step_{step}", storage_reader=reader, no_dist=True)
        assert not diffs(out, make_state(step))


def test_module_and_optimizer_step_right_after_async_save(tmp_path: Path) -> None:
    """The training-loop case: ``nn.Module`` parameters (``requires_grad``) and AdamW state,
    then an optimizer step while the save runs; the checkpoint holds the pre-step values."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step() -> None:
        opt.zero_grad()
        model(torch.randn(5, 48, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()

    train_step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    want = copy.deepcopy(sd)
    fut = dcp.async_save(sd, storage_writer=CompressedWriter(tmp_path / "ck", codec="zstd", frame_size=FRAME), no_dist=True)
    train_step()  # parameters and optimizer state change in place
    fut.result(timeout=scaled(120))
    assert not torch.equal(model.state_dict()["0.weight"], want["model"]["0.weight"])

    fresh = copy.deepcopy(model)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.zero_grad()
    fresh(torch.randn(5, 48, dtype=torch.bfloat16)).float().sum().backward()
    fresh_opt.step()  # creates the optimizer state to load into
    out = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": 0}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    errs = diffs(out, want)
    assert not errs, errs
    # loaded in place: the module itself holds the saved parameters
    assert not diffs(fresh.state_dict(), want["model"])


def test_async_save_over_committed_checkpoint_fails_through_the_future(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    dcp.async_save(make_state(1), storage_writer=CompressedWriter(path, frame_size=FRAME), no_dist=True).result(timeout=scaled(120))
    fut = dcp.async_save(make_state(2), storage_writer=CompressedWriter(path, frame_size=FRAME), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        fut.result(timeout=scaled(120))
    errors = exists_failures(info.value)
    assert errors and all(isinstance(e, CheckpointExistsError) for e in errors), info.value.failures
    assert_loads_equal(path, make_state(1))  # untouched
    fut = dcp.async_save(make_state(2), storage_writer=CompressedWriter(path, codec="lz4", frame_size=FRAME, overwrite=True),
                         no_dist=True)
    fut.result(timeout=scaled(120))
    assert_loads_equal(path, make_state(2))


def test_writer_pickles_with_its_configuration(tmp_path: Path) -> None:
    """Process mode sends the writer to the checkpoint process by pickle."""
    writer = CompressedWriter(tmp_path / "a", codec="zstd:3", frame_size=FRAME, byte_group=False, threads=1)
    copy = pickle.loads(pickle.dumps(writer))
    assert (copy.codec, copy.frame_size, copy.byte_group, copy.threads, copy.overwrite) == (
        writer.codec, writer.frame_size, writer.byte_group, writer.threads, writer.overwrite)
    assert copy.checkpoint_id == writer.checkpoint_id
    dcp.save(make_state(3), storage_writer=copy, no_dist=True)
    assert_loads_equal(tmp_path / "a", make_state(3))
    # a writer that has already saved pickles too, and still refuses to overwrite
    again = pickle.loads(pickle.dumps(copy))
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(4), storage_writer=again, no_dist=True)
    assert all(isinstance(e, CheckpointExistsError) for e in exists_failures(info.value))
    again.reset(tmp_path / "b")
    dcp.save(make_state(4), storage_writer=again, no_dist=True)
    assert_loads_equal(tmp_path / "b", make_state(4))


# -- process mode: a spawned single-rank gloo group ------------------------------------------------

PROCESS_CHECKS = ["process_save", "process_save_again_no_dist", "process_save_error"]


def _record(out: Path, check: str, fn) -> None:
    try:
        fn()
        status = "ok"
    except BaseException:  # noqa: BLE001 - CheckpointException is a BaseException
        status = traceback.format_exc()
    (out / check).write_text(status)


def _process_mode_worker(rank: int, store: str, root: str, out: str) -> None:
    # _ProcessBasedAsyncCheckpointExecutor needs an initialized process group (it broadcasts
    # the address of the checkpoint process's own TCPStore: MASTER_ADDR or this host's name).
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=scaled(120)))
    root_p, out_p = Path(root), Path(out)
    mode = AsyncCheckpointerType.PROCESS
    try:
        def first():
            sd = make_state(1)
            fut = dcp.async_save(sd, storage_writer=CompressedWriter(root_p / "p1", codec="zstd", frame_size=FRAME),
                                 async_checkpointer_type=mode)
            scramble_(sd)
            assert isinstance(fut.result(timeout=scaled(240)), Metadata)
            assert_loads_equal(root_p / "p1", make_state(1), no_dist=False)

        def second():  # the checkpoint process is reused; no_dist and checkpoint_id inside it
            sd = make_state(2)
            writer = CompressedWriter(root_p / "elsewhere", codec="lz4", frame_size=FRAME)
            fut = dcp.async_save(sd, checkpoint_id=root_p / "p2", storage_writer=writer,
                                 async_checkpointer_type=mode, no_dist=True)
            scramble_(sd)
            fut.result(timeout=scaled(240))
            assert_loads_equal(root_p / "p2", make_state(2), no_dist=False)
            assert not (root_p / "elsewhere" / ".metadata").exists()

        def error():  # a failure in the checkpoint process reaches the caller's future
            fut = dcp.async_save(make_state(3), storage_writer=CompressedWriter(root_p / "p1", codec="zstd", frame_size=FRAME),
                                 async_checkpointer_type=mode)
            try:
                fut.result(timeout=scaled(240))
            except CheckpointException as exc:
                errors = exists_failures(exc)
                assert errors and all(isinstance(e, CheckpointExistsError) for e in errors), exc.failures
            else:
                raise AssertionError("saving over a committed checkpoint did not fail")
            assert_loads_equal(root_p / "p1", make_state(1), no_dist=False)

        _record(out_p, "process_save", first)
        _record(out_p, "process_save_again_no_dist", second)
        _record(out_p, "process_save_error", error)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def process_mode(tmp_path_factory) -> tuple[Path, Path, str | None]:
    root = tmp_path_factory.mktemp("async_process")
    out = root / "records"
    out.mkdir()
    store = root / "filestore"
    ctx = mp.start_processes(_process_mode_worker, args=(str(store), str(root), str(out)), nprocs=1,
                             join=False, start_method="spawn")
    error = None
    deadline = time.monotonic() + scaled(SPAWN_TIMEOUT)
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the process-mode worker did not finish within {SPAWN_TIMEOUT} s")
    except BaseException:  # noqa: BLE001 - reported by every check that lacks a record
        error = traceback.format_exc()
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(scaled(5))
    return root, out, error


@pytest.mark.parametrize("check", PROCESS_CHECKS)
def test_process_mode_single_rank_group(process_mode, check: str) -> None:
    """``AsyncCheckpointerType.PROCESS`` in a 1-rank gloo group: save (tensors scrambled right
    after the call), a second save through the same checkpoint process with ``no_dist=True``,
    and a failure (existing checkpoint) raised through the future."""
    _, out, error = process_mode
    f = out / check
    assert f.exists(), f"no record: the worker crashed or hung\n{error or ''}"
    assert f.read_text() == "ok", f.read_text()


@pytest.mark.parametrize("name,seed", [("p1", 1), ("p2", 2)])
def test_process_mode_checkpoint_loads_here(process_mode, name: str, seed: int) -> None:
    root, out, error = process_mode
    assert (out / "process_save").exists(), error
    assert_loads_equal(root / name, make_state(seed))
