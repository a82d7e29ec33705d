"""A promotion's coordinator makes storage requests that do not grow as ranks times polls.

The coordinator of a promotion waits for every rank's fragment in the target and commits the target's
``.metadata`` from them.  On an object store each request costs 10-20 ms, so at 16k ranks the old
"read every fragment at every poll" took tens of minutes.  Now a poll is one listing (S3: a request per
1000 objects), each fragment is read once when it appears (again only when a listing shows it changed),
in a bounded pool, and the commit reuses those reads; the source ``.metadata`` is decoded once per
promotion, for every target.

Counted: the target's backend primitives (:class:`benchmarks.bench_promote_requests.CountingLocal`, a
local directory whose list, GET, HEAD, DELETE and PUT count as the S3 requests they are), while the
promoter's own commit job runs a simulated promotion of 64 ranks; and the decodes of the source's
``.metadata``, both kinds: real decodes (``metadata_io._decode``) and every open that returns a decoded
``Metadata`` (``metadata_io._fresh``, which cached reopens go through as well).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from speed import scaled

from benchmarks.bench_promote_requests import (
    FRAGMENT_READERS,
    SAVE_ID,
    CountingLocal,
    Counts,
    Simulation,
    data_file,
    older_ranks,
    waves,
)
from dcp_tiered import CompressedWriter
from dcp_tiered.dcp import metadata_io
from dcp_tiered.errors import PromotionIOError
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.layout import fragment_name, step_name
from dcp_tiered.tiers.promote.fragments import FragmentWait, commit_from_fragments
from dcp_tiered.tiers.promote.promoter import Promoter

RANKS = 64


@pytest.fixture(scope="module")
def promoted(tmp_path_factory) -> tuple[Simulation, dict]:
    """One simulated promotion of 64 ranks to its commit, through the promoter's commit job."""
    sim = Simulation(tmp_path_factory.mktemp("promote64"), RANKS)
    return sim, sim.run(Promoter)


def test_a_poll_is_one_listing_plus_the_reads_of_the_fragments_that_appeared(promoted) -> None:
    got = promoted[1]
    polls = got["per_poll"]
    assert len(polls) == len(waves(RANKS)), polls
    older = set(older_ranks(RANKS))
    seen: set[int] = set()
    for k, (wave, poll) in enumerate(zip(waves(RANKS), polls[:-1])):
        new = set(wave) | (older if k == 0 else set())  # the first poll also reads the older attempt's
        seen |= new
        assert poll == ({"list": 1, "fragment GET": len(new)} if new else {"list": 1}), (
            f"poll {k}: {poll}; a poll should list once and read only the {len(new)} fragment(s) that appeared "
            f"or changed (every poll's requests: {polls})")
    # the last poll reads the straggler's fragment, and its commit reads none again
    assert polls[-1] == {"list": 2, "fragment GET": 1, "PUT": 1, "DELETE": RANKS}, polls[-1]


def test_each_fragment_is_read_once_and_the_total_is_listings_plus_one_read_per_fragment(promoted) -> None:
    sim, got = promoted
    reads = sim.target_counts.fragment_reads
    # read by the first poll, then replaced by their rank
    older = {fragment_name(data_file(r)) for r in set(older_ranks(RANKS)) - set(waves(RANKS)[0])}
    assert {n: c for n, c in reads.items() if c != 1} == dict.fromkeys(older, 2), (
        "each fragment read once; an older attempt's fragment once more after its rank replaced it")
    assert got["kinds"] == {"list": got["polls"] + 1, "fragment GET": RANKS + len(older), "PUT": 1, "DELETE": RANKS}
    assert 1 <= got["max_concurrency"] <= FRAGMENT_READERS
    assert got["source"] == {"HEAD": 2, "GET": 2}, got["source"]  # .metadata read at the start and at the commit


def _wait_until_complete(sim: Simulation) -> FragmentWait:
    files = [data_file(r) for r in range(sim.ranks)]
    wait = FragmentWait(files, SAVE_ID, 0.0, 0.0, missing=files)
    for r in range(sim.ranks):
        sim.arrive(r)
    assert wait.poll(sim.dst, 1.0, "test") == []
    return wait


def test_a_changed_fragment_is_read_again_and_a_wrong_size_is_retried_without_rereads(tmp_path: Path) -> None:
    sim = Simulation(tmp_path, 8)
    files = [data_file(r) for r in range(8)]
    wait = FragmentWait(files, SAVE_ID, 0.0, 0.0, missing=files)
    for r in range(8):
        sim.arrive(r)
    frag = sim.dst_dir / fragment_name(data_file(3))
    good = frag.read_bytes()
    frag.write_bytes(good[: len(good) // 2])  # a torn fragment: refused (missing), as today
    assert wait.poll(sim.dst, 1.0, "test") == [data_file(3)]
    before = Counter(sim.target_counts.fragment_reads)
    frag.write_bytes(good)  # its size changed: read again
    assert wait.poll(sim.dst, 2.0, "test") == []
    assert sim.target_counts.fragment_reads - before == {fragment_name(data_file(3)): 1}
    (sim.dst_dir / data_file(5)).write_bytes(b"short")  # a copy not finished: retried, as a storage failure
    before = Counter(sim.target_counts.fragment_reads)
    with pytest.raises(PromotionIOError, match="expected"):
        commit_from_fragments(sim.src, sim.dst, SAVE_ID, reads=wait.reads)
    assert sim.target_counts.fragment_reads == before, "the commit read fragments the wait had read"
    sim.arrive(5)
    assert commit_from_fragments(sim.src, sim.dst, SAVE_ID, reads=wait.reads) > 0
    assert (sim.dst_dir / ".metadata").exists() and not list(sim.dst_dir.glob(".*.records.json"))


def test_an_older_attempts_fragment_of_the_same_size_counts_once_replaced_where_no_times_are_listed(tmp_path) -> None:
    """memory:// lists no modification times: a fragment of another save is read again until it is this save's."""
    sim = Simulation(tmp_path, 4)
    dst = Storage(f"memory://promote-requests-{tmp_path.name}/ckpt")
    wait = FragmentWait([data_file(r) for r in range(4)], SAVE_ID, 0.0, 0.0)
    for r in range(4):
        sim.arrive(r, "cd" * 16 if r == 2 else SAVE_ID)
        for name in (data_file(r), fragment_name(data_file(r))):
            dst.commit_bytes(name, (sim.dst_dir / name).read_bytes())
    assert all(mtime is None for _size, mtime in dst.file_stats().values())
    assert wait.poll(dst, 1.0, "test") == [data_file(2)]
    sim.arrive(2)  # the same size: only the save id differs
    dst.commit_bytes(fragment_name(data_file(2)), (sim.dst_dir / fragment_name(data_file(2))).read_bytes())
    assert wait.poll(dst, 2.0, "test") == []


def test_a_fragment_listed_larger_than_the_limit_is_never_read(tmp_path: Path, monkeypatch) -> None:
    from dcp_tiered.tiers.promote import fragments

    sim = Simulation(tmp_path, 4)
    monkeypatch.setattr(fragments, "FRAGMENT_MAX_BYTES", 10)
    wait = FragmentWait([data_file(r) for r in range(4)], SAVE_ID, 0.0, 0.0)
    for r in range(4):
        sim.arrive(r)
    assert wait.poll(sim.dst, 1.0, "test") == [data_file(r) for r in range(4)]
    assert not sim.target_counts.fragment_reads


# -- the source .metadata: decoded once per promotion, for every target ---------------------------


class Decodes:
    """Opens of a ``.metadata`` by the checkpoint id it holds: real decodes and all opens (cached reopens too)."""

    def __init__(self, monkeypatch) -> None:
        self.decoded: Counter[str] = Counter()
        self.opened: Counter[str] = Counter()
        real_decode, real_fresh = metadata_io._decode, metadata_io._fresh

        def decode(data, source, *args, **kwargs):
            md = real_decode(data, source, *args, **kwargs)
            self.decoded[str(md.storage_meta.checkpoint_id)] += 1
            return md

        def fresh(md):
            self.opened[str(md.storage_meta.checkpoint_id)] += 1
            return real_fresh(md)

        monkeypatch.setattr(metadata_io, "_decode", decode)
        monkeypatch.setattr(metadata_io, "_fresh", fresh)
        metadata_io._DECODED.clear()


@pytest.mark.parametrize("resumed", [False, True])
def test_the_source_metadata_is_decoded_once_for_a_promotion_to_two_tiers(tmp_path: Path, monkeypatch,
                                                                          resumed: bool) -> None:
    local = Tier("local", str(tmp_path / "local"), codec="lz4", keep=5)
    tiers = [local, Tier("copy", str(tmp_path / "copy"), codec="lz4", keep=5),
             Tier("reencoded", str(tmp_path / "reencoded"), codec="zstd", keep=5)]
    src = tmp_path / "local" / step_name(3)
    dcp.save({"a": torch.arange(64.0), "b": torch.ones(8)}, storage_writer=CompressedWriter(str(src), codec="lz4"),
             no_dist=True)
    md = metadata_io.load_metadata(Storage(str(src)))
    records = list(md.storage_data.items())
    first = Promoter(tiers, nice=None)
    intent = first.record_intent(step_name(3), local, ["copy", "reencoded"], records[0][1]["file"], records,
                                 coordinator=True, save_id=md.storage_meta.save_id)
    decodes = Decodes(monkeypatch)
    if resumed:  # read back from the source (untrusted): checked against the source .metadata first
        first.close(wait=False)
        p = Promoter(tiers, nice=None)
        assert p.resume() == 1
    else:
        p = first
        p.submit(intent)
    try:
        p.wait(timeout=scaled(60))
    finally:
        p.close(wait=False)
    assert [(r.target, r.kind, r.ok) for r in p.reports if r.kind == "metadata"] and all(r.ok for r in p.reports), \
        [r.line() for r in p.reports if not r.ok]
    assert all((tmp_path / name / step_name(3) / ".metadata").exists() for name in ("copy", "reencoded"))
    source = str(md.storage_meta.checkpoint_id)
    assert decodes.decoded[source] == 1, dict(decodes.decoded)
    assert decodes.opened[source] == 1, (f"the source .metadata was opened {decodes.opened[source]} times (cached "
                                         f"reopens counted) for one promotion to two tiers: {dict(decodes.opened)}")


def test_counting_storage_counts_a_listing_as_its_s3_pages(tmp_path: Path) -> None:
    counts = Counts()
    store = CountingLocal.at(tmp_path, counts)
    for i in range(1001):
        (tmp_path / f"f{i}").write_bytes(b"")
    store.file_stats()
    assert counts.kinds == {"list": 2}
