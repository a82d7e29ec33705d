"""``dcp_tiered.inspect``: describe, verify, load_any, save_any and convert as a library.

The same checkpoint is saved three ways (this package's format, stock DCP, one ``torch.save``
file) and every function is driven on real local files; damage is made by editing bytes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import CompressedWriter
from dcp_tiered import inspect as ckpt
from dcp_tiered.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CodecError,
    ConfigError,
    CorruptCheckpointError,
)

FRAME = 4096  # the smallest frame: "model.w" spans several frames


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {"w": torch.randn(64, 96, generator=g), "b": torch.randn(96, generator=g).to(torch.bfloat16),
                  "ids": torch.arange(40, dtype=torch.int64)},
        "optim": {"exp_avg": torch.randn(64, 96, generator=g) * 1e-3, "step": torch.tensor(7.0)},
        "extra": {"epoch": 3, "lr": 0.5},
    }


def _assert_same(a: dict, b: dict) -> None:
    """Equal bit for bit, dtypes and Python values included."""
    torch.testing.assert_close(b, a, rtol=0, atol=0)


class Counter:
    """A progress factory that records what it was told."""

    bars: list["Counter"] = []

    def __init__(self, total: float, desc: str = "", unit: str = "") -> None:
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0.0
        Counter.bars.append(self)

    def update(self, n: float = 1) -> None:
        self.done += n

    def __enter__(self) -> "Counter":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect")
    dcp.save(_state(), storage_writer=CompressedWriter(root / "native", codec="zstd", frame_size=FRAME), no_dist=True)
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(root / "stock")), no_dist=True)
    torch.save(_state(), root / "model.pt")
    return {"root": root, "native": root / "native", "stock": root / "stock", "pt": root / "model.pt"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _record(path: Path, key: str) -> dict:
    md = ckpt.open_reader(str(path)).read_metadata()
    return next(rec for index, rec in md.storage_data.items() if index.fqn == key)


def test_import_loads_no_torch() -> None:
    code = "import sys, dcp_tiered.inspect; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120), check=True)
    assert out.stdout.strip() == "[]"


def test_describe_native_and_stock(ckpts: dict[str, Path]) -> None:
    native = ckpt.describe(ckpts["native"])
    assert native.format == "dcp_tiered v2" and native.format_version == 2 and native.codecs == ["zstd:1"]
    rows = {r.key: r for r in native.rows}
    assert [r.key for r in native.rows] == sorted(rows)
    w = rows["model.w"]
    assert (w.kind, w.dtype, w.shape, w.raw_bytes) == ("tensor", "float32", (64, 96), 64 * 96 * 4)
    assert 0 < w.stored_bytes < w.raw_bytes and w.codec.startswith("zstd:1") and w.files == ["__0_0.distcp"]
    assert rows["model.b"].dtype == "bfloat16" and rows["extra.epoch"].kind == "object"
    assert native.fp32_bytes == (64 * 96 * 2 + 96 + 1) * 4 + 40 * 8  # the bf16 tensor counted at 4 bytes
    assert native.summary()["items"] == 7 and native.as_dict()["tensors"][0]["key"] == native.rows[0].key
    json.dumps(native.as_dict())

    stock = ckpt.describe(str(ckpts["stock"]))
    assert stock.format == "stock DCP" and stock.format_version is None
    srow = {r.key: r for r in stock.rows}["model.w"]
    assert srow.stored_dtype == "float32" and srow.codec == "stock (torch.save)" and srow.stored_bytes > 0
    assert {r.key for r in stock.rows} == set(rows)


def test_describe_and_verify_refuse_what_is_not_a_checkpoint(ckpts: dict[str, Path]) -> None:
    for fn in (ckpt.describe, ckpt.verify):
        with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
            fn(ckpts["root"] / "nothing-here")
        with pytest.raises(CheckpointNotFoundError):
            fn(ckpts["pt"])  # a torch.save file is loaded (load_any), not described


def test_verify_good_checkpoints_counts_every_frame_and_byte(ckpts: dict[str, Path]) -> None:
    Counter.bars.clear()
    good = ckpt.verify(ckpts["native"], progress=Counter)
    assert good.ok and good.problems == [] and good.items == 7 and good.files == 1
    assert good.frames >= good.items + 2  # model.w and optim.exp_avg span several frames
    assert good.bytes_read == ckpt.describe(ckpts["native"]).stored_bytes
    (bar,) = Counter.bars
    assert (bar.desc, bar.unit, bar.total, bar.done) == ("verify", "B", good.bytes_read, good.bytes_read)
    assert good.counts() == {"items": 7, "frames": good.frames, "files": 1, "bytes": good.bytes_read}
    assert f"{good.frames} frames checksummed" in good.counts_text()

    stock = ckpt.verify(ckpts["stock"])
    assert stock.ok and stock.items == 7 and stock.frames == 0 and stock.files >= 1


def test_verify_names_file_key_and_frame_of_a_flipped_byte(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["native"], tmp_path / "bitflip")
    rec = _record(bad, "optim.exp_avg")
    assert len(rec["frames"]) >= 2
    data = bad / rec["file"]
    raw = bytearray(data.read_bytes())
    raw[rec["offset"] + rec["frames"][0] + 5] ^= 0x40  # inside frame 1 of optim.exp_avg
    data.write_bytes(bytes(raw))

    result = ckpt.verify(str(bad))
    assert not result.ok and len(result.problems) == 1, result.problems
    (problem,) = result.problems
    assert "checksum mismatch in frame 1 of 'optim.exp_avg'" in problem and str(data) in problem
    assert result.items == 7  # every other item was still checked


def test_verify_lists_missing_and_truncated_files(ckpts: dict[str, Path], tmp_path: Path) -> None:
    short = _copy(ckpts["native"], tmp_path / "short")
    with open(short / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    problems = ckpt.verify(short).problems
    assert problems and all("is truncated" in p and "__0_0.distcp" in p for p in problems)
    assert any("'model.w'" in p for p in problems)

    gone = _copy(ckpts["stock"], tmp_path / "gone")
    files = sorted(gone.glob("*.distcp"))
    files[0].unlink()
    result = ckpt.verify(gone)
    assert result.problems == [f"missing file {files[0]}"]


def test_load_any_reads_all_three_formats_with_original_dtypes(ckpts: dict[str, Path]) -> None:
    for name in ("native", "stock", "pt"):
        Counter.bars.clear()
        _assert_same(_state(), ckpt.load_any(ckpts[name], progress=Counter))
        if name != "pt":
            (bar,) = Counter.bars
            assert bar.desc == "read" and bar.done == bar.total == 7


def test_load_any_refuses_a_missing_or_non_dict_torch_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        ckpt.load_any(tmp_path / "absent.pt")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="holds a list, not a state dict"):
        ckpt.load_any(tmp_path / "list.pt")


def test_convert_round_trips_through_every_format(ckpts: dict[str, Path], tmp_path: Path) -> None:
    to_lz4 = ckpt.convert(ckpts["stock"], tmp_path / "lz4", codec="lz4")
    assert to_lz4.saved["format"] == "dcp_tiered" and to_lz4.saved["codec"] == "lz4"
    assert to_lz4.dst_bytes == ckpt.stored_size(tmp_path / "lz4") and to_lz4.src_bytes == ckpt.stored_size(ckpts["stock"])
    assert to_lz4.ratio == round(to_lz4.dst_bytes / to_lz4.src_bytes, 4) < 1
    assert to_lz4.as_dict()["ratio"] == to_lz4.saved["ratio"]  # what was saved: stored over raw bytes
    to_pt = ckpt.convert(tmp_path / "lz4", tmp_path / "back.pt")
    assert to_pt.saved == {"format": "torch.save", "stored_bytes": (tmp_path / "back.pt").stat().st_size}
    to_stock = ckpt.convert(tmp_path / "back.pt", tmp_path / "stock", codec=ckpt.STOCK)
    assert to_stock.saved == {"format": "stock DCP"}
    to_native = ckpt.convert(tmp_path / "stock", tmp_path / "zstd3", codec="zstd:3")
    assert ckpt.describe(tmp_path / "zstd3").codecs == ["zstd:3"] and ckpt.verify(tmp_path / "zstd3").ok
    assert to_native.saved["items"] == 7
    _assert_same(_state(), ckpt.load_any(tmp_path / "zstd3"))
    _assert_same(_state(), torch.load(tmp_path / "back.pt", weights_only=True))


def test_convert_downcasts_floats_only(ckpts: dict[str, Path], tmp_path: Path) -> None:
    ckpt.convert(ckpts["native"], tmp_path / "bf16", dtype=torch.bfloat16)
    rows = {r.key: r for r in ckpt.describe(tmp_path / "bf16").rows}
    assert rows["model.w"].dtype == "float32" and rows["model.w"].stored_dtype == "bfloat16"
    assert rows["model.ids"].stored_dtype == "int64"
    ckpt.convert(ckpts["native"], tmp_path / "half.pt", dtype=torch.float16)
    half = torch.load(tmp_path / "half.pt", weights_only=True)
    assert half["model"]["w"].dtype == torch.float16 and half["model"]["ids"].dtype == torch.int64


def test_convert_refuses_to_replace_and_checks_the_codec_first(ckpts: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        ckpt.convert(ckpts["native"], ckpts["stock"], codec=ckpt.STOCK)
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        ckpt.convert(ckpts["native"], ckpts["pt"])
    with pytest.raises(CheckpointException) as raised:  # raised inside dcp.save: DCP wraps it
        ckpt.convert(ckpts["stock"], ckpts["native"])
    assert isinstance(raised.value.failures[0][0], CheckpointExistsError)  # (error, traceback)
    with pytest.raises(CodecError):
        ckpt.convert(tmp_path / "no-such-source", tmp_path / "x", codec="brotli")
    assert not (tmp_path / "x").exists()
    out = _copy(ckpts["stock"], tmp_path / "replaced")
    ckpt.convert(ckpts["native"], out, codec=ckpt.STOCK, overwrite=True)
    _assert_same(_state(), ckpt.load_any(out))


def test_malformed_stock_record_is_a_corrupt_checkpoint(ckpts: dict[str, Path]) -> None:
    reader = ckpt.open_reader(str(ckpts["stock"]))
    md = reader.read_metadata()
    index = next(iter(md.storage_data))
    md.storage_data[index] = object()  # a record without the fields of one
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        ckpt.describe(reader)
