"""Every `dcp-tiered` command through its real entry point, in a child process.

Checkpoints are prepared in-process with the library; the commands then run as users run
them: the console script's ``main()`` with its arguments, in a child forked from the tests'
forkserver (:mod:`forked`, which imported torch once), or the installed `dcp-tiered` script
itself where a test needs a tty.  Calls that do not depend on each other run concurrently to
keep the suite short.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from forked import run_cli, start_cli
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.tiers import Tier, TieredCheckpointer, TieredWriter
from dcp_tiered.tiers.promote.promoter import Promoter

_SCRIPT = Path(sys.executable).with_name("dcp-tiered")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "dcp_tiered.cli"]
COMMANDS = ["train", "demo", "inspect", "verify", "ls", "convert", "export", "import", "promote", "gc", "cost", "bench"]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    env.update(extra or {})
    return env


def cli(*args: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_cli(*args, env=_env(), cwd=cwd, timeout=timeout)


def cli_parallel(*calls: list) -> list[subprocess.CompletedProcess]:
    """Run independent commands concurrently; results in order."""
    runs = [start_cli(*c, env=_env()) for c in calls]
    return [r.communicate(scaled(180)) for r in runs]


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"{res.args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def one_line_error(res: subprocess.CompletedProcess, code: int) -> str:
    assert res.returncode == code, f"{res.args}: exit {res.returncode}, expected {code}\n{res.stdout}\n{res.stderr}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0], res.stderr
    return lines[0]


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(128, 96, generator=g), "b": torch.randn(96, generator=g).to(torch.bfloat16),
                  "ids": torch.arange(40, dtype=torch.int64)},
        "optim": {"exp_avg": torch.randn(128, 96, generator=g) * 1e-3, "step": torch.tensor(7.0)},
        "extra": {"epoch": 3, "name": "run-1"},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


class _CrashedPromoter(Promoter):
    """A promoter whose process died right after the save committed: intents recorded, nothing run."""

    def submit(self, intent) -> None:  # type: ignore[no-untyped-def]
        pass

    def retention(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        pass


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("cli")
    state = _state()
    dcp.save(state, storage_writer=CompressedWriter(root / "native", codec="zstd"), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "stock")), no_dist=True)
    tiers = [Tier("local", str(root / "tiers" / "local"), codec="lz4", keep=3),
             Tier("shared", str(root / "tiers" / "shared"), codec="zstd", keep=2)]
    with TieredCheckpointer(tiers, optimizer_every=2) as ckpt:
        for step in (1, 2, 3):
            state["model"]["w"].add_(1.0)
            ckpt.maybe_save(step, state, force=True)
    # step 4: committed on local, its promotion to shared recorded but never run (a crash)
    writer = TieredWriter(tiers, due=["local", "shared"], promoter=_CrashedPromoter(tiers))
    dcp.save(state, storage_writer=writer, checkpoint_id="step_000000004", no_dist=True)
    # an uncommitted leftover older than the newest committed checkpoint
    leftover = root / "tiers" / "local" / "step_000000000"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"\0" * 100)
    yaml_path = root / "tiers.yaml"
    yaml_path.write_text(
        "tiers:\n"
        f"  - {{name: local, url: '{tiers[0].url}', codec: lz4, keep: 3}}\n"
        f"  - {{name: shared, url: '{tiers[1].url}', codec: zstd, keep: 2}}\n"
    )
    return {"root": root, "state": _state(), "tiers_yaml": yaml_path, "tiers": tiers}


def test_help_on_every_command_with_examples_and_exit_codes() -> None:
    top = ok(cli("--help"))
    for name in COMMANDS:
        assert name in top.stdout
    assert "exit codes:" in top.stdout
    for res, name in zip(cli_parallel(*[[c, "--help"] for c in COMMANDS]), COMMANDS):
        ok(res)
        assert "examples:" in res.stdout and "exit codes:" in res.stdout, name
        assert "dcp-tiered " + name in res.stdout
    assert cli().returncode == 2  # no command: help and a usage exit code


def test_inspect_and_verify(data: dict) -> None:
    root = data["root"]
    bad = root / "bitflip"
    shutil.copytree(root / "native", bad)
    data_file = bad / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data_file.write_bytes(bytes(raw))
    short = root / "short"
    shutil.copytree(root / "native", short)
    with open(short / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    ins_native, ins_stock, ver_all, ver_none = cli_parallel(
        ["inspect", root / "native", "--json"], ["inspect", root / "stock"],
        ["verify", root / "native", root / "stock", bad, short, "--json"], ["verify", root / "nothing-here"])

    info = json.loads(ok(ins_native).stdout)
    assert info["format"] == "dcp_tiered v2" and info["format_version"] == 2 and info["codecs"] == ["zstd:1"]
    rows = {r["key"]: r for r in info["tensors"]}
    assert rows["model.w"]["dtype"] == "float32" and rows["model.w"]["shape"] == [128, 96]
    assert rows["model.w"]["raw_bytes"] == 128 * 96 * 4 and 0 < rows["model.w"]["stored_bytes"] < 128 * 96 * 4
    assert rows["model.b"]["dtype"] == "bfloat16" and rows["model.ids"]["dtype"] == "int64"
    assert rows["extra.epoch"]["kind"] == "object"
    assert info["raw_bytes"] >= sum(r["raw_bytes"] or 0 for r in info["tensors"] if r["kind"] == "tensor")

    text = ok(ins_stock).stdout
    assert "stock DCP" in text and "model.w" in text and "128x96" in text and "float32" in text

    assert ver_all.returncode == 1, ver_all.stderr
    good, stock, flipped, truncated = json.loads(ver_all.stdout)
    assert good["ok"] and good["frames"] >= good["items"] == 7 and not good["problems"]
    assert stock["ok"] and stock["files"] >= 1
    assert not flipped["ok"] and any("checksum mismatch" in p for p in flipped["problems"])
    assert not truncated["ok"] and any("truncated" in p for p in truncated["problems"])
    assert "not a committed checkpoint" in one_line_error(ver_none, 3)


def test_convert_between_formats_and_back(data: dict) -> None:
    root, original = data["root"], data["state"]
    out = root / "converted"
    to_lz4, to_pt_bf16 = cli_parallel(["convert", root / "stock", out / "lz4", "--codec", "lz4", "--json"],
                                      ["convert", root / "native", out / "bf16.pt", "--dtype", "bf16"])
    res = json.loads(ok(to_lz4).stdout)
    assert res["format"] == "dcp_tiered" and res["codec"] == "lz4" and res["dst_bytes"] < res["src_bytes"]
    ok(to_pt_bf16)
    # compressed -> torch.save -> stock DCP, every value bit for bit
    to_pt, = cli_parallel(["convert", out / "lz4", out / "model.pt"])
    ok(to_pt)
    _assert_same(original, torch.load(out / "model.pt", weights_only=True))
    ok(cli("convert", out / "model.pt", out / "stock", "--codec", "stock"))
    back: dict = {}
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(back, storage_reader=CompressedReader(out / "stock"), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    _assert_same(original, back)
    bf16 = torch.load(out / "bf16.pt", weights_only=True)
    assert bf16["model"]["w"].dtype == torch.bfloat16 and bf16["model"]["ids"].dtype == torch.int64


def test_ls_promote_gc_cost(data: dict) -> None:
    y = data["tiers_yaml"]
    flags = ["--local-path", data["tiers"][0].url, "--shared-path", data["tiers"][1].url, "--keep-local", "3", "--keep-shared", "2"]
    promote_dry, gc_dry, ls_before = cli_parallel(["promote", "--tiers", y, "--dry-run", "--json"],
                                                  ["gc", *flags, "--leftover-grace", "0", "--dry-run", "--json"], ["ls", "--tiers", y])
    pending = json.loads(ok(promote_dry).stdout)["pending"]
    assert pending == [{"tier": "local", "step": 4, "name": "step_000000004", "targets": ["shared"]}]
    would = json.loads(ok(gc_dry).stdout)["would_delete"]
    assert {(w["tier"], w["step"]) for w in would} == {("local", 0), ("local", 1)}  # leftover, and keep=3
    text = ok(ls_before).stdout
    assert "uncommitted" in text and "pending -> shared" in text

    events = data["root"] / "promote-events.jsonl"
    res = json.loads(ok(cli("promote", "--tiers", y, "--json", "--event-log", events)).stdout)
    assert res["ok"] and res["resumed"] == 1
    assert {(r["target"], r["kind"], r["ok"]) for r in res["reports"]} == {("shared", "data", True), ("shared", "metadata", True)}
    assert all(json.loads(line)["event"] == "promotion" for line in events.read_text().splitlines())

    ls_after, cost = cli_parallel(["ls", "--tiers", y, "--json"], ["cost", *flags, "--price", "shared=0.5", "--json"])
    rows = {(r["tier"], r["step"]): r for r in json.loads(ok(ls_after).stdout)}
    assert rows[("shared", 4)]["committed"] and rows[("shared", 4)]["complete"]
    assert not rows[("local", 4)]["pending_promotions"] and "also on shared" in rows[("local", 4)]["promotion"]
    assert rows[("local", 0)]["state"] == "uncommitted"
    assert rows[("local", 1)]["optimizer"] is True and rows[("local", 2)]["optimizer"] is False
    # shared keeps 2: retention after the promotion already dropped step 2
    assert {s for t, s in rows if t == "shared"} == {3, 4}
    c = json.loads(ok(cost).stdout)
    tiers = {t["tier"]: t for t in c["tiers"]}
    assert tiers["shared"]["price_gb_month"] == 0.5 and tiers["local"]["price_gb_month"] == 0.08
    assert tiers["shared"]["stored_bytes"] == rows[("shared", 4)]["size_bytes"] and tiers["shared"]["keep"] == 2
    kept = rows[("shared", 3)]["size_bytes"] + rows[("shared", 4)]["size_bytes"]  # each kept checkpoint at its size
    assert tiers["shared"]["kept_bytes"] == kept and tiers["shared"]["checkpoints"] == 2
    assert tiers["shared"]["monthly_usd"] == pytest.approx(kept / 2**30 * 0.5)
    assert 0 < tiers["local"]["fp32_bytes"] and c["saving_usd"] == pytest.approx(c["fp32_monthly_usd"] - c["monthly_usd"])

    gone = json.loads(ok(cli("gc", *flags, "--leftover-grace", "0", "--json")).stdout)["deleted"]
    assert {(g["tier"], g["step"]) for g in gone} == {("local", 0), ("local", 1)}
    assert sorted(p.name for p in Path(data["tiers"][0].url).iterdir()) == ["step_000000002", "step_000000003", "step_000000004"]


def test_usage_errors_are_one_line(data: dict) -> None:
    root = data["root"]
    no_tiers, bad_price, exists, bad_codec, collide = cli_parallel(
        ["train", "--steps", "3"], ["cost", "--tiers", data["tiers_yaml"], "--price", "oops"],
        ["convert", root / "native", root / "stock", "--codec", "stock"],
        ["convert", root / "native", root / "x", "--codec", "brotli"],
        ["train", "--steps", "3", "--tiers", data["tiers_yaml"], "--d-model", "16", "--vocab", "32", "--seq-len", "8"])
    assert "pass --resume" in one_line_error(collide, 2)
    assert "--local-path" in one_line_error(no_tiers, 2)
    assert "TIER=USD" in one_line_error(bad_price, 2)
    assert "--overwrite" in one_line_error(exists, 2)
    assert "unknown codec" in one_line_error(bad_codec, 2)


# -- one flag vocabulary, no flag that does nothing, progress, bench --path ------------------------------------

def _subparsers() -> dict:
    import argparse

    from dcp_tiered.cli.__main__ import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """(visible flag -> dest, hidden flag -> dest) of one command's parser."""
    import argparse

    visible, hidden = {}, {}
    for a in p._actions:
        for s in a.option_strings:
            if s.startswith("--") and s != "--help":
                (hidden if a.help == argparse.SUPPRESS else visible)[s] = a.dest
    return visible, hidden


def test_one_flag_vocabulary_old_spellings_hidden_but_accepted() -> None:
    from dcp_tiered.cli.args import ALIASES

    flag_of_dest: dict[str, set] = {}
    for name, p in _subparsers().items():
        visible, hidden = _options(p)
        assert not set(visible) & set(ALIASES), f"{name}: an old spelling is visible"
        for flag, dest in visible.items():
            flag_of_dest.setdefault(dest, set()).add(flag)
        for old, dest in hidden.items():
            if old == "--debug":
                continue  # the global --debug, also after the command
            assert old in ALIASES and visible[ALIASES[old]] == dest, f"{name}: {old} is no alias of a visible flag"
            assert old not in p.format_help(), f"{name} --help shows {old}"
        assert "--codecs" not in p.format_help() and "--checkpoint-dtype" not in p.format_help()
    # one spelling per concept: a dest has the same flag on every command (and --codec/--dtype are the only ones)
    assert {d: f for d, f in flag_of_dest.items() if len(f) > 1} == {}
    assert flag_of_dest["codec"] == {"--codec"} and flag_of_dest["dtype"] == {"--dtype"}
    # the old spellings still parse into the new dest
    subs = _subparsers()
    a = subs["train"].parse_args(["--compression", "zstd:3", "--checkpoint-dtype", "bf16"])
    assert (a.codec, a.dtype) == ("zstd:3", "bf16")
    a = subs["bench"].parse_args(["--codecs", "lz4", "--dtypes", "fp32,bf16"])
    assert (a.codec, a.dtype) == ("lz4", "fp32,bf16")
    a = subs["train"].parse_args([])
    assert (a.codec, a.dtype) == (None, "fp32")
    # commands that do not encode or schedule refuse those flags (exit 2) instead of ignoring them
    for cmd, flag in (("ls", "--codec"), ("gc", "--compression"), ("cost", "--dtype"), ("promote", "--checkpoint-interval-s"),
                      ("ls", "--keep-local")):
        res = cli(cmd, "--local-path", "/nonexistent", flag, "1")
        assert res.returncode == 2 and "unrecognized arguments" in res.stderr, (cmd, flag, res.stderr)


class _Recording:
    """Wraps a parsed Namespace and records which attributes a command reads."""

    def __init__(self, ns) -> None:  # type: ignore[no-untyped-def]
        object.__setattr__(self, "_ns", ns)
        object.__setattr__(self, "_read", set())

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        self._read.add(name)
        return getattr(self._ns, name)

    def __setattr__(self, name: str, value) -> None:  # type: ignore[no-untyped-def]
        setattr(self._ns, name, value)


def test_no_command_accepts_a_flag_it_ignores(data: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run each command in-process on namespaces that record reads: every option's dest is read."""
    import contextlib
    import io

    from dcp_tiered.cli.output import debug_enabled

    monkeypatch.chdir(tmp_path)
    root, yaml_path = data["root"], data["tiers_yaml"]
    empty = tmp_path / "empty"
    empty.mkdir()
    three = ["--local-path", empty, "--shared-path", tmp_path / "s", "--durable-path", tmp_path / "d"]
    runs = {
        "ls": [["--tiers", yaml_path], ["--local-path", empty, "--json"]],
        "gc": [[*three, "--dry-run", "--json"], ["--local-path", empty, "--leftover-grace", "1h"]],
        "cost": [["--tiers", yaml_path, "--price", "local=0.1"], [*three, "--stored-gb", "1", "--fp32-gb", "2", "--json"]],
        "promote": [[*three, "--dry-run"], ["--local-path", empty, "--event-log", tmp_path / "ev.jsonl", "--json"]],
        "inspect": [[root / "native", "--json"]],
        "verify": [[root / "native"]],
        "convert": [[root / "native", tmp_path / "conv", "--codec", "lz4", "--dtype", "bf16", "--overwrite", "--json"]],
        "bench": [["--model", "tiny", "--no-stock", "--codec", "lz4", "--path", tmp_path / "b", "--repeat", "1", "--no-chart", "--json"],
                  [root / "native", "--no-stock", "--codec", "none", "--dtype", "bf16", "--chart", tmp_path / "c.png"]],
    }
    subs = _subparsers()
    for name, argvs in runs.items():
        read: set = set()
        for argv in argvs:
            rec = _Recording(subs[name].parse_args([str(a) for a in argv]))
            debug_enabled(rec)  # what main() reads
            with contextlib.redirect_stdout(io.StringIO()):
                rec.func(rec)
            read |= rec._read
        visible, _ = _options(subs[name])
        unread = {f for f, dest in visible.items() if dest not in read}
        assert unread == set(), f"{name} accepts {sorted(unread)} but never reads them"


def argparse_ns(**kw):  # type: ignore[no-untyped-def]
    import argparse

    return argparse.Namespace(**kw)


def test_progress_is_tqdm_with_rate_on_a_tty_only(data: dict, tmp_path: Path) -> None:
    import io

    from dcp_tiered.cli import output

    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    import sys as _sys

    saved = _sys.stderr
    _sys.stderr = tty = FakeTTY()
    try:
        with output.progress(10 << 20, "verify", unit="B") as bar:
            bar.update(5 << 20)
            bar.refresh()
        with output.progress_for(argparse_ns(json=True))(10, "x") as quiet:
            quiet.update(5)
    finally:
        _sys.stderr = saved
    text = tty.getvalue()
    assert "verify:" in text and "B/s" in text, text  # a rate
    assert "5.00M/10.0M" in text and "<" in text, text  # amount and ETA
    assert "x:" not in text  # --json: no bar
    plain = io.StringIO()  # not a terminal: nothing drawn
    _sys.stderr = plain
    try:
        with output.progress(10, "verify") as bar:
            bar.update(10)
    finally:
        _sys.stderr = saved
    assert plain.getvalue() == ""

    # the real command on a pseudo-terminal: verify draws a byte bar with a rate; --json does not
    import fcntl
    import pty
    import select
    import struct
    import termios

    for extra, want in (([], True), (["--json"], False)):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
        proc = subprocess.Popen([*CLI, "verify", str(data["root"] / "native"), *extra], stdout=subprocess.PIPE,
                                stderr=slave, env=_env(), text=True)
        os.close(slave)
        chunks = b""
        while True:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                chunks += chunk
            elif proc.poll() is not None:
                break
        proc.wait(scaled(120))
        os.close(master)
        assert proc.returncode == 0
        err = chunks.decode(errors="replace")
        assert ("verify:" in err and "B/s" in err) == want, err


def test_promote_and_gc_draw_byte_progress_on_a_tty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import io

    from dcp_tiered.cli.__main__ import main

    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    tiers = [Tier("local", str(tmp_path / "local"), codec="lz4", keep=1), Tier("shared", str(tmp_path / "shared"), keep=1)]
    state = _state()
    with TieredCheckpointer(tiers[:1]) as ckpt:
        for step in (1, 2, 3):
            ckpt.maybe_save(step, state, force=True)
    writer = TieredWriter(tiers, due=["local", "shared"], promoter=_CrashedPromoter(tiers))
    dcp.save(state, storage_writer=writer, checkpoint_id="step_000000004", no_dist=True)
    flags = ["--local-path", tiers[0].url, "--shared-path", tiers[1].url, "--keep-local", "1", "--keep-shared", "1"]
    for argv, desc in ((["promote", *flags], "promote:"), (["gc", *flags, "--leftover-grace", "0"], "gc local:")):
        tty = FakeTTY()
        monkeypatch.setattr(sys, "stderr", tty)
        assert main(argv) == 0
        monkeypatch.undo()
        assert desc in tty.getvalue() and "B/s" in tty.getvalue(), tty.getvalue()
    assert sorted(p.name for p in (tmp_path / "local").iterdir() if p.name.startswith("step_")) == ["step_000000004"]
    capsys.readouterr()


# -- review of issue 14's CLI: usage errors, --keep-X, aliases, --overwrite, bench cleanup ------------------------

def test_subcommand_usage_errors_are_one_line_naming_the_command(tmp_path: Path) -> None:
    unknown, missing_value, bad_choice, top = cli_parallel(
        ["ls", "--local-path", tmp_path, "--codec", "lz4"], ["ls", "--tiers"],
        ["convert", "a", "b", "--dtype", "fp8"], ["--bogus"])
    assert one_line_error(unknown, 2) == \
        "dcp-tiered ls: error: unrecognized arguments: --codec lz4 (see dcp-tiered ls --help)"
    assert one_line_error(missing_value, 2).startswith("dcp-tiered ls: error: argument --tiers: expected one argument")
    assert one_line_error(bad_choice, 2).startswith("dcp-tiered convert: error: argument --dtype")
    assert one_line_error(top, 2) == "dcp-tiered: error: unrecognized arguments: --bogus (see dcp-tiered --help)"


def test_top_level_help_lists_every_command_once() -> None:
    import re

    out = ok(cli("--help")).stdout
    for name in COMMANDS:
        assert len(re.findall(rf"^\s+{name}\s", out, flags=re.M)) == 1, (name, out)
    assert "positional arguments" not in out and "usage: dcp-tiered" in out and "COMMAND" in out


def test_keep_without_its_tier_is_a_usage_error(tmp_path: Path, data: dict) -> None:
    local = tmp_path / "local"
    local.mkdir()
    gc, promote, cost, from_yaml, what_if = cli_parallel(
        ["gc", "--local-path", local, "--keep-shared", "1"], ["promote", "--local-path", local, "--keep-durable", "2"],
        ["cost", "--local-path", local, "--stored-gb", "1", "--keep-durable", "3"],
        ["gc", "--tiers", data["tiers_yaml"], "--keep-durable", "1", "--dry-run"],
        ["cost", "--stored-gb", "1", "--keep-durable", "3", "--json"])
    assert "--keep-shared" in one_line_error(gc, 2) and "--shared-path" in gc.stderr
    assert "--keep-durable" in one_line_error(promote, 2)
    assert "--keep-durable" in one_line_error(cost, 2)
    assert "--keep-durable" in one_line_error(from_yaml, 2) and "local, shared" in from_yaml.stderr
    # a what-if without tiers prices the three default tiers: --keep-X is used there
    assert {t["tier"]: t["keep"] for t in json.loads(ok(what_if).stdout)["tiers"]}["durable"] == 3


def test_every_command_with_codec_or_dtype_takes_every_old_spelling(data: dict, tmp_path: Path) -> None:
    from dcp_tiered.cli.args import ALIASES

    having = set()
    for name, p in _subparsers().items():
        visible, hidden = _options(p)
        expected = {old for old, new in ALIASES.items() if new in visible}  # export: --dtype alone, import: --codec
        assert {f for f in hidden if f != "--debug"} == expected, name
        if expected:
            having.add(name)
    assert having == {"train", "convert", "bench", "export", "import"}
    a = _subparsers()["convert"].parse_args(["s", "d", "--compression", "lz4", "--checkpoint-dtype", "bf16"])
    assert (a.codec, a.dtype) == ("lz4", "bf16")
    a = _subparsers()["train"].parse_args(["--codecs", "lz4", "--dtypes", "bf16"])
    assert (a.codec, a.dtype) == ("lz4", "bf16")
    out = json.loads(ok(cli("convert", data["root"] / "native", tmp_path / "c", "--compression", "lz4",
                            "--checkpoint-dtype", "bf16", "--json")).stdout)
    assert out["codec"] == "lz4"


def test_convert_onto_an_existing_checkpoint_names_the_flag(data: dict, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    ok(cli("convert", data["root"] / "native", dst, "--codec", "lz4"))
    for res in cli_parallel(["convert", data["root"] / "native", dst, "--codec", "lz4"],
                            ["convert", data["root"] / "native", dst, "--codec", "stock"]):
        line = one_line_error(res, 2)
        assert "--overwrite" in line and "overwrite=True" not in line and "overwrite=False" not in line, line


def test_missing_tiers_file_is_a_configuration_error_as_documented(tmp_path: Path) -> None:
    res = cli("ls", "--tiers", tmp_path / "none.yaml")
    assert "none.yaml" in one_line_error(res, 2)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    usage_row = next(ln for ln in docs.splitlines() if ln.startswith("| 2 |"))
    assert "--tiers" in usage_row


@pytest.mark.parametrize("copied", ["data", "data+fragment"])
def test_ls_labels_a_half_finished_promotion_one_way(tmp_path: Path, copied: str) -> None:
    """A promotion a crash cut short, whether its target holds only copied data or a fragment too: the
    source says where it is pending, the target that it is incoming from the source, never "also on"."""
    from dcp_tiered.tiers.layout import FRAGMENT_SUFFIX

    tiers = [Tier("local", str(tmp_path / "local"), codec="lz4", keep=2), Tier("shared", str(tmp_path / "shared"), keep=2)]
    writer = TieredWriter(tiers, due=["local", "shared"], promoter=_CrashedPromoter(tiers))
    dcp.save(_state(), storage_writer=writer, checkpoint_id="step_000000004", no_dist=True)
    src, dst = tmp_path / "local" / "step_000000004", tmp_path / "shared" / "step_000000004"
    dst.mkdir(parents=True)
    for f in src.glob("*.distcp"):
        (dst / f.name).write_bytes(f.read_bytes())
    if copied == "data+fragment":
        (dst / f"__0{FRAGMENT_SUFFIX}").write_text("{}")
    out = ok(cli("ls", "--local-path", tiers[0].url, "--shared-path", tiers[1].url, "--json")).stdout
    rows = {r["tier"]: r for r in json.loads(out)}
    assert rows["local"]["promotion"] == "pending -> shared"
    assert rows["shared"]["state"] == "uncommitted"
    assert rows["shared"]["promotion"] == "incoming from local (promotion not committed yet)"
