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


#: destinations a load decodes into: the stored tensors themselves, another dtype (a downcast checkpoint
#: loaded into the model's fp32, or bf16 weights), non-contiguous ones, and half of each tensor (resharding)
DESTINATIONS = {
    "same": "{k: torch.zeros_like(v) for k, v in state.items()}",
    "bf16": "{k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in state.items()}",
    "strided": "{k: torch.zeros(2 * v.numel())[::2] for k, v in state.items()}",
    "half": "{k: v.new_zeros(v.numel() // 2) for k, v in state.items()}",
}


def test_extra_memory_of_a_local_load_is_two_read_chunks_not_the_state(tmp_path) -> None:
    """Whatever the destination: a tensor that cannot be decoded into in place is decoded frame by frame
    into it (another dtype or device, a whole tensor), or through a buffer of its own made when its first
    frame is read and dropped once it is copied (a strided or partial destination), never all at once.
    One child saves the state once and loads it into each kind of destination in turn."""
    res = run_isolated(f"""
        import gc
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
        from dcp_tiered import CompressedReader, CompressedWriter

        class Half(DefaultLoadPlanner):  # the first half of each tensor, as a resharded load asks for it
            def create_local_plan(self):
                half = [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 19]))]
                return LoadPlan([i for k in self.state_dict for i in create_read_items_for_chunk_list(
                    k, self.metadata.state_dict_metadata[k], half)])

        g = torch.Generator().manual_seed(0)
        state = {{f"layer{{i}}.weight": torch.randn(1 << 20, generator=g) for i in range(48)}}  # 192 MiB
        dcp.save(state, storage_writer=CompressedWriter({str(tmp_path / "ck")!r}, codec="zstd:1", sync_files=False),
                 no_dist=True)
        extra = {{}}
        for kind, make in {{{", ".join(f"{k!r}: lambda: {v}" for k, v in DESTINATIONS.items())}}}.items():
            dest = make()
            planner = Half() if kind == "half" else None
            reader = CompressedReader({str(tmp_path / "ck")!r}, threads=2)
            base = reset_peak()
            dcp.load(dest, storage_reader=reader, planner=planner, no_dist=True)
            extra[kind] = status("VmHWM") - base
            want = {{k: v[: v.numel() // 2] for k, v in state.items()}} if planner is not None else state
            assert all(torch.equal(dest[k], v.to(dest[k].dtype)) for k, v in want.items()), kind
            del dest, reader
            gc.collect()
        emit(extra)
    """, timeout=180, memory_mb=4096, env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert res.returncode == 0, res.describe()
    bound = 2 * CHUNK + ALLOWANCE
    assert set(res.result) == set(DESTINATIONS)
    over = {k: v >> 20 for k, v in res.result.items() if v > bound}
    assert not over, f"MiB extra {over}, bound {bound >> 20} MiB"


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
