"""The write path: vectored local writes and batched small frames write the same bytes as the
per-piece streaming path, complete on short writes, and report failures naming the file."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import numpy as np
import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.dcp import frame_pipeline
from dcp_tiered.errors import StorageError
from dcp_tiered.storage import Storage
from dcp_tiered.storage import writeback
from dcp_tiered.storage.writeback import RawFile, WritebackFile
from tests.failures import failure_of

DATA = "__0_0.distcp"


def mixed_state() -> dict:
    """Multi-frame fp32, bf16, many small tensors, ints, an empty tensor and a bytes object."""
    g = torch.Generator().manual_seed(3)
    sd: dict = {
        "big": torch.randn(300_000, generator=g) * 0.02,  # several 256 KiB frames below
        "half": (torch.randn(70_000, generator=g) * 0.1).bfloat16(),
        "ints": torch.arange(5000, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "blob": io.BytesIO(b"opaque bytes" * 100),
        "step": 7,
    }
    for i in range(300):
        sd[f"small.{i}"] = torch.randn(1 + 37 * i, generator=g)
    return sd


def save(sd: dict, path: str, **kw) -> None:
    dcp.save(sd, storage_writer=CompressedWriter(path, overwrite=True, frame_size=256 << 10, **kw), no_dist=True)


def load_equal(sd: dict, path: str, **kw) -> None:
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else io.BytesIO() if isinstance(v, io.BytesIO) else 0)
           for k, v in sd.items()}
    dcp.load(out, storage_reader=CompressedReader(path, **kw), no_dist=True)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == out[k].dtype and torch.equal(v, out[k]), k
        elif isinstance(v, io.BytesIO):
            assert out[k].getvalue() == v.getvalue(), k
        else:
            assert out[k] == v, k


def per_piece_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path before vectored writes: one pool job per frame, one ``write`` per piece, nothing gathered."""
    def one_by_one(f, pieces) -> None:
        for p in pieces:
            f.write(p)

    monkeypatch.setattr(frame_pipeline, "write_pieces", one_by_one)
    monkeypatch.setattr(frame_pipeline, "SMALL_FRAME", 0)
    monkeypatch.setattr(frame_pipeline, "FLUSH_BYTES", 0)


@pytest.mark.parametrize("threads", [1, 3])
def test_vectored_batched_path_writes_the_same_bytes_as_the_per_piece_path(tmp_path: Path, monkeypatch, threads: int) -> None:
    calls = []
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: calls.append(len(bufs)) or real(fd, bufs))
    sd = mixed_state()
    save(sd, str(tmp_path / "new"), threads=threads)
    assert calls and max(calls) > 5, "the local path did not gather pieces into vectored writes"
    with monkeypatch.context() as m:
        per_piece_path(m)
        save(sd, str(tmp_path / "old"), threads=threads)
    assert (tmp_path / "new" / DATA).read_bytes() == (tmp_path / "old" / DATA).read_bytes()
    new_md = CompressedReader(str(tmp_path / "new")).read_metadata().storage_data
    old_md = CompressedReader(str(tmp_path / "old")).read_metadata().storage_data
    assert new_md == old_md  # same records: offsets, frame lengths, checksums
    load_equal(sd, str(tmp_path / "new"))


def test_streaming_backends_write_the_same_bytes(tmp_path: Path, s3_bucket) -> None:
    sd = mixed_state()
    save(sd, str(tmp_path / "local"))
    url, opts = s3_bucket
    save(sd, f"{url}/ck", storage_options=opts)
    s3 = Storage(f"{url}/ck", opts)
    (name,) = [n for n in s3.listdir() if n.endswith(".distcp")]  # object stores tag the name per save
    assert s3.read_bytes(name) == (tmp_path / "local" / DATA).read_bytes()
    load_equal(sd, f"{url}/ck", storage_options=opts)


def test_async_save_through_the_vectored_path_loads_bit_exact(tmp_path: Path) -> None:
    sd = mixed_state()
    writer = CompressedWriter(str(tmp_path / "a"), frame_size=256 << 10)
    dcp.async_save(sd, storage_writer=writer, no_dist=True).result(timeout=scaled(300))
    load_equal(sd, str(tmp_path / "a"))


def short_writes(monkeypatch: pytest.MonkeyPatch, limits: list[int]) -> list[int]:
    """Make ``os.writev`` write at most the next limit's bytes (cycling): what signals and caps do."""
    real = os.writev
    seen: list[int] = []

    def short(fd: int, bufs) -> int:
        cap = limits[len(seen) % len(limits)]
        out, left = [], cap
        for b in bufs:
            v = memoryview(b).cast("B")
            if left <= 0:
                break
            out.append(v[:left])
            left -= len(out[-1])
        n = real(fd, out) if out else 0
        seen.append(n)
        return n

    monkeypatch.setattr(os, "writev", short)
    return seen


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 1000), max_size=20), limits=st.lists(st.integers(1, 5000), min_size=1, max_size=5))
def test_writev_all_completes_every_short_write(tmp_path_factory, sizes: list[int], limits: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) if i % 2 else rng.bytes(n) for i, n in enumerate(sizes)]
    path = tmp_path_factory.mktemp("w") / "f"
    with pytest.MonkeyPatch.context() as m:
        short_writes(m, limits)
        with RawFile(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)) as f:
            assert f.writev(pieces) == sum(sizes)
    assert path.read_bytes() == b"".join(bytes(p) for p in pieces)


def test_more_pieces_than_iov_max_and_short_writes_in_a_save(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(writeback, "IOV_MAX", 7)
    seen = short_writes(monkeypatch, [100_003, 5, 65_536])
    sd = mixed_state()
    save(sd, str(tmp_path / "short"))
    assert any(n < 100_003 for n in seen)
    monkeypatch.undo()
    save(sd, str(tmp_path / "plain"))
    assert (tmp_path / "short" / DATA).read_bytes() == (tmp_path / "plain" / DATA).read_bytes()
    load_equal(sd, str(tmp_path / "short"))


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EIO, "I/O error"), None])
def test_a_failed_vectored_write_is_a_storage_error_naming_the_file(tmp_path: Path, monkeypatch, failure) -> None:
    if failure is None:
        monkeypatch.setattr(os, "writev", lambda fd, bufs: 0)  # moved nothing: must not spin
    else:
        monkeypatch.setattr(os, "writev", lambda fd, bufs: (_ for _ in ()).throw(failure))
    err = failure_of(lambda: save(mixed_state(), str(tmp_path / "ck")))
    assert isinstance(err, StorageError), err
    assert DATA in str(err) and str(tmp_path / "ck") in str(err)
    assert not (tmp_path / "ck" / ".metadata").exists()


def test_writeback_runs_on_vectored_writes(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (real(fd), synced.append(os.fstat(fd).st_size)))
    with RawFile(os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)) as raw:
        f = WritebackFile(raw, sync_every=1000)  # type: ignore[arg-type]
        f.writev([b"a" * 600, np.full(600, 98, dtype=np.uint8)])
        f.join()
        assert synced == [1200]
        f.writev([b"c" * 10])
        f.sync()
    assert (tmp_path / "f").read_bytes() == b"a" * 600 + b"b" * 600 + b"c" * 10


@pytest.mark.parametrize("sync_files", [True, False])
def test_sync_files_decides_whether_the_data_file_is_fsynced(tmp_path: Path, monkeypatch, sync_files: bool) -> None:
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    sd = {"w": torch.randn(1000)}
    save(sd, str(tmp_path / "ck"), sync_files=sync_files)
    assert any(p.endswith(DATA) for p in synced) == sync_files
    assert any(p.endswith(".metadata") or ".metadata." in p for p in synced)  # the commit is always durable
    load_equal(sd, str(tmp_path / "ck"))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_at_most_threads_plus_two_frames_are_in_flight(tmp_path: Path, monkeypatch, threads: int) -> None:
    """A save submits a frame only when fewer than ``threads + 2`` are submitted and not yet written, so
    its extra memory is (2 x threads + 2) frames (README): counted at the pool, whatever the tensor size."""
    seen = {"out": 0, "max": 0}
    real = frame_pipeline.write_items

    class Counting:
        def __init__(self, pool) -> None:
            self.pool = pool

        def submit(self, fn, *args):
            seen["out"] += 1
            seen["max"] = max(seen["max"], seen["out"])
            fut = self.pool.submit(fn, *args)
            result = fut.result

            def counted(*a, _done=[False], **k):  # noqa: B006 - once per future
                if not _done[0]:
                    _done[0] = True
                    seen["out"] -= 1
                return result(*a, **k)
            fut.result = counted
            return fut

    monkeypatch.setattr(frame_pipeline, "write_items", lambda f, s, c, fs, pool, *a: real(f, s, c, fs, Counting(pool), *a))
    from dcp_tiered.dcp import writer as writer_mod
    monkeypatch.setattr(writer_mod, "write_items", frame_pipeline.write_items)
    frame = 256 << 10
    state = {"big": torch.randn(40 * frame // 4 + 1000), "small": torch.randn(10)}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "c", codec="zstd:1", frame_size=frame, threads=threads),
             no_dist=True)
    assert seen["out"] == 0 and seen["max"] == threads + 2


def test_encoders_run_side_by_side_at_a_small_frame_size(tmp_path: Path, monkeypatch) -> None:
    """At a frame size below the batch size the frames of one tensor are not gathered into one batch (the
    in-flight bound would then allow one batch at a time): three encoders meet at a barrier for each frame."""
    import threading

    barrier, met = threading.Barrier(3), []
    real = frame_pipeline.write_items

    class Meeting:
        def __init__(self, pool) -> None:
            self.pool = pool

        def submit(self, fn, *args):
            def job(*a):
                try:
                    barrier.wait(timeout=scaled(5))
                    met.append(True)
                except threading.BrokenBarrierError:
                    met.append(False)
                return fn(*a)
            return self.pool.submit(job, *args)

    monkeypatch.setattr(frame_pipeline, "write_items", lambda f, s, c, fs, pool, *a: real(f, s, c, fs, Meeting(pool), *a))
    from dcp_tiered.dcp import writer as writer_mod
    monkeypatch.setattr(writer_mod, "write_items", frame_pipeline.write_items)
    frame = 64 << 10
    state = {"w": torch.randn(12 * frame // 4)}  # 12 frames
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "c", frame_size=frame, threads=3), no_dist=True)
    assert met == [True] * 12, met
    load_equal(state, str(tmp_path / "c"))


def test_a_conjugate_view_saves_as_its_values(tmp_path: Path) -> None:
    z = torch.randn(64, dtype=torch.complex64)
    state = {"z": z.conj(), "n": -z.real}  # lazy conjugate and negative bits: saved as the values they show
    save(state, str(tmp_path / "c"))
    load_equal({k: v.resolve_conj().resolve_neg() for k, v in state.items()}, str(tmp_path / "c"))
