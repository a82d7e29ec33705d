"""Bad configuration is refused at construction (issue 12): tier places compared after
normalization, tier paths that are not directories, unreachable tiers, numeric ranges and
types of writer and checkpointer options.  Every error is a short ConfigError naming the field.
"""

from __future__ import annotations

import os
import pathlib
import time
import uuid

import pytest
from speed import scaled

from dcp_tiered import CompressedWriter, ConfigError, StorageError
from dcp_tiered.dcp.writer import MAX_FRAME_SIZE, MIN_FRAME_SIZE
from dcp_tiered.storage.paths import location
from dcp_tiered.tiers.config import CheckpointerOptions
from dcp_tiered.tiers.config import (
    Tier,
    check_step,
    check_str_list,
    validate_tiers,
)
from dcp_tiered.tiers.save.writer import TieredWriter


def config_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert len(msg) < 400, f"not short: {msg}"
    return msg


# --------------------------------------------------------------------------- one place, one tier


@pytest.mark.parametrize("second", ["{d}/", "file://{d}", "{d}/./", "{d}/sub/..", "{link}"])
def test_the_same_directory_spelled_twice_is_refused(tmp_path, second):
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink(d, tmp_path / "link")
    a = Tier("fast", str(d))
    b = Tier("slow", second.format(d=d, link=tmp_path / "link"))
    msg = config_error(validate_tiers, [a, b], probe=False)
    assert "'fast'" in msg and "'slow'" in msg and "url" in msg and "same place" in msg


@pytest.mark.parametrize("outer, inner", [("{d}", "{d}/slow"), ("{d}/", "file://{d}/a/b"), ("{d}/x", "{d}")])
def test_nested_tier_directories_are_refused(tmp_path, outer, inner):
    a = Tier("a", outer.format(d=tmp_path))
    b = Tier("b", inner.format(d=tmp_path))
    msg = config_error(validate_tiers, [a, b], probe=False)
    assert "nested" in msg and "url" in msg


def test_sibling_directories_with_a_common_prefix_are_fine(tmp_path):
    validate_tiers([Tier("a", str(tmp_path / "ck")), Tier("b", str(tmp_path / "ck2"))], probe=False)


def test_object_store_places_compare_without_protocol_and_slash_but_per_endpoint():
    ep = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    assert location("s3://b/run/", ep) == location("s3a://b/run", ep)
    msg = config_error(validate_tiers, [Tier("a", "s3://b/run/", storage_options=ep), Tier("b", "s3://b/run", storage_options=ep)],
                       probe=False)
    assert "same place" in msg
    config_error(validate_tiers, [Tier("a", "s3://b/run", storage_options=ep), Tier("b", "s3://b/run/slow", storage_options=ep)],
                 probe=False)
    other = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:2"}}
    validate_tiers([Tier("a", "s3://b/run", storage_options=ep), Tier("b", "s3://b/run", storage_options=other)], probe=False)
    # a local tier and an object-store key with the same text are different places
    validate_tiers([Tier("a", "/b/run"), Tier("b", "s3://b/run", storage_options=ep)], probe=False)


def test_rank_and_node_templates_that_meet_are_refused(tmp_path):
    msg = config_error(validate_tiers, [Tier("a", f"{tmp_path}/{{rank}}"), Tier("b", f"{tmp_path}/{{node}}")], probe=False)
    assert "same place" in msg
    config_error(validate_tiers, [Tier("a", f"{tmp_path}/r{{rank}}"), Tier("b", f"{tmp_path}")], probe=False)
    validate_tiers([Tier("a", f"{tmp_path}/r{{rank}}"), Tier("b", f"{tmp_path}/n{{node}}")], probe=False)


def test_tiers_must_be_a_list_of_tiers():
    config_error(validate_tiers, "/x")
    config_error(validate_tiers, {"name": "a", "url": "/x"})


# --------------------------------------------------------------------------- tier paths that are not directories


@pytest.mark.parametrize("kind", ["file", "fifo"])
@pytest.mark.parametrize("probe", [True, False])
def test_a_tier_path_that_is_not_a_directory_is_refused(tmp_path, kind, probe):
    path = tmp_path / "tier"
    if kind == "file":
        path.write_bytes(b"x")
    else:
        os.mkfifo(path)
    msg = config_error(validate_tiers, [Tier("fast", str(path))], probe=probe)
    assert "'fast'" in msg and "url" in msg and "not a directory" in msg


def test_a_tier_path_below_a_file_is_refused_by_the_probe(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    msg = config_error(validate_tiers, [Tier("fast", str(tmp_path / "f" / "sub"))])
    assert "'fast'" in msg and "not a directory" in msg
    validate_tiers([Tier("fast", str(tmp_path / "f" / "sub"))], probe=False)


def _read_only_mount() -> str | None:
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 3 and "ro" in parts[3].split(",") and os.path.isdir(parts[1]) and parts[1] != "/":
                return parts[1]
    return None


def test_a_tier_on_a_read_only_filesystem_is_refused_by_the_probe():
    mount = _read_only_mount()
    if mount is None:
        pytest.skip("no read-only mount on this machine")
    msg = config_error(validate_tiers, [Tier("fast", os.path.join(mount, f"dcp-tiered-{uuid.uuid4().hex}"))])
    assert "'fast'" in msg and "writable" in msg


def test_the_probe_creates_nothing(tmp_path):
    validate_tiers([Tier("fast", str(tmp_path / "a" / "b"))])
    assert not (tmp_path / "a").exists()


def test_missing_bucket_is_refused_at_construction_naming_tier_and_bucket(moto_server):
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    tier = Tier("durable", f"s3://{bucket}/run", storage_options=moto_server.storage_options)
    t0 = time.monotonic()
    msg = config_error(validate_tiers, [tier])
    assert "'durable'" in msg and bucket in msg and "url" in msg
    assert time.monotonic() - t0 < scaled(60)
    validate_tiers([tier], probe=False)  # the probe can be skipped
    good = Tier("durable", f"s3://{moto_server.make_bucket()}/run", storage_options=moto_server.storage_options)
    validate_tiers([good])


def test_unreachable_endpoint_is_a_storage_error_naming_the_tier():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {"key": "k", "secret": "s", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
               "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2, "read_timeout": 2}}
    with pytest.raises(StorageError) as info:
        validate_tiers([Tier("durable", "s3://b/run", storage_options=options)])
    assert "'durable'" in str(info.value) and not isinstance(info.value, ConfigError)


def test_checkpointer_refuses_a_missing_bucket_at_construction(tmp_path, moto_server):
    from dcp_tiered import TieredCheckpointer

    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    tiers = [Tier("fast", str(tmp_path / "fast")),
             Tier("durable", f"s3://{bucket}/run", storage_options=moto_server.storage_options)]
    msg = config_error(TieredCheckpointer, tiers)
    assert bucket in msg and "'durable'" in msg


def test_checkpointer_refuses_one_directory_twice(tmp_path):
    from dcp_tiered import TieredCheckpointer

    config_error(TieredCheckpointer, [Tier("a", str(tmp_path / "x")), Tier("b", str(tmp_path / "x") + "/")])


# --------------------------------------------------------------------------- options: ranges and types


@pytest.mark.parametrize("kwargs, field", [
    ({"frame_size": 100}, "frame_size"),
    ({"frame_size": MIN_FRAME_SIZE - 1}, "frame_size"),
    ({"frame_size": MAX_FRAME_SIZE + 1}, "frame_size"),
    ({"frame_size": 1 << 40}, "frame_size"),
    ({"frame_size": 65536.0}, "frame_size"),
    ({"frame_size": "64k"}, "frame_size"),
    ({"frame_size": True}, "frame_size"),
    ({"threads": 0}, "threads"),
    ({"threads": -1}, "threads"),
    ({"threads": 2.5}, "threads"),
    ({"nice": -5}, "nice"),
    ({"overwrite": "yes"}, "overwrite"),
    ({"sync_files": 1}, "sync_files"),
    ({"storage_options": "anon=true"}, "storage_options"),
])
def test_compressed_writer_options(tmp_path, kwargs, field):
    msg = config_error(CompressedWriter, tmp_path / "ckpt", **kwargs)
    assert field in msg
    assert not (tmp_path / "ckpt").exists()


def test_compressed_writer_frame_size_bounds_are_accepted(tmp_path):
    CompressedWriter(tmp_path / "a", frame_size=MIN_FRAME_SIZE)
    CompressedWriter(tmp_path / "b", frame_size=MAX_FRAME_SIZE)


def test_compressed_writer_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    assert "not a directory" in config_error(CompressedWriter, tmp_path / "f")


@pytest.mark.parametrize("kwargs, field", [
    ({"threads": 0}, "threads"),
    ({"frame_size": 100}, "frame_size"),
    ({"frame_size": 1 << 40}, "frame_size"),
])
def test_tiered_writer_options(tmp_path, kwargs, field):
    assert field in config_error(TieredWriter, [Tier("a", str(tmp_path / "a"))], **kwargs)


def test_tiered_writer_refuses_one_directory_twice(tmp_path):
    config_error(TieredWriter, [Tier("a", str(tmp_path / "x")), Tier("b", f"file://{tmp_path}/x/")])


@pytest.mark.parametrize("kwargs, field", [
    ({"optimizer_keys": "optim"}, "optimizer_keys"),
    ({"optimizer_keys": b"optim"}, "optimizer_keys"),
    ({"optimizer_keys": ["optim", 3]}, "optimizer_keys"),
    ({"optimizer_keys": [""]}, "optimizer_keys"),
    ({"optimizer_keys": None}, "optimizer_keys"),
    ({"optimizer_every": 0}, "optimizer_every"),
    ({"optimizer_every": "2"}, "optimizer_every"),
    ({"threads": 0}, "threads"),
    ({"frame_size": 100}, "frame_size"),
    ({"on_busy": "drop"}, "on_busy"),
    ({"async_save": "yes"}, "async_save"),
    ({"via_fastest": None}, "via_fastest"),
    ({"leftover_grace": "soon"}, "leftover_grace"),
    ({"leftover_grace": -1}, "leftover_grace"),
])
def test_checkpointer_options(kwargs, field):
    assert field in config_error(CheckpointerOptions, **kwargs)


def test_checkpointer_options_normalized():
    got = CheckpointerOptions(optimizer_keys=["opt"], leftover_grace="2m", frame_size=1 << 20)
    assert got.optimizer_keys == ("opt",) and got.leftover_grace == 120.0 and got.frame_size == 1 << 20
    assert CheckpointerOptions(leftover_grace=0).leftover_grace == 0.0
    assert CheckpointerOptions().threads is None


def test_str_is_not_a_list_of_keys():
    msg = config_error(check_str_list, "optim", "optimizer_keys")
    assert "optimizer_keys" in msg and "['optim']" in msg
    assert check_str_list(("a", "b"), "k") == ("a", "b")


@pytest.mark.parametrize("step", [-5, -1, True, 1.0, "5", None])
def test_bad_steps(step):
    assert "step" in config_error(check_step, step)


@pytest.mark.parametrize("step", [0, 5, 10**9 - 1, 10**12])
def test_good_steps(step):
    assert check_step(step) == step


@pytest.mark.parametrize("bad", ["/tmp/x\x00y", "/tmp/x\ny"])
def test_a_tier_url_with_a_control_character_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="control character"):
        Tier("local", bad)


@pytest.mark.parametrize("command", ["ls", "gc", "promote"])
def test_cli_tier_commands_refuse_a_regular_file_as_tier(tmp_path: pathlib.Path, command: str) -> None:
    import subprocess
    import sys

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    res = subprocess.run([sys.executable, "-m", "dcp_tiered.cli", command, "--local-path", str(not_a_dir)],
                         capture_output=True, text=True, timeout=scaled(120))
    assert res.returncode == 2, res.stderr  # usage/configuration, not "no checkpoints" with exit 0
    assert "not a directory" in res.stderr and "Traceback" not in res.stderr
