"""Safe loading and corruption detection: crafted and damaged checkpoints never run code,
never allocate unbounded memory, never load silently wrong values, and fail with a
``dcp_tiered`` error that names the file, the tensor key and the checkpoint.

Everything runs on real local directories. Huge-allocation cases run under an address
space cap (``memory_cap``) so that a regression fails fast instead of eating the machine.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import io
import os
import pickle
import resource
import shlex
import shutil
import struct
import subprocess
import time
import tracemalloc
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

from failures import failure_of
from dcp_tiered.dcp.metadata_io import unpack_metadata
from dcp_tiered import (
    CheckpointNotFoundError,
    CompressedReader,
    CompressedWriter,
    CorruptCheckpointError,
    DcpTieredError,
    UnsafeCheckpointError,
)
from dcp_tiered.codecs import FrameCodec, filter_for
from dcp_tiered.dcp.safe_pickle import safe_loads

FRAME = 4096
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- helpers


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def memory_cap(extra: int = 4 << 30):
    """Cap this process's address space at its current size plus ``extra``.

    A reader that trusts a lying size and allocates terabytes (or zero-fills gigabytes)
    then fails at once with MemoryError/RuntimeError instead of thrashing the machine.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))




def is_dcp_metadata_wrapper(err: BaseException | None) -> bool:
    """DCP (torch 2.13) turns any read_metadata() failure into
    ``AssertionError('metadata is None; global metadata read failed: <message>; ...')``; the
    original type is lost, only its message survives."""
    return isinstance(err, AssertionError) and "global metadata read failed:" in str(err)


def assert_error(err: BaseException | None, cls: type, *needles: str) -> None:
    """``err`` is a ``cls`` (or DCP's read_metadata wrapper carrying one's message) naming each needle."""
    assert err is not None, f"expected {cls.__name__}, nothing was raised"
    if not is_dcp_metadata_wrapper(err):
        assert isinstance(err, cls), f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    for needle in needles:
        assert needle in str(err), f"{needle!r} not in error message: {err}"


def save(path, state, codec="zstd", **kw) -> Path:
    dcp.save(state, storage_writer=CompressedWriter(path, codec=codec, frame_size=FRAME, sync_files=False, **kw), no_dist=True)
    return Path(path)


def zeros_like_state(state):
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, str):
        return ""
    if isinstance(state, int):
        return 0
    return None


def load(path, like, **reader_kw):
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=CompressedReader(path, **reader_kw), no_dist=True)
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    else:
        assert a == b


def records(ckpt: Path) -> dict:
    """``{fqn: record}`` of a checkpoint we wrote ourselves (so plain pickle is fine here)."""
    md = unpack_metadata((ckpt / ".metadata").read_bytes())
    return {idx.fqn: rec for idx, rec in md.storage_data.items()}


def rewrite_metadata(ckpt: Path, edit) -> None:
    md = unpack_metadata((ckpt / ".metadata").read_bytes())
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def edit_record(ckpt: Path, fqn: str, **changes) -> None:
    def _edit(md):
        for idx, rec in list(md.storage_data.items()):
            if idx.fqn == fqn:
                if isinstance(rec, dict):
                    rec.update(changes)
                else:  # stock _StorageInfo
                    md.storage_data[idx] = dataclasses.replace(rec, **changes)
                return
        raise LookupError(fqn)

    rewrite_metadata(ckpt, _edit)


def state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "big": torch.randn(4096, generator=g),  # 16 KiB float32: 4 frames, byte-grouped
        "ids": torch.arange(1000),  # int64: 2 frames, unfiltered
        "half": torch.randn(3000, generator=g).to(torch.bfloat16),  # 2 frames, sign-rotated planes
        "note": "a string item",
        "step": 7,
    }


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return save(tmp_path / "ckpt", state())


class _Reduce:
    """Pickles as ``fn(*args)``: the classic code-execution payload."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


UNPICKLED: list = []


class Custom:
    """A harmless custom class: still must not be unpickled from a checkpoint."""

    def __init__(self, value):
        self.value = value

    def __setstate__(self, st):
        UNPICKLED.append(st)
        self.__dict__.update(st)


def assert_not_created(marker: Path, wait: float = 0.0) -> None:
    deadline = time.monotonic() + scaled(wait)
    while True:
        assert not marker.exists(), f"the payload ran: {marker} was created"
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


# --------------------------------------------------------------------------- malicious .metadata


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _payloads(marker: Path) -> dict[str, bytes]:
    m = str(marker)
    touch = f"open({m!r}, 'w').close()"
    return {
        "os.system": pickle.dumps(_Reduce(os.system, f"touch {shlex.quote(m)}")),
        "os.system-protocol0": pickle.dumps(_Reduce(os.system, f"touch {shlex.quote(m)}"), protocol=0),
        "eval": pickle.dumps(_Reduce(builtins.eval, touch)),
        "exec": pickle.dumps(_Reduce(builtins.exec, touch)),
        "subprocess.Popen": pickle.dumps(_Reduce(subprocess.Popen, ["touch", m])),
        "getattr-gadget": pickle.dumps(_Reduce(getattr, _Reduce(builtins.__import__, "os"), "system")),
        # an allowed module, a disallowed attribute reached through a dotted name (protocol 4):
        # pathlib.Path.write_text(PosixPath(marker), "x")
        "pathlib.Path.write_text": b"\x80\x04\x8c\x07pathlib\x8c\x0fPath.write_text\x93"
        + b"\x8c\x07pathlib\x8c\x09PosixPath\x93" + _unicode(m) + b"\x85R"
        + _unicode("x") + b"\x86R.",
        "torch.load": pickle.dumps(_Reduce(torch.load, m)),
    }


def _metadata_with_payload(ckpt: Path, marker: Path) -> bytes:
    """A real checkpoint's metadata with a payload hidden in a field DCP never inspects."""
    md = unpack_metadata((ckpt / ".metadata").read_bytes())
    md.planner_data = {"x": _Reduce(os.system, f"touch {shlex.quote(str(marker))}")}
    return pickle.dumps(md)


@pytest.mark.parametrize("name", ["os.system", "os.system-protocol0", "eval", "exec", "subprocess.Popen", "pathlib.Path.write_text"])
def test_payloads_do_run_under_plain_pickle(tmp_path, name):
    """The payloads are real: plain pickle runs them (so the refusals below are not vacuous)."""
    marker = tmp_path / "ran"
    result = pickle.loads(_payloads(marker)[name])
    if isinstance(result, subprocess.Popen):
        result.wait(scaled(30))
    assert marker.exists()


@pytest.mark.parametrize("name", list(_payloads(Path("/m"))) + ["inside-real-metadata"])
def test_code_payload_in_metadata_runs_nothing(ckpt, tmp_path, name):
    marker = tmp_path / f"PWNED-{name}"
    data = _metadata_with_payload(ckpt, marker) if name == "inside-real-metadata" else _payloads(marker)[name]
    (ckpt / ".metadata").write_bytes(data)
    where = str(ckpt / ".metadata")

    err = failure_of(lambda: CompressedReader(ckpt).read_metadata())
    assert_error(err, UnsafeCheckpointError, where)
    assert_not_created(marker)

    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, UnsafeCheckpointError, where)
    assert_not_created(marker, wait=0.3 if "Popen" in name or "system" in name else 0.0)


@pytest.mark.parametrize(
    "name,data,cls",
    [
        ("empty", b"", CorruptCheckpointError),
        ("text", b"this is not a pickle, just text\n", CorruptCheckpointError),
        ("zeros", bytes(64), CorruptCheckpointError),
        ("json", b'{"state_dict_metadata": {}}', CorruptCheckpointError),
        ("torch.save zip", None, CorruptCheckpointError),
        ("a dict, not Metadata", pickle.dumps({"state_dict_metadata": {}}), CorruptCheckpointError),
        ("collections.Counter", pickle.dumps(collections.Counter(a=1)), UnsafeCheckpointError),
        ("test-module class", pickle.dumps(Custom(1)), UnsafeCheckpointError),
        ("truncated pickle", pickle.dumps(list(range(100)))[:-7], CorruptCheckpointError),
    ],
)
def test_metadata_that_is_not_dcp_metadata_is_refused(ckpt, name, data, cls):
    if data is None:
        buf = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buf)
        data = buf.getvalue()
    (ckpt / ".metadata").write_bytes(data)
    UNPICKLED.clear()
    assert_error(failure_of(lambda: CompressedReader(ckpt).read_metadata()), cls, str(ckpt / ".metadata"))
    assert_error(failure_of(lambda: load(ckpt, state())), cls, str(ckpt / ".metadata"))
    assert UNPICKLED == []


def test_windows_path_in_metadata_is_a_dcp_tiered_error():
    # pathlib.WindowsPath is on the allow-list, but instantiating it on Linux raises
    # NotImplementedError, which safe_loads does not translate.
    data = b"\x80\x02cpathlib\nWindowsPath\nX\x01\x00\x00\x00a\x85R."
    err = failure_of(lambda: safe_loads(data, "x/.metadata"))
    assert isinstance(err, CorruptCheckpointError), f"{type(err).__name__}: {err}"


def test_metadata_pickle_memo_cannot_allocate_gigabytes(ckpt):
    # 9 bytes: push None, then LONG_BINPUT with memo index 2**25. The C unpickler grows (and
    # zero-fills) its memo table to 2 * index entries: 512 MiB here, up to 64 GiB for an index of 2**32-1.
    # A single bit flip in a real .metadata (REDUCE 'R' -> LONG_BINPUT 'r') does the same.
    (ckpt / ".metadata").write_bytes(b"\x80\x02Nr" + struct.pack("<I", 1 << 25) + b".")
    tracemalloc.start()
    try:
        with memory_cap():
            err = failure_of(lambda: CompressedReader(ckpt).read_metadata())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(err, CorruptCheckpointError), f"{type(err).__name__}: {err}"
    assert peak < 64 << 20, f"reading a 9-byte .metadata allocated {peak >> 20} MiB"


# --------------------------------------------------------------------------- non-tensor items


def unchecked_objects(monkeypatch) -> None:
    """Let CompressedWriter write objects a reader must refuse (it refuses them at save otherwise)."""
    monkeypatch.setattr("dcp_tiered.dcp.writer.encode_object", lambda item, data, *a: (data.getvalue(), {}))


def test_custom_class_bytes_item_is_not_unpickled(tmp_path, monkeypatch):
    unchecked_objects(monkeypatch)
    path = save(tmp_path / "c", {"obj": Custom(3), "w": torch.ones(4)})
    UNPICKLED.clear()
    err = failure_of(lambda: load(path, {"obj": Custom(0), "w": torch.ones(4)}))
    assert_error(err, UnsafeCheckpointError, "'obj'", str(path))
    assert UNPICKLED == []


@pytest.mark.parametrize("writer", ["compressed", "stock", "stock-zstd"])
def test_code_payload_in_bytes_item_runs_nothing(tmp_path, writer, monkeypatch):
    unchecked_objects(monkeypatch)
    marker = tmp_path / "PWNED"
    sd = {"obj": _Reduce(os.system, f"touch {shlex.quote(str(marker))}"), "w": torch.ones(4)}
    path = tmp_path / "c"
    if writer == "compressed":
        save(path, sd)
    else:
        ext = [ZStandard()] if writer == "stock-zstd" else None
        dcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False, _extensions=ext), no_dist=True)
    err = failure_of(lambda: load(path, {"obj": None, "w": torch.zeros(4)}))
    assert_error(err, UnsafeCheckpointError, "'obj'")
    assert_not_created(marker, wait=0.3)


def test_code_payload_in_stock_tensor_item_runs_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "c"
    dcp.save({"w": torch.ones(4)}, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    buf = io.BytesIO()
    torch.save(_Reduce(os.system, f"touch {shlex.quote(str(marker))}"), buf)
    (path / "evil.distcp").write_bytes(buf.getvalue())
    edit_record(path, "w", relative_path="evil.distcp", offset=0, length=len(buf.getvalue()))
    err = failure_of(lambda: load(path, {"w": torch.zeros(4)}))
    assert_error(err, CorruptCheckpointError, "'w'")
    assert_not_created(marker, wait=0.3)


# --------------------------------------------------------------------------- path containment

ESCAPES = ["../x", "/etc/passwd", "s3://other/x", "a/../../x", "..", "file:///etc/passwd", "~/x", "C:\\x", "a\x00b", ""]


@pytest.mark.parametrize("name", ESCAPES)
def test_native_record_file_escaping_the_checkpoint_is_refused(ckpt, name):
    edit_record(ckpt, "big", file=name)
    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, UnsafeCheckpointError, "'big'", str(ckpt))


@pytest.mark.parametrize("name", ESCAPES[:4])
def test_stock_record_file_escaping_the_checkpoint_is_refused(tmp_path, name):
    path = tmp_path / "c"
    dcp.save({"w": torch.ones(4)}, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    edit_record(path, "w", relative_path=name)
    err = failure_of(lambda: load(path, {"w": torch.zeros(4)}))
    assert_error(err, UnsafeCheckpointError, "'w'")


def test_escaping_file_is_refused_even_when_it_exists(tmp_path):
    # The target exists and holds the very bytes the record describes: containment, not
    # a missing file, must be what stops the read.
    ckpt = save(tmp_path / "ckpt", state())
    shutil.copy(ckpt / "__0_0.distcp", tmp_path / "outside.distcp")
    edit_record(ckpt, "big", file="../outside.distcp")
    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, UnsafeCheckpointError, "'big'")


# --------------------------------------------------------------------------- bombs and lying sizes


def _rle_zstd(total: int, declared: int | None = None) -> bytes:
    """A hand-built zstd frame of RLE blocks: 4 stored bytes per 128 KiB of output.

    ``declared`` sets the frame content size field (single segment); None leaves it out.
    """
    if declared is None:
        out = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0x00, 17 << 3]))  # no content size, 128 MiB window
    else:
        out = bytearray(b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", declared))
    left = total
    while left:
        n = min(left, 1 << 17)
        left -= n
        out += struct.pack("<I", (left == 0) | (1 << 1) | (n << 3))[:3] + b"\x07"
    return bytes(out)


def _replace_frame(ckpt: Path, fqn: str, planes: list[bytes]) -> None:
    """Append a stored frame made of compressed ``planes`` and point ``fqn``'s record at it,
    with a valid checksum: what an attacker who controls the whole checkpoint can do."""
    frame = struct.pack("<B", len(planes)) + b"".join(struct.pack("<BI", 1, len(p)) for p in planes) + b"".join(planes)
    data = ckpt / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(frame)
    edit_record(ckpt, fqn, offset=offset, length=len(frame), frames=(len(frame),), sums=(xxhash.xxh3_64_intdigest(frame),))


def test_rle_bomb_helper_is_a_real_bomb():
    bomb = _rle_zstd(64 << 20)
    assert len(bomb) < 4096
    reader = zstandard.ZstdDecompressor().stream_reader(bomb)
    total = 0
    while chunk := reader.read(8 << 20):
        total += len(chunk)
    assert total == 64 << 20


@pytest.mark.parametrize(
    "case,fqn,planes",
    [
        ("declares 1 TiB", "ids", [_rle_zstd(4000, declared=1 << 40)]),
        ("declares 1 GiB", "ids", [_rle_zstd(4000, declared=1 << 30)]),
        ("no size, inflates to 256 MiB", "ids", [_rle_zstd(256 << 20)]),
        ("per-plane bomb", "big", [_rle_zstd(64 << 20)] * 4),
    ],
)
def test_zstd_bomb_frames_are_refused_without_inflating(tmp_path, case, fqn, planes):
    g = torch.Generator().manual_seed(0)
    sd = {"ids": torch.arange(500), "big": torch.randn(1000, generator=g)}  # one 4000-byte frame each
    ckpt = save(tmp_path / "c", sd)
    _replace_frame(ckpt, fqn, planes)
    tracemalloc.start()
    try:
        with memory_cap():
            err = failure_of(lambda: load(ckpt, sd))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_error(err, CorruptCheckpointError, f"'{fqn}'", str(ckpt))
    assert peak < 64 << 20, f"{case}: decoding allocated {peak >> 20} MiB"


def _one_frame(rec: dict) -> dict:
    """Collapse a record's frame table into one frame, so a grown ``frame`` size stays consistent."""
    return {"frames": (rec["length"],), "sums": rec["sums"][:1]}


# Each lie is made internally consistent (frame count, stored length, shape x itemsize = raw),
# so only a cross-check against the data file or DCP's own chunk sizes can catch it.
LIES = {
    # bytes item: raw and frame size grown together keep the frame table consistent
    "bytes raw 32 TiB": ("note", lambda r: dict(raw=1 << 45, frame=1 << 45)),
    "bytes raw 1 GiB": ("note", lambda r: dict(raw=1 << 30, frame=1 << 30)),
    # tensor whose record shape (not DCP's chunk size) lies
    "tensor shape 4 TiB": ("big", lambda r: dict(shape=(1 << 40,), raw=4 << 40, frame=4 << 40, **_one_frame(r))),
    "tensor shape 16 GiB": ("big", lambda r: dict(shape=(1 << 32,), raw=16 << 30, frame=16 << 30, **_one_frame(r))),
    "int64 tensor shape 16 GiB": ("ids", lambda r: dict(shape=(1 << 31,), raw=16 << 30, frame=16 << 30, **_one_frame(r))),
    "tensor shape of another rank": ("big", lambda r: dict(shape=(1 << 20, 1 << 20), raw=4 << 40, frame=4 << 40, **_one_frame(r))),
    # a frame whose stored length lies (the file is a few KiB)
    "stored frame 1 TiB": ("ids", lambda r: dict(frames=(1 << 40, 10), length=(1 << 40) + 10)),
    "stored frame 16 GiB": ("ids", lambda r: dict(frames=(1 << 34, 10), length=(1 << 34) + 10)),
    # smaller lies
    "raw one element short": ("ids", lambda r: dict(raw=7992)),
    "raw one frame more": ("ids", lambda r: dict(raw=8000 + FRAME)),
    "shape smaller": ("big", lambda r: dict(shape=(2048,), raw=8192, frames=r["frames"][:2], sums=r["sums"][:2], length=sum(r["frames"][:2]))),
    "frame count short": ("big", lambda r: dict(frames=(1,), sums=(0,), length=1)),
    "frame size halved": ("big", lambda r: dict(frame=FRAME // 2)),
    "dtype itemsize mismatch": ("big", lambda r: dict(dtype="float64")),
    "negative offset": ("big", lambda r: dict(offset=-1)),
    "frame table with a str": ("big", lambda r: dict(frames=("a", 1, 2, 3))),
    "frame table as a list": ("big", lambda r: dict(frames=list(r["frames"]))),
    "shape with a float": ("big", lambda r: dict(shape=(4096.0,))),
    "itemsize zero": ("ids", lambda r: dict(itemsize=0)),
}


@pytest.mark.parametrize("case", list(LIES))
def test_lying_record_sizes_raise_corrupt_without_huge_allocation(ckpt, case):
    fqn, lie = LIES[case]
    edit_record(ckpt, fqn, **lie(records(ckpt)[fqn]))
    tracemalloc.start()
    try:
        with memory_cap():
            err = failure_of(lambda: load(ckpt, state()))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_error(err, CorruptCheckpointError, f"'{fqn}'", str(ckpt))
    assert peak < 256 << 20, f"{case}: allocated {peak >> 20} MiB"


@pytest.mark.parametrize("length", [1 << 40, 1 << 30])
def test_stock_record_with_lying_length_is_refused_without_huge_allocation(tmp_path, length):
    path = tmp_path / "c"
    dcp.save({"w": torch.ones(4), "s": "text"}, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    edit_record(path, "w", length=length)  # the data file holds about 1.5 KiB
    tracemalloc.start()
    try:
        with memory_cap():
            err = failure_of(lambda: load(path, {"w": torch.zeros(4), "s": ""}))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_error(err, CorruptCheckpointError, "'w'")
    assert peak < 64 << 20, f"a {length}-byte lie allocated {peak >> 20} MiB"


def test_stock_zstd_item_inflating_past_its_tensor_size_is_refused(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": torch.ones(16)}, storage_writer=FileSystemWriter(path, sync_files=False, _extensions=[ZStandard()]), no_dist=True)
    bomb = _rle_zstd(256 << 20)
    (path / "bomb.distcp").write_bytes(bomb)
    edit_record(path, "w", relative_path="bomb.distcp", offset=0, length=len(bomb))
    tracemalloc.start()
    try:
        with memory_cap():
            err = failure_of(lambda: load(path, {"w": torch.zeros(16)}))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_error(err, CorruptCheckpointError, "'w'")
    assert peak < 64 << 20, f"allocated {peak >> 20} MiB"


# --------------------------------------------------------------------------- corruption of data files


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none"])
@pytest.mark.parametrize("fqn", ["big", "ids", "half", "note"])
def test_bit_flip_in_data_file_names_frame_key_and_file(tmp_path, codec, fqn):
    ckpt = save(tmp_path / "ckpt", state(), codec=codec)
    rec = records(ckpt)[fqn]
    n = len(rec["frames"]) - 1  # the last frame of the item
    pos = rec["offset"] + sum(rec["frames"][:n]) + rec["frames"][n] // 2
    data = bytearray((ckpt / rec["file"]).read_bytes())
    data[pos] ^= 0x10
    (ckpt / rec["file"]).write_bytes(bytes(data))
    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, CorruptCheckpointError, f"frame {n} of '{fqn}'", str(ckpt / rec["file"]))
    assert "checksum mismatch" in str(err)


def test_every_single_bit_flip_of_a_frame_is_detected(tmp_path):
    sd = {"w": torch.randn(16, generator=torch.Generator().manual_seed(3))}
    ckpt = save(tmp_path / "ckpt", sd)
    rec = records(ckpt)["w"]
    original = (ckpt / rec["file"]).read_bytes()
    for pos in range(rec["offset"], rec["offset"] + rec["length"]):
        for bit in range(8):
            data = bytearray(original)
            data[pos] ^= 1 << bit
            (ckpt / rec["file"]).write_bytes(bytes(data))
            err = failure_of(lambda: load(ckpt, sd))
            assert isinstance(err, CorruptCheckpointError), f"flip of bit {bit} at {pos}: {type(err).__name__}: {err}"


def test_truncated_data_file_names_file_key_and_checkpoint(ckpt):
    recs = records(ckpt)
    last = max(recs, key=lambda k: recs[k]["offset"])  # only this item loses bytes
    rec = recs[last]
    data = (ckpt / rec["file"]).read_bytes()
    (ckpt / rec["file"]).write_bytes(data[: rec["offset"] + rec["length"] // 2])
    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, CorruptCheckpointError, str(ckpt / rec["file"]), f"'{last}'")


def test_data_file_truncated_to_nothing_is_detected(ckpt):
    (ckpt / "__0_0.distcp").write_bytes(b"")
    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, CorruptCheckpointError, str(ckpt / "__0_0.distcp"))


def test_deleted_data_file_names_file_key_and_checkpoint(ckpt):
    (ckpt / "__0_0.distcp").unlink()
    err = failure_of(lambda: load(ckpt, state()))
    assert isinstance(err, (CheckpointNotFoundError, CorruptCheckpointError)), f"{type(err).__name__}: {err}"
    assert str(ckpt / "__0_0.distcp") in str(err)
    assert any(f"'{k}'" in str(err) for k in state()), f"no tensor key in: {err}"


def test_extra_bytes_after_the_data_are_harmless(ckpt):
    with open(ckpt / "__0_0.distcp", "ab") as f:
        f.write(os.urandom(1000))
    assert_same(load(ckpt, state()), state())


# --------------------------------------------------------------------------- corruption of .metadata


def test_deleted_metadata_is_not_a_checkpoint(ckpt):
    (ckpt / ".metadata").unlink()
    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, CheckpointNotFoundError, str(ckpt), ".metadata")
    assert isinstance(err, FileNotFoundError)


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, 0.99])
def test_truncated_metadata_is_corrupt(ckpt, keep):
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: int(len(data) * keep)])
    err = failure_of(lambda: CompressedReader(ckpt).read_metadata())
    assert_error(err, CorruptCheckpointError, str(ckpt / ".metadata"))
    err = failure_of(lambda: load(ckpt, state()))
    assert_error(err, CorruptCheckpointError, str(ckpt / ".metadata"))


@pytest.fixture(scope="module")
def metadata_flip_scan(tmp_path_factory):
    """Flip one bit in every byte of a real .metadata (bit chosen per byte) and load.

    Returns ``[(pos, bit, outcome)]`` where outcome is "equal", "WRONG VALUES" or the error.
    """
    root = tmp_path_factory.mktemp("flips")
    sd = {k: v for k, v in state().items() if k != "half"}
    ckpt = save(root / "ckpt", sd)
    original = (ckpt / ".metadata").read_bytes()
    out = []
    with memory_cap(2 << 30):
        for pos in range(len(original)):
            bit = (pos * 3) % 8
            data = bytearray(original)
            data[pos] ^= 1 << bit
            (ckpt / ".metadata").write_bytes(bytes(data))
            err = failure_of(lambda: CompressedReader(ckpt).read_metadata())
            if err is None:
                loaded = {}

                def go():
                    loaded["v"] = load(ckpt, sd)

                err = failure_of(go)
                if err is None:
                    try:
                        assert_same(loaded["v"], sd)
                        err = "equal"
                    except AssertionError:
                        err = "WRONG VALUES"
            out.append((pos, bit, err))
    return out


def test_metadata_bit_flips_never_load_wrong_values(metadata_flip_scan):
    wrong = [(pos, bit) for pos, bit, outcome in metadata_flip_scan if outcome == "WRONG VALUES"]
    assert not wrong, f"{len(wrong)} single-bit flips of .metadata loaded silently wrong values: (byte, bit) {wrong}"


def test_metadata_bit_flips_fail_with_dcp_tiered_errors(metadata_flip_scan):
    bad = {}
    for pos, bit, outcome in metadata_flip_scan:
        if isinstance(outcome, BaseException) and not isinstance(outcome, DcpTieredError):
            bad.setdefault(f"{type(outcome).__name__}: {str(outcome)[:80]}", []).append((pos, bit))
    summary = "\n".join(f"  {k} at (byte, bit) {v[:5]}{' ...' if len(v) > 5 else ''}" for k, v in bad.items())
    assert not bad, f"{sum(map(len, bad.values()))} single-bit flips of .metadata escaped as non-dcp_tiered errors:\n{summary}"


# --------------------------------------------------------------------------- fuzzing


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory) -> bytes:
    return (save(tmp_path_factory.mktemp("md") / "c", state()) / ".metadata").read_bytes()


def _mutate(data: bytes, draw) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        pos = draw(st.integers(0, max(0, len(buf) - 1)))
        if kind == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and buf:
            buf[pos] = draw(st.integers(0, 255))
        elif kind == "cut":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del buf[pos : pos + draw(st.integers(1, 8))]
    return bytes(buf)


@FUZZ
@given(data=st.data())
def test_fuzz_safe_loads_only_raises_dcp_tiered_errors(real_metadata, data):
    blob = data.draw(st.one_of(st.binary(max_size=300), st.just(real_metadata).map(lambda b: b)))
    if data.draw(st.booleans()):
        blob = _mutate(blob, data.draw)
    with memory_cap(2 << 30):
        try:
            safe_loads(blob, "fuzz/.metadata")
        except DcpTieredError:
            pass


CODECS = [(c, filter_for(is_float, i), i) for c in ("none", "lz4", "zstd:1") for is_float, i in ((False, 1), (False, 8), (True, 4), (True, 2), (True, 8))]


@FUZZ
@given(data=st.data())
def test_fuzz_frame_decode_only_raises_dcp_tiered_errors(data):
    import numpy as np

    spec = data.draw(st.sampled_from(CODECS))
    fc = FrameCodec(*spec)
    n = data.draw(st.integers(0, 64)) * spec[2]
    raw = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)) if n else b"", dtype=np.uint8)
    if data.draw(st.booleans()):
        raw = np.zeros(n, dtype=np.uint8)  # compressible: exercise compressed planes
    stored = b"".join(bytes(memoryview(p).cast("B")) for p in fc.encode(raw).pieces)
    out = np.empty(n, dtype=np.uint8)
    fc.decode(stored, out)
    assert out.tobytes() == raw.tobytes()
    blob = data.draw(st.one_of(st.binary(max_size=200), st.just(stored).map(lambda b: _mutate(b, data.draw))))
    size = data.draw(st.one_of(st.just(n), st.integers(0, 1 << 16)))
    with memory_cap(2 << 30):
        try:
            fc.decode(blob, np.empty(size, dtype=np.uint8))
        except DcpTieredError:
            pass


@pytest.fixture(scope="module")
def fuzz_ckpt(tmp_path_factory):
    g = torch.Generator().manual_seed(5)
    sd = {
        "f32": torch.randn(3000, generator=g),
        "bf16": torch.randn(1500, generator=g).to(torch.bfloat16),
        "i64": torch.randint(0, 5, (700,), generator=g),
        "zeros": torch.zeros(3000),
        "text": "hello",
    }
    ckpt = save(tmp_path_factory.mktemp("fuzz") / "c", sd)
    return ckpt, sd, (ckpt / "__0_0.distcp").read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_data_file_is_detected(fuzz_ckpt, data):
    ckpt, sd, original = fuzz_ckpt
    verify = data.draw(st.booleans())
    mutated = _mutate(original, data.draw)
    (ckpt / "__0_0.distcp").write_bytes(mutated)
    try:
        loaded = {}

        def go():
            loaded["v"] = load(ckpt, sd, verify=verify)

        with memory_cap():
            err = failure_of(go)
    finally:
        (ckpt / "__0_0.distcp").write_bytes(original)
    changed = mutated[: len(original)] != original
    if err is not None:
        assert isinstance(err, DcpTieredError), f"{type(err).__name__}: {err}"
        assert changed, f"an intact data file failed to load: {err}"
    elif verify or not changed:
        assert not changed, "a mutated data file loaded without error with verify on"
        assert_same(loaded["v"], sd)


# --------------------------------------------------------------------------- chunk tables


def _chunks_gone(md) -> None:  # "w" keeps its size but loses its chunks and its record
    md.state_dict_metadata["w"].chunks = []
    for idx in [i for i in md.storage_data if i.fqn == "w"]:
        del md.storage_data[idx]


def _chunk_halved(md) -> None:  # one chunk covering half the tensor
    c = md.state_dict_metadata["w"].chunks[0]
    md.state_dict_metadata["w"].chunks = [dataclasses.replace(c, sizes=torch.Size([c.sizes[0] // 2]))]


def _chunk_twice(md) -> None:  # the same chunk twice, and the size doubled: volume matches, half overlaps
    item = md.state_dict_metadata["w"]
    item.size = torch.Size([item.size[0] * 2])
    item.chunks = [item.chunks[0], item.chunks[0]]


def _record_gone(md) -> None:
    for idx in [i for i in md.storage_data if i.fqn == "w"]:
        del md.storage_data[idx]


@pytest.mark.parametrize("edit", [_chunks_gone, _chunk_halved, _chunk_twice, _record_gone])
def test_a_chunk_table_that_does_not_tile_the_tensor_is_refused(tmp_path, edit):
    path = save(tmp_path / "c", {"w": torch.arange(64.0), "v": torch.ones(4)})
    rewrite_metadata(path, edit)
    err = failure_of(lambda: CompressedReader(path))  # never loads a step with elements nobody wrote
    assert_error(err, CorruptCheckpointError, "'w'")
