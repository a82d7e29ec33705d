"""CompressedReader loads checkpoints written by stock DCP writers exactly, and checkpoints
of either kind load into an empty state dict through DCP's ``_EmptyStateDictLoadPlanner``.

Stock writers covered: ``FileSystemWriter`` (defaults, ``thread_count=2``, one file per
tensor, the experimental ``ZStandard`` stream extension) and ``FsspecWriter`` (local and
``memory://``).
"""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, _load_state_dict_from_keys

from dcp_tiered import CompressedReader, CompressedWriter


def full_state() -> dict:
    """Tensors of many dtypes and shapes, nested dicts, strings, ints and lists."""
    g = torch.Generator().manual_seed(11)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, 3.4e38, -1.5])
    return {
        "f32": torch.randn(33, 7, generator=g),
        "f64": torch.randn(5, 3, dtype=torch.float64, generator=g),
        "f16": torch.randn(129, generator=g).half(),
        "bf16": torch.randn(4, 65, generator=g).bfloat16(),
        "special": special,
        "i8": torch.arange(-128, 128, dtype=torch.int8),
        "u8": torch.randint(0, 256, (300,), dtype=torch.uint8, generator=g),
        "i16": torch.randint(-30000, 30000, (50,), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (40,), dtype=torch.int32, generator=g),
        "i64": torch.arange(-5, 1000, 3),
        "bool": torch.rand(37, generator=g) > 0.5,
        "c64": torch.randn(6, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(8, 6, generator=g).t(),  # non-contiguous on save
        "model": {
            "layer": {"weight": torch.randn(16, 16, generator=g), "bias": torch.zeros(16)},
            "embed": torch.randn(100, 8, generator=g).bfloat16(),
        },
        "optim": {"step": 12, "lr": "cosine", "betas": [0.9, 0.999], "state": {"exp_avg": torch.randn(16, generator=g)}},
        "name": "run-42",
        "epoch": 3,
    }


def blank_like(value):
    """The same structure with every leaf reset, so loading has to fill in every value."""
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, 7) if value.dtype != torch.bool else torch.zeros_like(value)
    if isinstance(value, str):
        return ""
    if isinstance(value, int):
        return -1
    if isinstance(value, list):
        return []
    raise TypeError(type(value))


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_exactly_equal(got, want, where="") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_exactly_equal(got[k], want[k], f"{where}.{k}" if where else k)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        assert bits(got) == bits(want), f"{where}: values differ"
    else:
        assert got == want and type(got) is type(want), f"{where}: {got!r} != {want!r}"


def flatten(sd: dict, prefix: str = "") -> dict:
    """``{"a": {"b": x}}`` -> ``{"a.b": x}``: how DCP names nested leaves."""
    out = {}
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _memory_url() -> str:
    return f"memory://dcp-tiered-stock-{uuid.uuid4().hex}/ckpt"


STOCK_WRITERS = {
    "FileSystemWriter": lambda p: FileSystemWriter(p, sync_files=False),
    "FileSystemWriter-thread_count=2": lambda p: FileSystemWriter(p, sync_files=False, thread_count=2),
    "FileSystemWriter-file_per_tensor": lambda p: FileSystemWriter(p, sync_files=False, single_file_per_rank=False),
    "FileSystemWriter-zstd": lambda p: FileSystemWriter(p, sync_files=False, _extensions=[ZStandard()]),
    "FileSystemWriter-zstd-thread_count=2": lambda p: FileSystemWriter(p, sync_files=False, thread_count=2, _extensions=[ZStandard()]),
    "FsspecWriter-local": lambda p: FsspecWriter(p, sync_files=False),
    "FsspecWriter-memory": lambda p: FsspecWriter(p, sync_files=False),
    "FsspecWriter-memory-zstd": lambda p: FsspecWriter(p, sync_files=False, _extensions=[ZStandard()]),
}


def _path_for(name: str, tmp_path) -> str:
    return _memory_url() if "memory" in name else str(tmp_path / "ckpt")


@pytest.mark.parametrize("writer", list(STOCK_WRITERS))
def test_reader_loads_stock_checkpoint_exactly(tmp_path, writer):
    path = _path_for(writer, tmp_path)
    saved = full_state()
    dcp.save(saved, storage_writer=STOCK_WRITERS[writer](path), no_dist=True)
    out = blank_like(saved)
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    assert_exactly_equal(out, full_state())


@pytest.mark.parametrize("writer", ["FileSystemWriter", "FileSystemWriter-zstd", "FsspecWriter-memory"])
def test_reader_loads_a_subset_of_a_stock_checkpoint(tmp_path, writer):
    path = _path_for(writer, tmp_path)
    dcp.save(full_state(), storage_writer=STOCK_WRITERS[writer](path), no_dist=True)
    want = full_state()
    out = {"bf16": torch.zeros(4, 65, dtype=torch.bfloat16), "model": {"layer": {"bias": torch.ones(16)}}, "name": ""}
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    assert_exactly_equal(out, {"bf16": want["bf16"], "model": {"layer": {"bias": want["model"]["layer"]["bias"]}}, "name": "run-42"})


@pytest.mark.parametrize("verify", [True, False])
def test_reader_loads_stock_checkpoint_with_either_verify_setting(tmp_path, verify):
    path = str(tmp_path / "ckpt")
    dcp.save(full_state(), storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    out = blank_like(full_state())
    dcp.load(out, storage_reader=CompressedReader(path, verify=verify, threads=1), no_dist=True)
    assert_exactly_equal(out, full_state())


def test_stock_metadata_round_trips_through_the_safe_unpickler(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save(full_state(), storage_writer=FileSystemWriter(path, sync_files=False, _extensions=[ZStandard()]), no_dist=True)
    md = CompressedReader(path).read_metadata()
    assert set(md.state_dict_metadata) == set(flatten(full_state()))


ALL_WRITERS = {
    "CompressedWriter-zstd": lambda p: CompressedWriter(p, sync_files=False),
    "CompressedWriter-lz4": lambda p: CompressedWriter(p, codec="lz4", sync_files=False),
    "CompressedWriter-none-small-frames": lambda p: CompressedWriter(p, codec="none", frame_size=4096, sync_files=False),
    "CompressedWriter-memory": lambda p: CompressedWriter(p, sync_files=False),
    "FileSystemWriter": STOCK_WRITERS["FileSystemWriter"],
    "FileSystemWriter-zstd": STOCK_WRITERS["FileSystemWriter-zstd"],
    "FsspecWriter-memory": STOCK_WRITERS["FsspecWriter-memory"],
}


@pytest.mark.parametrize("writer", list(ALL_WRITERS))
def test_load_into_empty_state_dict_with_empty_state_dict_planner(tmp_path, writer):
    path = _path_for(writer, tmp_path)
    dcp.save(full_state(), storage_writer=ALL_WRITERS[writer](path), no_dist=True)
    out: dict = {}
    # As torch.distributed.checkpoint.format_utils.dcp_to_torch_save does, with our reader.
    _load_state_dict(out, storage_reader=CompressedReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert_exactly_equal(out, full_state())


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
@pytest.mark.parametrize("writer", ["CompressedWriter-zstd", "FileSystemWriter-zstd"])
def test_load_state_dict_from_keys_with_compressed_reader(tmp_path, writer):
    path = _path_for(writer, tmp_path)
    dcp.save(full_state(), storage_writer=ALL_WRITERS[writer](path), no_dist=True)
    out = _load_state_dict_from_keys(storage_reader=CompressedReader(path))
    assert_exactly_equal(out, full_state())
    some = _load_state_dict_from_keys({"f32", "name"}, storage_reader=CompressedReader(path))
    assert_exactly_equal(some, {"f32": full_state()["f32"], "name": "run-42"})


def test_empty_state_dict_planner_restores_original_dtypes_and_shapes(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = full_state()
    dcp.save(saved, storage_writer=CompressedWriter(path, frame_size=4096, sync_files=False), no_dist=True)
    out: dict = {}
    _load_state_dict(out, storage_reader=CompressedReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    for name, tensor in flatten(saved).items():
        if isinstance(tensor, torch.Tensor):
            got = flatten(out)[name]
            assert (got.dtype, tuple(got.shape)) == (tensor.dtype, tuple(tensor.shape)), name


def test_stock_zstd_small_items_do_not_reserve_huge_buffers(tmp_path):
    # Decoding a stream.zstd item must not allocate its worst-case bound up front: a 6-byte
    # string item would otherwise cost a 1 GiB buffer (fatal under ulimit -v or strict overcommit).
    import tracemalloc

    path = str(tmp_path / "ckpt")
    saved = {"w": torch.ones(4), "s": "small", "n": 3}
    dcp.save(saved, storage_writer=FileSystemWriter(path, sync_files=False, _extensions=[ZStandard()]), no_dist=True)
    out = {"w": torch.zeros(4), "s": "", "n": 0}
    tracemalloc.start()
    try:
        dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_exactly_equal(out, saved)
    assert peak < 64 << 20, f"loading a few bytes allocated {peak >> 20} MiB"
