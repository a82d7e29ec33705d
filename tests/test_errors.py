"""Errors users meet: bad codec specs, wrong paths, existing checkpoints, overwrites,
missing buckets, unreachable endpoints and unknown format versions.

Every one is a ``dcp_tiered`` error that also derives from the fitting builtin, names
what is wrong, and comes quickly: never a bare KeyError/AssertionError, never a hang.
S3 runs against the real moto server of conftest.py.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import threading
import uuid

import fsspec
import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

from failures import failure_of
from dcp_tiered.dcp.metadata_io import unpack_metadata
from dcp_tiered import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CodecError,
    CompressedReader,
    CompressedWriter,
    ConfigError,
    CorruptCheckpointError,
    DcpTieredError,
    StorageError,
    UnsupportedFormatError,
)

HANG_LIMIT_S = 60  # a generous bound: only a hang (not a slow run) trips it


# --------------------------------------------------------------------------- helpers




def failure_within(seconds: float, fn) -> BaseException | None:
    """``failure_of(fn)`` run on a watchdog thread: fail the test if it has not returned in ``seconds``."""
    box: dict = {}

    def run() -> None:
        box["err"] = failure_of(fn)

    t = threading.Thread(target=run, name="watchdog-target", daemon=True)
    t.start()
    seconds = scaled(seconds)
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still running after {seconds} s: the call hangs instead of failing")
    return box["err"]


def assert_not_bare(err: BaseException | None) -> None:
    assert err is not None, "nothing was raised"
    assert isinstance(err, DcpTieredError), f"expected a dcp_tiered error, got {type(err).__name__}: {err}"


def state(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(2)
    return {
        "w": torch.randn(64, 32, generator=g) * scale,
        "b": torch.arange(10) * int(scale),
        "nested": {"h": (torch.randn(300, generator=g) * scale).bfloat16()},
        "name": f"run-{scale}",
    }


def blank(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        out[k] = blank(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else ""
    return out


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if isinstance(want[k], dict):
            assert_equal(got[k], want[k])
        elif isinstance(want[k], torch.Tensor):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        else:
            assert got[k] == want[k], k


def save(path, sd, storage_options=None, **kw) -> None:
    writer = CompressedWriter(path, storage_options=storage_options, frame_size=4096, sync_files=False, **kw)
    dcp.save(sd, storage_writer=writer, no_dist=True)


def load(path, like, storage_options=None) -> dict:
    out = blank(like)
    dcp.load(out, storage_reader=CompressedReader(path, storage_options=storage_options), no_dist=True)
    return out


def files_of(url: str, storage_options=None) -> dict[str, bytes]:
    """Every file under ``url`` with its bytes, by relative name, read through fsspec directly."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache()
    root = root.rstrip("/")
    try:
        found = fs.find(root)
    except FileNotFoundError:
        return {}
    return {os.path.relpath(p, root).replace(os.sep, "/"): fs.cat_file(p) for p in found}


def put_file(url: str, name: str, data: bytes, storage_options=None) -> None:
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.pipe_file(root.rstrip("/") + "/" + name, data)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["local", "memory", "s3"])
def location(request, tmp_path):
    """``(checkpoint url, storage_options)`` on each real backend."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    if request.param == "memory":
        return f"memory://dcp-tiered-errors-{uuid.uuid4().hex}/ckpt", None
    bucket, options = request.getfixturevalue("s3_bucket")
    return f"{bucket}/run/ckpt", options


# --------------------------------------------------------------------------- codec and config


@pytest.mark.parametrize("spec", ["zstd:0", "zstd:23", "gzip", "zstd:x", "zstd:", "zstd:-1", "zstd:3.5", "lz4:1", "", "none:1"])
def test_unknown_codec_or_level_fails_at_construction_listing_valid_ones(tmp_path, spec):
    path = tmp_path / "ckpt"
    with pytest.raises(CodecError) as info:
        CompressedWriter(path, codec=spec)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, ConfigError)
    msg = str(err)
    assert repr(spec) in msg, msg
    assert "1..22" in msg, f"valid zstd levels not listed: {msg}"
    if not spec.startswith("zstd"):
        assert all(name in msg for name in ("none", "lz4", "zstd")), f"valid codecs not listed: {msg}"
    assert not path.exists(), "a refused writer must not touch storage"


@pytest.mark.parametrize("spec", [None, 3, b"zstd"])
def test_codec_that_is_not_a_string_is_a_codec_error(tmp_path, spec):
    with pytest.raises(CodecError):
        CompressedWriter(tmp_path / "ckpt", codec=spec)


@pytest.mark.parametrize("spec", ["none", "lz4", "zstd", "zstd:1", "zstd:22"])
def test_valid_codecs_are_accepted(tmp_path, spec):
    CompressedWriter(tmp_path / "ckpt", codec=spec)


@pytest.mark.parametrize("kwargs", [{"frame_size": 100}, {"frame_size": 0}, {"threads": 0}, {"threads": -2}])
def test_bad_writer_options_are_config_errors(tmp_path, kwargs):
    with pytest.raises(ConfigError) as info:
        CompressedWriter(tmp_path / "ckpt", **kwargs)
    assert isinstance(info.value, ValueError)
    assert next(iter(kwargs)) in str(info.value)


def test_bad_reader_threads_is_a_config_error(tmp_path):
    save(tmp_path / "ckpt", state())
    with pytest.raises(ConfigError):
        CompressedReader(tmp_path / "ckpt", threads=0)


# --------------------------------------------------------------------------- not a checkpoint


def _interrupted_save(path) -> None:
    save(path, state())
    os.remove(os.path.join(path, ".metadata"))


@pytest.mark.parametrize("kind", ["missing dir", "empty dir", "data files only", "a file", "parent of a checkpoint", "memory://"])
def test_path_that_is_not_a_checkpoint(tmp_path, kind):
    path = str(tmp_path / "ckpt")
    if kind == "empty dir":
        os.makedirs(path)
    elif kind == "data files only":
        _interrupted_save(path)
    elif kind == "a file":
        with open(path, "wb") as f:
            f.write(b"not a checkpoint")
    elif kind == "parent of a checkpoint":
        save(os.path.join(path, "step_1"), state())
    elif kind == "memory://":
        path = f"memory://dcp-tiered-errors-{uuid.uuid4().hex}/nothing"
    err = failure_of(lambda: load(path, state()))
    assert isinstance(err, CheckpointNotFoundError), f"{type(err).__name__}: {err}"
    assert isinstance(err, FileNotFoundError)
    assert path in str(err)


def test_s3_prefix_without_checkpoint_is_not_a_checkpoint(s3_bucket):
    bucket, options = s3_bucket
    url = f"{bucket}/run/nothing-here"
    err = failure_within(HANG_LIMIT_S, lambda: load(url, state(), options))
    assert isinstance(err, CheckpointNotFoundError), f"{type(err).__name__}: {err}"
    assert url in str(err)


# --------------------------------------------------------------------------- exists / overwrite


def test_saving_twice_without_overwrite_is_refused_and_keeps_the_first(location):
    url, options = location
    save(url, state(1.0), options)
    before = files_of(url, options)
    err = failure_of(lambda: save(url, state(2.0), options))
    assert isinstance(err, CheckpointExistsError), f"{type(err).__name__}: {err}"
    assert isinstance(err, FileExistsError)
    assert url in str(err) and "overwrite" in str(err)
    assert files_of(url, options) == before, "a refused save changed the existing checkpoint"
    assert_equal(load(url, state(1.0), options), state(1.0))


def test_overwrite_replaces_values_and_leaves_no_stale_data_files(location):
    url, options = location
    save(url, state(1.0), options)
    # A data file of an earlier save with more ranks: no longer part of any checkpoint here.
    put_file(url, "__7_0.distcp", b"stale bytes of an older save", options)
    new = {"w": torch.full((8, 8), 3.0), "extra": torch.arange(5, dtype=torch.int32), "name": "second"}
    save(url, new, options, overwrite=True)

    assert_equal(load(url, new, options), new)
    md = CompressedReader(url, storage_options=options).read_metadata()
    assert set(md.state_dict_metadata) == {"w", "extra", "name"}, "keys of the first save are still described"
    referenced = {rec["file"] for rec in md.storage_data.values()}
    present = files_of(url, options)
    assert referenced <= set(present), f"metadata names missing files {referenced - set(present)}"
    data_files = {n for n in present if n.endswith(".distcp")}
    assert data_files == referenced, f"stale data files remain: {sorted(data_files - referenced)}"
    assert not [n for n in present if n.endswith(".tmp")], f"temporary files left: {sorted(present)}"
    # The old values are gone, not merely shadowed: loading the old layout fails clearly.
    err = failure_of(lambda: load(url, {"b": torch.zeros(10, dtype=torch.int64)}, options))
    assert err is not None


def test_overwrite_of_a_path_without_checkpoint_is_a_plain_save(tmp_path):
    save(tmp_path / "ckpt", state(), overwrite=True)
    assert_equal(load(tmp_path / "ckpt", state()), state())


# --------------------------------------------------------------------------- S3 failures


def test_missing_bucket_names_the_bucket(moto_server):
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/run/step_1"
    options = moto_server.storage_options
    for action in (lambda: save(url, state(), options), lambda: load(url, state(), options)):
        err = failure_within(HANG_LIMIT_S, action)
        assert_not_bare(err)
        assert isinstance(err, (StorageError, FileNotFoundError)), f"{type(err).__name__}: {err}"
        assert bucket in str(err), str(err)


def _unreachable_options() -> dict:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{closed_port()}", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2, "read_timeout": 2},
        "skip_instance_cache": True,
    }


@pytest.mark.parametrize("action", ["save", "load"])
def test_unreachable_endpoint_fails_instead_of_hanging(action):
    options = _unreachable_options()
    url = "s3://some-bucket/run/step_1"
    fn = (lambda: save(url, state(), options)) if action == "save" else (lambda: load(url, state(), options))
    err = failure_within(HANG_LIMIT_S, fn)
    assert_not_bare(err)
    assert isinstance(err, StorageError) and isinstance(err, OSError), f"{type(err).__name__}: {err}"


@pytest.mark.parametrize("action", ["save", "load"])
def test_unreachable_endpoint_is_not_reported_as_a_missing_bucket(action):
    options = _unreachable_options()
    endpoint = options["client_kwargs"]["endpoint_url"]
    url = "s3://some-bucket/run/step_1"
    fn = (lambda: save(url, state(), options)) if action == "save" else (lambda: load(url, state(), options))
    err = failure_within(HANG_LIMIT_S, fn)
    assert_not_bare(err)
    msg = str(err)
    assert "does not exist" not in msg, f"an unreachable endpoint was reported as a missing bucket: {msg}"
    assert endpoint.split("//")[1] in msg or "connect" in msg.lower(), f"the error does not say the endpoint is unreachable: {msg}"
    assert not isinstance(err, FileNotFoundError), f"{type(err).__name__}: {msg}"


# --------------------------------------------------------------------------- format versions and bad records


_DELETE = object()


def _edit_records(path, edit) -> None:
    """Rewrite each storage record ``rec`` of ``fqn`` as ``edit(fqn, rec)`` (``_DELETE`` drops it)."""
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        md = unpack_metadata(f.read())  # our own checkpoint: plain pickle is fine here
    for idx in list(md.storage_data):
        new = edit(idx.fqn, md.storage_data[idx])
        if new is _DELETE:
            del md.storage_data[idx]
        else:
            md.storage_data[idx] = new
    with open(meta, "wb") as f:
        pickle.dump(md, f)


def _set(fqn: str, **changes):
    def edit(name, rec):
        return {**rec, **changes} if name == fqn else rec

    return edit


def test_unknown_format_version_is_unsupported(tmp_path):
    path = str(tmp_path / "ckpt")
    save(path, state())
    _edit_records(path, _set("w", fmt=99))
    err = failure_of(lambda: load(path, state()))
    assert isinstance(err, UnsupportedFormatError), f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError)
    assert "99" in str(err) and "'w'" in str(err) and path in str(err)


@pytest.mark.parametrize(
    "changes,what",
    [
        ({"filter": "bytegroup-v9"}, "bytegroup-v9"),
        ({"codec": "brotli"}, "brotli"),
        ({"codec": "zstd:99"}, "zstd:99"),
        ({"dtype": "float128"}, "float128"),
        ({"kind": "sparse"}, "sparse"),
    ],
)
def test_unknown_transform_in_a_record_is_unsupported(tmp_path, changes, what):
    # What a newer dcp_tiered might write: refused as a format this version cannot read.
    path = str(tmp_path / "ckpt")
    save(path, state())
    _edit_records(path, _set("w", **changes))
    err = failure_of(lambda: load(path, state()))
    assert isinstance(err, UnsupportedFormatError), f"{type(err).__name__}: {err}"
    assert what in str(err) and "'w'" in str(err)


def test_unknown_stock_stream_transform_is_unsupported(tmp_path):
    path = str(tmp_path / "ckpt")
    sd = {"w": torch.ones(8)}
    dcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False, _extensions=[ZStandard()]), no_dist=True)
    _edit_records(path, lambda fqn, rec: dataclasses.replace(rec, transform_descriptors=["stream.brotli/1"]))
    err = failure_of(lambda: load(path, sd))
    assert isinstance(err, UnsupportedFormatError), f"{type(err).__name__}: {err}"
    assert "stream.brotli/1" in str(err)


REQUIRED = ["fmt", "kind", "file", "offset", "length", "raw", "codec", "filter", "itemsize", "frame", "frames", "sums", "dtype", "shape"]


@pytest.mark.parametrize("field", REQUIRED)
def test_record_missing_a_field_is_a_clear_error(tmp_path, field):
    path = str(tmp_path / "ckpt")
    save(path, state())
    _edit_records(path, lambda fqn, rec: {k: v for k, v in rec.items() if k != field} if fqn == "w" else rec)
    err = failure_of(lambda: load(path, state()))
    assert_not_bare(err)
    assert isinstance(err, (CorruptCheckpointError, UnsupportedFormatError)), f"{type(err).__name__}: {err}"
    assert "'w'" in str(err)


@pytest.mark.parametrize(
    "case",
    ["record missing", "record is a string", "record is None", "storage_data is None", "storage_data is a list"],
)
def test_malformed_storage_data_is_a_clear_error(tmp_path, case):
    path = str(tmp_path / "ckpt")
    save(path, state())
    if case == "record missing":
        _edit_records(path, lambda fqn, rec: _DELETE if fqn == "w" else rec)
    elif case == "record is a string":
        _edit_records(path, lambda fqn, rec: "__0_0.distcp" if fqn == "w" else rec)
    elif case == "record is None":
        _edit_records(path, lambda fqn, rec: None if fqn == "w" else rec)
    else:
        meta = os.path.join(path, ".metadata")
        with open(meta, "rb") as f:
            md = unpack_metadata(f.read())
        md.storage_data = None if case == "storage_data is None" else list(md.storage_data.values())
        with open(meta, "wb") as f:
            pickle.dump(md, f)
    err = failure_of(lambda: load(path, state()))
    assert_not_bare(err)
    assert isinstance(err, CorruptCheckpointError), f"{type(err).__name__}: {err}"


def test_errors_derive_from_the_fitting_builtins():
    import dcp_tiered

    assert issubclass(dcp_tiered.CodecError, ValueError)
    assert issubclass(dcp_tiered.ConfigError, ValueError)
    assert issubclass(dcp_tiered.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(dcp_tiered.CheckpointExistsError, FileExistsError)
    assert issubclass(dcp_tiered.CorruptCheckpointError, ValueError)
    assert issubclass(dcp_tiered.UnsafeCheckpointError, dcp_tiered.CorruptCheckpointError)
    assert issubclass(dcp_tiered.UnsupportedFormatError, ValueError)
    assert issubclass(dcp_tiered.StorageError, OSError)
    for name in ("CodecError", "ConfigError", "CheckpointNotFoundError", "CheckpointExistsError", "CorruptCheckpointError",
                 "UnsafeCheckpointError", "UnsupportedFormatError", "StorageError"):
        assert issubclass(getattr(dcp_tiered, name), dcp_tiered.DcpTieredError), name


@pytest.mark.parametrize("content", [b"not a pickle", b""])
def test_dcp_load_reports_metadata_errors_with_their_own_type(tmp_path, content):
    # README: "Inside dcp.save / dcp.load, DCP wraps them in its CheckpointException ...; the
    # original error is in exc.failures[rank][0]". torch 2.13's dcp.load catches whatever
    # read_metadata() raises and raises AssertionError("metadata is None; ...") in its place,
    # so unless the reader surfaces metadata errors before DCP calls read_metadata(), users get
    # a bare AssertionError for a corrupt or malicious .metadata.
    path = tmp_path / "ckpt"
    save(path, state())
    (path / ".metadata").write_bytes(content)
    err = failure_of(lambda: load(path, state()))
    assert isinstance(err, CorruptCheckpointError), f"{type(err).__name__}: {str(err)[:200]}"


@pytest.mark.parametrize("kwargs", [{"threads": "2"}, {"threads": 2.5}, {"threads": True}, {"threads": 0},
                                    {"max_object_bytes": "1"}, {"max_object_bytes": -1}])
def test_reader_arguments_are_checked_as_the_writers_are(tmp_path, kwargs) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=CompressedWriter(tmp_path / "c"), no_dist=True)
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        CompressedReader(tmp_path / "c", **kwargs)
