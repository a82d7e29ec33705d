"""Hostile files and concurrent writers (issue 12): links, FIFOs, devices, oversized files,
and two saves racing for one path.

Every load of a hostile checkpoint runs in a child process (tests/isolated.py) with a timeout
and a memory limit, so a hang or a runaway read fails one test instead of stalling pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered.dcp.metadata_io import unpack_metadata
from dcp_tiered import CompressedReader, CompressedWriter, CorruptCheckpointError, UnsafeCheckpointError
from dcp_tiered.storage import Storage
from failures import failure_of
from isolated import run_isolated

HANG_S = 90  # generous: only a hang trips it


def state(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 32, generator=g) * scale, "b": torch.arange(100) * int(scale)}


def save(path, sd, storage_options=None, **kw) -> None:
    dcp.save(sd, storage_writer=CompressedWriter(path, storage_options=storage_options, frame_size=4096,
                                                 sync_files=False, **kw), no_dist=True)


def load(path, like, storage_options=None) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=CompressedReader(path, storage_options=storage_options), no_dist=True)
    return out


# A child that opens a checkpoint with the reader, lists its tier and reads its .metadata through
# Storage, and reports what each raised.
_PROBE = """
import json, sys, os
from dcp_tiered import CompressedReader
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.catalog import list_tier
from dcp_tiered.tiers.config import Tier
path, tier_root = sys.argv[1], sys.argv[2]
out = {}
def attempt(what, fn):
    try:
        fn()
        out[what] = "ok"
    except BaseException as exc:
        out[what] = type(exc).__name__ + ": " + str(exc)[:300]
attempt("reader", lambda: CompressedReader(path))
attempt("read_bytes", lambda: Storage(path).read_bytes(".metadata", max_bytes=1 << 20))
attempt("size", lambda: Storage(path).size(".metadata"))
def ls():
    infos = list_tier(Tier("t", tier_root, keep=1))
    out["ls_committed"] = [i.committed for i in infos]
attempt("ls", ls)
emit(out)
"""


def probe(path: Path, tier_root: Path, memory_mb: int = 2000) -> dict:
    code = "import sys\nsys.argv = ['x', %r, %r]\n" % (str(path), str(tier_root)) + _PROBE
    res = run_isolated(code, timeout=HANG_S, memory_mb=memory_mb)
    assert not res.timed_out and not res.crashed and res.returncode == 0, res.describe()
    return res.result


def test_fifo_named_metadata_does_not_block_reader_or_ls(tmp_path):
    ckpt = tmp_path / "tier" / "step_000000001"
    ckpt.mkdir(parents=True)
    os.mkfifo(ckpt / ".metadata")
    out = probe(ckpt, tmp_path / "tier")
    for what in ("reader", "read_bytes", "size"):
        assert out[what].startswith(("UnsafeCheckpointError", "CheckpointNotFoundError")), out
    assert out["ls"] == "ok" and out["ls_committed"] == [False], out


def test_metadata_linked_to_dev_zero_is_refused_without_reading(tmp_path):
    ckpt = tmp_path / "tier" / "step_000000001"
    ckpt.mkdir(parents=True)
    os.symlink("/dev/zero", ckpt / ".metadata")
    out = probe(ckpt, tmp_path / "tier", memory_mb=1500)
    for what in ("reader", "read_bytes", "size"):
        assert out[what].startswith("UnsafeCheckpointError"), out
        assert "link" in out[what], out
    assert out["ls"] == "ok" and out["ls_committed"] == [False], out


def test_sparse_huge_metadata_is_refused_before_reading(tmp_path):
    ckpt = tmp_path / "tier" / "step_000000001"
    ckpt.mkdir(parents=True)
    with open(ckpt / ".metadata", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB of holes: reading it whole would need 1 GiB of memory
    out = probe(ckpt, tmp_path / "tier", memory_mb=1200)
    assert out["read_bytes"].startswith("CorruptCheckpointError") and str(1 << 30) in out["read_bytes"], out
    assert out["size"] == "ok", out


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_read_bytes_max_bytes(tmp_path, backend):
    url = str(tmp_path / "d") if backend == "local" else f"memory://hostile-{uuid.uuid4().hex}/d"
    s = Storage(url)
    s.makedirs()
    s.commit_bytes("f", b"x" * 100)
    assert s.read_bytes("f", max_bytes=100) == b"x" * 100
    assert s.read_bytes("f") == b"x" * 100
    with pytest.raises(CorruptCheckpointError, match="100 bytes"):
        s.read_bytes("f", max_bytes=99)


def test_data_file_linked_outside_the_checkpoint_is_not_followed(tmp_path):
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    save(ckpt, state())
    outside.mkdir()
    shutil.move(ckpt / "__0_0.distcp", outside / "__0_0.distcp")
    os.symlink(outside / "__0_0.distcp", ckpt / "__0_0.distcp")
    err = failure_of(lambda: load(ckpt, state()))
    assert isinstance(err, UnsafeCheckpointError), f"{type(err).__name__}: {err}"
    assert "__0_0.distcp" in str(err) and "link" in str(err)


def test_subdirectory_linked_outside_the_checkpoint_is_not_followed(tmp_path):
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    save(ckpt, state())
    outside.mkdir()
    shutil.move(ckpt / "__0_0.distcp", outside / "__0_0.distcp")
    os.symlink(outside, ckpt / "sub")
    # Point every record at sub/__0_0.distcp: lexically inside the checkpoint, physically not.
    import pickle

    with open(ckpt / ".metadata", "rb") as f:
        md = unpack_metadata(f.read())  # our own checkpoint: plain pickle is fine here
    for idx, rec in list(md.storage_data.items()):
        md.storage_data[idx] = {**rec, "file": "sub/__0_0.distcp"}
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    err = failure_of(lambda: load(ckpt, state()))
    assert isinstance(err, UnsafeCheckpointError), f"{type(err).__name__}: {err}"
    # Listing does not walk into the link either.
    assert "sub/__0_0.distcp" not in Storage(ckpt).file_sizes()


def test_step_directory_linked_into_a_tier_is_not_followed(tmp_path):
    from dcp_tiered.tiers.catalog import list_tier
    from dcp_tiered.tiers.config import Tier

    tier, elsewhere = tmp_path / "tier", tmp_path / "elsewhere" / "step_000000007"
    save(elsewhere, state())
    tier.mkdir()
    os.symlink(elsewhere, tier / "step_000000007")
    child = Storage(tier).child("step_000000007")
    with pytest.raises(UnsafeCheckpointError):
        child.read_bytes(".metadata")
    assert child.file_sizes() == {}
    infos = list_tier(Tier("t", str(tier), keep=1))
    assert [i.committed for i in infos] == [False]


def test_a_planted_link_never_redirects_a_write(tmp_path):
    ckpt, victim = tmp_path / "ckpt", tmp_path / "victim"
    victim.write_bytes(b"precious")
    ckpt.mkdir()
    os.symlink(victim, ckpt / "__0_0.distcp")
    assert failure_of(lambda: save(ckpt, state())) is not None
    assert victim.read_bytes() == b"precious"


def test_a_fifo_where_a_data_file_goes_does_not_block_a_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / "__0_0.distcp")
    code = f"""
import torch, torch.distributed.checkpoint as dcp
from dcp_tiered import CompressedWriter
try:
    dcp.save({{"w": torch.ones(10)}}, storage_writer=CompressedWriter({str(ckpt)!r}, sync_files=False), no_dist=True)
    emit("saved")
except BaseException as exc:  # DCP's CheckpointException is a BaseException
    emit(type(exc).__name__)
"""
    res = run_isolated(code, timeout=HANG_S, memory_mb=2000)
    assert not res.timed_out and res.returncode == 0, res.describe()
    assert res.result != "saved"


# --------------------------------------------------------------------------- concurrent writers

_RACER = """
import json, os, sys, time
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from dcp_tiered import CompressedWriter
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.save.writer import TieredWriter
me, root, sync, rounds, opts, kind = sys.argv[1:]
me, rounds, opts = int(me), int(rounds), json.loads(opts) or None
out = []
for r in range(rounds):
    open(f"{sync}/{r}.{me}", "w").close()
    deadline = time.monotonic() + RACE_WAIT_S
    while not os.path.exists(f"{sync}/{r}.{1 - me}"):
        if time.monotonic() > deadline:
            raise SystemExit("the other racer never came")
        time.sleep(0.0002)
    sd = {"w": torch.full((128, 64), float(1000 * me + r)), "b": torch.arange(3000) + me}
    try:
        if kind == "tiered":
            writer = TieredWriter([Tier("t", root, keep=1000, storage_options=opts or {})], due=["t"], frame_size=4096)
            try:
                dcp.save(sd, storage_writer=writer, checkpoint_id=f"r{r}", no_dist=True)
            finally:
                writer.close()
        else:
            dcp.save(sd, storage_writer=CompressedWriter(f"{root}/r{r}", storage_options=opts, frame_size=4096,
                                                         sync_files=False), no_dist=True)
        out.append(["won", ""])
    except CheckpointException as exc:
        err = next(iter(exc.failures.values()))[0]
        out.append([type(err).__name__, str(err)])
    except Exception as exc:
        out.append([type(exc).__name__, str(exc)])
emit(out)
"""


def race(root: str, sync: Path, rounds: int, storage_options: dict | None = None, kind: str = "compressed") -> list[list]:
    """Two processes save to ``root/r{i}`` at the same moment, ``rounds`` times; each one's outcomes."""
    sync.mkdir(parents=True, exist_ok=True)
    results: list = [None, None]

    def run(me: int) -> None:
        args = [str(me), root, str(sync), str(rounds), json.dumps(storage_options or {}), kind]
        code = "import sys\nsys.argv = ['x'] + %r\nRACE_WAIT_S = %r\n" % (args, scaled(60)) + _RACER
        results[me] = run_isolated(code, timeout=60 + 10 * rounds, memory_mb=4000)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res in results:
        assert not res.timed_out and res.returncode == 0 and res.result is not None, res.describe()
    return [r.result for r in results]


def check_race(root: str, outcomes: list[list], rounds: int, storage_options: dict | None = None) -> None:
    for r in range(rounds):
        got = [outcomes[0][r], outcomes[1][r]]
        winners = [i for i in (0, 1) if got[i][0] == "won"]
        assert len(winners) == 1, f"round {r}: {got}"
        kind, msg = got[1 - winners[0]]
        assert kind == "CheckpointExistsError", f"round {r}: the loser got {kind}: {msg}"
        assert "Checkpoint already exists" in msg and "overwrite=True" in msg, msg
        w = winners[0]
        want = {"w": torch.full((128, 64), float(1000 * w + r)), "b": torch.arange(3000) + w}
        got_sd = load(f"{root}/r{r}", want, storage_options)
        assert all(torch.equal(got_sd[k], want[k]) for k in want), f"round {r}: the committed checkpoint is not the winner's"


@pytest.mark.parametrize("kind", ["compressed", "tiered"])
def test_two_concurrent_saves_to_one_local_path_exactly_one_wins(tmp_path, kind):
    rounds = 20 if kind == "compressed" else 10
    root = str(tmp_path / "ckpts")
    outcomes = race(root, tmp_path / "sync", rounds, kind=kind)
    check_race(root, outcomes, rounds)
    # A committed checkpoint keeps no lock file behind.
    assert not any(p.name == ".lock" for p in Path(root).rglob("*"))


def test_two_concurrent_saves_to_one_s3_path_exactly_one_wins(tmp_path, moto_server):
    rounds = 8
    bucket = moto_server.make_bucket()
    options = moto_server.storage_options
    root = f"s3://{bucket}/race"
    outcomes = race(root, tmp_path / "sync", rounds, options)
    check_race(root, outcomes, rounds, options)
    # The loser's uniquely named data files are gone: every data file is referenced.
    for r in range(rounds):
        url = f"{root}/r{r}"
        md = CompressedReader(url, storage_options=options).read_metadata()
        referenced = {rec["file"] for rec in md.storage_data.values()}
        present = {n for n in Storage(url, options).file_sizes() if n.endswith(".distcp")}
        assert present == referenced, f"round {r}: stray data files {sorted(present - referenced)}"


def test_save_while_another_holds_the_lock_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    lock = Storage(ckpt).try_lock(".lock")
    assert lock is not None and lock.held
    err = failure_of(lambda: save(ckpt, state()))
    assert type(err).__name__ == "CheckpointExistsError" and "being written" in str(err), err
    assert not (ckpt / "__0_0.distcp").exists(), "data was written before the save was refused"
    lock.release()
    save(ckpt, state())  # the lock is free again
    assert not (ckpt / ".lock").exists()


def test_a_lock_left_by_a_killed_save_does_not_block_the_next(tmp_path):
    ckpt = tmp_path / "ckpt"
    code = f"""
import os
from dcp_tiered.storage import Storage
lock = Storage({str(ckpt)!r}).try_lock(".lock")
os._exit(0)  # dies holding the lock, as a killed save would
"""
    res = run_isolated(code, timeout=HANG_S, memory_mb=2000)
    assert res.returncode == 0, res.describe()
    assert (ckpt / ".lock").exists()
    save(ckpt, state())
    assert load(ckpt, state())["b"].equal(state()["b"])


def _save_on_ranks(rank: int, world_size: int, path: str, out: str) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    sd = {"w": torch.full((1000,), float(rank))}
    try:
        dcp.save(sd, storage_writer=CompressedWriter(path, frame_size=4096, sync_files=False))
        result = "saved"
    except CheckpointException as exc:
        errs = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        result = ",".join(sorted({type(e).__name__ for e in errs}))
    Path(out, f"rank{rank}").write_text(result)


def test_a_refused_claim_fails_every_rank_before_any_writes(tmp_path):
    from gloo_ranks import run_ranks

    ckpt = tmp_path / "ckpt"
    lock = Storage(ckpt).try_lock(".lock")  # another job is writing this checkpoint
    out = tmp_path / "out"
    out.mkdir()
    try:
        run_ranks(_save_on_ranks, 2, tmp_path, str(ckpt), str(out), timeout=300)
    finally:
        lock.release()
    assert [(out / f"rank{r}").read_text() for r in (0, 1)] == ["CheckpointExistsError"] * 2
    assert not list(ckpt.glob("*.distcp")), "a rank wrote data although the coordinator lost the claim"


def test_a_save_that_failed_on_this_rank_lets_a_retry_claim_the_path(tmp_path: Path) -> None:
    import numpy as np
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_tiered import numpy_safe_globals

    sd = {"rng": np.random.RandomState(0).get_state(), "w": torch.ones(3)}
    writer = CompressedWriter(tmp_path / "a")  # kept alive: its lock must not outlive the failed save
    with pytest.raises(CheckpointException):
        dcp.save(sd, storage_writer=writer, no_dist=True)  # refused at save: numpy needs the opt-in
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "a", safe_globals=numpy_safe_globals()), no_dist=True)
    assert (tmp_path / "a" / ".metadata").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_load_any_and_convert_of_a_special_pt_file_do_not_block(tmp_path, kind):
    """``inspect.load_any``/``convert`` of a ``.pt`` path that is a FIFO (blocked forever in
    open), a link to /dev/zero (read until memory runs out) or a directory: a clear
    UnsafeCheckpointError instead (a directory is read as a checkpoint directory, whatever its name, as
    the Lightning plugin names its ``last.ckpt``: an empty one is no checkpoint)."""
    pt = tmp_path / "model.pt"
    if kind == "fifo":
        os.mkfifo(pt)
    elif kind == "dev-zero":
        pt.symlink_to("/dev/zero")
    else:
        pt.mkdir()
    code = f"""
from dcp_tiered import inspect as ckpt
out = {{}}
for what, fn in (("load_any", lambda: ckpt.load_any({str(pt)!r})),
                 ("convert", lambda: ckpt.convert({str(pt)!r}, {str(tmp_path / 'out')!r}))):
    try:
        fn()
        out[what] = "ok"
    except BaseException as exc:
        out[what] = type(exc).__name__
emit(out)
"""
    res = run_isolated(code, timeout=HANG_S, memory_mb=2000)
    assert not res.timed_out and not res.crashed and res.returncode == 0, res.describe()
    want = "CheckpointNotFoundError" if kind == "directory" else "UnsafeCheckpointError"
    assert res.result == {"load_any": want, "convert": want}
