"""A compressed save's extra memory is bounded by its frames in flight, not by its largest tensor.

Measured in a child process: the peak resident set (``VmHWM``, reset through ``clear_refs`` once the
state exists) above the resident set before the save, for a state holding one 512 MiB float32 tensor
of normal values (byte-grouped planes that zstd shrinks a little: each encoded frame is a new buffer).
The bound is ``(2 x threads + 2) x frame_size`` (the writer's in-flight bound) plus an allowance.

With glibc's default policy a freed frame buffer stays in its thread's arena (the mmap threshold rises
to the size of the buffers freed), so the resident peak also holds what each encoder thread's arena
kept: ``ALLOWANCE`` covers that.  With the threshold fixed (``MALLOC_MMAP_THRESHOLD_``), freed frames go
back to the system and the peak is the writer's own: within ``TIGHT_ALLOWANCE`` (codec contexts, thread
stacks, the two records) of the frames in flight.  The device path also keeps one host staging buffer per
encoder thread (pinned where CUDA is present), reused by every later save: ``threads x frame_size`` more.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_tiered.dcp.tensors as tensors
import dcp_tiered.dcp.writer as writer_mod
from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.errors import SaveError, StorageError
from failures import failure_of
from isolated import run_isolated

FRAME = 4 << 20
THREADS = 2
ALLOWANCE = 48 << 20
TIGHT_ALLOWANCE = 4 << 20
FIXED_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}  # glibc's default start, not raised by frees


@pytest.mark.parametrize(("staged", "env", "allowance", "numpy"), [
    (False, None, ALLOWANCE, False), (False, FIXED_THRESHOLD, TIGHT_ALLOWANCE, False),
    (True, FIXED_THRESHOLD, THREADS * FRAME + TIGHT_ALLOWANCE, False), (False, FIXED_THRESHOLD, TIGHT_ALLOWANCE, True)],
    ids=["cpu", "cpu-fixed-mmap-threshold", "device-path-fixed-mmap-threshold", "numpy-kernel-fixed-mmap-threshold"])
def test_extra_memory_of_a_save_with_a_512_mib_tensor_is_bounded_by_its_frames(tmp_path, staged: bool, env,
                                                                               allowance: int, numpy: bool) -> None:
    """``device-path``: the tensor's bytes go through :class:`DeviceBytes` as a CUDA tensor's do (copied to
    host memory frame by frame on the encoders' threads): a copy of the whole tensor would show here.
    ``numpy-kernel``: without the native byte-grouping kernel (not built, or built for another Python) each
    encoder thread holds up to three frames more: its kept sign-swap scratch buffer and the two frame-sized
    temporaries of the swap's shifts (about 15 MiB more than the native kernel, measured)."""
    res = run_isolated(f"""
        import os, torch
        import torch.distributed.checkpoint as dcp
        import dcp_tiered.dcp.tensors as tensors
        from dcp_tiered import CompressedWriter
        from dcp_tiered.codecs import bytegroup
        if {staged!r}:
            tensors.staged_by_frame = lambda t: True
        if {numpy!r}:
            bytegroup._native = None

        g = torch.Generator().manual_seed(0)
        # normal values, 64 MiB of them repeated: each 4 MiB frame is as compressible as real weights
        state = {{"embedding": torch.randn(16 << 20, generator=g).repeat(8), "bias": torch.zeros(16)}}
        writer = CompressedWriter({str(tmp_path / "ck")!r}, codec="zstd:1", threads={THREADS}, frame_size={FRAME},
                                  sync_files=False)
        base = reset_peak()
        dcp.save(state, storage_writer=writer, no_dist=True)
        emit({{"extra": status("VmHWM") - base, "native": bytegroup._native is not None}})
    """, timeout=120, memory_mb=6144, env=env)
    assert res.returncode == 0, res.describe()
    bound = (2 * THREADS + 2) * FRAME + allowance + (0 if res.result["native"] else 3 * THREADS * FRAME)
    assert res.result["extra"] <= bound, f"{res.result['extra'] >> 20} MiB extra, bound {bound >> 20} MiB"


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300_000, generator=g), "h": torch.randn(1000, 7, generator=g).to(torch.bfloat16),
            "t": torch.randn(64, 64, generator=g).t(), "n": torch.zeros(0), "step": 7}


@pytest.mark.parametrize("codec,threads", [("zstd:1", 1), ("zstd:1", 4), ("none", 4)])
def test_the_device_path_writes_the_same_bytes(tmp_path, monkeypatch, codec: str, threads: int) -> None:
    """Frame-by-frame staging (the path of CUDA tensors, forced here on CPU tensors) writes exactly the
    bytes the in-memory path writes, and they load back bit for bit: also when a save takes host buffers
    of several sizes that an earlier save gave back (largest first), and with frames stored raw."""
    g = torch.Generator().manual_seed(5)
    big = {f"big{i}": torch.randn(100_000 + 1000 * i, generator=g) for i in range(4)}  # a frame each, all sizes

    def state(reverse: bool) -> dict:
        return {**_state(), **dict(reversed(big.items()) if reverse else big.items())}

    for name, staged, reverse in (("cpu", False, False), ("staged", True, False), ("cpu_r", False, True),
                                  ("staged_r", True, True)):
        monkeypatch.setattr(tensors, "staged_by_frame", lambda t, _s=staged: _s)
        dcp.save(state(reverse), storage_writer=CompressedWriter(tmp_path / name, codec=codec, frame_size=1 << 20,
                                                                 threads=threads), no_dist=True)
    for name in ("", "_r"):
        assert (tmp_path / f"cpu{name}" / "__0_0.distcp").read_bytes() == \
            (tmp_path / f"staged{name}" / "__0_0.distcp").read_bytes()
    saved = state(True)
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()}
    dcp.load(back, storage_reader=CompressedReader(tmp_path / "staged_r"), no_dist=True)
    for k, v in saved.items():
        assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, k


@pytest.mark.parametrize("fail", ["copy", "stage"])
def test_a_failed_device_copy_names_the_tensor_not_a_write(tmp_path, monkeypatch, fail: str) -> None:
    """A device copy that fails on an encoder thread (a CUDA error), or a tensor that cannot be staged
    (out of memory in ``contiguous``), fails the save as a SaveError naming the tensor and the file, not as
    a storage write failure (which would send the user after the disk), and nothing is committed."""
    monkeypatch.setattr(tensors, "staged_by_frame", lambda t: True)

    def broken(*_a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
    if fail == "copy":
        monkeypatch.setattr(tensors.DeviceBytes, "__getitem__", broken)
    else:
        monkeypatch.setattr(writer_mod, "tensor_bytes", broken)
    state = {"a": torch.ones(10), "emb": torch.randn(300_000)}
    err = failure_of(lambda: dcp.save(state, storage_writer=CompressedWriter(tmp_path / "c", codec="zstd:1", threads=2),
                                      no_dist=True))
    assert isinstance(err, SaveError) and not isinstance(err, StorageError), repr(err)
    msg = str(err)
    assert "'a'" in msg or "'emb'" in msg
    assert "__0_0.distcp" in msg and "illegal memory access" in msg and "nothing was committed" in msg
    assert not (tmp_path / "c" / ".metadata").exists()


def test_a_failed_frame_in_a_batch_names_its_own_tensor(tmp_path, monkeypatch) -> None:
    """Small tensors are encoded in batches: a failure in one of them names that tensor, not the batch's
    first (a wrong name sends the user after a healthy tensor)."""
    monkeypatch.setattr(tensors, "staged_by_frame", lambda t: True)
    real = tensors.DeviceBytes.__getitem__

    def broken(self, frame):
        if self.nbytes == 777 * 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return real(self, frame)
    monkeypatch.setattr(tensors.DeviceBytes, "__getitem__", broken)
    state = {f"a{i:02d}": torch.randn(1000) for i in range(20)} | {"z_bad": torch.randn(777)}
    err = failure_of(lambda: dcp.save(state, storage_writer=CompressedWriter(tmp_path / "c", threads=2), no_dist=True))
    assert isinstance(err, SaveError) and "saving 'z_bad'" in str(err) and "'a0" not in str(err), str(err)


def test_out_of_memory_while_encoding_is_a_memory_error(tmp_path, monkeypatch) -> None:
    """A save that runs out of host memory fails as this package's SaveError that is also a MemoryError."""
    monkeypatch.setattr(tensors, "staged_by_frame", lambda t: True)

    def no_memory(*_a):
        raise MemoryError("simulated")
    monkeypatch.setattr(tensors.DeviceBytes, "__getitem__", no_memory)
    err = failure_of(lambda: dcp.save({"w": torch.randn(300_000)}, storage_writer=CompressedWriter(tmp_path / "c"),
                                      no_dist=True))
    assert isinstance(err, SaveError) and isinstance(err, MemoryError) and "'w'" in str(err), repr(err)


def test_host_buffers_fit_every_frame_of_the_save_and_are_kept_per_copy_in_flight() -> None:
    """The device path's host buffers are of the save's frame size, so a frame of any size reuses one: one
    encoder thread copying frames of growing sizes keeps one buffer, not one per size (the pool kept up to
    16 of any size, pinned, after the save); a copy that fails gives its buffer back."""
    pool = tensors._HostBuffers()
    frame = 4 << 20
    for n in range(1, 40):
        arr, _part = pool.get(n * 100_000, frame)
        pool.put(arr)
    assert [b.numel() for b in pool._free] == [frame]
    held = [pool.get(frame, frame)[0] for _ in range(3)]  # three encoders at once
    for arr in held:
        pool.put(arr)
    assert len(pool._free) == 3 and not pool._lent
    pool.get(1000, 1 << 20)  # a later save of smaller frames reuses the larger buffers
    assert len(pool._free) == 2

    class Failing:
        def __getitem__(self, _s):
            raise RuntimeError("CUDA error (simulated)")
    staged = tensors.DeviceBytes(torch.zeros(10), frame)
    staged._flat = Failing()
    monkey_pool = tensors._BUFFERS
    lent = len(monkey_pool._lent)
    with pytest.raises(RuntimeError):
        staged[0:40]
    assert len(monkey_pool._lent) == lent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_written_on_a_side_stream_saves_and_loads_its_values(tmp_path) -> None:
    """The device copies follow the work queued on the stream current at the save (a training loop's side
    stream), and a load decodes into a CUDA destination frame by frame."""
    side = torch.cuda.Stream()
    t = torch.zeros(64 << 20, device="cuda")  # 256 MiB: many frames, copied on several encoder threads
    with torch.cuda.stream(side):
        t.fill_(3.0)
        dcp.save({"t": t}, storage_writer=CompressedWriter(tmp_path / "c", codec="zstd:1"), no_dist=True)
    back = {"t": torch.zeros(64 << 20, device="cuda")}
    dcp.load(back, storage_reader=CompressedReader(tmp_path / "c"), no_dist=True)
    assert bool((back["t"] == 3.0).all())
