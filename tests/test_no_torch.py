"""Without torch: ``Tier``, the options, the cost model and ``dcp-tiered cost``/``ls`` work; every
other command says "install torch first (pip install torch)" and exits 2.

The fast tests block torch in a child interpreter (``sys.modules["torch"] = None``, which makes
``import torch`` raise ``ModuleNotFoundError``); the slow one installs the project offline into a
fresh virtual environment that has no torch at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from speed import scaled

ROOT = Path(__file__).resolve().parents[1]
INSTALL_TORCH = "install torch first (pip install torch)"

#: Run a command or snippet with torch unimportable, the worktree first on the path.
BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_without_torch(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=scaled(timeout))


def cli_without_torch(*argv: str) -> subprocess.CompletedProcess:
    code = f"import runpy; sys.argv = ['dcp-tiered', *{list(argv)!r}]; runpy.run_module('dcp_tiered.cli', run_name='__main__')"
    return run_without_torch(code)


def make_checkpoint(tier_dir: Path, step: int) -> Path:
    """A real committed checkpoint of step ``step`` in ``tier_dir`` (this process has torch)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedWriter

    path = tier_dir / f"step_{step:09d}"
    dcp.save({"model": {"w": torch.arange(64.0)}, "optim": {"m": torch.ones(8)}},
             storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    return path


def test_library_names_that_need_torch_say_so_on_import():
    res = run_without_torch(
        "for name in ('CompressedWriter', 'TieredCheckpointer'):\n"
        "    try:\n        getattr(__import__('dcp_tiered'), name)\n"
        "    except ModuleNotFoundError as e:\n        print(e.name, '|', e)\n"
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("torch | dcp_tiered.") and INSTALL_TORCH in line for line in lines), lines


def test_tier_options_and_cost_import_without_torch():
    res = run_without_torch(
        "from dcp_tiered import Tier, ConfigError\n"
        "from dcp_tiered.tiers import Tier as T2, parse_duration\n"
        "from dcp_tiered.tiers.config import CheckpointerOptions\n"
        "import dcp_tiered.cost as cost\n"
        "t = Tier('durable', 's3://bucket/run', every='1h30m', keep=3)\n"
        "assert T2 is Tier and parse_duration('1h30m') == 5400\n"
        "CheckpointerOptions.from_mapping({'async_save': False})\n"
        "print(cost.monthly_cost(10 * cost.GB, cost.price_for(t.name, t.url), t.keep))\n"
        "try:\n    Tier('local', '/x', keep=0)\nexcept ConfigError as e:\n    print('refused', e)\n"
        "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    )
    assert res.returncode == 0, res.stderr
    first, refused = res.stdout.splitlines()
    assert float(first) == pytest.approx(10 * 0.023 * 3)
    assert refused.startswith("refused") and "keep" in refused


def test_cli_cost_what_if_without_torch_and_without_tiers():
    res = cli_without_torch("cost", "--stored-gb", "10", "--fp32-gb", "40", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [t["tier"] for t in out["tiers"]] == ["local", "shared", "durable"]
    assert all(t["stored_bytes"] == 10 << 30 and t["fp32_bytes"] == 40 << 30 for t in out["tiers"])


def test_cli_ls_and_cost_list_a_real_checkpoint_without_torch(tmp_path):
    make_checkpoint(tmp_path / "local", 12)
    (tmp_path / "local" / "step_000000020").mkdir()  # an uncommitted leftover
    res = cli_without_torch("ls", "--local-path", str(tmp_path / "local"), "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["step"]: r for r in json.loads(res.stdout)}
    assert rows[12]["committed"] and rows[12]["state"] == "committed" and rows[12]["size_bytes"] > 0
    assert rows[12]["complete"] is None and rows[12]["codec"] is None  # needs torch: unknown, not "incomplete"
    assert rows[20]["state"] == "uncommitted"
    assert "need torch" in res.stderr and INSTALL_TORCH in res.stderr
    table = cli_without_torch("ls", "--local-path", str(tmp_path / "local"))
    assert table.returncode == 0 and "committed" in table.stdout and "12" in table.stdout, table.stderr

    cost = cli_without_torch("cost", "--local-path", str(tmp_path / "local"), "--json")
    assert cost.returncode == 0, cost.stderr
    (local,) = json.loads(cost.stdout)["tiers"]
    assert local["source"] == "step 12" and local["stored_bytes"] == rows[12]["size_bytes"]


@pytest.mark.parametrize("argv", [["inspect", "{ckpt}"], ["verify", "{ckpt}"], ["convert", "{ckpt}", "{tmp}/out.pt"],
                                  ["gc", "--local-path", "{tier}", "--dry-run"], ["bench"]])
def test_other_commands_say_install_torch_and_exit_2(tmp_path, argv):
    ckpt = make_checkpoint(tmp_path / "local", 3)
    args = [a.format(ckpt=ckpt, tmp=tmp_path, tier=tmp_path / "local") for a in argv]
    res = cli_without_torch(*args)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert f"dcp-tiered {argv[0]}: {INSTALL_TORCH}" in res.stderr
    assert "Traceback" not in res.stderr


def test_import_dcp_tiered_stays_light():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import dcp_tiered"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=scaled(120))
    assert res.returncode == 0, res.stderr
    modules = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    heavy = {m for m in modules if m.split(".")[0] in {"torch", "numpy", "zstandard", "lz4", "xxhash", "fsspec", "yaml"}}
    assert not heavy, f"import dcp_tiered imports {sorted(heavy)}"
    ours = {m for m in modules if m.startswith("dcp_tiered")}
    assert ours <= {"dcp_tiered", "dcp_tiered.errors", "dcp_tiered.lazy"}, sorted(ours)


def test_pyproject_does_not_require_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip().lower()
             for d in project["dependencies"]]
    assert "torch" not in names and names, names


# -- a real environment without torch -------------------------------------------------------

DEPS = ("numpy", "numpy.libs", "zstandard", "lz4", "xxhash", "fsspec", "yaml", "_yaml")


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=scaled(60), check=True)
    return Path(out.stdout.strip())


def test_fresh_venv_without_torch_runs_cost_and_ls(tmp_path):
    here = _site_packages(Path(sys.executable))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=scaled(300))
    py = venv / "bin" / "python"
    site = _site_packages(py)
    for name in DEPS:  # the project's dependencies, without torch, from this environment (offline)
        if (here / name).exists():
            (site / name).symlink_to(here / name)
    # Install the project offline from a copy (an in-tree build would write build/ into the worktree).
    src = tmp_path / "src"
    shutil.copytree(ROOT / "dcp_tiered", src / "dcp_tiered", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    # The venv's own setuptools may predate bdist_wheel; the build backend comes from this environment.
    backend = tmp_path / "backend"
    backend.mkdir()
    for name in ("setuptools", "_distutils_hack", "pkg_resources"):
        if (here / name).exists():
            (backend / name).symlink_to(here / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                              str(src)], env={**env, "PYTHONPATH": str(backend)}, capture_output=True, text=True,
                             timeout=scaled(600))
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('torch'))"], env=env,
                           capture_output=True, text=True, timeout=scaled(60), cwd=tmp_path)
    assert probe.stdout.strip() == "None", probe

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "dcp-tiered"), *argv], env=env, capture_output=True, text=True,
                              timeout=scaled(300), cwd=tmp_path)

    res = cli("cost", "--stored-gb", "10")
    assert res.returncode == 0 and "durable" in res.stdout, res.stderr
    ckpt = make_checkpoint(tmp_path / "tier", 7)
    res = cli("ls", "--local-path", str(tmp_path / "tier"))
    assert res.returncode == 0, res.stderr
    assert any(line.split()[:3] == ["local", "7", "committed"] for line in res.stdout.splitlines()), res.stdout
    res = cli("inspect", str(ckpt))
    assert res.returncode == 2 and INSTALL_TORCH in res.stderr, (res.returncode, res.stderr)
    res = subprocess.run([str(py), "-c", "from dcp_tiered import Tier; print(Tier('local', '/x').keep)"], env=env,
                         capture_output=True, text=True, timeout=scaled(60), cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "2", res.stderr
