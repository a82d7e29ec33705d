"""``bench``: compare codecs on a user's own checkpoint (or a generated model): table and PNG chart."""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

from dcp_tiered.cli.args import add_storage_args, storage_options_for
from dcp_tiered.cli.output import EXIT_OK, CliError, Progress, human_bytes, print_json, table

BENCH_EXAMPLES = """\
examples:
  dcp-tiered bench ckpt/shared/step_000001000                 # your checkpoint, default codecs
  dcp-tiered bench --model small --codecs lz4,zstd:1,zstd:3 --dtypes fp32,bf16 --chart codecs.png
  dcp-tiered bench model.pt --json --no-chart"""

MODELS = {
    "tiny": {"vocab": 512, "seq_len": 64, "d_model": 128, "layers": 2, "heads": 4},
    "small": {"vocab": 4096, "seq_len": 128, "d_model": 256, "layers": 4, "heads": 4},
}


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("bench", help="codec comparison on your checkpoint or a generated model (table + PNG)",
                       description="Save the checkpoint's state with every codec (in memory, no disk I/O), load it back, "
                                   "and report stored size, ratio and save/load throughput; with stock DCP as the "
                                   "baseline. Writes a PNG chart when matplotlib is installed.",
                       epilog=BENCH_EXAMPLES)
    p.add_argument("path", nargs="?", help="checkpoint directory/URL or torch.save file (or use --model)")
    p.add_argument("--model", choices=sorted(MODELS), help="bench a generated GPT model with AdamW state instead")
    p.add_argument("--codecs", default="none,lz4,zstd:1,zstd:3", help="comma-separated codecs (default none,lz4,zstd:1,zstd:3)")
    p.add_argument("--dtypes", default="fp32", help="comma-separated storage dtypes among fp32,bf16,fp16 (default fp32)")
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

    from dcp_tiered.cli.train_model import batch_for_step, build_model

    cfg = MODELS[name]
    torch.manual_seed(0)
    model = build_model(cfg["vocab"], cfg["seq_len"], cfg["d_model"], cfg["layers"], cfg["heads"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, 4):  # a few real steps so the optimizer state is not all zeros
        tokens = batch_for_step(step, 0, 4, cfg["seq_len"], cfg["vocab"], "cpu")
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _raw_bytes(sd: Any) -> int:
    import torch

    from dcp_tiered.cli.train_model import flat_tensors

    return sum(v.numel() * v.element_size() for v in flat_tensors(sd).values() if isinstance(v, torch.Tensor))


def _run_one(sd: dict, codec: str, dtype_name: str) -> dict[str, Any]:
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dcp_tiered.cli.args import parse_dtype
    from dcp_tiered.dcp.planners import DowncastSavePlanner
    from dcp_tiered.dcp.reader import CompressedReader
    from dcp_tiered.dcp.writer import CompressedWriter

    url = f"memory://dcp-tiered-bench/{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    dtype = parse_dtype(dtype_name)
    planner = DowncastSavePlanner(dtype) if dtype is not None else None
    try:
        t0 = time.perf_counter()
        if codec == "stock":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

            dcp.save(sd, storage_writer=FsspecWriter(url), planner=planner, no_dist=True)
            save_s = time.perf_counter() - t0
            stored = sum(int(i["size"]) for i in fs.find(url, detail=True).values())
            reader: Any = FsspecReader(url)
        else:
            writer = CompressedWriter(url, codec)
            dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
            save_s = time.perf_counter() - t0
            stored = sum(int(i["size"]) for i in fs.find(url, detail=True).values())
            reader = CompressedReader(url)
        t0 = time.perf_counter()
        _load_state_dict({}, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        load_s = time.perf_counter() - t0
    finally:
        try:
            fs.rm(url, recursive=True)
        except FileNotFoundError:
            pass
    return {"stored_bytes": stored, "save_s": save_s, "load_s": load_s}


def cmd_bench(args: argparse.Namespace) -> int:
    from dcp_tiered.codecs import parse_codec
    from dcp_tiered.errors import CodecError

    if bool(args.path) == bool(args.model):
        raise CliError("give a checkpoint PATH or --model NAME (one of them)")
    codecs = []
    for c in [c.strip() for c in args.codecs.split(",") if c.strip()]:
        try:
            codecs.append(str(parse_codec(c)))
        except CodecError as exc:
            raise CliError(f"--codecs: {exc}") from exc
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("fp32", "bf16", "fp16")]
    if bad or not dtypes:
        raise CliError(f"--dtypes: unknown {bad or dtypes}; use fp32, bf16, fp16")
    if args.repeat < 1:
        raise CliError("--repeat must be at least 1")
    if args.path:
        from dcp_tiered.inspect import load_any

        sd = load_any(args.path, storage_options_for(args.path, args))
        source = args.path
    else:
        sd = _model_state(args.model)
        source = f"generated {args.model} GPT + AdamW"
    raw = _raw_bytes(sd)
    runs = ([("stock", "fp32")] if not args.no_stock else []) + [(c, d) for d in dtypes for c in codecs]
    rows = []
    with Progress(len(runs) * args.repeat, "bench") as bar:
        for codec, dtype in runs:
            best: dict[str, Any] | None = None
            for _ in range(args.repeat):
                r = _run_one(sd, codec, dtype)
                best = r if best is None else {"stored_bytes": r["stored_bytes"], "save_s": min(best["save_s"], r["save_s"]),
                                               "load_s": min(best["load_s"], r["load_s"])}
                bar.update()
            assert best is not None
            rows.append({
                "codec": codec, "dtype": dtype, "label": codec if dtype == "fp32" else f"{codec}+{dtype}", "raw_bytes": raw,
                "stored_bytes": best["stored_bytes"], "ratio": round(best["stored_bytes"] / raw, 4) if raw else None,
                "save_mb_s": round(raw / 1e6 / best["save_s"], 1) if best["save_s"] else None,
                "load_mb_s": round(raw / 1e6 / best["load_s"], 1) if best["load_s"] else None,
                "save_s": round(best["save_s"], 4), "load_s": round(best["load_s"], 4),
            })
    chart, chart_note = None, None
    if not args.no_chart:
        chart, chart_note = _chart(rows, args.chart, source)
    if args.json:
        print_json({"source": source, "raw_bytes": raw, "results": rows, "chart": chart, "chart_note": chart_note})
        return EXIT_OK
    print(f"{source}: {human_bytes(raw)} raw (in memory; no disk I/O)")
    print(table([(r["label"], human_bytes(r["stored_bytes"]), f"{r['ratio']:.3f}", r["save_mb_s"], r["load_mb_s"]) for r in rows],
                ["codec", "stored", "ratio", "save MB/s", "load MB/s"], right=(1, 2, 3, 4)))
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
    ax2.set_title("throughput (in memory)")
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
