"""Promotion safety: bounded waits, independent jobs, untrusted intents, pinned steps.

* A node comes back with an empty node-local tier after a crash mid-promotion: rank 0's
  resumed promotion waits for a file of rank 1 that can never arrive.  It must give up within
  the documented bound (:func:`fragment_wait_bound`) with a ``PromotionError`` naming the tier,
  the step and the missing file, and later promotions must commit meanwhile (runs in a child
  process: a regression hangs for an hour, which fails one test instead of stalling pytest).
* ``Promoter.wait(timeout)`` / ``close(timeout=)`` say what is still pending; a stalled
  target tier never delays promotions to another tier.
* Promotion intents (``.promote-{rank}.json``) are untrusted input: malformed, misplaced or
  hostile ones are skipped with a warning, left in place for gc, and never damage a committed
  checkpoint (the source itself, or a committed step of another save on the target).
* Retention run by a resumed promotion honours steps marked busy (pinned restore candidates).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.distributed.checkpoint as dcp
from gloo_ranks import run_ranks
from isolated import run_isolated
from speed import scaled

from dcp_tiered import CompressedReader, CorruptCheckpointError, PromotionError, Tier, TieredCheckpointer
from dcp_tiered.storage.retry import RetryPolicy
from dcp_tiered.tiers.layout import INTENT_FIELDS, INTENT_MAX_BYTES, parse_intent
from dcp_tiered.tiers.promote.promoter import FRAGMENT_WAIT_CAP, FRAGMENT_WAIT_FLOOR, Promoter, fragment_wait_bound

from faults import FaultyFS, committed_steps, register, reset_faults  # noqa: F401 (fixture)

register()
FAST_RETRY = RetryPolicy(attempts=2, base=0.01, cap=0.05)
TESTS = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("reset_faults")


def state(step: int) -> dict:
    return {"model": {"w": torch.full((2000,), float(step)), "b": torch.arange(64.0) + step}}


def load_step(path: Path) -> float:
    out = {"model": {"w": torch.zeros(2000), "b": torch.zeros(64)}}
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    assert torch.equal(out["model"]["b"], torch.arange(64.0) + out["model"]["w"][0]), f"{path} mixes steps"
    return float(out["model"]["w"][0])


def crash_save(tiers: list[Tier], step: int, values: int | None = None) -> None:
    """Save ``step`` to every tier's source, then die before any promotion ran (intents stay)."""
    ck = TieredCheckpointer(tiers, resume_promotions=False)
    ck.promoter.submit = lambda intent: None  # type: ignore[method-assign]
    ck.maybe_save(step, state(step if values is None else values), force=True)
    ck.close()


# =========================================================================== the bound


def test_bound_is_of_the_order_of_the_save_interval() -> None:
    def t(every):
        return Tier("t", "/tmp/x", every=every)

    assert fragment_wait_bound(t(None), t("5m")) == 300
    assert fragment_wait_bound(t("10m"), t(None)) == 600
    assert fragment_wait_bound(t("1s"), t("1s")) == FRAGMENT_WAIT_FLOOR
    assert fragment_wait_bound(t(None), t("1d")) == FRAGMENT_WAIT_CAP
    assert fragment_wait_bound(t(None), t(None)) < 3600, "no hour-long default"
    assert fragment_wait_bound(t("1s"), t("1s"), own_copy_s=100) == 300, "a slow copy of our own file waits longer"


# =========================================================================== the lost node


def lost_node_tiers(root: str) -> list[Tier]:
    return [Tier("local", f"{root}/local/{{rank}}", every_steps=1, keep=5, codec="lz4"),
            Tier("shared", f"{root}/shared", every="1s", keep=5, codec="zstd")]


def _lost_node_save(rank: int, world_size: int, root: str) -> None:
    """Both ranks save step 5 (each its own keys) to the node-local tier; the job dies before promoting."""
    ck = TieredCheckpointer(lost_node_tiers(root), resume_promotions=False)
    ck.promoter.submit = lambda intent: None  # type: ignore[method-assign]
    ck.maybe_save(5, {f"rank{rank}": {"w": torch.full((3000,), 5.0 + rank)}}, force=True)
    ck.close()


_LOST_NODE_CHILD = """
import os, time, torch
from dcp_tiered import PromotionError, TieredCheckpointer
from dcp_tiered.tiers.promote.promoter import fragment_wait_bound
from test_promotion_safety import lost_node_tiers
fragment_wait_bound.__globals__["FRAGMENT_WAIT_FLOOR"] = {floor!r}  # the test's shorter floor (see below)
tiers = lost_node_tiers({root!r})
bound = fragment_wait_bound(*tiers)
t0 = time.monotonic()
ck = TieredCheckpointer(tiers)  # rank 0 alone: resumes its intent, whose commit waits for rank 1's file
ck.maybe_save(6, {{"rank0": {{"w": torch.full((3000,), 6.0)}}}}, force=True)
step6 = os.path.join({root!r}, "shared", "step_000000006", ".metadata")
while not os.path.exists(step6) and time.monotonic() - t0 < bound + {slack!r}:
    time.sleep(0.1)
pending_at_step6 = ck.promoter.pending()
error = None
try:
    ck.close()
except PromotionError as exc:
    error = str(exc)
emit({{"bound": bound, "step6": os.path.exists(step6), "pending_at_step6": pending_at_step6,
       "close_s": time.monotonic() - t0, "error": error}})
"""


def test_lost_node_promotion_gives_up_within_the_bound_and_later_promotions_commit(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    run_ranks(_lost_node_save, 2, tmp_path, root, timeout=240)
    d5 = "step_000000005"
    assert (tmp_path / "run/local/0" / d5 / ".metadata").exists()
    assert (tmp_path / "run/local/0" / d5 / ".promote-0.json").exists()
    shutil.rmtree(tmp_path / "run/local/1")  # the node comes back with an empty local tier
    assert fragment_wait_bound(*lost_node_tiers(root)) == FRAGMENT_WAIT_FLOOR
    # The child lowers the floor (60 s) to 15 quiet-machine seconds: the same bound, reached sooner
    # (the wait, the give-up and step 6's commit meanwhile are the same code at any floor).
    bound = scaled(15.0)
    res = run_isolated(_LOST_NODE_CHILD.format(root=root, floor=bound, slack=scaled(60)), timeout=15 + 240, cwd=TESTS)
    assert not res.timed_out and res.returncode == 0, res.describe()
    out = res.result
    assert out["step6"], "a later promotion never committed"
    assert any("step 5" in p and "waiting" in p for p in out["pending_at_step6"]), (
        f"step 6 should commit while step 5 still waits, pending then: {out['pending_at_step6']}")
    err = out["error"]
    assert err is not None, "close() returned without reporting the promotion that gave up"
    for what in ("'shared'", "step 5", "rank(s) 1", "__1_0.distcp"):
        assert what in err, f"{what!r} missing from: {err}"
    assert out["bound"] == bound, out
    assert out["close_s"] < bound + scaled(120), out  # generous slack for a loaded machine; today: one hour
    assert committed_steps(tmp_path / "run/shared") == [6]
    assert load_dir_rank0(tmp_path / "run/shared/step_000000006") == 6.0
    # the intent no longer asks for the impossible commit: a restart does not wait again
    assert not (tmp_path / "run/local/0" / d5 / ".promote-0.json").exists()
    assert (tmp_path / "run/local/0" / d5 / ".metadata").exists(), "the source step stays"


def load_dir_rank0(path: Path) -> float:
    out = {"rank0": {"w": torch.zeros(3000)}}
    dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
    return float(out["rank0"]["w"][0])


# =========================================================================== wait/close(timeout), independence


def test_stalled_tier_never_delays_promotions_to_another_and_wait_says_what_is_pending(tmp_path: Path) -> None:
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=5, codec="lz4"),
             Tier("stuck", f"faulty://{tmp_path}/stuck", every_steps=1, keep=5, codec="zstd"),
             Tier("other", str(tmp_path / "other"), every_steps=1, keep=5, codec="zstd")]
    ck = TieredCheckpointer(tiers)
    FaultyFS.faults.stall.clear()  # every write to the `stuck` tier hangs
    try:
        ck.maybe_save(1, state(1))
        assert FaultyFS.faults.stalled.wait(scaled(60))
        deadline = time.monotonic() + scaled(120)
        while 1 not in committed_steps(tmp_path / "other") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert committed_steps(tmp_path / "other") == [1], "the stalled tier delayed the promotion to another tier"
        with pytest.raises(PromotionError, match=r"still pending.*step 1 local->stuck"):
            ck.promoter.wait(timeout=0.5)
        with pytest.raises(PromotionError, match=r"still pending.*step 1 local->stuck"):
            ck.promoter.close(wait=True, timeout=0.5)
    finally:
        FaultyFS.faults.stall.set()
        ck.promoter.close(wait=False)
    assert load_step(tmp_path / "other" / "step_000000001") == 1.0


# =========================================================================== untrusted intents


def two_tiers(tmp_path: Path) -> list[Tier]:
    return [Tier("local", str(tmp_path / "local"), every_steps=1, keep=5, codec="lz4"),
            Tier("shared", str(tmp_path / "shared"), every_steps=1, keep=5, codec="zstd")]


def _intent_path(tmp_path: Path, step: int = 5) -> Path:
    return tmp_path / "local" / f"step_{step:09d}" / ".promote-0.json"


def _edit(field: str, value):
    def edit(doc: dict) -> object:
        doc[field] = value
        return doc
    return edit


def _edit_record(field: str, value):
    def edit(doc: dict) -> object:
        doc["records"][0][1][field] = value
        return doc
    return edit


def _nested(doc: dict) -> bytes:
    return b"[" * 200_000 + b"]" * 200_000


HOSTILE = {
    "onto_itself": _edit("targets", ["local"]),
    "commit_onto_itself": lambda d: {**d, "targets": [], "meta": ["local"]},
    "empty_list": lambda d: [],
    "deeply_nested": _nested,
    "not_json": lambda d: b"\xff\xfe{",
    "json_null": lambda d: None,
    "extra_field": _edit("evil", 1),
    "missing_field": lambda d: {k: v for k, v in d.items() if k != "records"},
    "name_of_another_dir": _edit("name", "step_000000004"),
    "name_with_path": _edit("name", "../step_000000005"),
    "source_mismatch": _edit("source", "shared"),
    "rank_mismatch": _edit("rank", 1),
    "rank_wrong_type": _edit("rank", "0"),
    "data_file_with_separator": _edit("data_file", "../../etc/x.distcp"),
    "data_file_dotdot": _edit("data_file", "..distcp"),
    "unknown_target": _edit("targets", ["nowhere"]),
    "targets_not_a_list": _edit("targets", "shared"),
    "targets_repeated": _edit("targets", ["shared", "shared"]),
    "save_id_wrong_type": _edit("save_id", ["x"]),
    "records_wrong_type": _edit("records", {"a": 1}),
    "record_wrong_file": _edit_record("file", "__1_0.distcp"),
    "record_huge_offset": _edit_record("offset", -1),
    "record_nested": _edit_record("shape", [[1, [2]]]),
}


def _write_hostile(path: Path, kind: str, original: bytes) -> None:
    out = HOSTILE[kind](json.loads(original))
    path.write_bytes(out if isinstance(out, bytes) else json.dumps(out).encode())


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_intent_is_skipped_and_never_damages_a_committed_step(tmp_path: Path, kind: str, caplog) -> None:
    tiers = two_tiers(tmp_path)
    crash_save(tiers, 5)
    intent = _intent_path(tmp_path)
    _write_hostile(intent, kind, intent.read_bytes())
    hostile = intent.read_bytes()
    src = tmp_path / "local" / "step_000000005"
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    caplog.set_level(logging.WARNING)
    ck = TieredCheckpointer(tiers, retry=FAST_RETRY)  # resumes (or skips) the intent
    try:
        ck.promoter.wait(timeout=scaled(120))
        infos = ck.list()  # the catalog (`ls`, restore) reads intents too
        pending = [set(i.pending_promotions) & {"local", "shared"} for i in infos if i.step == 5]
        assert pending == [set()], "an invalid intent counts as a pending promotion"
        out = state(0)
        assert ck.restore(out) == 5
    finally:
        ck.promoter.close(wait=False)
        ck.close()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before, "the committed source step changed"
    assert load_step(src) == 5.0
    assert intent.read_bytes() == hostile, "an invalid intent is left in place for gc"
    assert committed_steps(tmp_path / "shared") == []
    assert "promotion intent" in caplog.text


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
                     max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(INTENT_FIELDS + ("x",)), _JSON) | _JSON)
def test_parse_intent_accepts_only_valid_intents_and_raises_nothing_else(doc) -> None:
    """Any JSON value: either a valid intent or CorruptCheckpointError, never another exception."""
    try:
        got = parse_intent(json.dumps(doc).encode(), "fuzz", file_name=".promote-0.json", dir_name="step_000000005",
                           source="local", tiers={"local", "shared"})
    except CorruptCheckpointError:
        return
    assert got["name"] == "step_000000005" and got["source"] == "local" and got["rank"] == 0
    assert "local" not in got["targets"] + got["meta"]


def test_oversized_intent_is_not_read(tmp_path: Path, caplog) -> None:
    tiers = two_tiers(tmp_path)
    crash_save(tiers, 5)
    intent = _intent_path(tmp_path)
    with open(intent, "r+b") as f:
        f.truncate(INTENT_MAX_BYTES + 1)  # sparse: costs no disk, would cost memory if read
    caplog.set_level(logging.WARNING)
    ck = TieredCheckpointer(tiers)
    ck.close()
    assert "limit" in caplog.text
    assert committed_steps(tmp_path / "shared") == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_intent_that_is_a_fifo_or_a_link_is_not_read(tmp_path: Path) -> None:
    tiers = two_tiers(tmp_path)
    crash_save(tiers, 5)
    intent = _intent_path(tmp_path)
    outside = tmp_path / "outside.json"
    outside.write_bytes(intent.read_bytes())
    intent.unlink()
    intent.symlink_to(outside)
    crash_save(tiers, 6)
    fifo = _intent_path(tmp_path, 6)
    fifo.unlink()
    os.mkfifo(fifo)
    code = f"""
    from dcp_tiered import Tier, TieredCheckpointer
    tiers = [Tier("local", {str(tmp_path / 'local')!r}), Tier("shared", {str(tmp_path / 'shared')!r})]
    ck = TieredCheckpointer(tiers)
    n = len(ck.list())
    ck.close()
    emit(n)
    """
    res = run_isolated(code, timeout=120)
    assert not res.timed_out and res.returncode == 0, res.describe()
    assert committed_steps(tmp_path / "shared") == []


def test_intent_whose_target_resolves_to_its_source_is_skipped(tmp_path: Path) -> None:
    """A second tier whose path is a link to the first: promoting onto it would empty the source."""
    (tmp_path / "alias").symlink_to(tmp_path / "local", target_is_directory=True)
    tiers = two_tiers(tmp_path)
    crash_save(tiers, 5)
    intent = _intent_path(tmp_path)
    doc = json.loads(intent.read_bytes())
    doc["targets"], doc["meta"] = ["alias"], ["alias"]
    intent.write_text(json.dumps(doc))
    src = tmp_path / "local" / "step_000000005"
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    promoter = Promoter(tiers + [Tier("alias", str(tmp_path / "alias"), codec="zstd")], retry=FAST_RETRY)
    try:
        assert promoter.resume() == 1
        promoter.wait(timeout=scaled(120))
    finally:
        promoter.close(wait=False)
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.name != ".promote-0.json"} == {
        k: v for k, v in before.items() if k != ".promote-0.json"}
    assert load_step(src) == 5.0


def test_resumed_intent_never_replaces_a_committed_step_of_another_save(tmp_path: Path) -> None:
    tiers = two_tiers(tmp_path)
    other = TieredCheckpointer([tiers[1]])
    other.maybe_save(5, state(99))  # the target already holds step 5 of another save
    other.close()
    crash_save(tiers, 5)
    ck = TieredCheckpointer(tiers, retry=FAST_RETRY)
    try:
        ck.promoter.wait(timeout=scaled(120))
    finally:
        ck.close()
    assert load_step(tmp_path / "shared" / "step_000000005") == 99.0, "a resumed intent replaced another save's step"
    assert load_step(tmp_path / "local" / "step_000000005") == 5.0


def test_resumed_intent_of_the_same_save_is_idempotent(tmp_path: Path) -> None:
    tiers = two_tiers(tmp_path)
    crash_save(tiers, 5)
    intent = _intent_path(tmp_path).read_bytes()
    ck = TieredCheckpointer(tiers, retry=FAST_RETRY)  # resumes and commits
    ck.close()
    assert committed_steps(tmp_path / "shared") == [5]
    _intent_path(tmp_path).write_bytes(intent)  # the same intent once more (another process had it)
    ck = TieredCheckpointer(tiers, retry=FAST_RETRY)
    ck.close()
    assert load_step(tmp_path / "shared" / "step_000000005") == 5.0
    assert not _intent_path(tmp_path).exists()


def test_resumed_intent_removes_the_temp_file_of_a_killed_rewrite(tmp_path: Path, caplog) -> None:
    """A rank SIGKILLed while rewriting its intent leaves ``.promote-0.json.<hex>.tmp`` next to it:
    it is no intent (not read, no warning), and the finished promotion removes it with the intent once
    it is older than the leftover grace."""
    tiers = two_tiers(tmp_path)
    crash_save(tiers, 5)
    temp = _intent_path(tmp_path).with_name(".promote-0.json.0badc0de.tmp")
    temp.write_bytes(_intent_path(tmp_path).read_bytes()[:10])
    from dcp_tiered.tiers.catalog import list_tier
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
        infos = list_tier(tiers[0])
    assert [i.pending_promotions for i in infos] == [("shared",)]
    assert "unreadable promotion intent" not in caplog.text
    young = temp.with_name(".promote-0.json.0000beef.tmp")  # maybe a commit in progress in another process
    young.write_bytes(b"{")
    os.utime(temp, (time.time() - 7200, time.time() - 7200))
    ck = TieredCheckpointer(tiers, retry=FAST_RETRY)  # leftover_grace: one hour
    ck.close()
    assert load_step(tmp_path / "shared" / "step_000000005") == 5.0
    assert sorted(p.name for p in _intent_path(tmp_path).parent.glob(".promote-*")) == [young.name]


# =========================================================================== pinned steps


def test_retention_of_a_resumed_promotion_honours_pinned_steps(tmp_path: Path) -> None:
    """keep=1 on the target: the resumed promotion's commit runs retention there, which must not delete
    a step marked busy (the restore helper pins its candidates this way)."""
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=5, codec="lz4"),
             Tier("shared", str(tmp_path / "shared"), every_steps=1, keep=1, codec="zstd")]
    ck = TieredCheckpointer(tiers)
    ck.maybe_save(3, state(3))
    ck.close()
    assert committed_steps(tmp_path / "shared") == [3]
    crash_save(tiers, 5)
    promoter = Promoter(tiers, retry=FAST_RETRY, leftover_grace=0)
    promoter.set_writing(["shared"], 3, True)  # e.g. being restored right now
    try:
        assert promoter.resume() == 1
        promoter.wait(timeout=scaled(120))
        assert committed_steps(tmp_path / "shared") == [3, 5], "retention deleted a pinned step"
        assert load_step(tmp_path / "shared" / "step_000000003") == 3.0
        promoter.set_writing(["shared"], 3, False)
        promoter.retention(tiers[1])
        promoter.wait(timeout=scaled(120))
    finally:
        promoter.close(wait=False)
    assert committed_steps(tmp_path / "shared") == [5]


# =========================================================================== errors: I/O or not


def test_a_promotion_error_is_no_oserror_and_is_not_retried() -> None:
    """``PromotionError`` is not an ``OSError``: the retry loop (only for storage failures) runs it once."""
    from dcp_tiered.storage.retry import retrying

    calls = []

    def closed() -> None:
        calls.append(1)
        raise PromotionError("the promoter is closed")

    with pytest.raises(PromotionError):
        retrying(closed, RetryPolicy(attempts=4, base=0.001, cap=0.001), "submit")
    assert calls == [1]
    assert not isinstance(PromotionError("x"), OSError)


def _own_intent(tiers: list[Tier], step: int, swap: bool = False):
    """This rank's recorded intent of ``step`` in the source tier, as a fresh (not resumed) intent."""
    from dcp_tiered.tiers.promote.promoter import PromotionIntent

    path = Path(tiers[0].url) / f"step_{step:09d}" / ".promote-0.json"
    doc = json.loads(path.read_text())
    if swap:  # valid records, swapped between the two keys
        (ia, ra), (ib, rb) = doc["records"]
        doc["records"] = [[ia, rb], [ib, ra]]
    return PromotionIntent(**{k: v for k, v in doc.items()})


def test_wait_raises_an_oserror_only_when_every_failure_is_storage(tmp_path: Path) -> None:
    """A copy that fails on storage (after its retries) is a ``PromotionIOError``: also an ``OSError``,
    caused by the storage error.  A commit refused by the protocol's checks is a plain ``PromotionError``,
    tried once."""
    from dcp_tiered import PromotionIOError, StorageError

    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=5, codec="lz4"),
             Tier("shared", str(tmp_path / "shared"), every_steps=1, keep=5, codec="lz4")]
    crash_save(tiers, 5)
    shutil.rmtree(tmp_path / "shared", ignore_errors=True)
    (tmp_path / "shared").write_text("a file where the tier directory should be")
    p = Promoter(tiers, retry=FAST_RETRY)
    try:
        p.submit(_own_intent(tiers, 5))
        with pytest.raises(PromotionIOError) as info:
            p.wait(timeout=scaled(120))
        assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, StorageError)
        assert [r.attempts for r in p.reports if r.kind == "data"] == [FAST_RETRY.attempts]
    finally:
        p.close(wait=False)

    (tmp_path / "shared").unlink()
    p = Promoter(tiers, retry=FAST_RETRY)
    try:
        p.submit(_own_intent(tiers, 5, swap=True))
        with pytest.raises(PromotionError, match="do not describe the source") as info:
            p.wait(timeout=scaled(120))
        assert not isinstance(info.value, OSError)
        assert [r.attempts for r in p.reports if r.kind == "metadata"] == [1], "a refused commit was retried"
    finally:
        p.close(wait=False)
    assert not (tmp_path / "shared" / "step_000000005" / ".metadata").exists()


def test_a_closed_promoter_refuses_work_with_a_promotion_error(tmp_path: Path) -> None:
    tier = Tier("local", str(tmp_path / "local"), every_steps=1)
    p = Promoter([tier])
    p.close()
    with pytest.raises(PromotionError, match="closed") as info:
        p.retention(tier)
    assert not isinstance(info.value, OSError)


def test_a_step_whose_commit_is_still_owed_is_kept_by_every_rank_of_its_directory(tmp_path: Path) -> None:
    """The coordinator's intent, once its own data file is copied, owes only the commit (``meta``).
    Another rank of the node applies retention to the same node-local directory after its own
    copy: it must keep the step, since the coordinator still reads its ``.metadata``."""
    from dcp_tiered.tiers.catalog import list_tier
    from dcp_tiered.tiers.retention import Retention

    tiers = two_tiers(tmp_path)
    crash_save(tiers, 5)
    doc = json.loads(_intent_path(tmp_path).read_bytes())
    assert doc["targets"] == ["shared"] and doc["meta"] == ["shared"]
    doc["targets"] = []  # its data file is on the shared tier; the commit waits for other ranks' files
    _intent_path(tmp_path).write_text(json.dumps(doc))
    crash_save(tiers, 6)
    assert [i.pending_promotions for i in list_tier(tiers[0]) if i.step == 5] == [("shared",)]
    local = Tier("local", str(tmp_path / "local"), every_steps=1, keep=1, codec="lz4")
    other_rank = Retention([local, tiers[1]], rank=1, is_coordinator=False)
    assert 5 not in {i.step for i in other_rank.plan(local).victims}
