"""``nice`` lowers only the threads dcp-tiered owns, by exactly ``nice`` below the main thread,
never the caller's thread (a sync ``dcp.save`` from the training loop) and never twice.
Runs in a child process: a lowered thread cannot be raised back without privileges."""

from __future__ import annotations

import os

import pytest

from isolated import run_isolated

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are Linux's")

_CHILD = """
import os, threading, tempfile, torch
import torch.distributed.checkpoint as dcp
from dcp_tiered import CompressedWriter, Tier, TieredCheckpointer
from dcp_tiered.codecs import FrameCodec

def nice_of_this_thread():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

seen = {}
real = FrameCodec.encode
def encode(fc, *a, **k):
    seen.setdefault(threading.current_thread().name.split("_")[0], set()).add(nice_of_this_thread())
    return real(fc, *a, **k)
FrameCodec.encode = encode

base = nice_of_this_thread()
sd = {f"w{i}": torch.randn(64 * 1024) for i in range(4)}
root = tempfile.mkdtemp()
for i in range(3):  # a plain synchronous dcp.save from this (the training) thread
    dcp.save(sd, storage_writer=CompressedWriter(f"{root}/plain{i}", nice=5, codec="zstd:1"), no_dist=True)
after_sync = nice_of_this_thread()
sync_encoders = sorted(set().union(*seen.values()))
seen.clear()
with TieredCheckpointer([Tier("a", f"{root}/a", codec="none"), Tier("b", f"{root}/b", codec="zstd:1")],
                        async_save=True, nice=5) as ck:
    for step in (1, 2):
        ck.maybe_save(step, sd, force=True)
        ck.wait()
bg = sorted(set().union(*seen.values()))
emit({"base": base, "after_sync": after_sync, "sync_encoders": sync_encoders, "background": bg,
      "after_all": nice_of_this_thread()})
"""


def test_nice_lowers_only_owned_threads_once():
    res = run_isolated(_CHILD, timeout=240, memory_mb=4096)
    assert res.returncode == 0, res.stderr[-3000:]
    r = res.result
    want = min(19, r["base"] + 5)
    assert r["after_sync"] == r["base"] and r["after_all"] == r["base"]  # the caller keeps its priority
    assert r["sync_encoders"] == [want]  # encoders lowered by exactly nice, not nice twice
    assert r["background"] == [want]  # async encoders and promotion re-encodes alike


def test_a_save_off_the_main_thread_first_hands_the_gil_back(tmp_path, monkeypatch) -> None:
    """``dcp.async_save`` with either writer: DCP's first call on its thread sleeps once (so the
    training loop, waiting to return from ``async_save``, gets the GIL); a save on the main thread never."""
    import threading

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedWriter, Tier
    from dcp_tiered import thread_priority
    from dcp_tiered.tiers.save.writer import TieredWriter

    import time
    import types

    slept: list[tuple[bool, float]] = []
    # thread_priority's own name for the module: other threads' sleeps (the process's) are not counted
    monkeypatch.setattr(thread_priority, "time", types.SimpleNamespace(
        sleep=lambda s: (slept.append((threading.current_thread() is threading.main_thread(), s)), time.sleep(s))))
    state = {"w": torch.arange(8.0)}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "sync"), no_dist=True)
    assert slept == []
    dcp.async_save(state, storage_writer=CompressedWriter(tmp_path / "async"), no_dist=True).result()
    assert slept == [(False, thread_priority.YIELD_S)]
    tiers = [Tier("local", str(tmp_path / "tiers"))]
    dcp.async_save(state, storage_writer=TieredWriter(tiers), checkpoint_id="step_000000001", no_dist=True).result()
    assert slept == [(False, thread_priority.YIELD_S)] * 2
