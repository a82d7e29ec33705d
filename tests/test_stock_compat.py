"""CompressedReader loads checkpoints written by stock DCP writers exactly, and checkpoints
of either kind load into an empty state dict through DCP's ``_EmptyStateDictLoadPlanner``.

Stock writers covered: ``FileSystemWriter`` (defaults, ``thread_count=2``, one file per
tensor, the experimental ``ZStandard`` stream extension) and ``FsspecWriter`` (local and
``memory://``).
"""

from __future__ import annotations

import uuid

import pytest
from speed import scaled
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


# -- drop-in swaps from stock writers and readers ----------------------------------------------

import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from dcp_tiered import CheckpointExistsError, ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _failure(exc: BaseException) -> BaseException:
    """The error a rank raised inside ``dcp.save`` (DCP wraps it in ``CheckpointException``)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    first = next(iter(failures.values()))
    return first[0] if isinstance(first, tuple) else first  # (error, traceback summary)


def test_stock_writer_keywords_are_accepted_and_honoured(tmp_path):
    path = tmp_path / "ckpt"
    kwargs = dict(single_file_per_rank=True, sync_files=False, thread_count=2, per_thread_copy_ahead=10_000_000,
                  cache_staged_state_dict=False, overwrite=False)
    writer = CompressedWriter(path, codec="lz4", **kwargs)
    assert (writer.threads, writer.sync_files, writer.overwrite) == (2, False, False)
    dcp.save(full_state(), storage_writer=writer, no_dist=True)
    out = blank_like(full_state())
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    assert_exactly_equal(out, full_state())
    assert CompressedWriter(tmp_path / "b", threads=3, thread_count=3).threads == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"single_file_per_rank": False}, "single_file_per_rank=False is not supported: CompressedWriter always writes one"),
    ({"threads": 2, "thread_count": 4}, "threads=2 and thread_count=4"),
    ({"thread_count": 0}, "thread_count must be at least 1"),
    ({"per_thread_copy_ahead": -1}, "per_thread_copy_ahead must be at least 0"),
])
def test_stock_writer_keywords_without_a_meaning_here_are_config_errors(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        CompressedWriter(tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("cls, args, example", [
    (CompressedWriter, (True,), "CompressedWriter(path, codec='zstd'"),  # stock's 2nd positional: single_file_per_rank
    (CompressedWriter, ("zstd", True), "CompressedWriter(path, codec='zstd'"),
    (CompressedReader, (None,), "CompressedReader(path, threads="),  # stock's 2nd positional: _extension_registry
])
def test_positional_arguments_after_path_are_a_type_error_naming_the_keyword_form(tmp_path, cls, args, example):
    with pytest.raises(TypeError, match="after path all arguments are keyword-only") as err:
        cls(tmp_path / "ckpt", *args)
    assert example in str(err.value)


def test_a_positional_codec_is_a_type_error_naming_the_keyword_form(tmp_path):
    with pytest.raises(TypeError, match=re.escape("CompressedWriter(path, codec='zstd'")):
        CompressedWriter(tmp_path / "ckpt", "lz4")
    assert CompressedWriter(tmp_path / "ckpt", codec="lz4").codec == "lz4"


def test_unknown_keywords_are_type_errors_not_silent_storage_options(tmp_path):
    with pytest.raises(TypeError, match="did you mean threads="):
        CompressedWriter(tmp_path / "ckpt", thread=2)
    with pytest.raises(TypeError, match="a local path takes none"):
        CompressedWriter(tmp_path / "ckpt", anon=True)
    with pytest.raises(TypeError, match="_extensions"):
        CompressedWriter(tmp_path / "ckpt", _extensions=[ZStandard()])
    with pytest.raises(TypeError, match="did you mean verify="):
        CompressedReader(tmp_path / "ckpt", verfy=False)


def test_fsspec_options_as_keywords_like_fsspec_writer():
    url = _memory_url()
    writer = CompressedWriter(url, sync_files=False, skip_instance_cache=False)
    assert writer.storage_options == {"skip_instance_cache": False}
    dcp.save(full_state(), storage_writer=writer, no_dist=True)
    reader = CompressedReader(url, skip_instance_cache=False, storage_options={"skip_instance_cache": False})
    out = blank_like(full_state())
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert_exactly_equal(out, full_state())
    with pytest.raises(ConfigError, match="skip_instance_cache given both"):
        CompressedWriter(url, skip_instance_cache=False, storage_options={"skip_instance_cache": True})


def test_resave_refusal_matches_stock_words_and_is_a_runtime_error(tmp_path):
    stock_path, ours_path = tmp_path / "stock", tmp_path / "ours"
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(stock_path, overwrite=False), no_dist=True)
    dcp.save({"w": torch.ones(3)}, storage_writer=CompressedWriter(ours_path), no_dist=True)
    with pytest.raises(BaseException) as stock:
        dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(stock_path, overwrite=False), no_dist=True)
    with pytest.raises(BaseException) as ours:
        dcp.save({"w": torch.zeros(3)}, storage_writer=CompressedWriter(ours_path), no_dist=True)
    stock_err, ours_err = _failure(stock.value), _failure(ours.value)
    assert isinstance(stock_err, RuntimeError) and "Checkpoint already exists" in str(stock_err)
    assert isinstance(ours_err, CheckpointExistsError)
    assert isinstance(ours_err, RuntimeError) and isinstance(ours_err, FileExistsError)  # stock's and ours
    assert "Checkpoint already exists" in str(ours_err) and "overwrite=True" in str(ours_err)
    # overwrite=True replaces it, as stock's default does
    dcp.save({"w": torch.zeros(3)}, storage_writer=CompressedWriter(ours_path, overwrite=True), no_dist=True)
    out = {"w": torch.ones(3)}
    dcp.load(out, storage_reader=CompressedReader(ours_path), no_dist=True)
    assert torch.equal(out["w"], torch.zeros(3))


def test_stock_readers_cannot_read_compressed_checkpoints_and_the_readme_says_what_to_do(tmp_path):
    # The documented limit: stock readers fail on our records (no message can be planted in
    # .metadata without breaking safe loading and format 1).  If torch ever changes this,
    # the README's Errors section must change with it.
    path = tmp_path / "ckpt"
    dcp.save(full_state(), storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    # format 2: the tensor table stock sees lists only the records table's head item
    with pytest.raises(BaseException, match="relative_path|Missing key in checkpoint state_dict") as err:
        dcp.load(blank_like(full_state()), storage_reader=FileSystemReader(path), no_dist=True)
    assert isinstance(_failure(err.value), (AttributeError, RuntimeError))
    with pytest.raises(BaseException, match="relative_path"):
        dcp_to_torch_save(path, tmp_path / "stock.pt")
    readme = " ".join((ROOT / "README.md").read_text().split())
    errors = readme[readme.index("## Errors"):]
    assert "'dict' object has no attribute 'relative_path'" in errors
    assert "CompressedReader" in errors and "dcp-tiered convert SRC DST --codec stock" in errors

    # ... and the workaround the README gives works: convert, then stock tools read it.
    stock = tmp_path / "stock"
    res = subprocess.run([sys.executable, "-m", "dcp_tiered.cli", "convert", str(path), str(stock), "--codec", "stock"],
                         capture_output=True, text=True, timeout=scaled(300), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    out = blank_like(full_state())
    dcp.load(out, storage_reader=FileSystemReader(stock), no_dist=True)
    assert_exactly_equal(out, full_state())
    dcp_to_torch_save(stock, tmp_path / "stock.pt")
    assert torch.equal(torch.load(tmp_path / "stock.pt", weights_only=True)["f32"], full_state()["f32"])
