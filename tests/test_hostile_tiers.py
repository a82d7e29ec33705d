"""Hostile tier contents: crafted promotion intents and fragments, symbolic links in a tier,
aliasing step names, and failed promotions through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from speed import scaled
import torch

from dcp_tiered import PromotionError, RestoreError, SaveError, Tier, TieredCheckpointer
from dcp_tiered.cli.__main__ import main as cli_main
from dcp_tiered.dcp.metadata_io import load_metadata
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.catalog import list_tier
from dcp_tiered.tiers.layout import fragment_name, intent_name, parse_step, step_name
from dcp_tiered.tiers.promote.fragments import commit_from_fragments, copy_with_fragment
from dcp_tiered.tiers.promote.intents import index_to_json
from dcp_tiered.tiers.promote.promoter import Promoter


def _tier(root: Path, name: str, codec: str = "lz4", **kw) -> Tier:
    kw.setdefault("keep", 3)
    return Tier(name, str(root / name), every_steps=1, codec=codec, **kw)


def _save(tiers: list[Tier], step: int, sd: dict) -> None:
    c = TieredCheckpointer(tiers)
    c.maybe_save(step, sd)
    c.close(timeout=scaled(120))


def _swapped_intent(ckpt: Path, source: str, target: str) -> None:
    """Write a .promote-0.json whose records are valid but swapped between keys ``a`` and ``b``."""
    md = load_metadata(Storage(str(ckpt)))
    recs = {i.fqn: (i, r) for i, r in md.storage_data.items()}
    records = [[index_to_json(recs["a"][0]), recs["b"][1]], [index_to_json(recs["b"][0]), recs["a"][1]]]
    doc = {"name": ckpt.name, "source": source, "rank": 0, "data_file": recs["a"][1]["file"], "records": records,
           "targets": [target], "meta": [target], "save_id": md.storage_meta.save_id}
    (ckpt / intent_name(0)).write_text(json.dumps(doc))


def _restore(tiers: list[Tier], sd: dict) -> int | None:
    c = TieredCheckpointer(tiers)
    try:
        return c.restore(sd)
    finally:
        c.close(timeout=scaled(60))


# -- A: a crafted intent never commits wrong values -----------------------------------------


@pytest.mark.parametrize("codec", ["lz4", "zstd"])  # byte copy, and re-encoding
def test_swapped_intent_records_are_refused(tmp_path: Path, codec: str) -> None:
    local, shared = _tier(tmp_path, "local"), _tier(tmp_path, "shared", codec=codec)
    _save([local], 5, {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)})
    src = tmp_path / "local" / step_name(5)
    _swapped_intent(src, "local", "shared")
    p = Promoter([local, shared])
    try:
        assert p.resume() == 1
        p.wait(timeout=scaled(60))  # resumed work is reported, not raised
    finally:
        p.close(wait=False)
    assert any(not r.ok and "differ from the committed .metadata" in (r.error or "") for r in p.reports)
    assert not (tmp_path / "shared" / step_name(5) / ".metadata").exists()
    assert (src / intent_name(0)).exists()  # left for gc
    sd = {"a": torch.zeros(4), "b": torch.zeros(4)}
    assert _restore([shared], sd) is None


def test_swapped_fragment_records_are_not_committed(tmp_path: Path) -> None:
    """Defence in depth: the commit checks the fragments (files in the target) against the source too."""
    local, shared = _tier(tmp_path, "local"), _tier(tmp_path, "shared")
    _save([local], 5, {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)})
    src, dst = tmp_path / "local" / step_name(5), tmp_path / "shared" / step_name(5)
    md = load_metadata(Storage(str(src)))
    recs = {i.fqn: (i, r) for i, r in md.storage_data.items()}
    data_file = recs["a"][1]["file"]
    dst.mkdir(parents=True)
    (dst / data_file).write_bytes((src / data_file).read_bytes())
    swapped = [[index_to_json(recs["a"][0]), recs["b"][1]], [index_to_json(recs["b"][0]), recs["a"][1]]]
    (dst / fragment_name(data_file)).write_text(json.dumps({"save_id": md.storage_meta.save_id, "records": swapped}))
    with pytest.raises(PromotionError, match="do not describe the source"):
        commit_from_fragments(Storage(str(src)), Storage(str(dst)), md.storage_meta.save_id)
    assert not (dst / ".metadata").exists()


def test_genuine_resumed_intent_still_promotes(tmp_path: Path) -> None:
    local, shared = _tier(tmp_path, "local"), _tier(tmp_path, "shared", codec="zstd")
    _save([local], 5, {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)})
    src = tmp_path / "local" / step_name(5)
    md = load_metadata(Storage(str(src)))
    records = [[index_to_json(i), r] for i, r in md.storage_data.items()]
    doc = {"name": src.name, "source": "local", "rank": 0, "data_file": records[0][1]["file"], "records": records,
           "targets": ["shared"], "meta": ["shared"], "save_id": md.storage_meta.save_id}
    (src / intent_name(0)).write_text(json.dumps(doc))
    p = Promoter([local, shared])
    try:
        assert p.resume() == 1
        p.wait(timeout=scaled(60))
    finally:
        p.close(wait=False)
    assert all(r.ok for r in p.reports), p.reports
    sd = {"a": torch.zeros(4), "b": torch.zeros(4)}
    assert _restore([shared], sd) == 5
    assert sd["a"].tolist() == [1.0] * 4 and sd["b"].tolist() == [2.0] * 4


# -- B: symbolic links in a tier are never written or deleted through --------------------------


def test_retention_never_deletes_through_a_step_link(tmp_path: Path) -> None:
    outside = tmp_path / "pretrained"
    _save([Tier("x", str(tmp_path / "seed"), every_steps=1)], 0, {"w": torch.ones(4)})
    (tmp_path / "seed" / step_name(0)).rename(outside)
    (tmp_path / "local").mkdir()
    link = tmp_path / "local" / step_name(0)
    link.symlink_to(outside)
    before = sorted(os.listdir(outside))
    c = TieredCheckpointer([_tier(tmp_path, "local", keep=1)], leftover_grace=0)
    for s in (1, 2, 3):
        c.maybe_save(s, {"w": torch.full((4,), float(s))})
        c.wait(timeout=scaled(60))
    c.close(timeout=scaled(60))
    assert sorted(os.listdir(outside)) == before == [".metadata", "__0_0.distcp"]
    assert link.is_symlink()


def test_gc_never_deletes_through_a_step_link(tmp_path: Path) -> None:
    outside = tmp_path / "pretrained"
    _save([Tier("x", str(tmp_path / "seed"), every_steps=1)], 0, {"w": torch.ones(4)})
    (tmp_path / "seed" / step_name(0)).rename(outside)
    _save([_tier(tmp_path, "local")], 5, {"w": torch.ones(4)})
    (tmp_path / "local" / step_name(1)).symlink_to(outside)
    rc = cli_main(["gc", "--local-path", str(tmp_path / "local"), "--keep-local", "1", "--leftover-grace", "0"])
    assert rc == 0
    assert sorted(os.listdir(outside)) == [".metadata", "__0_0.distcp"]
    assert (tmp_path / "local" / step_name(1)).is_symlink()


@pytest.mark.parametrize("where", ["local", "shared"])
def test_save_never_writes_through_a_step_link(tmp_path: Path, where: str) -> None:
    precious = tmp_path / "precious"
    _save([Tier("x", str(tmp_path / "seed"), every_steps=1)], 0, {"w": torch.full((4,), 9.0)})
    (tmp_path / "seed" / step_name(0)).rename(precious)
    before = {f: (precious / f).read_bytes() for f in os.listdir(precious)}
    for t in ("local", "shared"):
        (tmp_path / t).mkdir()
    (tmp_path / where / step_name(7)).symlink_to(precious)
    c = TieredCheckpointer([_tier(tmp_path, "local"), _tier(tmp_path, "shared", codec="zstd")])
    with pytest.raises((SaveError, PromotionError), match="symbolic link"):
        try:
            c.maybe_save(7, {"w": torch.full((4,), 1.0)})
        finally:
            c.close(timeout=scaled(60))
    assert {f: (precious / f).read_bytes() for f in os.listdir(precious)} == before


# -- C: a linked checkpoint is listed as present but unusable; restore names it --------------------


@pytest.mark.parametrize("what", ["step dir", ".metadata"])
def test_linked_checkpoint_is_unusable_and_restore_names_it(tmp_path: Path, what: str) -> None:
    tier = _tier(tmp_path, "local")
    _save([tier], 1, {"w": torch.ones(4)})
    step = tmp_path / "local" / step_name(1)
    if what == "step dir":
        step.rename(tmp_path / "elsewhere")
        step.symlink_to(tmp_path / "elsewhere")
    else:
        (step / ".metadata").rename(step / ".m")
        (step / ".metadata").symlink_to(".m")
    (info,) = list_tier(tier)
    assert info.unusable and not info.committed and not info.complete
    assert "symbolic link" in (info.problem or "")
    # restore does not take it for "no checkpoint yet" (which `restore(sd) or 0` turns into step 0)
    with pytest.raises(RestoreError, match="symbolic link"):
        _restore([tier], {"w": torch.zeros(4)})


def test_linked_newer_checkpoint_falls_back_to_an_older_one(tmp_path: Path) -> None:
    tier = _tier(tmp_path, "local")
    _save([tier], 1, {"w": torch.ones(4)})
    (tmp_path / "local" / step_name(9)).symlink_to(tmp_path / "local" / step_name(1))
    sd = {"w": torch.zeros(4)}
    assert _restore([tier], sd) == 1


# -- D: `dcp-tiered promote` exits 1 when a resumed promotion fails ------------------------------


def test_cli_promote_exits_1_when_a_promotion_fails(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    local, shared = _tier(tmp_path, "local"), _tier(tmp_path, "shared", codec="zstd")
    _save([local], 1, {"a": torch.arange(64.0), "b": torch.arange(64.0) * 2})
    src = tmp_path / "local" / step_name(1)
    md = load_metadata(Storage(str(src)))
    records = [[index_to_json(i), r] for i, r in md.storage_data.items()]
    data_file = records[0][1]["file"]
    doc = {"name": src.name, "source": "local", "rank": 0, "data_file": data_file, "records": records,
           "targets": ["shared"], "meta": ["shared"], "save_id": md.storage_meta.save_id}
    (src / intent_name(0)).write_text(json.dumps(doc))
    data = bytearray((src / data_file).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a frame fails its checksum while re-encoding: the promotion fails
    (src / data_file).write_bytes(bytes(data))
    (tmp_path / "tiers.yaml").write_text(
        f"tiers:\n  - name: local\n    url: {tmp_path}/local\n    codec: lz4\n"
        f"  - name: shared\n    url: {tmp_path}/shared\n    codec: zstd\n")
    rc = cli_main(["promote", "--tiers", str(tmp_path / "tiers.yaml")])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "FAILED" in out
    assert not (tmp_path / "shared" / step_name(1) / ".metadata").exists()


# -- E: one step, one directory name ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["step_3", "step_0000000003", "step_\u0663", "step_00000000\u0663",
                                  "step_000000003\n", "step_+00000003", "step_0100000000"])
def test_step_names_do_not_alias(name: str) -> None:
    assert parse_step(name) is None


@pytest.mark.parametrize("step", [0, 3, 999_999_999, 1_000_000_000, 12_345_678_901])
def test_step_names_round_trip(step: int) -> None:
    assert parse_step(step_name(step)) == step


def test_alias_dir_is_not_listed_nor_collected(tmp_path: Path) -> None:
    tier = _tier(tmp_path, "local", keep=2)
    c = TieredCheckpointer([tier], leftover_grace=0)
    for s in (1, 2, 3):
        c.maybe_save(s, {"w": torch.full((4,), float(s))})
    c.close(timeout=scaled(60))
    alias = tmp_path / "local" / "step_3"
    alias.mkdir()
    (alias / "junk").write_text("x")
    assert sorted(i.name for i in list_tier(tier)) == [step_name(2), step_name(3)]
    sd = {"w": torch.zeros(4)}
    assert _restore([tier], sd) == 3 and sd["w"].tolist() == [3.0] * 4


def test_copy_from_duplicated_records_is_not_committed(tmp_path: Path) -> None:
    """A rank that cannot check its intent (node-local source: .metadata only on the coordinator's node)
    re-encodes what the intent says (here ``b`` read from ``a``'s bytes); the commit compares the records
    each copy used with the source .metadata and refuses."""
    local, shared = _tier(tmp_path, "local"), _tier(tmp_path, "shared", codec="zstd")
    _save([local], 5, {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)})
    src, dst = Storage(str(tmp_path / "local" / step_name(5))), Storage(str(tmp_path / "shared" / step_name(5)))
    md = load_metadata(src)
    recs = {i.fqn: (i, r) for i, r in md.storage_data.items()}
    crafted = [(recs["a"][0], recs["a"][1]), (recs["b"][0], recs["a"][1])]
    copy_with_fragment(src, dst, recs["a"][1]["file"], crafted, shared, md.storage_meta.save_id)
    with pytest.raises(PromotionError, match="do not describe the source"):
        commit_from_fragments(src, dst, md.storage_meta.save_id)
    assert not (tmp_path / "shared" / step_name(5) / ".metadata").exists()
