"""``bench``: compare codecs on a user's own checkpoint (or a generated model): table and PNG chart."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

from dcp_tiered.cli.args import DTYPES, add_codec_dtype_args, add_storage_args, parse_dtype, storage_options_for
from dcp_tiered.cli.output import EXIT_OK, CliError, human_bytes, print_json, progress_for, table, ticking
from dcp_tiered.cli.train_model import batch_for_step, build_model, flat_tensors
from dcp_tiered.errors import CodecError
from dcp_tiered.inspect import load_any

BENCH_EXAMPLES = """\
examples:
  dcp-tiered bench                                            # a generated model, in memory, default codecs
  dcp-tiered bench ckpt/shared/step_000001000                 # your checkpoint
  dcp-tiered bench --model small --codec lz4,zstd:1,zstd:3 --dtype fp32,bf16 --chart codecs.png
  dcp-tiered bench --path /nvme/scratch --json --no-chart     # save/load on your own disk
  dcp-tiered bench --path s3://bucket/tmp --s3-endpoint-url http://127.0.0.1:9000   # ... or bucket"""

log = logging.getLogger(__name__)

MODELS = {
    "tiny": {"vocab": 512, "seq_len": 64, "d_model": 128, "layers": 2, "heads": 4},
    "small": {"vocab": 4096, "seq_len": 128, "d_model": 256, "layers": 4, "heads": 4},
}


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("bench", help="codec comparison on your checkpoint or a generated model (table + PNG)",
                       description="Save the state with every codec, load it back, and report stored size, ratio and "
                                   "save/load throughput, with stock DCP as the baseline. In memory by default; with "
                                   "--path on your own disk or bucket (everything written there is deleted after). "
                                   "One codec at a time: memory stays at about the state plus one loaded copy (the "
                                   "peak RSS is reported). Writes a PNG chart when matplotlib is installed.",
                       epilog=BENCH_EXAMPLES)
    p.add_argument("source", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory/URL or torch.save file to bench (default: a generated model, see --model)")
    p.add_argument("--model", choices=sorted(MODELS), help="bench a generated GPT model with AdamW state (default small)")
    p.add_argument("--path", metavar="URL", help="save and load under this directory or URL (local path or s3://...) "
                                                "instead of in memory; a fresh subfolder, deleted after")
    add_codec_dtype_args(p, codec_default="none,lz4,zstd:1,zstd:3", codec_help="comma-separated codecs "
                         "(default none,lz4,zstd:1,zstd:3)", dtype_default="fp32", dtype_choices=None,
                         dtype_help="comma-separated storage dtypes among fp32,bf16,fp16 (default fp32)")
    p.add_argument("--no-stock", action="store_true", help="skip the stock DCP baseline")
    p.add_argument("--repeat", type=int, default=1, help="runs per codec; the fastest is reported")
    p.add_argument("--chart", default="dcp-tiered-bench.png", metavar="PNG", help="chart path (default dcp-tiered-bench.png)")
    p.add_argument("--no-chart", action="store_true", help="do not write a chart")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_args(p)
    p.set_defaults(func=cmd_bench)


def _model_state(name: str) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    cfg = MODELS[name]
    torch.manual_seed(0)
    model = build_model(cfg["vocab"], cfg["seq_len"], cfg["d_model"], cfg["layers"], cfg["heads"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, 4):  # a few real steps so the optimizer state is not all zeros
        tokens = batch_for_step(step, 0, 4, cfg["seq_len"], cfg["vocab"], "cpu")
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    optim.zero_grad(set_to_none=True)  # the gradients are not part of the state
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _raw_bytes(sd: Any) -> int:
    import torch

    return sum(v.numel() * v.element_size() for v in flat_tensors(sd).values() if isinstance(v, torch.Tensor))


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _run_one(sd: dict, codec: str, dtype_name: str, url: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Save ``sd`` to ``url`` with ``codec``, load it back, delete it: sizes and seconds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dcp_tiered.dcp.planners import DowncastSavePlanner
    from dcp_tiered.dcp.reader import CompressedReader
    from dcp_tiered.dcp.writer import CompressedWriter
    from dcp_tiered.storage import Storage

    dtype = parse_dtype(dtype_name)
    planner = DowncastSavePlanner(dtype) if dtype is not None else None
    where = Storage(url, opts)
    with removed_after(where):
        if codec == "stock":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

            writer: Any = FsspecWriter(url, **opts)
            reader: Any = lambda: FsspecReader(url, **opts)  # noqa: E731
        else:
            writer = CompressedWriter(url, codec=codec, storage_options=opts)
            reader = lambda: CompressedReader(url, storage_options=opts)  # noqa: E731
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
        save_s = time.perf_counter() - t0
        stored = sum(where.file_sizes().values())
        t0 = time.perf_counter()
        loaded: dict = {}
        _load_state_dict(loaded, storage_reader=reader(), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        load_s = time.perf_counter() - t0
        del loaded  # one loaded copy at a time
    return {"stored_bytes": stored, "save_s": save_s, "load_s": load_s}


def _parse_lists(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    from dcp_tiered.codecs import get_codec

    codecs = []
    for c in [c.strip() for c in args.codec.split(",") if c.strip()]:
        try:
            codecs.append(str(get_codec(c)))
        except CodecError as exc:
            raise CliError(f"--codec: {exc}") from exc
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise CliError(f"--dtype: unknown {bad or dtypes}; use fp32, bf16, fp16")
    if args.repeat < 1:
        raise CliError("--repeat must be at least 1")
    return codecs, dtypes


@contextlib.contextmanager
def removed_after(where: Any) -> Iterator[None]:
    """Delete ``where`` (a Storage) after the block. Nothing to delete is fine; while an error is in
    flight, a failed delete is logged and the original error goes on (the cleanup never masks it)."""
    def remove() -> None:
        try:
            where.remove_tree()
        except FileNotFoundError:
            pass  # nothing was written

    try:
        yield
    except BaseException:
        try:
            remove()
        except Exception as exc:  # e.g. the same broken storage: the user needs the first error
            log.warning("bench: could not delete %s after the error below", where.url, exc_info=exc)
        raise
    remove()


def _missing_top(path: str) -> str | None:
    """The topmost directory of the local ``path`` that does not exist yet (what bench will create)."""
    top = None
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        top, path = path, os.path.dirname(path)
    return top


def _remove_created(path: str | None, top: str | None) -> None:
    """Remove the empty directories from ``path`` up to ``top`` that bench created (nothing else)."""
    if top is None:
        return
    d = os.path.abspath(path)
    while d == top or d.startswith(top + os.sep):
        try:
            os.rmdir(d)
        except OSError:
            return
        d = os.path.dirname(d)


def _bench_root(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Where the runs write: a fresh folder under ``--path``, else in memory."""
    if not args.path:
        return f"memory://dcp-tiered-bench/{uuid.uuid4().hex}", {}
    from dcp_tiered.storage import Storage

    opts = storage_options_for(args.path, args)
    where = Storage(args.path, opts)
    if where.is_local and os.path.lexists(where.root) and not os.path.isdir(where.root):
        raise CliError(f"--path {args.path}: not a directory; give a directory (or s3://bucket/prefix) where bench "
                       "may write a temporary folder")
    where.check_reachable()
    return f"{args.path.rstrip('/')}/dcp-tiered-bench-{uuid.uuid4().hex[:12]}", opts


def _runs(sd: dict, raw: int, runs: list, root: str, opts: dict, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (codec, dtype) run, one at a time (what one run wrote and loaded is freed before the next)."""
    import gc

    from dcp_tiered.storage import Storage

    rows = []
    with removed_after(Storage(root, opts)):
        with progress_for(args)(raw * len(runs) * args.repeat, "bench", unit="B") as bar, ticking(bar):
            for codec, dtype in runs:
                best: dict[str, Any] | None = None
                for i in range(args.repeat):
                    bar.set_postfix_str(f"{codec}+{dtype}", refresh=False)
                    r = _run_one(sd, codec, dtype, f"{root}/{len(rows)}-{i}", opts)
                    gc.collect()
                    best = r if best is None else {**r, "save_s": min(best["save_s"], r["save_s"]),
                                                   "load_s": min(best["load_s"], r["load_s"])}
                    bar.update(raw)
                assert best is not None
                rows.append({
                    "codec": codec, "dtype": dtype, "label": codec if dtype == "fp32" else f"{codec}+{dtype}", "raw_bytes": raw,
                    "stored_bytes": best["stored_bytes"], "ratio": round(best["stored_bytes"] / raw, 4) if raw else None,
                    "save_mb_s": round(raw / 1e6 / best["save_s"], 1) if best["save_s"] else None,
                    "load_mb_s": round(raw / 1e6 / best["load_s"], 1) if best["load_s"] else None,
                    "save_s": round(best["save_s"], 4), "load_s": round(best["load_s"], 4),
                })
    return rows


def cmd_bench(args: argparse.Namespace) -> int:
    if args.source and args.model:
        raise CliError("give a CHECKPOINT to bench or --model NAME, not both")
    codecs, dtypes = _parse_lists(args)
    root, opts = _bench_root(args)
    with progress_for(args)(1, "bench: preparing the state") as bar, ticking(bar):
        if args.source:
            sd = load_any(args.source, storage_options_for(args.source, args))
            source = args.source
        else:
            model = args.model or "small"
            sd = _model_state(model)
            source = f"generated {model} GPT + AdamW"
        bar.update()
    raw = _raw_bytes(sd)
    rss_state = peak_rss_bytes()
    runs = ([("stock", "fp32")] if not args.no_stock else []) + [(c, d) for d in dtypes for c in codecs]
    created = _missing_top(args.path) if args.path and "://" not in args.path else None
    try:
        rows = _runs(sd, raw, runs, root, opts, args)
    finally:
        _remove_created(args.path, created)  # a --path that did not exist is not left behind
    where = args.path or "memory"
    memory = {"peak_rss_bytes": peak_rss_bytes(), "peak_rss_before_runs_bytes": rss_state}
    chart, chart_note = None, None
    if not args.no_chart:
        chart, chart_note = _chart(rows, args.chart, source)
    if args.json:
        print_json({"source": source, "raw_bytes": raw, "where": where, "results": rows, "chart": chart,
                    "chart_note": chart_note, **memory})
        return EXIT_OK
    print(f"{source}: {human_bytes(raw)} raw; saved to and loaded from {where if args.path else 'memory (no disk I/O)'}")
    print(table([(r["label"], human_bytes(r["stored_bytes"]), f"{r['ratio']:.3f}", r["save_mb_s"], r["load_mb_s"]) for r in rows],
                ["codec", "stored", "ratio", "save MB/s", "load MB/s"], right=(1, 2, 3, 4)))
    print(f"peak RSS {human_bytes(memory['peak_rss_bytes'])} ({human_bytes(rss_state)} with the state loaded, before the runs)")
    if chart:
        print(f"chart: {chart}")
    elif chart_note:
        print(chart_note)
    return EXIT_OK


def _chart(rows: list[dict], path: str, source: str) -> tuple[str | None, str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "no chart: matplotlib is not installed (pip install matplotlib); the table above has the numbers"
    labels = [r["label"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(labels, [r["ratio"] or 0 for r in rows], color="tab:blue")
    ax1.set_ylabel("stored / raw (lower is better)")
    ax1.set_title("compression ratio")
    x = range(len(rows))
    ax2.bar([i - 0.2 for i in x], [r["save_mb_s"] or 0 for r in rows], width=0.4, label="save")
    ax2.bar([i + 0.2 for i in x], [r["load_mb_s"] or 0 for r in rows], width=0.4, label="load")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels)
    ax2.set_ylabel("MB/s of raw state (higher is better)")
    ax2.set_title("throughput")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"dcp-tiered bench: {source}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        plt.close(fig)
        raise CliError(f"cannot write chart {path}: {exc}; pass --chart PATH or --no-chart") from exc
    plt.close(fig)
    return path, None


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m dcp_tiered.cli bench")
