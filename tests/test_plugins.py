"""Plugins found by entry point: a codec and a storage backend that another distribution declares
(groups ``dcp_tiered.codecs`` and ``dcp_tiered.storage``) work in ``dcp-tiered inspect/verify/convert``
with no wrapper script, and a missing, broken or clashing plugin is an error that says what to do.

Each plugin is a real installed distribution as ``importlib.metadata`` sees one: a ``*.dist-info``
folder (``METADATA``, ``entry_points.txt``) and a module, in a folder on ``PYTHONPATH``.  Everything
runs in child processes, so no plugin is ever loaded into pytest's own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from forked import start_cli
from isolated import run_isolated
from speed import scaled
from test_cli import _assert_same, ok, one_line_error

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "dcp_tiered.cli"]

# A plugin distribution: a deflate codec (stdlib zlib) and a filesystem it brings with its backend.
TOY_PLUGIN = '''
import zlib

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dcp_tiered.codecs import Codec
from dcp_tiered.errors import CorruptCheckpointError
from dcp_tiered.storage import FsspecStorage


class DeflateCodec(Codec):
    """zlib's deflate. Spec "deflate" (level 6) or "deflate:N" (N in 1..9)."""

    codec_id = "deflate"
    spec_help = "deflate, deflate:N (N in 1..9)"
    max_ratio = 1032  # deflate's best case

    def __init__(self, level=6):
        if type(level) is not int or not 1 <= level <= 9:
            raise ValueError(f"level must be an integer 1..9, got {level!r}")
        self.level = level

    @classmethod
    def config_from_arg(cls, arg):
        return {} if arg is None else {"level": int(arg)}

    def spec_arg(self):
        return None if self.level == 6 else str(self.level)

    def get_config(self):
        return {"id": self.codec_id, "level": self.level}

    def compress(self, data):
        return zlib.compress(memoryview(data).cast("B"), self.level)

    def decompress(self, data, raw_len):
        d = zlib.decompressobj()
        try:
            out = d.decompress(data, raw_len)
        except zlib.error as exc:
            raise CorruptCheckpointError(f"deflate block: {exc}") from exc
        if len(out) != raw_len or not d.eof or d.unconsumed_tail:
            raise CorruptCheckpointError(f"deflate block does not decode to {raw_len} bytes")
        return out


class ToyFS(LocalFileSystem):
    """Local files behind toyfs:// (a filesystem only this plugin knows)."""

    protocol = ("toyfs",)
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return LocalFileSystem._strip_protocol(path[len("toyfs://"):] if path.startswith("toyfs://") else path)


fsspec.register_implementation("toyfs", ToyFS, clobber=True)


class ToyStorage(FsspecStorage):
    @classmethod
    def handles(cls, fs):
        return isinstance(fs, ToyFS)
'''

# A plugin whose module cannot be imported (ImportError, then SystemExit); it logs each import attempt to
# $PLUGIN_IMPORT_LOG.
BROKEN_PLUGIN = '''
import os

with open(os.environ["PLUGIN_IMPORT_LOG"], "a+") as f:
    f.seek(0)
    again = bool(f.read())
    f.write("imported\\n")
if again:  # its second import (the other entry point) exits the process, as a careless module may
    raise SystemExit(3)
raise ImportError("libshaky.so: cannot open shared object file")
'''

# A plugin that tries to take built-in names, or declares things that are not codecs or backends.
CLASH_PLUGIN = '''
from dcp_tiered.codecs import Codec


class FakeZstd(Codec):
    codec_id = "zstd"
    compresses = False

    def compress(self, data):
        return bytes(data)

    def decompress(self, data, raw_len):
        return bytes(data)


not_a_codec = object()
'''


def _distribution(folder: Path, name: str, version: str, entry_points: str, module: str, source: str) -> Path:
    """An installed distribution for ``importlib.metadata``: ``folder`` on ``sys.path`` holds its
    ``*.dist-info`` and its module."""
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (folder / f"{module}.py").write_text(source)
    return folder


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plugins")
    return {
        "toy": _distribution(root / "toy", "dcp-tiered-toy", "0.1", """
            [dcp_tiered.codecs]
            deflate = toy_plugin:DeflateCodec
            [dcp_tiered.storage]
            toyfs = toy_plugin:ToyStorage
            """, "toy_plugin", TOY_PLUGIN),
        "broken": _distribution(root / "broken", "dcp-tiered-broken", "0.2", """
            [dcp_tiered.codecs]
            shaky = broken_plugin:ShakyCodec
            [dcp_tiered.storage]
            shakyfs = broken_plugin:ShakyStorage
            """, "broken_plugin", BROKEN_PLUGIN),
        "clash": _distribution(root / "clash", "dcp-tiered-clash", "0.3", """
            [dcp_tiered.codecs]
            zstd = clash_plugin:FakeZstd
            fastzstd = clash_plugin:FakeZstd
            oddity = clash_plugin:not_a_codec
            [dcp_tiered.storage]
            file = clash_plugin:FakeZstd
            oddfs = clash_plugin:FakeZstd
            """, "clash_plugin", CLASH_PLUGIN),
        "twin": _distribution(root / "twin", "dcp-tiered-twin", "0.4", """
            [dcp_tiered.codecs]
            deflate = twin_plugin:DeflateCodec
            """, "twin_plugin", "raise ImportError('never imported: the name is ambiguous')\n"),
    }


def _path(*folders: Path) -> str:
    return os.pathsep.join([str(ROOT), *map(str, folders)])


def _child(code: str, *folders: Path, **env: str):
    """Run ``code`` in a child with ``folders`` (installed plugins) on ``sys.path``."""
    res = run_isolated(code, timeout=120, env={"PYTHONPATH": _path(*folders), **env})
    assert res.returncode == 0, res.describe()
    return res.result


def cli(*folders: Path, timeout: float = 180, forked: bool = False) -> Callable[..., list[subprocess.CompletedProcess]]:
    """Run ``dcp-tiered`` commands concurrently, with ``folders`` (installed plugins) on the path: each in
    a new interpreter, or with ``forked`` in a child of the tests' forkserver (tests/forked.py: torch and
    dcp_tiered imported, never a plugin or an entry point looked up; ``PYTHONPATH`` put on ``sys.path`` as
    an interpreter's start would), which skips the 3-5 CPU seconds of imports of each start."""

    def run(*calls: list) -> list[subprocess.CompletedProcess]:
        env = dict(os.environ, PYTHONPATH=_path(*folders), PYTHONWARNINGS="ignore")
        if forked:
            return [p.communicate(scaled(timeout)) for p in [start_cli(*c, env=env) for c in calls]]
        procs = [subprocess.Popen([*CLI, *map(str, c)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for c in calls]
        out = []
        for c, p in zip(calls, procs):
            stdout, stderr = p.communicate(timeout=scaled(timeout))
            out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
        return out

    return run


@pytest.fixture(scope="module")
def saved(plugins: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same state saved with the plugin codec to a local directory and through the plugin backend."""
    root = tmp_path_factory.mktemp("saved")
    result = _child(f"""
        import torch, torch.distributed.checkpoint as dcp
        from dcp_tiered import CompressedWriter
        from dcp_tiered.storage import Storage
        g = torch.Generator().manual_seed(0)
        state = {{"model": {{"w": torch.randn(256, 64, generator=g).to(torch.bfloat16),
                            "ids": torch.arange(4096, dtype=torch.int64) % 7}},
                  "extra": {{"epoch": 3}}}}
        torch.save(state, {str(root / "reference.pt")!r})
        dcp.save(state, storage_writer=CompressedWriter({str(root / "local")!r}, codec="deflate:9"), no_dist=True)
        dcp.save(state, storage_writer=CompressedWriter("toyfs://{root}/toy", codec="deflate"), no_dist=True)
        emit(type(Storage("toyfs://{root}/toy")).__name__)
    """, plugins["toy"])
    assert result == "ToyStorage"
    return {"root": root, "local": root / "local", "toy": f"toyfs://{root}/toy",
            "state": torch.load(root / "reference.pt", weights_only=True)}


def test_a_codec_and_a_backend_registered_only_by_entry_point_work_in_the_cli(plugins: dict, saved: dict) -> None:
    """The two inspects (the codec's and the backend's entry point) run in new interpreters, as an
    installed command starts; the other commands in forked children, where the entry points are looked up
    just the same (the forkserver never looked any up)."""
    out = saved["root"] / "out"
    run, run_forked = cli(plugins["toy"]), cli(plugins["toy"], forked=True)
    ins_local, ins_toy = run(["inspect", saved["local"], "--json"], ["inspect", saved["toy"], "--json"])
    verified, to_zstd, to_pt, toy_to_pt = run_forked(
        ["verify", saved["local"], saved["toy"], "--json"],
        ["convert", saved["local"], out / "zstd", "--codec", "zstd"], ["convert", saved["local"], out / "local.pt"],
        ["convert", saved["toy"], out / "toy.pt"])
    local, toy = json.loads(ok(ins_local).stdout), json.loads(ok(ins_toy).stdout)
    assert local["codecs"] == ["deflate:9"] and toy["codecs"] == ["deflate"]
    ids = next(r for r in local["tensors"] if r["key"] == "model.ids")
    assert ids["stored_bytes"] < ids["raw_bytes"] // 10  # deflate really compressed it
    assert all(r["ok"] and r["frames"] > 0 for r in json.loads(ok(verified).stdout))
    for res in (to_zstd, to_pt, toy_to_pt):
        ok(res)
    _assert_same(saved["state"], torch.load(out / "local.pt", weights_only=True))
    _assert_same(saved["state"], torch.load(out / "toy.pt", weights_only=True))
    back, = run_forked(["convert", out / "zstd", f"toyfs://{out}/deflate", "--codec", "deflate:1", "--json"])
    assert json.loads(ok(back).stdout)["codec"] == "deflate:1"
    again, = run_forked(["convert", f"toyfs://{out}/deflate", out / "again.pt"])
    ok(again)
    _assert_same(saved["state"], torch.load(out / "again.pt", weights_only=True))


def test_without_the_plugin_the_cli_says_which_entry_point_group_to_install(saved: dict) -> None:
    # the inspects in new interpreters, verify and convert in forked children (see cli)
    ins_local, ins_toy = cli()(["inspect", saved["local"]], ["inspect", saved["toy"]])
    ver_local, conv_local = cli(forked=True)(["verify", saved["local"]], ["convert", saved["local"], saved["root"] / "nope.pt"])
    for res in (ins_local, ver_local, conv_local):
        line = one_line_error(res, 4)
        assert "'deflate:9'" in line and "dcp_tiered.codecs" in line and "install" in line, line
    line = one_line_error(ins_toy, 2)
    assert "'toyfs'" in line and "dcp_tiered.storage" in line and "install" in line, line
    assert not (saved["root"] / "nope.pt").exists()


def test_a_broken_plugin_is_imported_once_named_and_breaks_nothing_else(plugins: dict, saved: dict,
                                                                         tmp_path: Path) -> None:
    log = tmp_path / "imports.log"
    log.touch()
    result = _child("""
        import dcp_tiered
        from dcp_tiered.codecs import get_codec
        from dcp_tiered.errors import CodecError, ConfigError
        from dcp_tiered.storage import Storage
        import os
        get_codec("zstd:3"), Storage(os.environ["PLUGIN_IMPORT_LOG"] + ".d"), Storage("memory://x/y")
        before = open(os.environ["PLUGIN_IMPORT_LOG"]).read()
        errors = []
        for ask in (lambda: get_codec("shaky"), lambda: get_codec("shaky:2"), lambda: Storage("shakyfs://b/c"),
                    lambda: Storage("shakyfs://b/d")):
            try:
                ask()
            except (CodecError, ConfigError) as exc:
                errors.append([type(exc).__name__, str(exc), repr(exc.__cause__)])
        emit({"before": before, "errors": errors, "deflate": str(get_codec("deflate:2"))})
    """, plugins["broken"], plugins["toy"], PLUGIN_IMPORT_LOG=str(log))
    assert result["before"] == ""  # built-ins, local and memory:// never load a plugin
    assert log.read_text() == "imported\n" * 2  # each of the two entry points loaded once, never retried
    (codec_kind, first, cause), (_, second, _), (storage_kind, storage, _), (_, storage_again, _) = result["errors"]
    assert codec_kind == "CodecError" and first == second and storage == storage_again and "ImportError" in cause
    for message, why in ((first, "libshaky.so"), (storage, "SystemExit: 3")):
        assert "dcp-tiered-broken 0.2" in message and why in message and "Reinstall" in message, message
    assert "'shaky'" in first and "dcp_tiered.codecs" in first
    assert storage_kind == "ConfigError" and "'shakyfs'" in storage and "dcp_tiered.storage" in storage
    assert result["deflate"] == "deflate:2"  # another plugin of the same group still works
    ins, = cli(plugins["broken"], plugins["toy"])(["inspect", saved["local"]])
    assert "model.w" in ok(ins).stdout


def test_a_plugin_cannot_take_a_built_in_name_or_register_what_is_not_a_codec(plugins: dict, tmp_path: Path) -> None:
    result = _child(f"""
        import logging
        from dcp_tiered.codecs import get_codec
        from dcp_tiered.errors import CodecError, ConfigError
        from dcp_tiered.storage import Storage
        logging.basicConfig(level=logging.WARNING)
        out = {{"zstd": type(get_codec("zstd")).__name__, "local": type(Storage({str(tmp_path)!r})).__name__}}
        for name, ask in [("fastzstd", lambda: get_codec("fastzstd")), ("oddity", lambda: get_codec("oddity")),
                          ("oddfs", lambda: Storage("oddfs://b/c"))]:
            try:
                ask()
            except (CodecError, ConfigError) as exc:
                out[name] = str(exc)
        out["zstd after"] = type(get_codec("zstd:2")).__name__
        emit(out)
    """, plugins["clash"])
    assert result["zstd"] == result["zstd after"] == "ZstdCodec" and result["local"] == "LocalStorage"
    clash = result["fastzstd"]
    assert "'fastzstd'" in clash and "dcp-tiered-clash 0.3" in clash and "'zstd'" in clash and "built in" in clash, clash
    assert "not a Codec subclass" in result["oddity"] and "'oddity'" in result["oddity"]
    assert "not a Storage subclass" in result["oddfs"] and "dcp-tiered-clash 0.3" in result["oddfs"]


def test_an_entry_point_named_after_a_built_in_is_refused_with_a_warning_naming_it(plugins: dict) -> None:
    res = run_isolated("""
        import logging
        from dcp_tiered.codecs import get_codec
        from dcp_tiered.errors import CodecError
        from dcp_tiered.storage import Storage
        logging.basicConfig(level=logging.WARNING)
        for ask in (lambda: get_codec("unheard-of"), lambda: Storage("memory://a/b")):
            try:
                ask()
            except CodecError as exc:
                print("error:", exc)
        emit(type(get_codec("zstd")).__name__)
    """, timeout=120, env={"PYTHONPATH": _path(plugins["clash"])})
    assert res.returncode == 0 and res.result == "ZstdCodec", res.describe()
    assert "unknown codec 'unheard-of'" in res.stdout
    for group, name in (("dcp_tiered.codecs", "zstd"), ("dcp_tiered.storage", "file")):
        warning = next(ln for ln in res.stderr.splitlines() if f"entry point '{name}'" in ln)
        assert group in warning and "dcp-tiered-clash 0.3" in warning and "built in" in warning, warning


def test_a_name_two_distributions_declare_is_refused_naming_both(plugins: dict) -> None:
    message = _child("""
        from dcp_tiered.codecs import get_codec
        from dcp_tiered.errors import CodecError
        try:
            get_codec("deflate")
        except CodecError as exc:
            emit(str(exc))
    """, plugins["toy"], plugins["twin"])
    assert "2 installed distributions provide codec 'deflate'" in message, message
    assert "dcp-tiered-toy 0.1" in message and "dcp-tiered-twin 0.4" in message and "Uninstall all but one" in message
