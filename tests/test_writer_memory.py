"""A compressed save's extra memory is bounded by its frames in flight, not by its largest tensor.

Measured in a child process: the peak resident set (``VmHWM``, reset through ``clear_refs`` once the
state exists) above the resident set before the save, for a state holding one 512 MiB float32 tensor
of normal values (byte-grouped planes that zstd shrinks a little: each encoded frame is a new buffer).
The bound is ``(2 x threads + 2) x frame_size`` (the writer's in-flight bound) plus a fixed allowance
for the pool, the codecs' contexts and the allocator.
"""

from __future__ import annotations

from isolated import run_isolated

FRAME = 4 << 20
THREADS = 2
ALLOWANCE = 48 << 20


def test_extra_memory_of_a_save_with_a_512_mib_tensor_is_bounded_by_its_frames(tmp_path) -> None:
    res = run_isolated(f"""
        import os, torch
        import torch.distributed.checkpoint as dcp
        from dcp_tiered import CompressedWriter

        def status(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

        g = torch.Generator().manual_seed(0)
        state = {{"embedding": torch.randn(128 << 20, generator=g), "bias": torch.zeros(16)}}
        writer = CompressedWriter({str(tmp_path / "ck")!r}, codec="zstd:1", threads={THREADS}, frame_size={FRAME},
                                  sync_files=False)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak starts again from here
        base = status("VmRSS")
        dcp.save(state, storage_writer=writer, no_dist=True)
        emit({{"extra": status("VmHWM") - base}})
    """, timeout=120, memory_mb=6144)
    assert res.returncode == 0, res.describe()
    bound = (2 * THREADS + 2) * FRAME + ALLOWANCE
    assert res.result["extra"] <= bound, f"{res.result['extra'] >> 20} MiB extra, bound {bound >> 20} MiB"
