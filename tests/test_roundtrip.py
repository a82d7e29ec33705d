"""CompressedWriter/CompressedReader round trips over local paths, file://, memory:// and S3 (moto)."""

from __future__ import annotations

import os
import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_tiered import CheckpointNotFoundError, CompressedReader, CompressedWriter
from dcp_tiered.dcp.format import METADATA_FILE, is_native_record
from dcp_tiered.dcp.metadata_io import decode_metadata

CODECS = ["none", "lz4", "zstd", "zstd:3"]


def sample_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "fp32": torch.randn(257, 129, generator=g) * 0.02,
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(33, 7, generator=g).to(torch.float16),
        "fp64": torch.randn(40, generator=g, dtype=torch.float64),
        "int": torch.randint(-1000, 1000, (50,), generator=g),
        "int8": torch.randint(-100, 100, (17,), generator=g, dtype=torch.int8),
        "bool": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "view": torch.randn(64, 48, generator=g).t()[::2],
        "nested": {"a": {"b": torch.arange(10)}, "step": 12, "name": "run-1", "lr": 3e-4},
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40]),
    }


def zeros_like_state(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, dict):
            out[k] = zeros_like_state(v)
        else:
            out[k] = type(v)()
    return out


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k], b[k].contiguous().view(-1).view(torch.uint8) if b[k].numel() else b[k]), k
        elif isinstance(a[k], dict):
            assert_state_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


@pytest.fixture(params=["local", "file", "memory", "s3"])
def location(request, tmp_path) -> tuple[str, dict]:
    kind = request.param
    if kind == "local":
        return str(tmp_path / "ckpt"), {}
    if kind == "file":
        return f"file://{tmp_path}/ckpt", {}
    if kind == "memory":
        return f"memory://dcp-tiered-tests/{uuid.uuid4().hex}", {}
    bucket, opts = request.getfixturevalue("s3_bucket")
    return f"{bucket}/run/step_1", opts


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_every_dtype(location: tuple[str, dict], codec: str) -> None:
    url, opts = location
    sd = sample_state()
    dcp.save(sd, storage_writer=CompressedWriter(url, codec=codec, storage_options=opts, frame_size=4096), no_dist=True)
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=CompressedReader(url, storage_options=opts), no_dist=True)
    assert_state_equal({k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}, out)


def test_checkpoint_id_form_and_reuse_of_one_writer(tmp_path) -> None:
    writer = CompressedWriter(tmp_path / "unused", codec="lz4")
    for step in (1, 2):
        sd = {"w": torch.full((10,), float(step))}
        dcp.save(sd, checkpoint_id=str(tmp_path / f"step_{step}"), storage_writer=writer, no_dist=True)
    for step in (1, 2):
        out = {"w": torch.zeros(10)}
        reader = CompressedReader(tmp_path / "step_1")
        dcp.load(out, checkpoint_id=str(tmp_path / f"step_{step}"), storage_reader=reader, no_dist=True)
        assert torch.equal(out["w"], torch.full((10,), float(step)))


def test_metadata_holds_only_builtins_and_is_written_last(tmp_path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(sample_state(), storage_writer=CompressedWriter(path), no_dist=True)
    names = sorted(os.listdir(path))
    assert names == [METADATA_FILE, "__0_0.distcp"]
    assert os.stat(path / METADATA_FILE).st_mtime_ns >= os.stat(path / "__0_0.distcp").st_mtime_ns
    md = decode_metadata((path / METADATA_FILE).read_bytes(), "test")

    def builtins_only(x: object) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and builtins_only(v) for k, v in x.items())
        if isinstance(x, tuple):
            return all(builtins_only(v) for v in x)
        return isinstance(x, (str, int, float, bool, type(None)))

    assert md.storage_data and all(is_native_record(r) and builtins_only(r) for r in md.storage_data.values())
    rec = next(r for i, r in md.storage_data.items() if i.fqn == "fp32")
    assert rec["dtype"] == "float32" and rec["codec"] == "zstd:1" and rec["filter"] == "bytegroup-signswap"
    assert rec["checksum"] == "xxh3_64" and len(rec["sums"]) == len(rec["frames"])
    # plain pickle of the metadata references no class of this package
    assert b"dcp_tiered" not in pickle.dumps(md)


class _FailingPlanner(DefaultSavePlanner):
    """Fails while resolving the Nth item: a crash in the middle of writing data."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.seen = 0

    def resolve_data(self, write_item):
        self.seen += 1
        if self.seen == self.fail_at:
            raise RuntimeError("injected failure while writing")
        return super().resolve_data(write_item)


def test_failed_save_leaves_no_checkpoint(tmp_path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(BaseException, match="injected"):
        dcp.save(sample_state(), storage_writer=CompressedWriter(path), planner=_FailingPlanner(3), no_dist=True)
    assert not (path / METADATA_FILE).exists()
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        CompressedReader(path)


def test_failed_overwrite_never_leaves_metadata_describing_replaced_files(tmp_path) -> None:
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(1000)}, storage_writer=CompressedWriter(path), no_dist=True)
    with pytest.raises(BaseException, match="injected"):
        dcp.save({"w": torch.zeros(1000), "v": torch.ones(3)}, storage_writer=CompressedWriter(path, overwrite=True),
                 planner=_FailingPlanner(2), no_dist=True)
    # the old checkpoint was un-committed before its data file was rewritten
    assert not (path / METADATA_FILE).exists()


def test_overwrite_replaces_and_cleans_stale_files(tmp_path) -> None:
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(1000)}, storage_writer=CompressedWriter(path), no_dist=True)
    (path / "__7_0.distcp").write_bytes(b"stale file of an older, larger save")
    dcp.save({"w": torch.full((1000,), 2.0)}, storage_writer=CompressedWriter(path, overwrite=True), no_dist=True)
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    assert torch.equal(out["w"], torch.full((1000,), 2.0))
    assert sorted(os.listdir(path)) == [METADATA_FILE, "__0_0.distcp"]


def test_reader_without_verify_still_loads(tmp_path) -> None:
    sd = sample_state()
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "c", frame_size=4096), no_dist=True)
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "c", verify=False, threads=1), no_dist=True)
    assert torch.equal(out["fp32"], sd["fp32"])


def test_large_tensor_many_frames_partial_reads(tmp_path) -> None:
    """Loading a slice (as resharding does) decodes the right frames of a big tensor."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    full = torch.randn(512, 300)
    dcp.save({"w": full}, storage_writer=CompressedWriter(tmp_path / "c", frame_size=4096), no_dist=True)
    md = CompressedReader(tmp_path / "c").read_metadata()
    assert len(next(iter(md.storage_data.values()))["frames"]) > 100
    out = {"w": torch.zeros(512, 300)}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "c"), planner=DefaultLoadPlanner(), no_dist=True)
    assert torch.equal(out["w"], full)
