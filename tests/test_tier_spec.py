"""``Tier`` validation, durations, tier lists and YAML tier files (dcp_tiered.tiers.config)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered import ConfigError
from dcp_tiered.tiers.config import Tier, load_tiers_yaml, parse_duration, validate_tiers

PROPS = settings(max_examples=300, deadline=None)


def _raises_config(fn, *args, **kwargs) -> str:
    """Call ``fn``, require a ConfigError (which is also a ValueError), return its message."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


# --------------------------------------------------------------------------- parse_duration


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("30sec", 30.0),
        ("5m", 300.0),
        ("5min", 300.0),
        ("1.5h", 5400.0),
        ("2hr", 7200.0),
        ("2d", 172800.0),
        (" 5 M ", 300.0),
        ("45", 45.0),
        ("5m30s", 330.0),
        ("1h30m", 5400.0),
        ("1d 2h", 93600.0),
        ("2.5", 2.5),
        (90, 90.0),
        (0.25, 0.25),
    ],
)
def test_parse_duration_values(text, seconds):
    got = parse_duration(text)
    assert isinstance(got, float)
    assert got == pytest.approx(seconds)


def test_parse_duration_none_stays_none():
    assert parse_duration(None) is None


@pytest.mark.parametrize("bad", ["5x", "", "m", "five minutes", "-5s", "30m1h", "1e3", "0", "0s", 0, -1, -0.5, True, False, [5]])
def test_parse_duration_rejects(bad):
    msg = _raises_config(parse_duration, bad, "tier 'x': field 'every'")
    assert "tier 'x': field 'every'" in msg


def test_parse_duration_rejects_nan():
    # BUG: NaN passes the `seconds <= 0` check, so a tier with `every: .nan` (YAML) or
    # every=float("nan") is accepted, and `now - last_time < nan` is always False, so the
    # time limit silently never applies.
    with pytest.raises(ConfigError):
        parse_duration(float("nan"))


@PROPS
@given(
    st.integers(1, 10**6) | st.floats(0.001, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
    st.sampled_from([("ms", 1e-3), ("s", 1.0), ("sec", 1.0), ("m", 60.0), ("min", 60.0), ("h", 3600.0), ("hr", 3600.0), ("d", 86400.0), ("", 1.0)]),
    st.booleans(),
)
def test_prop_parse_duration_number_and_unit(number, unit, upper):
    suffix, factor = unit
    text = f"{number}{suffix.upper() if upper else suffix}"
    if float(number) * factor <= 0:
        return
    assert parse_duration(text) == pytest.approx(float(number) * factor)


@PROPS
@given(st.floats(1e-9, 1e12, allow_nan=False) | st.integers(1, 10**12))
def test_prop_parse_duration_positive_numbers_are_seconds(x):
    assert parse_duration(x) == float(x)


@pytest.mark.parametrize("text", ["0\x1f", "1h\x1f", "\x1c5m", "\u0663", "5\u2003m"])
def test_parse_duration_refuses_control_and_non_ascii_characters(text):
    """Python's regex \\s and str.strip() also take \\x1c-\\x1f; float() does not (found by Hypothesis)."""
    with pytest.raises(ConfigError):
        parse_duration(text)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=12))
def test_prop_parse_duration_text_is_float_or_config_error(text):
    try:
        got = parse_duration(text)
    except ConfigError:
        return
    assert isinstance(got, float) and got > 0 and math.isfinite(got)


# --------------------------------------------------------------------------- Tier


def test_tier_defaults_and_normalisation():
    t = Tier("local", Path("/tmp/ckpt"), every="5m", every_steps=100, max_per_hour=4, keep=3, codec=" LZ4 ", dtype="bf16")
    assert t.url == "/tmp/ckpt" and isinstance(t.url, str)
    assert t.every == 300.0 and t.every_steps == 100 and t.max_per_hour == 4 and t.keep == 3
    assert t.codec == "lz4" and t.dtype == "bf16"
    d = Tier("d", "s3://bucket/ckpt", storage_options={"anon": False})
    assert d.every is None and d.every_steps is None and d.max_per_hour is None
    assert d.keep == 2 and d.codec.startswith("zstd") and d.dtype is None
    assert d.storage_options == {"anon": False} and type(d.storage_options) is dict
    assert Tier("z", "/x", codec="zstd:7").codec == "zstd:7"
    assert Tier("n", "/x", codec="none", dtype="fp16").codec == "none"
    assert hash(Tier("a", "/x")) == hash(Tier("a", "/x", keep=5))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"every": "5x"}, "every"),
        ({"every": "-5s"}, "every"),
        ({"every": 0}, "every"),
        ({"every": True}, "every"),
        ({"every_steps": 0}, "every_steps"),
        ({"every_steps": -3}, "every_steps"),
        ({"every_steps": 2.0}, "every_steps"),
        ({"every_steps": "100"}, "every_steps"),
        ({"every_steps": True}, "every_steps"),
        ({"max_per_hour": 0}, "max_per_hour"),
        ({"max_per_hour": 1.5}, "max_per_hour"),
        ({"keep": 0}, "keep"),
        ({"keep": -1}, "keep"),
        ({"keep": True}, "keep"),
        ({"keep": False}, "keep"),
        ({"keep": None}, "keep"),
        ({"keep": "2"}, "keep"),
        ({"codec": "gzip"}, "codec"),
        ({"codec": "zstd:99"}, "codec"),
        ({"codec": "zstd:fast"}, "codec"),
        ({"codec": 3}, "codec"),
        ({"dtype": "int8"}, "dtype"),
        ({"dtype": "float32"}, "dtype"),
        ({"storage_options": ["anon"]}, "storage_options"),
        ({"url": ""}, "url"),
        ({"url": None}, "url"),
        ({"url": 5}, "url"),
    ],
)
def test_tier_field_errors_name_tier_and_field(kwargs, field):
    args = {"name": "durable", "url": "s3://b/ckpt", **kwargs}
    msg = _raises_config(Tier, **args)
    assert "'durable'" in msg, msg
    assert field in msg, msg


def test_tier_codec_error_lists_valid_codecs():
    msg = _raises_config(Tier, "t", "/x", codec="gzip")
    assert "gzip" in msg and "zstd" in msg and "lz4" in msg


@pytest.mark.parametrize("name", ["bad name", "", "a/b", "../up", "tier:1", "ü", None, 5, ["x"]])
def test_tier_bad_name(name):
    msg = _raises_config(Tier, name, "/x")
    assert "name" in msg and repr(name) in msg


@pytest.mark.parametrize("name", ["local", "Shared_2", "durable.s3", "a-b", "0"])
def test_tier_good_names(name):
    assert Tier(name, "/x").name == name


def test_tier_nan_every_is_rejected():
    # BUG (same as test_parse_duration_rejects_nan): accepted today.
    with pytest.raises(ConfigError):
        Tier("t", "/x", every=float("nan"))


def test_node_local_and_resolved_url():
    shared = Tier("shared", "s3://bucket/run")
    assert not shared.node_local
    assert shared.resolved_url(rank=3, node=1) == "s3://bucket/run"
    per_rank = Tier("local", "/nvme/ckpt/rank{rank}")
    assert per_rank.node_local
    assert per_rank.resolved_url(rank=7) == "/nvme/ckpt/rank7"
    assert per_rank.resolved_url() == "/nvme/ckpt/rank0"
    per_node = Tier("node", "/scratch/node{node}/ckpt")
    assert per_node.node_local
    assert per_node.resolved_url(rank=9, node=2) == "/scratch/node2/ckpt"
    both = Tier("both", "file:///n{node}/r{rank}/{rank}")
    assert both.resolved_url(rank=5, node=1) == "file:///n1/r5/5"


@PROPS
@given(st.integers(0, 10**6), st.integers(0, 10**4))
def test_prop_resolved_url(rank, node):
    t = Tier("t", "/d/{node}/{rank}/x")
    assert t.resolved_url(rank, node) == f"/d/{node}/{rank}/x"
    assert "{" not in t.resolved_url(rank, node)


# --------------------------------------------------------------------------- Tier.from_dict


def test_from_dict_builds_a_tier():
    t = Tier.from_dict({"name": "s", "url": "/x", "every": "30s", "keep": 4, "storage_options": {"k": 1}})
    assert t == Tier("s", "/x", every=30.0, keep=4, storage_options={"k": 1})


def test_from_dict_rejects_unknown_fields_naming_them():
    msg = _raises_config(Tier.from_dict, {"name": "s", "url": "/x", "evry": "5m", "kep": 2})
    assert "'s'" in msg and "evry" in msg and "kep" in msg
    assert "every" in msg  # lists the known fields


def test_from_dict_unknown_fields_of_mixed_key_types():
    # BUG: `sorted(set(data) - known)` raises TypeError when unknown keys mix types, e.g. the
    # YAML mapping `{name: s, url: /x, 1: a, foo: b}` -> TypeError '<' not supported between
    # 'str' and 'int', not a ConfigError naming the fields.
    msg = _raises_config(Tier.from_dict, {"name": "s", "url": "/x", 1: "a", "foo": "b"})
    assert "foo" in msg and "1" in msg


def test_from_dict_missing_fields_and_wrong_types():
    msg = _raises_config(Tier.from_dict, {"name": "fast"})
    assert "'fast'" in msg and "url" in msg
    msg = _raises_config(Tier.from_dict, {"url": "/x"}, 2)
    assert "#3" in msg and "name" in msg
    msg = _raises_config(Tier.from_dict, ["name", "url"], 0)
    assert "#1" in msg and "mapping" in msg
    msg = _raises_config(Tier.from_dict, {"name": "fast", "url": "/x", "keep": "two"})
    assert "'fast'" in msg and "keep" in msg


# --------------------------------------------------------------------------- validate_tiers


def test_validate_tiers():
    a, b = Tier("a", "/a"), Tier("b", "/b")
    assert validate_tiers((a, b)) == [a, b]
    assert validate_tiers(iter([a])) == [a]
    assert "at least one" in _raises_config(validate_tiers, [])
    msg = _raises_config(validate_tiers, [a, b, Tier("a", "/c")])
    assert "unique" in msg and "'a'" in msg
    msg = _raises_config(validate_tiers, [a, Tier("c", "/a")])
    assert "URL" in msg and "/a" in msg
    msg = _raises_config(validate_tiers, [a, {"name": "b", "url": "/b"}])
    assert "Tier" in msg and "dict" in msg


# --------------------------------------------------------------------------- load_tiers_yaml


def _write(tmp_path: Path, text: "str | bytes", name: str = "tiers.yaml") -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    return p


def test_load_tiers_yaml_full_document(tmp_path):
    p = _write(
        tmp_path,
        """
# fastest first
tiers:
  - name: local
    url: /nvme/ckpt/{rank}
    every_steps: 100
    keep: 3
    codec: lz4
  - name: durable
    url: s3://bucket/run     # comment with é
    every: 1h
    max_per_hour: 1
    keep: 5
    codec: zstd:7
    dtype: bf16
    storage_options:
      endpoint_url: http://127.0.0.1:9000
optimizer_every: 4
async_save: true
""",
    )
    tiers, options = load_tiers_yaml(p)
    assert [t.name for t in tiers] == ["local", "durable"]
    local, durable = tiers
    assert local.node_local and local.every_steps == 100 and local.keep == 3 and local.codec == "lz4"
    assert durable.every == 3600.0 and durable.max_per_hour == 1 and durable.codec == "zstd:7"
    assert durable.dtype == "bf16" and durable.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert options == {"optimizer_every": 4, "async_save": True}
    # str paths work too
    assert load_tiers_yaml(str(p))[0] == tiers


def test_load_tiers_yaml_bare_list(tmp_path):
    p = _write(tmp_path, "- {name: a, url: /a, every: 30s}\n- {name: b, url: /b}\n")
    tiers, options = load_tiers_yaml(p)
    assert [(t.name, t.every) for t in tiers] == [("a", 30.0), ("b", None)]
    assert options == {}


def test_load_tiers_yaml_invalid_yaml(tmp_path):
    p = _write(tmp_path, "tiers:\n  - name: a\n    url: [unclosed\n")
    msg = _raises_config(load_tiers_yaml, p)
    assert "not valid YAML" in msg and str(p) in msg


def test_load_tiers_yaml_not_utf8(tmp_path):
    # BUG: a file that is not UTF-8 text raises UnicodeDecodeError out of yaml.safe_load
    # (only OSError and yaml.YAMLError are caught), not a ConfigError naming the file.
    # (`open(path)` also uses the locale encoding rather than UTF-8.)
    p = _write(tmp_path, b"tiers:\n  - name: a\n    url: /x\n# \xff\xfe\n")
    msg = _raises_config(load_tiers_yaml, p)
    assert str(p) in msg


def test_load_tiers_yaml_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    msg = _raises_config(load_tiers_yaml, p)
    assert "cannot read" in msg and str(p) in msg
    msg = _raises_config(load_tiers_yaml, tmp_path)  # a directory
    assert str(tmp_path) in msg


def test_load_tiers_yaml_missing_url(tmp_path):
    p = _write(tmp_path, "tiers:\n  - name: fast\n    every: 5m\n")
    msg = _raises_config(load_tiers_yaml, p)
    assert "'fast'" in msg and "url" in msg


@pytest.mark.parametrize(
    "text, needles",
    [
        ("", ["tiers"]),
        ("just a string\n", ["tiers"]),
        ("tiers: 5\n", ["tiers"]),
        ("tiers: {name: a, url: /a}\n", ["tiers"]),
        ("options: 1\n", ["tiers"]),
        ("tiers: []\n", ["at least one"]),
        ("tiers:\n  - local\n", ["#1", "mapping"]),
        ("tiers:\n  - {name: a, url: /a}\n  - 7\n", ["#2", "mapping"]),
        ("tiers:\n  - {name: a, url: /a, keep: two}\n", ["'a'", "keep"]),
        ("tiers:\n  - {name: a, url: /a, keep: 2.5}\n", ["'a'", "keep"]),
        ("tiers:\n  - {name: a, url: /a, every_steps: '100'}\n", ["'a'", "every_steps"]),
        ("tiers:\n  - {name: a, url: /a, every: [1]}\n", ["'a'", "every"]),
        ("tiers:\n  - {name: a, url: /a, every: 5x}\n", ["'a'", "every", "5x"]),
        ("tiers:\n  - {name: a, url: /a, codec: gzip}\n", ["'a'", "codec", "gzip"]),
        ("tiers:\n  - {name: a, url: /a, dtype: int8}\n", ["'a'", "dtype", "int8"]),
        ("tiers:\n  - {name: a, url: /a, storage_options: 3}\n", ["'a'", "storage_options"]),
        ("tiers:\n  - {name: a, url: 5}\n", ["'a'", "url"]),
        ("tiers:\n  - {name: a, url: /a, colour: red}\n", ["'a'", "colour"]),
        ("tiers:\n  - {name: a b, url: /a}\n", ["name", "a b"]),
        ("tiers:\n  - {name: a, url: /a}\n  - {name: a, url: /b}\n", ["unique", "'a'"]),
        ("tiers:\n  - {name: a, url: /a}\n  - {name: b, url: /a}\n", ["URL", "/a"]),
    ],
)
def test_load_tiers_yaml_clear_errors(tmp_path, text, needles):
    p = _write(tmp_path, text)
    msg = _raises_config(load_tiers_yaml, p)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_load_tiers_yaml_nan_every(tmp_path):
    # BUG (see test_parse_duration_rejects_nan): `every: .nan` loads as every=nan.
    p = _write(tmp_path, "tiers:\n  - {name: a, url: /a, every: .nan}\n")
    with pytest.raises(ConfigError, match=re.escape("every")):
        load_tiers_yaml(p)
