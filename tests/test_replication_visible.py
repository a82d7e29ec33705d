"""Peer replication made visible (issue 16): ``dcp-tiered ls`` shows each step's replica state,
the save report and the metrics count the bytes sent for replication.

4 gloo ranks simulate 2 nodes of 2 ranks (``LOCAL_WORLD_SIZE=2``), as in ``test_replication.py``:
``local`` is ``.../local/{node}`` with ``replicas=2, replication_jump=2`` (cliques [0, 2] and
[1, 3]).  Steps 1 and 2 replicate; step 3's replication fails on clique [1, 3] (rank 1 cannot read
its files).  Each rank records, after ``wait()``, its reports' replicated bytes and errors, its
own data files' sizes, and what a ``PrometheusExporter`` attached to its checkpointer counted.
``ls`` then runs in this process over copies of the saved tiers, changed to show each state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from speed import scaled
from gloo_ranks import read_records, record, run_ranks_recording

from dcp_tiered import ReplicationError, StorageError, Tier, TieredCheckpointer
from dcp_tiered.tiers.events import EventLog, SaveReport, SaveReports

WS, LOCAL = 4, 2
SPAWN_TIMEOUT = 420.0
STEPS = [1, 2, 3]


def tiers(root: Path) -> list[Tier]:
    return [Tier("local", f"{root}/local/{{node}}", keep=3, codec="lz4", replicas=2, replication_jump=2),
            Tier("shared", f"{root}/shared", keep=3, codec="zstd")]


def make_state(mesh, rank: int, step: int) -> dict:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    w = torch.randn((64, 24), generator=g)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)])}, f"own{rank}": torch.full((7, 3), float(rank + step))}


def _own_bytes(root: Path, rank: int, step: int) -> int:
    d = root / "local" / str(rank // LOCAL) / f"step_{step:09d}"
    return sum(f.stat().st_size for f in d.glob(f"__{rank}_*.distcp"))


def _save(root: Path, out: Path, mesh, rank: int) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from dcp_tiered.metrics import PrometheusExporter
    from dcp_tiered.tiers.replicas import replicate as replication

    ckpt = TieredCheckpointer(tiers(root))
    exporter = PrometheusExporter().attach(ckpt, scan=False)
    original = replication.owner_files

    def failing(storage, metadata, owner):
        if owner == 1:
            raise StorageError(f"rank {owner}: injected read failure")
        return original(storage, metadata, owner)

    facts: dict = {}
    try:
        for step in STEPS:
            if step == 3:
                replication.owner_files = failing
            ckpt.maybe_save(step, make_state(mesh, rank, step), force=True)
            try:
                ckpt.wait(timeout=scaled(180))
            except ReplicationError as exc:
                facts[f"wait_error_{step}"] = str(exc)
    finally:
        replication.owner_files = original
        ckpt.close()
    facts["reports"] = {r.step: [r.replicated_bytes, r.replication_error] for r in ckpt.reports}
    facts["own"] = {step: _own_bytes(root, rank, step) for step in STEPS}
    families = text_string_to_metric_families(exporter.render().decode())
    facts["metrics"] = {s.name: s.value for f in families for s in f.samples
                        if s.name.startswith("checkpoint_replication_") and s.labels == {"tier": "local"}}
    facts["event"] = {"replicated_bytes": ckpt.reports[0].as_dict()["replicated_bytes"]}
    (out / f"save.rank{rank}.json").write_text(json.dumps(facts))


def _save_worker(rank: int, world_size: int, data: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = init_device_mesh("cpu", (WS,))
    record(Path(out), "save", rank, lambda: _save(Path(data), Path(out), mesh, rank))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("replication_visible")
    out, error = run_ranks_recording(_save_worker, WS, root, str(root / "data"), root / "records", timeout=SPAWN_TIMEOUT)
    read_records(out, "save", WS, error)
    (root / "facts.json").write_text(json.dumps([json.loads((out / f"save.rank{r}.json").read_text()) for r in range(WS)]))
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(saved / "data", data)
    return data


def _yaml(tmp_path: Path, data: Path, replicas: bool = True) -> Path:
    rep = ", replicas: 2, replication_jump: 2" if replicas else ""
    y = tmp_path / "tiers.yaml"
    y.write_text(f"tiers:\n  - {{name: local, url: '{data}/local/{{node}}', keep: 3{rep}}}\n"
                 f"  - {{name: shared, url: '{data}/shared', keep: 3}}\n")
    return y


def ls(capsys, *argv: object) -> tuple[int, str]:
    from dcp_tiered.cli.__main__ import main

    capsys.readouterr()
    code = main(["ls", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out + out.err


def ls_json(capsys, *argv: object) -> dict:
    code, out = ls(capsys, *argv, "--json")
    assert code == 0, out
    return {(r["tier"], r["step"]): r for r in json.loads(out)}


@pytest.fixture(autouse=True)
def _no_local_world(monkeypatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


# -- the save report and the metrics ----------------------------------------------------------------


def test_reports_and_metrics_count_the_bytes_sent_for_replication(saved: Path) -> None:
    """After ``wait()`` each report holds the bytes its rank sent to its clique (its own data files,
    ``replicas - 1`` = 1 copy); the failed replication of step 3 on clique [1, 3] leaves an error and
    the bytes it had sent; the exporter's counters add up the same."""
    facts = json.loads((saved / "facts.json").read_text())
    for rank, f in enumerate(facts):
        failed = rank in (1, 3)
        for step in STEPS:
            sent, error = f["reports"][str(step)]
            if step == 3 and failed:  # what it had sent before the failure, at most its files
                assert 0 <= sent <= f["own"][str(step)] and "injected read failure" in error, f"rank {rank}: {f}"
            else:
                assert error is None and sent == f["own"][str(step)] > 0, f"rank {rank} step {step}: {f}"
        assert f["metrics"]["checkpoint_replication_bytes_total"] == sum(r[0] for r in f["reports"].values()), f
        assert f["metrics"]["checkpoint_replication_failures_total"] == (1 if failed else 0), f
        assert ("wait_error_3" in f) == failed, f
        assert f["event"]["replicated_bytes"] == f["own"]["1"], f


def test_save_reports_take_an_outcome_that_arrives_first() -> None:
    events = EventLog()
    reports = SaveReports(events)
    events.emit({"event": "replication", "tier": "local", "step": 5, "ok": True, "sent_bytes": 42})
    reports.append(SaveReport(5, ["local", "shared"], True, False))
    reports.append(SaveReport(6, ["local"], True, False))
    events.emit({"event": "replication", "tier": "local", "step": 6, "ok": False, "error": "peer gone"})
    events.emit({"event": "replication", "tier": "other", "step": 6, "ok": True, "sent_bytes": 1})
    assert [(r.replicated_bytes, r.replication_error) for r in reports] == [(42, None), (0, "peer gone")]
    assert reports[0].as_dict()["replicated_bytes"] == 42


# -- dcp-tiered ls --------------------------------------------------------------------------------


def test_ls_shows_each_steps_replica_state(saved: Path, tmp_path: Path, capsys) -> None:
    data = _copy(saved, tmp_path)
    rows = ls_json(capsys, "--tiers", _yaml(tmp_path, data))
    for step in (1, 2):
        rep = rows[("local", step)]["replication"]
        assert rep["replicated"] is True and rep["missing"] == [] and rep["world"] == WS, rep
        assert rep["cliques"] == [[0, 2], [1, 3]]
        assert [(d["index"], d["ranks"], d["replicas_of"]) for d in rep["dirs"]] == [(0, [0, 1], [2, 3]),
                                                                                     (1, [2, 3], [0, 1])]
    rep = rows[("local", 3)]["replication"]  # rank 1 never sent its files of step 3
    assert rep["replicated"] is False and rep["missing"] == [{"owner": 1, "node": 1}], rep
    assert [d["replicas_of"] for d in rep["dirs"]] == [[2, 3], [0]]
    assert all("replication" not in r for (tier, _), r in rows.items() if tier == "shared")
    _, text = ls(capsys, "--tiers", _yaml(tmp_path, data))
    assert re.search(r"\breplicas\b", text.splitlines()[0]), text
    assert "full; node 0: 2,3; node 1: 0,1" in text and "PARTIAL (missing 1 on node 1); node 0: 2,3; node 1: 0" in text
    # the same from the path flags
    flags = ls_json(capsys, "--local-path", f"{data}/local/{{node}}", "--replicas", "2", "--replication-jump", "2")
    assert flags[("local", 3)]["replication"]["missing"] == [{"owner": 1, "node": 1}]


def test_ls_without_replication_is_unchanged(saved: Path, tmp_path: Path, capsys) -> None:
    data = _copy(saved, tmp_path)
    rows = ls_json(capsys, "--tiers", _yaml(tmp_path, data, replicas=False))
    assert rows and all("replication" not in r for r in rows.values())
    _, text = ls(capsys, "--tiers", _yaml(tmp_path, data, replicas=False))
    assert text.splitlines()[0].split() == ["tier", "step", "state", "size", "codec", "optim", "promotion", "problem"]


def test_ls_after_a_lost_node(saved: Path, tmp_path: Path, capsys) -> None:
    """Node 0's directory gone: its steps are still listed, from node 1, which holds replicas of
    ranks 0 and 1; with the ranks per node given, the gaps are named."""
    data = _copy(saved, tmp_path)
    shutil.rmtree(data / "local" / "0")
    rows = ls_json(capsys, "--tiers", _yaml(tmp_path, data), "--ranks-per-node", "2")
    assert sorted(s for t, s in rows if t == "local") == STEPS
    rep = rows[("local", 2)]["replication"]
    assert rep["replicated"] is False and [d["exists"] for d in rep["dirs"]] == [False, True], rep
    assert rep["dirs"][1]["replicas_of"] == [0, 1]
    assert rep["missing"] == [{"owner": 2, "node": 0}, {"owner": 3, "node": 0}], rep
    _, text = ls(capsys, "--tiers", _yaml(tmp_path, data), "--ranks-per-node", "2")
    assert "PARTIAL (missing 2 on node 0, 3 on node 0); node 0: - (gone); node 1: 0,1" in text, text


def test_ls_ignores_stale_and_damaged_markers(saved: Path, tmp_path: Path, capsys) -> None:
    """A marker from another save of the step, or one whose files are short, vouches for nothing."""
    data = _copy(saved, tmp_path)
    step1 = data / "local" / "0" / "step_000000001"
    marker = json.loads((step1 / ".replica-2.json").read_text())
    (step1 / ".replica-2.json").write_text(json.dumps({**marker, "save_id": "an-older-save"}))
    step2 = data / "local" / "1" / "step_000000002"
    short = json.loads((step2 / ".replica-0.json").read_text())["files"][0]["file"]
    (step2 / short).write_bytes((step2 / short).read_bytes()[:-1])
    rows = ls_json(capsys, "--tiers", _yaml(tmp_path, data))
    one, two = rows[("local", 1)]["replication"], rows[("local", 2)]["replication"]
    assert one["missing"] == [{"owner": 2, "node": 0}] and one["dirs"][0]["stale"] == [2], one
    assert two["missing"] == [{"owner": 0, "node": 1}] and two["dirs"][1]["stale"] == [0], two


def test_ls_replication_flags_are_checked(tmp_path: Path, capsys) -> None:
    code, text = ls(capsys, "--tiers", _yaml(tmp_path, tmp_path), "--replicas", "2")
    assert code == 2 and "--replicas/--replication-jump apply to --local-path" in text
    code, text = ls(capsys, "--local-path", tmp_path / "plain", "--replicas", "2")
    assert code == 2 and "node-local" in text


def test_tier_dirs_match_the_placeholder_segment(tmp_path: Path) -> None:
    from dcp_tiered.cli.replicas import tier_dirs

    for name in ("node0", "node1", "node12", "nodeX", "other3"):
        (tmp_path / name / "ckpt").mkdir(parents=True)
    (tmp_path / "node7").write_text("a file, not a directory of the tier")
    dirs = tier_dirs(Tier("local", f"{tmp_path}/node{{node}}/ckpt", replicas=2))
    assert {k: s.url for k, s in dirs.items()} == {k: f"{tmp_path}/node{k}/ckpt" for k in (0, 1, 12)}
    assert sorted(tier_dirs(Tier("local", f"{tmp_path}/none/{{rank}}", replicas=2))) == []
