"""`dcp-tiered` on hostile checkpoints and unexpected errors: one line, the documented exit code.

Every hostile invocation runs the real CLI in a child process with a timeout and a memory
limit (the console script's ``main()`` in a child forked from the tests' forkserver, see
tests/forked.py, or in a child through tests/isolated.py), so a crash or a hang fails one test.  A traceback never reaches the user; ``--debug`` or
``DCP_TIERED_DEBUG=1`` shows it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from forked import start_cli
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
from isolated import run_isolated

from dcp_tiered.dcp.metadata_io import unpack_metadata
from dcp_tiered import CompressedWriter
from dcp_tiered.cli import output as common

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # generous: 2 shared CPU cores
MEMORY = 4 << 30


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop(common.DEBUG_ENV, None)
    env.update(extra or {})
    return env


def cli_parallel(*calls: list, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run CLI invocations concurrently, each with a timeout and a memory limit, in a session of its own; results in order."""
    runs = [start_cli(*c, env=_env(env), memory=MEMORY, new_session=True) for c in calls]
    out = []
    for c, r in zip(calls, runs):
        try:
            out.append(r.communicate(scaled(TIMEOUT)))
        except subprocess.TimeoutExpired:
            for q in runs:
                q.kill()
            pytest.fail(f"{c} hung for {TIMEOUT} s")
    return out


def no_traceback(res: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in res.stderr + res.stdout, f"{res.args}\n{res.stderr}"
    assert res.returncode >= 0, f"{res.args} died of signal {-res.returncode}\n{res.stderr}"


def one_line_error(res: subprocess.CompletedProcess, *codes: int) -> str:
    """The only stderr line, after checking the exit code is one of ``codes`` and no traceback shows."""
    no_traceback(res)
    assert res.returncode in codes, f"{res.args}: exit {res.returncode}, expected {codes}\n{res.stdout}\n{res.stderr}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0], res.stderr
    return lines[0]


class _Reduce:
    """Pickles as ``fn(*args)``: the classic code-execution payload."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _clone(root: Path, good: Path, name: str) -> Path:
    dst = root / name
    shutil.copytree(good, dst)
    return dst


def _edit_metadata(ckpt: Path, edit) -> None:
    md = unpack_metadata((ckpt / ".metadata").read_bytes())  # our own checkpoint: plain pickle is fine here
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def _data_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.distcp"))


def _set_record(md, fqn: str, **changes) -> None:
    for index, rec in md.storage_data.items():
        if index.fqn == fqn:
            rec.update(changes)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good checkpoint and one crafted variant per attack, by name."""
    root = tmp_path_factory.mktemp("hostile")
    good = root / "good"
    state = {"w": torch.randn(64, 32), "b": torch.ones(5), "epoch": 3}
    dcp.save(state, storage_writer=CompressedWriter(good, codec="zstd"), no_dist=True)
    out = {"good": good, "nothing": root / "nothing", "marker": root / "PWNED"}

    p = out["garbage"] = _clone(root, good, "garbage")
    (p / ".metadata").write_bytes(bytes(range(256)) * 3)
    p = out["os.system"] = _clone(root, good, "os.system")
    (p / ".metadata").write_bytes(pickle.dumps(_Reduce(os.system, f"touch {shlex.quote(str(out['marker']))}")))
    p = out["empty"] = _clone(root, good, "empty")
    (p / ".metadata").write_bytes(b"")
    p = out["metadata-dir"] = _clone(root, good, "metadata-dir")
    (p / ".metadata").unlink()
    (p / ".metadata").mkdir()
    p = out["missing-data"] = _clone(root, good, "missing-data")
    for f in _data_files(p):
        f.unlink()
    p = out["truncated-data"] = _clone(root, good, "truncated-data")
    for f in _data_files(p):
        os.truncate(f, 40)

    # type confusion: fields of the wrong type inside an otherwise valid DCP Metadata
    def str_key(md):
        md.storage_data["w"] = next(iter(md.storage_data.values()))

    def str_dtype(md):
        md.state_dict_metadata["w"].properties.dtype = "float32"

    def chunks_int(md):
        md.state_dict_metadata["w"].chunks = 5

    def offset_none(md):
        _set_record(md, "w", offset=None)

    for name, edit in [("str-key", str_key), ("str-dtype", str_dtype), ("chunks-int", chunks_int), ("offset-none", offset_none)]:
        out[name] = _clone(root, good, name)
        _edit_metadata(out[name], edit)
    return out


# Per hostile input: the exit codes `inspect` and `verify` must give.  A directory named
# .metadata is a storage error (cannot be read as a file) or a corrupt checkpoint, depending on
# whether the storage layer classifies non-regular files itself.
CORRUPT = (common.EXIT_CORRUPT,)
EXPECTED = {
    "nothing": ((common.EXIT_NOT_FOUND,), (common.EXIT_NOT_FOUND,)),
    "garbage": (CORRUPT, CORRUPT),
    "os.system": (CORRUPT, CORRUPT),
    "empty": (CORRUPT, CORRUPT),
    "metadata-dir": ((common.EXIT_CORRUPT, common.EXIT_STORAGE),) * 2,
    "missing-data": ((common.EXIT_OK,), (common.EXIT_PROBLEMS,)),  # inspect reads .metadata only
    "truncated-data": ((common.EXIT_OK,), (common.EXIT_PROBLEMS,)),
    "str-key": (CORRUPT, CORRUPT),
    "str-dtype": (CORRUPT, CORRUPT),
    "offset-none": (CORRUPT, CORRUPT),
    "good": ((common.EXIT_OK,), (common.EXIT_OK,)),
}
# the metadata loader checks the schema of every record: type confusion is a corrupt checkpoint
EXPECTED["chunks-int"] = (CORRUPT, CORRUPT)


def test_verify_checks_every_path_and_exits_with_the_worst_code(hostile: dict[str, Path]) -> None:
    names = list(EXPECTED)
    as_json, text = cli_parallel(["verify", "--json", *(hostile[n] for n in names)],
                                 ["verify", hostile["nothing"], hostile["truncated-data"], hostile["good"]])
    no_traceback(as_json)
    results = json.loads(as_json.stdout)
    assert [r["path"] for r in results] == [str(hostile[n]) for n in names]  # every path, in order
    for name, r in zip(names, results):
        assert r["exit_code"] in EXPECTED[name][1], (name, r)
        assert r["ok"] == (name == "good"), (name, r)
        if r["exit_code"] not in (common.EXIT_OK, common.EXIT_PROBLEMS):
            assert r["error"].count("\n") == 0 and str(hostile[name]) in r["error"], r
    assert as_json.returncode == max(r["exit_code"] for r in results)
    assert not hostile["marker"].exists(), "the os.system payload ran"

    # people's output: a verdict per path, then the worst code (3: no checkpoint beats 1: problems)
    no_traceback(text)
    assert text.returncode == common.EXIT_NOT_FOUND, text.stderr
    err = [ln for ln in text.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "not a committed checkpoint" in err[0] and str(hostile["nothing"]) in err[0]
    assert re.search(rf"^{re.escape(str(hostile['truncated-data']))}: \d+ problem\(s\) found", text.stdout, re.M), text.stdout
    assert f"{hostile['good']}: OK" in text.stdout
    assert "verified 3 paths: 1 OK, 1 with problems, 1 could not be verified (exit 3)" in text.stdout


def test_inspect_gives_the_documented_code_in_one_line(hostile: dict[str, Path]) -> None:
    names = list(EXPECTED)
    results = cli_parallel(*[["inspect", hostile[n]] for n in names])
    for name, res in zip(names, results):
        codes = EXPECTED[name][0]
        if codes == (common.EXIT_OK,):
            no_traceback(res)
            assert res.returncode == 0 and "w" in res.stdout, (name, res.stderr)
            continue
        line = one_line_error(res, *codes)
        assert str(hostile[name]) in line, (name, line)
        if res.returncode == common.EXIT_INTERNAL:
            assert "internal error" in line and "--debug" in line, line
        else:
            assert "internal error" not in line, line
    assert not hostile["marker"].exists(), "the os.system payload ran"


def test_ls_lists_hostile_checkpoints_without_failing(hostile: dict[str, Path], tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    names = ["good", "garbage", "os.system", "empty", "metadata-dir", "missing-data", "truncated-data"]
    for step, name in enumerate(names, start=1):
        shutil.copytree(hostile[name], tier / f"step_{step:09d}")
    # a promotion intent that is valid JSON of the wrong shape
    bad_intent = tmp_path / "intent"
    shutil.copytree(hostile["good"], bad_intent / "step_000000001")
    (bad_intent / "step_000000001" / ".promote-0.json").write_text("[]")
    listing, intent = cli_parallel(["ls", "--local-path", tier, "--json"], ["ls", "--local-path", bad_intent, "--json"])

    no_traceback(listing)
    assert listing.returncode == 0, listing.stderr
    rows = {r["step"]: r for r in json.loads(listing.stdout)}
    assert rows[1]["state"] == "committed" and rows[1]["problem"] is None
    for step, name in enumerate(names[1:], start=2):
        assert rows[step]["state"] != "committed", (name, rows[step])
    for step in (2, 3, 4, 6, 7):  # unreadable .metadata, or data files missing or short: said in one line
        assert rows[step]["problem"] and "\n" not in rows[step]["problem"], rows[step]
    assert not hostile["marker"].exists(), "the os.system payload ran"

    # an invalid intent is skipped (and left for gc): the step still lists as committed
    no_traceback(intent)
    assert intent.returncode == 0, intent.stderr
    assert json.loads(intent.stdout)[0]["step"] == 1


_UNEXPECTED = r"""
import contextlib, io, logging, sys, threading
from dcp_tiered.inspect import sources as ckptio
from dcp_tiered.cli.__main__ import main

def run(exc, *argv):
    def boom(path, *a, **k):
        if exc is not None and (not BAD or path == BAD):
            raise exc
        return real(path, *a, **k)
    ckptio.open_reader = boom
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(list(argv))
    return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()}

real = ckptio.open_reader
BAD = None
GOOD = sys.argv[1]
res = {}
res["internal"] = run(ZeroDivisionError("boom"), "inspect", GOOD)
res["debug"] = run(ZeroDivisionError("boom"), "--debug", "inspect", GOOD)
res["debug-after"] = run(ZeroDivisionError("boom"), "inspect", GOOD, "--debug")
res["memory"] = run(MemoryError(), "inspect", GOOD)
res["recursion"] = run(RecursionError("maximum recursion depth exceeded"), "inspect", GOOD)
res["interrupt"] = run(KeyboardInterrupt(), "inspect", GOOD)
res["permission"] = run(PermissionError(13, "Permission denied"), "inspect", GOOD)
res["enoent"] = run(FileNotFoundError(2, "No such file or directory"), "inspect", GOOD)
res["bad-str"] = run(type("Weird", (Exception,), {"__str__": lambda self: 1 / 0})(), "inspect", GOOD)
BAD = "/nonexistent/bad"
res["verify-continues"] = run(TypeError("crafted"), "verify", BAD, GOOD)

# a library logger reporting an exception, and a failing background thread: one line each
def noisy(path, *a, **k):
    try:
        raise OSError("disk on fire")
    except OSError:
        logging.getLogger("dcp_tiered.tiers.promote.promoter").exception("background job failed")
    t = threading.Thread(target=lambda: 1 / 0, name="promoter-0")
    t.start()
    t.join()
    return real(path, *a, **k)
ckptio.open_reader = noisy
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    logging.getLogger().handlers.clear()
    code = main(["inspect", GOOD])
res["noisy"] = {"code": code, "stderr": err.getvalue()}
emit(res)
"""


def test_unexpected_errors_are_one_line_with_their_code(hostile: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "unexpected.py"
    script.write_text("import sys\nsys.argv = ['x', %r]\n" % str(hostile["good"]))
    code = script.read_text() + _UNEXPECTED
    out = run_isolated(code, timeout=TIMEOUT, memory_mb=MEMORY >> 20, env={"PYTHONWARNINGS": "ignore", common.DEBUG_ENV: ""})
    assert out.returncode == 0 and out.result, out.describe()
    r = out.result

    def line(case: str) -> str:
        lines = [ln for ln in r[case]["stderr"].splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r[case]["stderr"], (case, r[case]["stderr"])
        return lines[0]

    assert r["internal"]["code"] == common.EXIT_INTERNAL
    text = line("internal")
    assert "internal error" in text and "ZeroDivisionError: boom" in text and "--debug" in text and common.DEBUG_ENV in text
    for case in ("debug", "debug-after"):  # `dcp-tiered --debug inspect X` and `dcp-tiered inspect X --debug`
        assert r[case]["code"] == common.EXIT_INTERNAL and "Traceback" in r[case]["stderr"], r[case]
    assert r["memory"]["code"] == common.EXIT_NO_MEMORY and "MemoryError" in line("memory")
    assert r["recursion"]["code"] == common.EXIT_INTERNAL and "RecursionError" in line("recursion")
    assert r["interrupt"]["code"] == common.EXIT_INTERRUPTED and "interrupted" in line("interrupt")
    assert r["permission"]["code"] == common.EXIT_STORAGE and "Permission denied" in line("permission")
    assert r["enoent"]["code"] == common.EXIT_NOT_FOUND and "FileNotFoundError" in line("enoent")
    assert r["bad-str"]["code"] == common.EXIT_INTERNAL and "Weird" in line("bad-str")
    # verify: the internal error of the first path does not stop the second
    v = r["verify-continues"]
    assert v["code"] == common.EXIT_INTERNAL and "TypeError: crafted" in v["stderr"] and "Traceback" not in v["stderr"]
    assert f"{hostile['good']}: OK" in v["stdout"]
    # tracebacks from loggers and threads are one line each too
    noisy = r["noisy"]
    assert noisy["code"] == 0 and "Traceback" not in noisy["stderr"], noisy["stderr"]
    assert "background job failed (OSError: disk on fire)" in noisy["stderr"]
    assert "ZeroDivisionError" in noisy["stderr"] and "promoter-0" in noisy["stderr"]


def test_debug_env_shows_the_traceback(hostile: dict[str, Path]) -> None:
    plain, = cli_parallel(["inspect", hostile["str-key"]])
    debug, = cli_parallel(["inspect", hostile["str-key"]], env={common.DEBUG_ENV: "1"})
    assert "damaged or crafted" in one_line_error(plain, common.EXIT_CORRUPT)
    assert debug.returncode == common.EXIT_CORRUPT and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("dcp-tiered inspect: error: CorruptCheckpointError")


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def test_every_error_class_maps_to_a_documented_code() -> None:
    from dcp_tiered import errors
    from dcp_tiered.storage import MissingFileError

    expected = {
        errors.ConfigError: common.EXIT_USAGE, errors.CodecError: common.EXIT_USAGE,
        errors.CheckpointExistsError: common.EXIT_USAGE, errors.CheckpointNotFoundError: common.EXIT_NOT_FOUND,
        MissingFileError: common.EXIT_NOT_FOUND, errors.CorruptCheckpointError: common.EXIT_CORRUPT,
        errors.UnsafeCheckpointError: common.EXIT_CORRUPT, errors.UnsupportedFormatError: common.EXIT_CORRUPT,
        errors.StorageError: common.EXIT_STORAGE, errors.PromotionError: common.EXIT_PROBLEMS,
        errors.SaveError: common.EXIT_PROBLEMS, errors.DcpTieredError: common.EXIT_PROBLEMS,
    }
    for cls, code in expected.items():
        assert common.exit_code_for(cls("x")) == code, cls
    documented = _documented_codes()
    for cls in _all_subclasses(errors.DcpTieredError):  # also the classes other modules add later
        try:
            exc = cls("x")
        except TypeError:  # a class with a different constructor: build it without one
            exc = cls.__new__(cls)
        code = common.exit_code_for(exc)
        assert code in documented and code != common.EXIT_INTERNAL, (cls, code)
    builtins = {KeyboardInterrupt(): common.EXIT_INTERRUPTED, MemoryError(): common.EXIT_NO_MEMORY,
                FileNotFoundError(): common.EXIT_NOT_FOUND, PermissionError(): common.EXIT_STORAGE,
                IsADirectoryError(): common.EXIT_STORAGE, RecursionError(): common.EXIT_INTERNAL,
                AttributeError(): common.EXIT_INTERNAL, TypeError(): common.EXIT_INTERNAL}
    for exc, code in builtins.items():
        assert common.exit_code_for(exc) == code, exc


def _documented_codes() -> set[int]:
    """The exit codes of docs/cli.md's table; they must equal those of `--help` and the EXIT_* constants."""
    doc = (ROOT / "docs" / "cli.md").read_text()
    section = doc[doc.index("## Exit codes"):]
    section = section[: section.index("\n## ", 5)]
    in_doc = {int(m) for m in re.findall(r"^\| (\d+) \|", section, re.M)}
    in_help = {int(m) for m in re.findall(r"^  (\d+) ", common.EXIT_CODES_HELP, re.M)}
    constants = {v for k, v in vars(common).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert in_doc == in_help == constants, (in_doc, in_help, constants)
    return in_doc
