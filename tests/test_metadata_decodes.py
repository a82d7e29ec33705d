"""A restore decodes each candidate's ``.metadata`` once per rank, through peers or not.

A candidate is one (tier, step) a restore considers.  Its ``.metadata`` is a byte string: on a
node-local tier each node's directory commits its own, so the copies of one save on two nodes
may be different bytes (then decoding each once is fine) or the same bytes (then they are one
``.metadata``: a rank decoding a peer's offered copy and then its own rewritten copy decodes it
twice).  What is counted is how often one rank decodes the same bytes of one candidate during one
``restore()``: at most once.  Whether a decode is of a candidate is told by the bytes (their digest
against every ``.metadata`` file under the tiers), not by the ``source`` argument, which for bytes
a peer sent names the peer rather than a path.

Counting: the decode itself (``metadata_io._decode``: trailer, allow-list unpickler, every table
and record checked), which every ``decode_metadata`` and ``load_metadata`` call of any module runs
unless the same bytes were decoded before in the process, gets a counting wrapper.

The job is the lost node of ``test_replication.py`` (4 gloo ranks as 2 nodes of 2; node 1's
directory deleted after the save; the shared tier left whole): every rank restores step 3 from
``local``, node 1's ranks through node 0's replicas, bit-exact.  Then every rank restores again
from the shared tier alone (no peers, no node-local tier).
"""

from __future__ import annotations

import json
import os
import shutil
import sys  # noqa: F401
import threading
from collections import Counter
from pathlib import Path

import pytest
import xxhash
from speed import scaled
from gloo_ranks import read_records, record, run_ranks_recording
from test_replication import (  # noqa: F401 (root, saved: fixtures)
    LOCAL,
    STEPS,
    WS,
    _in_thread,
    _mesh,
    diffs,
    make_state,
    root,
    saved,
    tiers,
)

from dcp_tiered import TieredCheckpointer

SPAWN_TIMEOUT = 180.0  # quiet-machine seconds: run_ranks scales it
WAIT_TIMEOUT = scaled(120.0)


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64(bytes(data)).hexdigest()


class DecodeCounter:
    """Wraps the one decode of ``.metadata`` bytes; records ``(source, digest, thread)`` while on."""

    def __init__(self) -> None:
        import dcp_tiered.dcp.metadata_io as metadata_io

        self.calls: list[dict] = []
        self.on = False
        original = metadata_io._decode

        def counted(data, source, *args, **kwargs):
            if self.on:
                self.calls.append({"source": str(source), "digest": _digest(data),
                                   "thread": threading.current_thread().name})
            return original(data, source, *args, **kwargs)

        metadata_io._decode = counted
        self.patched = ["dcp_tiered.dcp.metadata_io._decode"]

    def during(self, fn):
        import dcp_tiered.dcp.metadata_io as metadata_io

        metadata_io._DECODED.clear()  # each restore counted from a cold process: what it decodes, it decodes once
        self.calls.clear()
        self.on = True
        try:
            return fn()
        finally:
            self.on = False


# -- code on every rank ---------------------------------------------------------------------------


def _restore(counter: DecodeCounter, tier_list, mesh, rank: int) -> dict:
    ckpt = TieredCheckpointer(tier_list)
    events: list = []
    ckpt.events.hooks.append(events.append)
    try:
        sd = make_state(mesh, rank, 0)
        got = counter.during(lambda: _in_thread(lambda: ckpt.restore(sd), WAIT_TIMEOUT))
        return {"step": got, "diffs": diffs(sd, rank, got) if isinstance(got, int) else ["nothing restored"],
                "events": [(e["event"], e["step"], e["tier"], bool(e.get("through_peers")))
                           for e in events if e.get("event") == "restore"],
                "decodes": list(counter.calls), "patched": counter.patched}
    finally:
        ckpt.close(timeout=WAIT_TIMEOUT)


def _both(root_dir: Path, out: Path, mesh, rank: int) -> None:
    counter = DecodeCounter()  # TieredCheckpointer is imported: its modules are loaded
    facts = {"peers": _restore(counter, tiers(root_dir), mesh, rank)}
    facts["shared"] = _restore(counter, [t for t in tiers(root_dir) if t.name == "shared"], mesh, rank)
    import dcp_tiered.dcp.metadata_io as metadata_io

    cap, metadata_io.DECODE_CACHE_BYTES = metadata_io.DECODE_CACHE_BYTES, 0  # as for a .metadata over 32 MiB
    try:
        facts["uncached"] = _restore(counter, [t for t in tiers(root_dir) if t.name == "shared"], mesh, rank)
    finally:
        metadata_io.DECODE_CACHE_BYTES = cap
    (out / f"restore.rank{rank}.json").write_text(json.dumps(facts))


def _worker(rank: int, world_size: int, data: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = _mesh()
    record(Path(out), "restore", rank, lambda: _both(Path(data), Path(out), mesh, rank))


# -- the tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def restored(root: Path, saved) -> tuple[Path, list[dict]]:
    """Node 1's directory deleted (a replaced node), then both restores on every rank."""
    read_records(saved[0], "save", WS, saved[1])
    data = root / "data"
    shutil.rmtree(data / "local" / "1")
    out, error = run_ranks_recording(_worker, WS, root, str(data), root / "records_decodes", timeout=SPAWN_TIMEOUT)
    read_records(out, "restore", WS, error)
    return data, [json.loads((out / f"restore.rank{r}.json").read_text()) for r in range(WS)]


def _candidates(data: Path) -> dict[str, str]:
    """Digest of every ``.metadata`` under the tiers -> ``tier/dir/step_...`` of the files holding those bytes."""
    out: dict[str, list[str]] = {}
    for f in sorted(data.rglob(".metadata")):
        out.setdefault(_digest(f.read_bytes()), []).append(str(f.parent.relative_to(data)))
    return {d: " = ".join(names) for d, names in out.items()}


def _check_once(data: Path, facts: list[dict], which: str) -> None:
    names = _candidates(data)
    problems, table = [], []
    for rank, f in enumerate(facts):
        calls = f[which]["decodes"]
        counts = Counter(names.get(c["digest"], f"not a .metadata on disk ({c['digest']})") for c in calls)
        table.append(f"rank {rank}: {dict(counts)}")
        for cand, n in counts.items():
            if n > 1:
                sources = Counter(f"{c['source']} [{c['thread']}]" for c in calls if names.get(c["digest"], "") == cand)
                problems.append(f"rank {rank} decoded the .metadata of {cand} {n} times: {dict(sources)}")
        assert calls, f"rank {rank}: no decode counted; the wrapper missed decode_metadata (patched {f[which]['patched']})"
    assert not problems, (f"{which} restore: a candidate's .metadata decoded more than once per rank\n"
                          + "\n".join(problems) + "\ncounts per rank (candidate: decodes):\n" + "\n".join(table))


def test_restore_through_peers_decodes_each_candidates_metadata_once_per_rank(restored) -> None:
    data, facts = restored
    for rank, f in enumerate(facts):  # the situation: step 3 from local, node 1's ranks through peers, bit-exact
        p = f["peers"]
        assert p["step"] == STEPS[-1] and p["diffs"] == [], f"rank {rank}: {p['step']} {p['diffs']} {p['events']}"
        assert [e[:3] for e in p["events"]] == [["restore", STEPS[-1], "local"]], f"rank {rank}: {p['events']}"
    assert any(e[3] for f in facts for e in f["peers"]["events"]), [f["peers"]["events"] for f in facts]
    _check_once(data, facts, "peers")


def test_plain_restore_of_a_shared_tier_decodes_each_candidates_metadata_once_per_rank(restored) -> None:
    data, facts = restored
    for rank, f in enumerate(facts):
        s = f["shared"]
        assert isinstance(s["step"], int) and s["diffs"] == [], f"rank {rank}: {s['step']} {s['diffs']} {s['events']}"
        assert [e[2:] for e in s["events"]] == [["shared", False]], f"rank {rank}: {s['events']}"
    _check_once(data, facts, "shared")


def test_a_restore_decodes_once_where_the_cache_declines_the_file(restored) -> None:
    """The decode cache keeps files up to 32 MiB (of the issue's scale: about 0.9M records); a larger
    ``.metadata`` is still decoded once per restore, not once by the listing and again by the reader."""
    data, facts = restored
    for rank, f in enumerate(facts):
        u = f["uncached"]
        assert isinstance(u["step"], int) and u["diffs"] == [], f"rank {rank}: {u['step']} {u['diffs']} {u['events']}"
    _check_once(data, facts, "uncached")


def test_a_restore_keeps_one_large_decode_not_every_candidates(tmp_path, monkeypatch) -> None:
    """With the cache declining every file (as past 32 MiB), a restore over four committed steps decodes
    the step it restores once and keeps at most one decode past the cache's bound at a time, not every
    candidate's (each of which may be gigabytes)."""
    import torch

    import dcp_tiered.dcp.metadata_io as metadata_io
    from dcp_tiered import Tier

    tier = [Tier("t", str(tmp_path / "t"), keep=10)]
    ckpt = TieredCheckpointer(tier)
    for step in range(1, 5):
        ckpt.save_now(step, {"w": torch.full((8,), float(step))})
    ckpt.close()
    monkeypatch.setattr(metadata_io, "DECODE_CACHE_BYTES", 0)
    metadata_io._DECODED.clear()
    seen, original = [], metadata_io._decode

    def counted(data, source, *args, **kwargs):
        seen.append((source, len(metadata_io._PINNED)))
        return original(data, source, *args, **kwargs)

    monkeypatch.setattr(metadata_io, "_decode", counted)
    ckpt = TieredCheckpointer(tier)
    sd = {"w": torch.zeros(8)}
    assert ckpt.restore(sd) == 4 and torch.equal(sd["w"], torch.full((8,), 4.0))
    ckpt.close()
    assert max(n for _s, n in seen) <= 1 and not metadata_io._PINNED, seen
    assert sum("step_000000004" in s for s, _n in seen) == 1, seen
