"""One typed options model (issue 13/14): ``CheckpointerOptions`` shared by ``TieredCheckpointer``,
``from_yaml`` and ``dcp-tiered train``; bools are bools, durations are compound, unknown or
mistyped keys give a short error naming the field.  Also the one due-tier decision
(``SaveSchedule``) and ``CompressedWriter``'s public prefix and save id."""

from __future__ import annotations

import dataclasses
import subprocess
import textwrap
from pathlib import Path

import pytest
from forked import run_cli
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered import CompressedReader, CompressedWriter, Tier, TieredCheckpointer
from dcp_tiered.dcp.metadata_io import load_metadata
from dcp_tiered.dcp.writer import RankFilePrefix
from dcp_tiered.tiers.config import CheckpointerOptions
from dcp_tiered.tiers.policy import SaveSchedule
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.config import parse_duration
from test_config_validation import config_error

PROPS = settings(max_examples=200, deadline=None)
BOOLS = ("async_save", "resume_promotions", "via_fastest")
NAMES = set(CheckpointerOptions.names())


# --------------------------------------------------------------------------- booleans


@PROPS
@given(st.sampled_from(BOOLS), st.sampled_from(["false", "False", "no", "off", "0", "true", "yes", "", "n"]) | st.text(max_size=8))
def test_prop_a_string_is_never_a_bool(field, text):
    msg = config_error(CheckpointerOptions.from_mapping, {field: text}, where="tiers.yaml")
    assert msg.startswith("tiers.yaml: ") and field in msg


@PROPS
@given(st.sampled_from(BOOLS), st.integers() | st.none() | st.floats(allow_nan=False) | st.lists(st.booleans(), max_size=2))
def test_prop_only_true_and_false_are_bools(field, value):
    assert field in config_error(CheckpointerOptions.from_mapping, {field: value})


@given(st.sampled_from(BOOLS), st.booleans())
def test_prop_real_bools_are_kept(field, value):
    assert getattr(CheckpointerOptions.from_mapping({field: value}), field) is value


# --------------------------------------------------------------------------- durations


@PROPS
@given(st.integers(0, 30), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59), st.booleans())
def test_prop_compound_durations(d, h, m, s, spaced):
    parts = [f"{n}{u}" for n, u in ((d, "d"), (h, "h"), (m, "m"), (s, "s")) if n]
    seconds = d * 86400 + h * 3600 + m * 60 + s
    text = (" " if spaced else "").join(parts)
    if not parts:
        return
    assert parse_duration(text) == pytest.approx(seconds)
    assert CheckpointerOptions.from_mapping({"leftover_grace": text}).leftover_grace == pytest.approx(seconds)
    assert Tier("t", "/x", every=text).every == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["30m1h", "1h1h", "1h30", "h30m", "1h-30m", "1h 30x", "1.5.h"])
def test_bad_compound_durations(text):
    assert "leftover_grace" in config_error(CheckpointerOptions, leftover_grace=text)


def test_leftover_grace_zero_and_seconds():
    assert CheckpointerOptions(leftover_grace=0).leftover_grace == 0.0
    assert CheckpointerOptions(leftover_grace="0").leftover_grace == 0.0
    assert CheckpointerOptions(leftover_grace="0s").leftover_grace == 0.0  # as `gc --leftover-grace 0s`
    assert CheckpointerOptions(leftover_grace=0.0).leftover_grace == 0.0
    assert CheckpointerOptions(leftover_grace=90).leftover_grace == 90.0
    assert "leftover_grace" in config_error(CheckpointerOptions, leftover_grace=False)
    # None (YAML "leftover_grace:" left empty) used to pass and make every retention job fail
    # with a TypeError, so no checkpoint was ever deleted.
    assert "leftover_grace" in config_error(CheckpointerOptions, leftover_grace=None)


# --------------------------------------------------------------------------- unknown and mistyped keys


@PROPS
@given(st.text(min_size=1, max_size=20).filter(lambda k: k not in NAMES))
def test_prop_unknown_keys_are_named(key):
    msg = config_error(CheckpointerOptions.from_mapping, {key: 1, "async_save": True}, where="f.yaml")
    assert repr(key) in msg and "known:" in msg


@pytest.mark.parametrize("field, value", [
    ("optimizer_every", "5"), ("optimizer_every", 1.0), ("optimizer_every", True), ("threads", "4"),
    ("frame_size", "4MiB"), ("on_busy", True), ("optimizer_keys", "optim"), ("event_log", 3), ("event_log", ""),
    ("leftover_grace", [1]), ("background_threads", 0), ("nice", 20),
])
def test_mistyped_values_are_named(field, value):
    msg = config_error(CheckpointerOptions.from_mapping, {field: value}, where="f.yaml")
    assert msg.startswith("f.yaml: ") and field in msg


def test_not_a_mapping():
    assert "mapping" in config_error(CheckpointerOptions.from_mapping, ["async_save"], where="f.yaml")


def test_from_mapping_over_a_base_and_normalized():
    base = CheckpointerOptions(async_save=True, optimizer_every=3)
    got = CheckpointerOptions.from_mapping({"optimizer_keys": ["app.optim"], "event_log": Path("e.jsonl")}, base=base)
    assert got.async_save and got.optimizer_every == 3 and got.optimizer_keys == ("app.optim",)
    assert got.event_log == "e.jsonl"
    assert CheckpointerOptions(**got.as_dict()) == got
    assert dataclasses.replace(got, leftover_grace="2h").leftover_grace == 7200.0


# --------------------------------------------------------------------------- the three users


def test_checkpointer_keywords_options_and_unknown_keywords(tmp_path):
    tiers = [Tier("a", str(tmp_path / "a"))]
    with pytest.raises(TypeError, match="bogus"):
        TieredCheckpointer(tiers, bogus=1)
    with TieredCheckpointer(tiers, options=CheckpointerOptions(async_save=True, optimizer_every=4),
                            optimizer_every=2, leftover_grace="1h30m") as ck:
        assert ck.options.async_save and ck.options.optimizer_every == 2 and ck.options.leftover_grace == 5400.0
    assert "async_save" in config_error(TieredCheckpointer, tiers, async_save="false")


def _yaml(tmp_path: Path, options: str) -> Path:
    p = tmp_path / "tiers.yaml"
    p.write_text(textwrap.dedent(options) + f"tiers:\n  - {{name: local, url: {tmp_path}/l}}\n")
    return p


@pytest.mark.parametrize("options, field", [
    ('async_save: "false"\n', "async_save"),
    ("via_fastest: 'no'\n", "via_fastest"),
    ("leftover_grace: soon\n", "leftover_grace"),
    ("leftover_grace:\n", "leftover_grace"),
    ("threads: '4'\n", "threads"),
    ("asyncsave: true\n", "asyncsave"),
])
def test_from_yaml_refuses_with_the_file_and_field(tmp_path, options, field):
    p = _yaml(tmp_path, options)
    msg = config_error(TieredCheckpointer.from_yaml, p)
    assert str(p) in msg and field in msg


def test_from_yaml_reads_every_option(tmp_path):
    p = _yaml(tmp_path, """\
        async_save: no
        via_fastest: false
        resume_promotions: false
        leftover_grace: 1h30m
        optimizer_every: 2
        optimizer_keys: [app.optim]
        on_busy: skip
        threads: 2
        background_threads: 1
        nice: 0
        frame_size: 1048576
        event_log: {events}
    """.replace("{events}", str(tmp_path / "e.jsonl")))
    with TieredCheckpointer.from_yaml(p, optimizer_every=3) as ck:
        o = ck.options
        assert (o.async_save, o.via_fastest, o.resume_promotions, o.leftover_grace) == (False, False, False, 5400.0)
        assert (o.optimizer_every, o.optimizer_keys, o.on_busy, o.threads, o.frame_size) == (3, ("app.optim",), "skip", 2, 1 << 20)
        assert (o.background_threads, o.nice) == (1, 0)
        assert ck.events.path == str(tmp_path / "e.jsonl")


def test_from_yaml_takes_an_options_object_as_the_base_the_file_applies_to(tmp_path):
    p = _yaml(tmp_path, "optimizer_every: 2\n")
    base = CheckpointerOptions(on_busy="skip", optimizer_every=5)
    with TieredCheckpointer.from_yaml(p, options=base, threads=2) as ck:
        assert (ck.options.on_busy, ck.options.optimizer_every, ck.options.threads) == ("skip", 2, 2)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=600)


def test_train_accepts_the_options_the_api_accepts_and_refuses_string_bools(tmp_path):
    """``dcp-tiered train`` reads its YAML options through the same model: ``via_fastest`` and
    ``leftover_grace`` (missing from its old list) are accepted, ``async_save: "false"`` is refused."""
    small = ["--steps", "2", "--d-model", "16", "--vocab", "32", "--seq-len", "8", "--log-every", "0", "--json"]
    good = _yaml(tmp_path, "via_fastest: false\nleftover_grace: 1h30m\nasync_save: true\nbackground_threads: 1\nnice: 5\n")
    res = _cli("train", "--tiers", good, *small)
    assert res.returncode == 0, res.stderr
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = _yaml(bad_dir, 'async_save: "false"\n')
    res = _cli("train", "--tiers", bad, *small)
    assert res.returncode == 2, res.stderr
    assert "async_save" in res.stderr and str(bad) in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = _cli("train", "--tiers", good, "--optimizer-every", "0", *small)
    assert res.returncode == 2 and "optimizer_every" in res.stderr
    for flag, value, field in (("--nice", "20", "nice"), ("--background-threads", "0", "background_threads")):
        res = _cli("train", "--tiers", good, flag, value, *small)  # the budget flags go through the same model
        assert res.returncode == 2 and field in res.stderr and "command line: " in res.stderr, res.stderr


# --------------------------------------------------------------------------- the one due-tier decision


def test_save_schedule_agrees_only_when_the_clock_matters():
    calls = []

    def agree(idx):
        calls.append(list(idx))
        return [1]

    steps = SaveSchedule([Tier("a", "/a", every_steps=2), Tier("b", "/b", every_steps=5)])
    assert steps.decide(10, 0.0, agree=agree) == ("a", "b") and calls == []  # step schedules: no collective
    assert steps.decide(11, 0.0, agree=agree) == () and steps.decide(12, 0.0) == ("a",)
    assert steps.decide(13, 0.0, fallback=True) == ("a",)  # none due: a standalone writer still saves
    clock = SaveSchedule([Tier("a", "/a", every=10), Tier("b", "/b", every=60)], via_fastest=True)
    assert clock.decide(1, 0.0, agree=agree) == ("b",) and calls == [[0, 1]]  # the coordinator's answer wins
    assert clock.histories["a"].last_step is None and clock.histories["b"].last_step == 1
    assert clock.due(2, 5.0) == [0]  # a never saved: due; b within its 60 s
    clock.restored(7, 5.0, [0, 1])
    assert clock.due(8, 20.0) == [0] and clock.due(8, 70.0) == [0, 1]


# --------------------------------------------------------------------------- CompressedWriter's public prefix and save id


def test_compressed_writer_save_id_is_the_commits(tmp_path):
    sd = {"w": torch.arange(100.0)}
    w = CompressedWriter(tmp_path / "a", save_id="run7-save3")
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert load_metadata(Storage(str(tmp_path / "a"))).storage_meta.save_id == "run7-save3"
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "b"), no_dist=True)
    assert len(load_metadata(Storage(str(tmp_path / "b"))).storage_meta.save_id) == 32  # a fresh random id
    assert "save_id" in config_error(CompressedWriter, tmp_path / "c", save_id="")


class _Wrapper(CompressedWriter):
    """A wrapping writer choosing the rank's data file prefix through the public plan data."""

    def prepare_local_plan(self, plan):
        return super().prepare_local_plan(dataclasses.replace(plan, storage_data=RankFilePrefix("__shard7_")))


def test_rank_file_prefix_names_the_data_file(tmp_path):
    sd = {"w": torch.arange(100.0)}
    dcp.save(sd, storage_writer=_Wrapper(tmp_path / "ck"), no_dist=True)
    assert (tmp_path / "ck" / "__shard7_0.distcp").exists() and not (tmp_path / "ck" / "__0_0.distcp").exists()
    out = {"w": torch.zeros(100)}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(out["w"], sd["w"])
