"""Storage requests of a promotion's coordinator at N ranks: listings, fragment reads and the rest.

Run:  .venv/bin/python -m benchmarks.bench_promote_requests [--ranks 8,64,...,16384] [--old-up-to 2048] [--quick]

Writes the section "promote_requests" of docs/benchmarks.md and the results "promote_requests".

Simulates, in one process on a local directory, the coordinator's part of one promotion of a checkpoint
of N ranks: the source ``.metadata`` names N data files (one 16-byte item each); simulated ranks put
their data file and fragment into the target between the coordinator's polls (a quarter of the ranks
before each of the first four polls, one straggler after a fifth poll; a sixteenth of the ranks hold a
fragment of an older attempt from the start, an hour old, until they replace it), and the coordinator
runs the promoter's own commit job (``Promoter._commit_when_ready``, one call a poll) until it commits.
The target is a counting backend (:class:`CountingLocal`): each primitive is counted as the request it
is on S3 (list, GET, HEAD, DELETE, PUT), a listing as ceil(objects / 1000) list requests (S3's page), and
``--latency-ms`` makes each request take that long, so that concurrent requests overlap and show.

"old" runs the code before this change (commit ``OLD``: its ``fragments.py`` and ``promoter.py`` read
from git) the same way, up to ``--old-up-to`` ranks (its commit does per-file work over every record,
quadratic in N); beyond that its counts come from its formula, checked against every measured N.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from benchmarks.common import ROOT, machine_line, md_table, save_results, write_section
from dcp_tiered.dcp.format import ItemRecord
from dcp_tiered.dcp.metadata_io import encode_metadata
from dcp_tiered.names import METADATA_FILE
from dcp_tiered.storage.local import LocalStorage
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.jobs import Job
from dcp_tiered.tiers.layout import FRAGMENT_SUFFIX, fragment_name, step_name
from dcp_tiered.tiers.promote.fragments import FRAGMENT_READERS, fragment_bytes
from dcp_tiered.tiers.promote.intents import PromotionIntent

#: The code before the coordinator's requests were bounded (what "old" runs).
OLD = "da6e32f"
#: Objects in one page of an S3 listing.
LIST_PAGE = 1000
SAVE_ID, OLDER_SAVE_ID = "ab" * 16, "cd" * 16
STEP = 7
ITEM_BYTES = 24  # stored bytes of each rank's one item (16 raw bytes, zstd)


class Counts:
    """Requests made through :class:`CountingLocal` storages, by kind, and the most in flight at once."""

    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency
        self.kinds: Counter[str] = Counter()
        self.fragment_reads: Counter[str] = Counter()  # fragment name -> GETs
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def request(self, kind: str, n: int = 1) -> Iterator[None]:
        with self._lock:
            self.kinds[kind] += n
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency:
                time.sleep(self.latency)
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def get(self, name: str) -> contextlib.AbstractContextManager[None]:
        if name.endswith(FRAGMENT_SUFFIX):
            with self._lock:
                self.fragment_reads[name] += 1
            return self.request("fragment GET")
        return self.request("GET")

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.kinds)


class CountingLocal(LocalStorage):
    """A local directory whose primitives count as the S3 requests they would be (a listing: one per 1000 objects)."""

    counts: Counts

    @classmethod
    def at(cls, path: str | os.PathLike[str], counts: Counts) -> CountingLocal:
        storage = cls(os.fspath(path))
        storage.counts = counts
        return storage

    def child(self, name: str) -> CountingLocal:
        child = super().child(name)
        child.counts = self.counts  # type: ignore[union-attr]
        return child  # type: ignore[return-value]

    def _list(self) -> dict[str, tuple[int, float | None]]:
        out = super()._list()
        with self.counts.request("list", max(1, math.ceil(len(out) / LIST_PAGE))):
            return out

    def _size(self, name: str) -> int:
        with self.counts.request("HEAD"):
            return super()._size(name)

    def exists(self, name: str = "") -> bool:
        with self.counts.request("HEAD"):
            return super().exists(name)

    def _read_range(self, name: str, start: int, end: int) -> bytes:
        with self.counts.get(name):
            return super()._read_range(name, start, end)

    def _read_all(self, name: str) -> bytes:
        with self.counts.get(name):
            return super()._read_all(name)

    def _read_into(self, name: str, start: int, view: memoryview) -> int:
        with self.counts.get(name):
            return super()._read_into(name, start, view)

    def remove(self, name: str) -> None:
        with self.counts.request("DELETE"):
            super().remove(name)

    def _commit(self, name: str, data: bytes, exclusive: bool) -> bool:
        with self.counts.request("PUT"):
            return super()._commit(name, data, exclusive)


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def waves(ranks: int) -> list[list[int]]:
    """The ranks that arrive before each poll: four quarters, then none, then the straggler."""
    rest = list(range(ranks - 1))
    quarters = [rest[k * len(rest) // 4:(k + 1) * len(rest) // 4] for k in range(4)]
    return [*quarters, [], [ranks - 1]]


def older_ranks(ranks: int) -> list[int]:
    """The ranks whose fragment of an older attempt is in the target from the start."""
    return list(range(1, ranks, 16))


def _record(rank: int) -> tuple[MetadataIndex, dict]:
    index = MetadataIndex(f"layers.{rank}.w", torch.Size([0]), 0)
    return index, ItemRecord(
        version=1, kind="tensor", file=data_file(rank), offset=0, length=ITEM_BYTES, raw_length=16, codec="zstd:3",
        filter_name="bytegroup-signswap", itemsize=4, frame_size=4 << 20, frame_lengths=(ITEM_BYTES,),
        frame_sums=(rank,), checksum="xxh3_64", dtype="float32", orig_dtype="float32", shape=(4,)).to_builtin()


class Simulation:
    """One promotion of a source checkpoint of ``ranks`` data files from tier ``local`` to tier ``shared``
    under ``root``: the ranks' side written here directly, the coordinator's through counting storages."""

    def __init__(self, root: Path, ranks: int, latency: float = 0.0) -> None:
        self.ranks = ranks
        self.records = [_record(r) for r in range(ranks)]
        self.tiers = [Tier("local", str(root / "local"), codec="zstd:3"), Tier("shared", str(root / "shared"), codec="zstd:3")]
        self.src_dir, self.dst_dir = root / "local" / step_name(STEP), root / "shared" / step_name(STEP)
        self.src_dir.mkdir(parents=True)
        self.dst_dir.mkdir(parents=True)
        sdm = {i.fqn: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                            [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])
               for i, _ in self.records}
        md = Metadata(sdm, storage_data=dict(self.records),
                      storage_meta=StorageMeta(checkpoint_id=str(self.src_dir), save_id=SAVE_ID))
        (self.src_dir / METADATA_FILE).write_bytes(encode_metadata(md))
        self.older = older_ranks(ranks)
        hour_ago = time.time() - 3600
        for r in self.older:
            self.arrive(r, OLDER_SAVE_ID)
            os.utime(self.dst_dir / fragment_name(data_file(r)), (hour_ago, hour_ago))
        self.target_counts, self.source_counts = Counts(latency), Counts(latency)
        self.dst = CountingLocal.at(self.dst_dir, self.target_counts)
        self.src = CountingLocal.at(self.src_dir, self.source_counts)

    def arrive(self, rank: int, save_id: str = SAVE_ID) -> None:
        """What rank ``rank``'s promotion writes into the target: its data file, then its fragment."""
        (self.dst_dir / data_file(rank)).write_bytes(bytes(ITEM_BYTES))
        rec = [self.records[rank]]
        tmp = self.dst_dir / f"{fragment_name(data_file(rank))}.tmp"
        tmp.write_bytes(fragment_bytes(save_id, rec, rec))
        os.replace(tmp, self.dst_dir / fragment_name(data_file(rank)))

    def run(self, promoter_cls: type) -> dict[str, Any]:
        """The coordinator's commit job, one call a poll, with the waves in between; its requests."""
        promoter = promoter_cls(self.tiers, nice=None)
        try:
            intent = PromotionIntent(step_name(STEP), "local", None, [], [], ["shared"], SAVE_ID, 0)
            job = Job("shared", lambda job: None, "commit", (intent, "shared"))
            local, shared = self.tiers
            per_poll, polls, t0 = [], 0, time.perf_counter()
            for wave in waves(self.ranks):
                for r in wave:
                    self.arrive(r)
                before = self.target_counts.snapshot()
                again = promoter._commit_when_ready(job, intent, local, shared, self.src, self.dst, STEP)
                polls += 1
                per_poll.append(dict(self.target_counts.snapshot() - before))
                if again is None:
                    break
            seconds = time.perf_counter() - t0
            reports = [r for r in promoter.reports if r.kind == "metadata"]
        finally:
            promoter.close(wait=False)
        committed = (self.dst_dir / METADATA_FILE).exists()
        assert committed and reports and reports[-1].ok, (committed, [r.error for r in reports])
        kinds = self.target_counts.snapshot()
        return {"ranks": self.ranks, "polls": polls, "per_poll": per_poll, "kinds": dict(kinds),
                "source": dict(self.source_counts.snapshot()), "seconds": seconds,
                "max_concurrency": self.target_counts.max_in_flight,
                "most_reads_of_a_fragment": max(self.target_counts.fragment_reads.values(), default=0)}


def old_promoter() -> type | None:
    """The ``Promoter`` of commit :data:`OLD`, with its own ``fragments.py`` (None when git cannot show them)."""
    def source(path: str) -> str | None:
        got = subprocess.run(["git", "show", f"{OLD}:{path}"], cwd=ROOT, capture_output=True, text=True, check=False)
        return got.stdout if got.returncode == 0 else None

    texts = [source(f"dcp_tiered/tiers/promote/{m}.py") for m in ("fragments", "promoter")]
    if None in texts:
        return None
    modules = []
    for name, text in zip(("old_fragments", "old_promoter"), texts):
        module = types.ModuleType(f"benchmarks._{name}")
        sys.modules[module.__name__] = module  # dataclasses look their module up
        exec(compile(text, f"{OLD}:{name}.py", "exec"), module.__dict__)  # noqa: S102 (this repository's own old code)
        modules.append(module)
    fragments, promoter = modules
    for name in ("FragmentWait", "commit_from_fragments", "copy_with_fragment", "fragment_wait_bound"):
        setattr(promoter, name, getattr(fragments, name))
    return promoter.Promoter


def pages(objects: int) -> int:
    return max(1, math.ceil(objects / LIST_PAGE))


def old_formula(ranks: int) -> list[Counter[str]]:
    """The old coordinator's target requests, poll by poll: each poll lists and reads (HEAD + GET) every
    fragment there, and a poll still waiting asks for the target's ``.metadata`` (HEAD); the last poll's
    commit lists, asks for ``.metadata``, reads every fragment again, PUTs ``.metadata`` and DELETEs
    every fragment."""
    polls = []
    there = set(older_ranks(ranks))  # ranks with a data file and a fragment in the target
    for k, wave in enumerate(waves(ranks)):
        there |= set(wave)
        poll = Counter({"list": pages(2 * len(there)), "HEAD": len(there), "fragment GET": len(there)})
        if k < len(waves(ranks)) - 1:
            poll["HEAD"] += 1  # committed_save_id(dst) of a poll still waiting
        else:
            poll.update({"list": pages(2 * ranks), "HEAD": 1 + ranks, "fragment GET": ranks, "PUT": 1, "DELETE": ranks})
        polls.append(poll)
    return polls


COLUMNS = ["ranks", "code", "polls", "list requests", "fragment GETs", "other requests", "total",
           "most GETs of one fragment", "max concurrency", "per poll, waiting (max)",
           "at 15 ms a request, s", "source .metadata reads"]


def row(ranks: int, code: str, polls: int, kinds: dict[str, int], most: Any, conc: Any, waiting: int,
        source_reads: int) -> dict:
    lists, gets = kinds.get("list", 0), kinds.get("fragment GET", 0)
    other = sum(v for k, v in kinds.items() if k not in ("list", "fragment GET"))
    total = lists + gets + other
    # the pooled requests (fragment GETs, DELETEs) take 1/concurrency of their serial time
    width = conc if isinstance(conc, int) and conc > 1 else 1
    pooled = gets + kinds.get("DELETE", 0)
    estimate = 0.015 * (total - pooled + pooled / width)
    return {"ranks": ranks, "code": code, "polls": polls, "list requests": lists, "fragment GETs": gets,
            "other requests": other, "total": total, "most GETs of one fragment": most, "max concurrency": conc,
            "per poll, waiting (max)": waiting, "at 15 ms a request, s": f"{estimate:.1f}",
            "source .metadata reads": source_reads, "deletes": kinds.get("DELETE", 0)}


def measure(ranks_list: list[int], old_up_to: int, latency: float, scratch: Path) -> list[dict]:
    from dcp_tiered.tiers.promote.promoter import Promoter

    old_cls = old_promoter()
    rows = []
    for n in ranks_list:
        print(f"N = {n}")
        for code, cls in (("new", Promoter), ("old", old_cls)):
            formula = old_formula(n)
            if code == "old" and (cls is None or n > old_up_to):
                kinds = sum(formula, Counter())
                waiting = max(sum(p.values()) for p in formula[:-1])
                rows.append(row(n, "old (formula)", len(formula), kinds, len(formula) + 1, 1, waiting, 3))
                continue
            d = scratch / f"{code}-{n}"
            sim = Simulation(d, n, latency if code == "new" else 0.0)
            got = sim.run(cls)
            if code == "old":
                measured = [Counter(p) for p in got["per_poll"]]
                assert measured == formula, f"old formula off at N={n}: {measured} != {formula}"
            waiting = max(sum(p.values()) for p in got["per_poll"][:-1])
            rows.append(row(n, code, got["polls"], got["kinds"], got["most_reads_of_a_fragment"],
                            got["max_concurrency"], waiting, got["source"].get("GET", 0)))
            print(f"  {code}: {got['kinds']} in {got['seconds']:.2f} s, at most {got['max_concurrency']} at once; "
                  f"source {got['source']}")
            shutil.rmtree(d, ignore_errors=True)
    return rows


def write_doc(cmd: str, rows: list[dict], latency_ms: float) -> None:
    save_results("promote_requests", {"rows": rows, "latency_ms": latency_ms})
    table = md_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows])
    big = max(r["ranks"] for r in rows)
    new = next(r for r in rows if r["ranks"] == big and r["code"] == "new")
    old = next(r for r in rows if r["ranks"] == big and r["code"].startswith("old"))
    write_section("promote_requests", (
        f"## Promotion: the coordinator's storage requests against the ranks\n\n`{cmd}` — {machine_line()}.\n\n"
        "One promotion of a checkpoint of N ranks (one tiny item each), simulated in one process: the ranks' data "
        "files and fragments arrive in the target between the coordinator's polls (a quarter before each of the "
        "first four, one straggler after a fifth; a sixteenth of the ranks' fragments of an older attempt there "
        "from the start), and the coordinator runs the promoter's commit job once a poll until it commits. "
        "Requests are counted on the target as S3 requests: a listing as ceil(objects / 1000) list requests, "
        "fragment GETs apart from the other requests (HEAD, DELETE of the fragments after the commit, PUT of "
        "`.metadata`). \"old\" is the code of commit " + OLD + " run the same way (up to the size its quadratic "
        "commit allows here; above it, its formula, which matched every measured row). \"per poll, waiting\": the "
        "most requests of one poll before the commit. Max concurrency: the most requests in flight at once, each "
        f"taking {latency_ms:g} ms here (new code: a pool of at most {FRAGMENT_READERS} threads; old: serial). The "
        "last column estimates the coordinator's request time at 15 ms a request (pooled requests divided by the "
        "concurrency). The source `.metadata` (on the fast tier) is read at the start and again at the commit, "
        "which decodes it only if its bytes changed; the old code read and decoded it 3 times per target.\n\n" + table
        + f"\n\nAt {big:,} ranks the coordinator made {new['total']:,} requests ({new['list requests']} list "
        f"requests over {new['polls']} polls and the commit, {new['fragment GETs']:,} fragment GETs: each rank's "
        f"fragment once, and {new['fragment GETs'] - big:,} older attempts' fragments once more after their ranks "
        "replaced them, "
        f"and {new['other requests']:,} others: {new['deletes']:,} DELETEs of the fragments after the commit and the PUT "
        "of `.metadata`), the reads and deletes "
        f"{new['max concurrency']} at a time: about {new['at 15 ms a request, s']} s of requests at 15 ms each, "
        f"against {old['total']:,} serial requests (about {float(old['at 15 ms a request, s']) / 60:.0f} minutes) "
        "before. Each poll costs its listing's pages plus one GET per fragment that appeared or changed since the "
        "last; the source `.metadata` is decoded once per promotion (`tests/test_promotion_requests.py`)."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,512,2048,16384")
    ap.add_argument("--old-up-to", type=int, default=2048, help="largest N the old code runs at (else its formula)")
    ap.add_argument("--latency-ms", type=float, default=1.0, help="time each request of the new code takes")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = 8, 64, 512")
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.old_up_to = "8,64,512", 512
    ranks = [int(n) for n in args.ranks.split(",")]
    cmd = (f".venv/bin/python -m benchmarks.bench_promote_requests --ranks {args.ranks} --old-up-to {args.old_up_to} "
           f"--latency-ms {args.latency_ms:g}")
    with tempfile.TemporaryDirectory() as d:
        rows = measure(ranks, args.old_up_to, args.latency_ms / 1e3, Path(d))
    write_doc(cmd, rows, args.latency_ms)


if __name__ == "__main__":
    main()
