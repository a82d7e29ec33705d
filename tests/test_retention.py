"""Retention has one facts builder: ``dcp-tiered gc --dry-run`` lists exactly what the promoter's
retention job deletes on the same tier state, and ``gc`` deletes exactly that.

Tier states are built from one real checkpoint copied into step directories: committed steps,
uncommitted leftovers (old and young against ``--leftover-grace``), incoming promotions (an
uncommitted step with a fragment), steps pinned by a promotion intent (to a known tier, and to a
tier this tier set does not know), a step directory that is a symbolic link, and ``keep=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedWriter, Tier
from dcp_tiered.cli.__main__ import main as cli_main
from dcp_tiered.dcp.metadata_io import load_metadata
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.promote.intents import index_to_json
from dcp_tiered.tiers.layout import fragment_name, intent_name, parse_step, step_name
from dcp_tiered.tiers.promote.promoter import Promoter
from dcp_tiered.tiers.retention import Retention

HOUR = 3600.0

# per tier: {step: kind}; kinds: c committed, u uncommitted leftover (u_old: untouched for 2 h),
# f uncommitted with a promotion fragment, i:<tier> committed with a pending intent to <tier>, link
STATES = {
    "leftovers": ({"local": {0: "u_old", 1: "c", 2: "u", 3: "c", 4: "u_old", 5: "c", 6: "c", 7: "u"},
                   "shared": {1: "c", 2: "u_old", 3: "c"}}, {"local": 2, "shared": 1}, "1h"),
    "leftovers-no-grace": ({"local": {0: "u", 1: "c", 2: "u", 3: "c", 9: "u"}, "shared": {4: "u", 5: "c"}},
                           {"local": 1, "shared": 1}, "0"),
    "incoming-fragments": ({"local": {1: "c", 2: "c"}, "shared": {0: "f", 1: "u", 2: "c", 3: "f"}},
                           {"local": 1, "shared": 1}, "0"),
    "pinned-by-intents": ({"local": {1: "i:shared", 2: "i:other", 3: "c", 4: "c", 5: "c"}, "shared": {1: "c", 4: "c"}},
                          {"local": 1, "shared": 1}, "0"),
    "links-keep-1": ({"local": {1: "c", 2: "link", 3: "c", 4: "u", 5: "c"}, "shared": {2: "c", 3: "link", 6: "c"}},
                     {"local": 1, "shared": 1}, "0"),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template") / "ckpt"
    dcp.save({"a": torch.full((64,), 1.0), "b": torch.arange(64.0)}, storage_writer=CompressedWriter(root), no_dist=True)
    return root


def _intent(ckpt: Path, source: str, target: str) -> None:
    md = load_metadata(Storage(str(ckpt)))
    records = [[index_to_json(i), r] for i, r in md.storage_data.items()]
    doc = {"name": ckpt.name, "source": source, "rank": 0, "data_file": records[0][1]["file"], "records": records,
           "targets": [target], "meta": [target], "save_id": md.storage_meta.save_id}
    (ckpt / intent_name(0)).write_text(json.dumps(doc))


def build(root: Path, template: Path, state: str) -> tuple[list[Tier], Path]:
    """The tier state ``state`` under ``root``; returns the tiers and their YAML file."""
    layout, keep, grace = STATES[state]
    tiers = [Tier(name, str(root / name), codec="lz4", keep=keep[name]) for name in ("local", "shared")]
    old = time.time() - 2 * HOUR
    for tier, steps in layout.items():
        for step, kind in steps.items():
            d = root / tier / step_name(step)
            if kind == "link":
                target = root / f"outside-{tier}-{step}"
                shutil.copytree(template, target)
                d.parent.mkdir(parents=True, exist_ok=True)
                d.symlink_to(target)
                continue
            shutil.copytree(template, d)
            if kind in ("u", "u_old", "f"):
                (d / ".metadata").unlink()
            if kind == "f":
                data_file = next(p.name for p in d.iterdir() if p.name.endswith(".distcp"))
                (d / fragment_name(data_file)).write_text(json.dumps({"save_id": "ab", "records": []}))
            if kind.startswith("i:"):
                _intent(d, tier, kind[2:])
            if kind == "u_old":
                for p in [d, *d.iterdir()]:
                    os.utime(p, (old, old))
    yaml_path = root / "tiers.yaml"
    yaml_path.write_text("tiers:\n" + "".join(f"  - {{name: {t.name}, url: '{t.url}', codec: lz4, keep: {t.keep}}}\n"
                                              for t in tiers))
    return tiers, yaml_path


def on_disk(tiers: list[Tier]) -> set[tuple[str, int]]:
    return {(t.name, parse_step(p.name)) for t in tiers for p in Path(t.url).iterdir() if parse_step(p.name) is not None}


def gc(yaml_path: Path, grace: str, capsys: pytest.CaptureFixture, dry_run: bool) -> set[tuple[str, int]]:
    capsys.readouterr()
    rc = cli_main(["gc", "--tiers", str(yaml_path), "--leftover-grace", grace, "--json"] + (["--dry-run"] if dry_run else []))
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["would_delete" if dry_run else "deleted"]
    return {(r["tier"], r["step"]) for r in rows}


@pytest.mark.parametrize("state", sorted(STATES))
def test_gc_dry_run_lists_exactly_what_retention_deletes(tmp_path: Path, template: Path, state: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    grace = STATES[state][2]
    tiers, yaml_path = build(tmp_path / "a", template, state)
    before = on_disk(tiers)
    would = gc(yaml_path, grace, capsys, dry_run=True)
    assert on_disk(tiers) == before, "--dry-run deleted something"
    promoter = Promoter(tiers, leftover_grace=0.0 if grace == "0" else HOUR)
    try:
        for t in tiers:
            promoter.retention(t)
        promoter.wait(timeout=scaled(120))
    finally:
        promoter.close(wait=False)
    assert before - on_disk(tiers) == would, f"{state}: gc --dry-run and the retention job disagree"
    assert would, f"{state}: the state should have something to delete"

    tiers_b, yaml_b = build(tmp_path / "b", template, state)
    deleted = gc(yaml_b, grace, capsys, dry_run=False)
    assert deleted == would and before - on_disk(tiers_b) == would
    for t in tiers + tiers_b:  # links and what they point to are never deleted
        assert all(os.path.isdir(p) for p in Path(t.url).iterdir() if p.is_symlink())


def test_pinned_and_own_steps_are_honoured_by_the_one_facts_builder(tmp_path: Path, template: Path) -> None:
    """Steps pinned with ``set_writing`` are never planned for deletion; a leftover this process wrote
    (``mark_own``) needs no grace period.  The plan and the retention job agree on both."""
    tiers, _ = build(tmp_path, template, "leftovers")
    promoter = Promoter(tiers, leftover_grace=HOUR)
    promoter.set_writing(["local"], 3, True)  # e.g. a restore candidate
    promoter.mark_own("local", 2)  # young leftover, but written by this process
    plan = promoter.keeper.plan(tiers[0])
    assert {i.step for i in plan.victims} == {0, 1, 2, 4}
    before = on_disk(tiers)
    try:
        promoter.retention(tiers[0])
        promoter.wait(timeout=scaled(120))
    finally:
        promoter.close(wait=False)
    assert before - on_disk(tiers) == {("local", s) for s in (0, 1, 2, 4)}
    fresh = Retention(tiers, leftover_grace=HOUR).plan(tiers[0])  # another process: no pins, no own steps
    assert {i.step for i in fresh.victims} == {3}


@pytest.mark.parametrize("options", ["", "optimizer_keys: [opt_state]\n"])
def test_gc_keeps_the_newest_checkpoint_with_optimizer_state(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             options: str) -> None:
    """With ``optimizer_every > 1`` the checkpointer keeps the newest checkpoint holding the
    optimizer state beyond ``keep``; ``gc`` on the same YAML must keep it too (it used to
    delete it, leaving only model-only checkpoints to resume from)."""
    key = "opt_state" if options else "optim"
    root = tmp_path / "local"
    for step in (1, 2, 3):
        state = {"model": torch.arange(64.0) + step}
        if step == 1:
            state[key] = torch.zeros(64)
        dcp.save(state, storage_writer=CompressedWriter(root / step_name(step)), no_dist=True)
    yaml_path = tmp_path / "tiers.yaml"
    yaml_path.write_text(f"tiers:\n  - {{name: local, url: '{root}', keep: 2}}\noptimizer_every: 3\n{options}")
    tiers = [Tier("local", str(root), keep=2)]
    promoter = Promoter(tiers, leftover_grace=0.0, optimizer_keys=(key,))  # what TieredCheckpointer runs
    try:
        assert promoter.keeper.plan(tiers[0]).victims == []
    finally:
        promoter.close(wait=False)
    assert gc(yaml_path, "0", capsys, dry_run=True) == set()
    assert gc(yaml_path, "0", capsys, dry_run=False) == set()
    assert on_disk(tiers) == {("local", 1), ("local", 2), ("local", 3)}


def test_an_unreadable_checkpoint_does_not_stand_in_for_the_optimizer_state(tmp_path: Path) -> None:
    """Retention keeps the newest committed checkpoint holding the optimizer state; one whose
    ``.metadata`` cannot be read is not known to hold it and must not count as that checkpoint
    (it did: the readable full one was deleted and the unreadable one kept in its place)."""
    root = tmp_path / "local"
    for step, keys in ((1, ("model", "optim")), (2, ("model", "optim")), (3, ("model",))):
        dcp.save({k: torch.arange(64.0) + step for k in keys}, storage_writer=CompressedWriter(root / step_name(step)),
                 no_dist=True)
    (root / step_name(2) / ".metadata").write_bytes(b"\x80\x04damaged")
    tiers = [Tier("local", str(root), keep=1)]
    retention = Retention(tiers, leftover_grace=0.0, optimizer_keys=("optim",))
    assert 1 not in {i.step for i in retention.plan(tiers[0]).victims}


def test_node_local_ranks_keep_the_step_the_coordinator_keeps_for_the_optimizer(tmp_path: Path) -> None:
    """keep=1, ``optimizer_every=2``: step 1 holds the optimizer state, step 2 the model only.
    The coordinator keeps both (step 1 as the newest full one); every other rank must keep its
    files of step 1 too, or step 1 is whole on no node and a resume loses the optimizer state.
    Each node's directory holds its own ``.metadata`` (node commit), which says what it holds;
    a directory with data files but no ``.metadata`` (a refused node commit) is not committed."""
    local = tmp_path / "local"
    for step, keys in ((1, ("model", "optim")), (2, ("model",))):
        dcp.save({k: torch.arange(64.0) + step for k in keys}, storage_writer=CompressedWriter(local / "0" / step_name(step)),
                 no_dist=True)
        shutil.copytree(local / "0" / step_name(step), local / "1" / step_name(step))
    shutil.copytree(local / "1" / step_name(2), local / "1" / step_name(3))
    (local / "1" / step_name(3) / ".metadata").unlink()  # node 1's commit of step 3 was refused
    tier = Tier("local", str(local / "{rank}"), keep=1)
    kept = {}
    for rank in (0, 1):
        retention = Retention([tier], rank=rank, is_coordinator=rank == 0, leftover_grace=0.0, optimizer_keys=("optim",))
        kept[rank] = {1, 2} - {i.step for i in retention.plan(tier).victims}
    assert kept[0] == {1, 2}
    assert kept[1] == kept[0]  # step 3 (uncommitted on node 1) does not push step 2 out


def test_promote_keeps_the_newest_checkpoint_with_optimizer_state(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``dcp-tiered promote`` runs the target's retention after each commit; like the checkpointer's
    it must keep the newest checkpoint holding the optimizer state (it deleted it)."""
    root = tmp_path / "a"
    for tier, step, keys in (("shared", 1, ("model", "optim")), ("shared", 3, ("model",)), ("local", 4, ("model",))):
        dcp.save({k: torch.arange(64.0) + step for k in keys}, storage_writer=CompressedWriter(root / tier / step_name(step)),
                 no_dist=True)
    _intent(root / "local" / step_name(4), "local", "shared")
    yaml_path = root / "tiers.yaml"
    yaml_path.write_text(f"tiers:\n  - {{name: local, url: '{root / 'local'}', keep: 2}}\n"
                         f"  - {{name: shared, url: '{root / 'shared'}', keep: 1}}\n")
    assert cli_main(["promote", "--tiers", str(yaml_path), "--json"]) == 0
    tiers = [Tier("local", str(root / "local"), keep=2), Tier("shared", str(root / "shared"), keep=1)]
    assert {s for t, s in on_disk(tiers) if t == "shared"} == {1, 4}


def test_a_save_racing_the_listing_is_never_taken_for_a_leftover(tmp_path: Path, template: Path, monkeypatch) -> None:
    """A step this process is saving can be listed uncommitted and be committed and unpinned a moment
    later: retention must neither plan it from a stale listing (pins read before and after it) nor
    delete it once it is committed (checked again before deleting)."""
    import dcp_tiered.tiers.retention as retention_mod

    tiers, _ = build(tmp_path, template, "leftovers")
    keeper = Retention(tiers, leftover_grace=HOUR)
    keeper.marks.mark_own("local", 2)  # step 2: this process's save, listed while still uncommitted
    keeper.marks.pin(["local"], 2, True)
    real_list = retention_mod.list_tier

    def listing_then_commit(*args, **kwargs):
        infos = real_list(*args, **kwargs)
        keeper.marks.pin(["local"], 2, False)  # the save finished during the listing
        return infos

    monkeypatch.setattr(retention_mod, "list_tier", listing_then_commit)
    assert 2 not in {i.step for i in keeper.plan(tiers[0]).victims}
    monkeypatch.setattr(retention_mod, "list_tier", real_list)
    plan = keeper.plan(tiers[0])  # unpinned and still uncommitted: a leftover of this process
    assert 2 in {i.step for i in plan.victims}
    step2 = Path(tiers[0].url) / "step_000000002"
    shutil.copy(Path(tiers[0].url) / "step_000000003" / ".metadata", step2 / ".metadata")  # committed since
    keeper.apply(plan)
    assert (step2 / ".metadata").is_file()
