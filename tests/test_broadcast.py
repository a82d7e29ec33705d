"""Leader load (``load_and_broadcast``) on 4 gloo ranks, with two groups and with one.

The checkpoint is saved once in the pytest process; the 4 ranks are spawned once and run
every check (each records ``ok`` or its traceback, and the bytes it read from storage).
Storage is the local directory behind a counting fsspec filesystem (``counting://``): the
storage layer treats it as remote, so every read goes through ``cat_file`` and is counted.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import traceback
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from gloo_ranks import run_ranks
from tensor_values import hard_values

from dcp_tiered import (
    CheckpointNotFoundError,
    CompressedReader,
    CompressedWriter,
    ConfigError,
)
from dcp_tiered.dcp.broadcast import LeaderLoadError, load_and_broadcast
from dcp_tiered.dcp.bucket_broadcast import plan_buckets

SPAWN_TIMEOUT = 240.0
WS = 4
SMALL_BUCKET = 4096  # forces packing, splitting of large tensors and many broadcasts


# -- a filesystem that counts the bytes it serves -----------------------------------------------


class CountingFS(LocalFileSystem):
    """Local files behind ``counting://``; counts bytes returned by reads, per process."""

    protocol = ("counting",)
    root_marker = "/"
    lock = threading.Lock()
    read: dict[str, int] = {}  # file name -> bytes served

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = str(path)
        if path.startswith("counting://"):
            path = path[len("counting://"):]
        return LocalFileSystem._strip_protocol(path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with CountingFS.lock:
            name = os.path.basename(str(path))
            CountingFS.read[name] = CountingFS.read.get(name, 0) + len(data)
        return data

    @classmethod
    def reset(cls) -> None:
        with cls.lock:
            cls.read = {}

    @classmethod
    def data_bytes(cls) -> int:
        return sum(n for k, n in cls.read.items() if k.endswith(".distcp"))

    @classmethod
    def total(cls) -> int:
        return sum(cls.read.values())


def register() -> None:
    fsspec.register_implementation("counting", CountingFS, clobber=True)


# -- state ------------------------------------------------------------------------------------


def state() -> dict:
    """Replicated state: a tensor bigger than several small buckets, many dtypes, 0-d and
    empty tensors, a list of tensors, non-tensor values."""
    return {
        "model": {
            "big": hard_values(torch.float32, (300, 70), 1),  # 84000 bytes: ~21 small buckets
            "bf16": hard_values(torch.bfloat16, (1001,), 2),
            "f16": hard_values(torch.float16, (513,), 3),
            "f64": hard_values(torch.float64, (129,), 4),
            "i64": hard_values(torch.int64, (333,), 5),
            "i8": hard_values(torch.int8, (77,), 6),
            "bool": hard_values(torch.bool, (1023,), 7),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "nc": hard_values(torch.float32, (40, 30), 8),  # loaded into a transposed view
            "layers": [hard_values(torch.float32, (50,), 9), hard_values(torch.int32, (4, 4), 10)],
        },
        "optim": {"step": 17, "lr": 3e-4, "betas": [0.9, 0.999], "name": "adam-\u00e9"},
        "epoch": 3,
    }


def template(*, bad_shape: bool = False) -> tuple[dict, torch.Tensor]:
    """Zero-filled destination; ``model.nc`` is a transposed view of the returned base."""
    ref = state()
    model = {k: torch.zeros_like(v) for k, v in ref["model"].items() if k not in ("nc", "layers")}
    base = torch.zeros(30, 40)
    model["nc"] = base.t()
    model["layers"] = [torch.zeros_like(x) for x in ref["model"]["layers"]]
    if bad_shape:
        model["f64"] = torch.zeros(128, dtype=torch.float64)
    return {"model": model, "optim": {"step": None, "lr": None, "betas": None, "name": None}, "epoch": None}, base


def diffs(got: dict, base: torch.Tensor | None = None) -> list[str]:
    want = state()
    errs = []

    def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.dtype != b.dtype or a.shape != b.shape:
            errs.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif a.numel() and not torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)):
            errs.append(f"{name}: values differ")

    for k, v in want["model"].items():
        if k == "layers":
            for i, (a, b) in enumerate(zip(got["model"][k], v)):
                same(f"model.layers.{i}", a, b)
        else:
            same(f"model.{k}", got["model"][k], v)
    if base is not None:
        same("base of model.nc", base, want["model"]["nc"].t())
    for k in ("optim", "epoch"):
        if got[k] != want[k]:
            errs.append(f"{k}: {got[k]!r} != {want[k]!r}")
    return errs


def equal_states(a: dict, b: dict) -> list[str]:
    """Bitwise comparison of two loaded state dicts."""
    errs = []
    for k in a["model"]:
        x, y = a["model"][k], b["model"][k]
        pairs = zip(x, y) if isinstance(x, list) else [(x, y)]
        for s, t in pairs:
            if s.numel() and not torch.equal(s.contiguous().reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)):
                errs.append(f"model.{k} differs from the plain load")
    if a["optim"] != b["optim"] or a["epoch"] != b["epoch"]:
        errs.append("non-tensor values differ from the plain load")
    return errs


def check(errs: list[str]) -> None:
    if errs:
        raise AssertionError("\n  ".join(["loaded state differs:"] + errs))


# -- spawning ----------------------------------------------------------------------------------


def _record(out: Path, name: str, rank: int, fn) -> None:
    """Run one check; record ``ok`` (or the traceback) and the bytes read; re-sync the ranks."""
    CountingFS.reset()
    try:
        result = fn()
        status = "ok"
    except BaseException:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        result, status = None, traceback.format_exc()
    (out / f"{name}.rank{rank}").write_text(status)
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(
        {"data": CountingFS.data_bytes(), "total": CountingFS.total(), "result": result}))
    dist.barrier()


def _expect_error(fn, types: tuple[type, ...], must_contain: str = "") -> str:
    try:
        fn()
    except types as exc:
        assert must_contain in str(exc), f"{type(exc).__name__} without {must_contain!r}: {exc}"
        return type(exc).__name__
    raise AssertionError(f"no {[t.__name__ for t in types]} was raised")


def _worker(rank: int, world_size: int, ckpt: str, tiered: str, out: str) -> None:
    register()
    out_p = Path(out)
    url = "counting://" + ckpt
    groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    calls = {"n": 0}

    def factory(path: str = url):
        calls["n"] += 1
        return CompressedReader(path)

    plain: dict = {}

    def plain_load():
        tmpl, base = template()
        dcp.load(tmpl, storage_reader=CompressedReader(url))  # every rank reads everything
        check(diffs(tmpl, base))
        plain.update(tmpl)

    _record(out_p, "plain", rank, plain_load)

    def two_groups():
        calls["n"] = 0
        tmpl, base = template()
        stats = load_and_broadcast(tmpl, factory, process_group=groups)
        check(diffs(tmpl, base) + equal_states(tmpl, plain))
        assert stats.leader == (rank in (0, 2)) and stats.leader_rank == (0 if rank < 2 else 2), stats
        assert calls["n"] == (1 if stats.leader else 0), f"reader factory called {calls['n']} times"
        return {"leader": stats.leader, "buckets": stats.buckets}

    _record(out_p, "two_groups", rank, two_groups)

    def world_src1_small_buckets():
        tmpl, base = template()
        stats = load_and_broadcast(tmpl, url, src=1, bucket_bytes=SMALL_BUCKET)  # a path: readers built on rank 1 only
        check(diffs(tmpl, base) + equal_states(tmpl, plain))
        assert stats.leader == (rank == 1) and stats.group_ranks == [0, 1, 2, 3]
        assert stats.buckets > 20, stats  # the big tensor went in slices
        return {"leader": stats.leader, "buckets": stats.buckets}

    _record(out_p, "world_src1_small_buckets", rank, world_src1_small_buckets)

    def two_groups_src1_views():
        # leaders are group rank 1 (global 1 and 3); destinations are all non-contiguous views
        tmpl, _ = template()
        bases = {k: torch.zeros(2, *v.shape, dtype=v.dtype) for k, v in tmpl["model"].items() if isinstance(v, torch.Tensor)}
        for k, b in bases.items():
            tmpl["model"][k] = b[1]  # a view at an offset into a bigger storage
        stats = load_and_broadcast(tmpl, factory, process_group=groups, src=1, bucket_bytes=1000)
        check(diffs(tmpl))
        for k, b in bases.items():
            assert not b[0].any(), f"{k}: bytes outside the destination view were written"
        assert stats.leader == (rank in (1, 3))

    _record(out_p, "two_groups_src1_views", rank, two_groups_src1_views)

    def mismatch():
        tmpl, _ = template(bad_shape=rank == 3)
        if rank < 2:  # the other group is unaffected
            load_and_broadcast(tmpl, factory, process_group=groups)
            check(diffs(tmpl))
            return "ok"
        return _expect_error(lambda: load_and_broadcast(tmpl, factory, process_group=groups), (ConfigError,), "model.f64")

    _record(out_p, "mismatch", rank, mismatch)

    def leader_fails():
        calls["n"] = 0
        tmpl, _ = template()
        missing = "counting://" + ckpt + "_missing"
        name = _expect_error(lambda: load_and_broadcast(tmpl, lambda: factory(missing)),
                             (CheckpointNotFoundError, LeaderLoadError))
        assert name == ("CheckpointNotFoundError" if rank == 0 else "LeaderLoadError"), name
        assert calls["n"] == (1 if rank == 0 else 0)

    _record(out_p, "leader_fails", rank, leader_fails)

    def leader_fails_verification():
        # DCP wraps the leader's CorruptCheckpointError in CheckpointException (a BaseException):
        # the receivers must still hear of it, and the next load must stay in step
        tmpl, _ = template()
        bad = "counting://" + tiered + "/step_000000007"
        try:
            load_and_broadcast(tmpl, bad, process_group=groups)
        except LeaderLoadError:
            assert rank in (1, 3)
        except BaseException as exc:  # noqa: BLE001
            assert rank in (0, 2) and type(exc).__name__ == "CheckpointException", repr(exc)
        else:
            raise AssertionError("loading a corrupted checkpoint succeeded")
        tmpl, base = template()
        load_and_broadcast(tmpl, "counting://" + tiered + "/step_000000005", process_group=groups)
        check(diffs(tmpl, base))

    _record(out_p, "leader_fails_verification", rank, leader_fails_verification)

    def dtensor_refused():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = init_device_mesh("cpu", (world_size,))
        tmpl, _ = template()
        tmpl["model"]["big"] = distribute_tensor(torch.zeros(300, 70), mesh, [Replicate()])
        _expect_error(lambda: load_and_broadcast(tmpl, factory), (ConfigError,), "replicated")

    _record(out_p, "dtensor_refused", rank, dtensor_refused)

    def restore_broadcast():
        from dcp_tiered import Tier, TieredCheckpointer

        ck = TieredCheckpointer([Tier("shared", "counting://" + tiered, keep=3)], resume_promotions=False)
        try:
            CountingFS.reset()  # count the restore only
            tmpl, base = template()
            step = ck.restore(tmpl, broadcast=True)
            assert step == 5, step  # step 7 failed on the leader, and so was skipped on every rank
            assert ck.restore_failures == 1, ck.restore_failures
            check(diffs(tmpl, base))
        finally:
            ck.close()

    if "broadcast" in inspect.signature(__import__("dcp_tiered").TieredCheckpointer.restore).parameters:
        _record(out_p, "restore_broadcast", rank, restore_broadcast)

    def restore_broadcast_sharded_refused_once():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        from dcp_tiered import Tier, TieredCheckpointer

        mesh = init_device_mesh("cpu", (world_size,))
        tmpl, _ = template()
        tmpl["model"]["big"] = distribute_tensor(torch.zeros(300, 70), mesh, [Replicate()])
        with TieredCheckpointer([Tier("shared", "counting://" + tiered, keep=3)], resume_promotions=False) as ck:
            CountingFS.reset()
            _expect_error(lambda: ck.restore(tmpl, broadcast=True), (ConfigError,), "replicated")
            assert ck.restore_failures == 0, ck.restore_failures  # refused up front, no candidate tried
            assert CountingFS.data_bytes() == 0

    _record(out_p, "restore_broadcast_sharded", rank, restore_broadcast_sharded_refused_once)


# -- fixtures and tests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[Path, str | None]:
    from dcp_tiered import Tier, TieredCheckpointer

    root = tmp_path_factory.mktemp("bcast")
    ckpt = root / "ckpt"
    dcp.save(state(), storage_writer=CompressedWriter(ckpt, codec="zstd", frame_size=4096), no_dist=True)
    tiered = root / "tiered"
    with TieredCheckpointer([Tier("shared", str(tiered), keep=3)], resume_promotions=False) as ck:
        ck.maybe_save(5, state())
        ck.maybe_save(7, state())
    data = tiered / "step_000000007" / "__0_0.distcp"  # the newest fails verification: restore falls back to 5
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = root / "records"
    out.mkdir()
    try:
        run_ranks(_worker, WS, root, str(ckpt), str(tiered), str(out), timeout=SPAWN_TIMEOUT)
        return out, None
    except BaseException:  # noqa: BLE001 - reported by every check lacking a record
        return out, traceback.format_exc()


def _records(spawned, name: str) -> list[dict]:
    out, err = spawned
    problems, counts = [], []
    for r in range(WS):
        f = out / f"{name}.rank{r}"
        if not f.exists():
            problems.append(f"rank {r}: no record (ranks crashed or hung)\n{err or ''}")
            continue
        if (s := f.read_text()) != "ok":
            problems.append(f"rank {r}:\n{s}")
        counts.append(json.loads((out / f"{name}.rank{r}.json").read_text()))
    assert not problems, "\n".join(problems)
    return counts


def test_plain_load_reads_n_times(spawned) -> None:
    counts = _records(spawned, "plain")
    once = counts[0]["data"]
    assert once > 0 and all(c["data"] == once for c in counts), counts


def test_two_groups_read_once_per_group(spawned) -> None:
    """World size 4, groups {0,1} and {2,3}: the leaders read what one plain load reads, the
    receivers read nothing at all; the result equals the plain load bit for bit."""
    plain = _records(spawned, "plain")
    counts = _records(spawned, "two_groups")
    once = plain[0]["data"]
    assert [c["data"] for c in counts] == [once, 0, once, 0], counts
    assert counts[1]["total"] == counts[3]["total"] == 0, counts
    assert sum(c["data"] for c in counts) * 2 == sum(c["data"] for c in plain)


def test_one_group_reads_once(spawned) -> None:
    """One group of 4 (default group), leader at rank 1, 4 KiB buckets: storage serves 1x, plain load 4x."""
    plain = _records(spawned, "plain")
    counts = _records(spawned, "world_src1_small_buckets")
    assert [c["total"] > 0 for c in counts] == [False, True, False, False], counts
    assert sum(c["data"] for c in counts) * WS == sum(c["data"] for c in plain)


def test_views_and_group_rank_src(spawned) -> None:
    counts = _records(spawned, "two_groups_src1_views")
    assert [c["total"] > 0 for c in counts] == [False, True, False, True], counts


def test_structure_mismatch_fails_the_group_only(spawned) -> None:
    counts = _records(spawned, "mismatch")
    assert [c["result"] for c in counts] == ["ok", "ok", "ConfigError", "ConfigError"]


def test_leader_failure_reaches_every_rank(spawned) -> None:
    counts = _records(spawned, "leader_fails")
    assert counts[1]["total"] == counts[2]["total"] == counts[3]["total"] == 0


def test_leader_failure_inside_dcp_load_reaches_every_rank(spawned) -> None:
    _records(spawned, "leader_fails_verification")


def test_sharded_state_is_refused(spawned) -> None:
    _records(spawned, "dtensor_refused")


def test_restore_broadcast_refuses_sharded_state_once_up_front(spawned) -> None:
    _records(spawned, "restore_broadcast_sharded")


def test_checkpointer_restore_broadcast(spawned) -> None:
    """``TieredCheckpointer.restore(state, broadcast=True)``: only the leader reads data files,
    and a candidate that fails on the leader is skipped on every rank."""
    from dcp_tiered import TieredCheckpointer

    if "broadcast" not in inspect.signature(TieredCheckpointer.restore).parameters:
        pytest.skip("TieredCheckpointer.restore has no broadcast option yet")
    counts = _records(spawned, "restore_broadcast")
    plain = _records(spawned, "plain")
    # the leader read step 7 (until it failed) and step 5; the others read no data file
    assert counts[0]["data"] > plain[0]["data"] and [c["data"] for c in counts[1:]] == [0, 0, 0], counts


# -- single process --------------------------------------------------------------------------------


def test_without_process_group_is_a_plain_load(tmp_path: Path) -> None:
    register()
    dcp.save(state(), storage_writer=CompressedWriter(tmp_path / "c"), no_dist=True)
    tmpl, base = template()
    stats = load_and_broadcast(tmpl, lambda: CompressedReader(f"counting://{tmp_path}/c"))
    check(diffs(tmpl, base))
    assert stats.leader


def test_bad_arguments(tmp_path: Path) -> None:
    tmpl, _ = template()
    with pytest.raises(ConfigError):
        load_and_broadcast(tmpl, str(tmp_path), bucket_bytes=0)
    with pytest.raises(ConfigError):
        load_and_broadcast(tmpl, 42)  # type: ignore[arg-type]


def test_bucket_plan() -> None:
    plan = plan_buckets([10, 0, 30, 100, 5, 5], 40)
    assert plan == [[(0, 0, 10), (2, 0, 30)], [(3, 0, 40)], [(3, 40, 80)], [(3, 80, 100)], [(4, 0, 5), (5, 0, 5)]]
    for sizes in ([1] * 100, [39, 2, 41, 0, 80]):
        plan = plan_buckets(sizes, 40)
        assert all(sum(e - s for _, s, e in b) <= 40 for b in plan)
        covered: dict[int, int] = {}
        for b in plan:
            for i, s, e in b:
                assert s == covered.get(i, 0)
                covered[i] = e
        assert covered == {i: n for i, n in enumerate(sizes) if n}
