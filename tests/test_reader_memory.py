"""The local read pipeline of a load: its extra memory is bounded by its reads, not by the checkpoint's
size, and each read holds work for every decoder thread.

Measured in a child process: the peak resident set (``VmHWM``, reset through ``clear_refs`` once the
destination tensors exist) above the resident set before ``dcp.load``, for a state of many tensors of a
few MiB each, as a model shard has.  From a local directory the reader fetches the stored bytes in
chunks of 4 MiB per decoder thread into two buffers (one decoded while the other
fills), so decoding starts after the first chunk instead of after a whole batch of tensors.
"""

from __future__ import annotations

from isolated import run_isolated

CHUNK = 2 * (4 << 20)  # the local read the README states: 4 MiB per decoder thread, 2 threads
ALLOWANCE = 32 << 20  # decoders' contexts and frames, thread stacks, the metadata


def test_extra_memory_of_a_local_load_is_two_read_chunks_not_the_state(tmp_path) -> None:
    res = run_isolated(f"""
        import torch
        import torch.distributed.checkpoint as dcp
        from dcp_tiered import CompressedReader, CompressedWriter

        def status(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

        g = torch.Generator().manual_seed(0)
        state = {{f"layer{{i}}.weight": torch.randn(1 << 20, generator=g) for i in range(48)}}  # 192 MiB
        dcp.save(state, storage_writer=CompressedWriter({str(tmp_path / "ck")!r}, codec="zstd:1", sync_files=False),
                 no_dist=True)
        dest = {{k: torch.zeros_like(v) for k, v in state.items()}}
        reader = CompressedReader({str(tmp_path / "ck")!r}, threads=2)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak starts again from here
        base = status("VmRSS")
        dcp.load(dest, storage_reader=reader, no_dist=True)
        extra = status("VmHWM") - base
        assert all(torch.equal(dest[k], v) for k, v in state.items())
        emit({{"extra": extra}})
    """, timeout=120, memory_mb=4096, env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert res.returncode == 0, res.describe()
    bound = 2 * CHUNK + ALLOWANCE
    assert res.result["extra"] <= bound, f"{res.result['extra'] >> 20} MiB extra, bound {bound >> 20} MiB"


def test_the_frames_of_one_local_read_are_decoded_on_every_thread(tmp_path, monkeypatch) -> None:
    """A local read holds ``threads`` frames, so each decoder thread gets one: with two threads, two frames of
    a chunk are in ``_decode`` at once (a barrier of two meets for every frame of a 4-frame tensor)."""
    import threading

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedReader, CompressedWriter
    from speed import scaled

    state = {"w": torch.randn(4 << 20, generator=torch.Generator().manual_seed(1))}  # 4 frames of 4 MiB
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck", codec="zstd:1", sync_files=False), no_dist=True)
    barrier, met = threading.Barrier(2), []
    decode = CompressedReader._decode

    def paired(self, t, chunk, data):
        try:
            barrier.wait(timeout=scaled(5))
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)
        return decode(self, t, chunk, data)

    monkeypatch.setattr(CompressedReader, "_decode", paired)
    out = {"w": torch.zeros_like(state["w"])}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "ck", threads=2), no_dist=True)
    assert torch.equal(out["w"], state["w"])
    assert met == [True] * 4, met
