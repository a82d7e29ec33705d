"""Projection to a 1 TB checkpoint on 4,000 ranks, from codec speeds measured here.

Run:  .venv/bin/python -m benchmarks.bench_projection [--ckpt-tb 1] [--ranks 4000] ...

Writes the section "projection" of docs/benchmarks.md.  Only the codec figures (stored/raw
and single-core compress MB/s on real model + Adam state) are measured, in this run; every
bandwidth, core count and price is an assumption given on the command line and printed
in the table, so the projection can be redone for another cluster in one command.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.common import (
    adam_state,
    chart_or_note,
    machine_line,
    md_table,
    minilm_weights,
    save_results,
    timed,
    write_section,
)
from dcp_tiered.codecs import FrameCodec, filter_for, frame_bounds
from dcp_tiered.cost import TierUsage, estimate, format_usd

FRAME = 4 << 20


@dataclass(frozen=True)
class CodecSpeed:
    """What one codec does to a training state on one core: stored/raw and MB/s of raw bytes."""

    codec: str
    ratio: float
    compress_mbs: float


def training_state() -> tuple[np.ndarray, np.ndarray]:
    """Real MiniLM fp32 weights with their Adam moments (1:2, as fp32 master weights + AdamW keep
    them), and the weights alone, as bytes."""
    w = minilm_weights()

    def flat(sd: dict[str, torch.Tensor]) -> np.ndarray:
        return torch.cat([t.reshape(-1) for t in sd.values()]).view(torch.uint8).numpy().copy()

    return flat({**w, **adam_state(w)}), flat(w)


def measure(raw: np.ndarray, codec: str, repeat: int) -> CodecSpeed:
    """Compress ``raw`` in the writer's 4 MiB frames on one thread; best of ``repeat``."""
    fc = FrameCodec(codec, filter_for(True, 4), 4)
    bounds = frame_bounds(raw.nbytes, FRAME, 4)
    stored = 0
    best = float("inf")
    with ThreadPoolExecutor(1) as pool:
        for _ in range(repeat):
            frames: list = []
            best = min(best, timed(lambda: frames.extend(pool.map(lambda b: fc.encode(raw[b[0] : b[1]]), bounds))))
            stored = sum(f.stored_len for f in frames)
    return CodecSpeed(codec, stored / raw.nbytes, raw.nbytes / best / 1e6)


def project(args: argparse.Namespace, speeds: dict[str, CodecSpeed]) -> tuple[list[dict], dict]:
    """Per tier: bytes per rank, compress and write seconds, save time and monthly cost."""
    total = args.ckpt_tb * 1e12
    per_rank = total / args.ranks
    nodes = args.ranks / args.ranks_per_node
    tiers = [
        # name, codec, aggregate write bandwidth (bytes/s), ranks sharing it, keep, url for the cost model
        ("local", args.local_codec, args.local_gbps * 1e9, args.ranks_per_node, args.local_keep, "/nvme"),
        ("shared", args.shared_codec, args.shared_gbps * 1e9, args.ranks, args.shared_keep, "/lustre"),
        ("durable", args.durable_codec, args.object_gbps * 1e9, args.ranks, args.durable_keep, "s3://bucket"),
    ]
    rows = []
    usages = []
    for name, codec, bw, sharing, keep, url in tiers:
        sp = speeds[codec]
        stored = per_rank * sp.ratio
        compress_s = per_rank / (sp.compress_mbs * 1e6 * args.cores_per_rank) if sp.codec != "none" else 0.0
        write_s = stored * sharing / bw
        plain_write_s = per_rank * sharing / bw
        rows.append({
            "tier": name, "codec": codec, "keep": keep, "bytes_per_rank": per_rank, "stored_per_rank": stored,
            "compress_s": compress_s, "write_s": write_s, "save_s": max(compress_s, write_s),
            "save_s_serial": compress_s + write_s, "plain_write_s": plain_write_s,
            "stored_total": stored * args.ranks, "bandwidth_gbs": bw / 1e9, "sharing_ranks": sharing,
        })
        # the cost model's "fp32" size is the uncompressed state: the state is fp32 here
        usages.append(TierUsage(name, int(stored * args.ranks), int(total), keep, url))
    cost = estimate(usages)
    for r, t in zip(rows, cost.tiers):
        r["monthly_usd"] = t.monthly_usd
        r["plain_monthly_usd"] = t.fp32_monthly_usd
    blocked_s = per_rank / (args.d2h_gbps * 1e9)
    summary = {"total_bytes": total, "per_rank_bytes": per_rank, "nodes": nodes, "staging_copy_s": blocked_s,
               "monthly_usd": cost.monthly_usd, "plain_monthly_usd": cost.fp32_monthly_usd}
    return rows, summary


def render(args: argparse.Namespace, cmd: str, speeds: dict[str, CodecSpeed], rows: list[dict], summary: dict) -> str:
    mb = 1e6
    wr = summary["weights_only_ratio"]
    measured = md_table(
        ["codec (byte-grouped, 4 MiB frames)", "stored/raw, weights + Adam (used below)", "compress MB/s per core",
         "stored/raw, weights alone"],
        [[s.codec, f"{s.ratio:.3f}", f"{s.compress_mbs:.0f}", f"{wr[s.codec]:.3f}"] for s in speeds.values()],
    )
    assumed = md_table(
        ["assumption", "value"],
        [
            ["checkpoint (model + optimizer state, fp32)", f"{args.ckpt_tb:g} TB"],
            ["ranks / ranks per node", f"{args.ranks} / {args.ranks_per_node} ({summary['nodes']:.0f} nodes)"],
            ["CPU cores per rank free for checkpoint compression", args.cores_per_rank],
            ["node-local NVMe write, per node", f"{args.local_gbps:g} GB/s"],
            ["shared parallel filesystem write, aggregate", f"{args.shared_gbps:g} GB/s"],
            ["object storage upload, aggregate", f"{args.object_gbps:g} GB/s"],
            ["device-to-host staging copy per rank (async save)", f"{args.d2h_gbps:g} GB/s"],
            ["prices per GB-month", "local $0.08, shared $0.14, object $0.023 (`dcp_tiered.cost` defaults)"],
        ],
    )
    table = md_table(
        ["tier", "codec", "keep", "raw MB per rank", "stored MB per rank", "compress s", "write s",
         "save s (pipelined .. serial)", "uncompressed write s", "stored TB per checkpoint", "$ / month", "$ / month uncompressed"],
        [[r["tier"], r["codec"], r["keep"], f"{r['bytes_per_rank'] / mb:.0f}", f"{r['stored_per_rank'] / mb:.0f}",
          f"{r['compress_s']:.2f}", f"{r['write_s']:.2f}", f"{r['save_s']:.2f} .. {r['save_s_serial']:.2f}",
          f"{r['plain_write_s']:.2f}", f"{r['stored_total'] / 1e12:.2f}", format_usd(r["monthly_usd"]),
          format_usd(r["plain_monthly_usd"])] for r in rows],
    )

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["plain_write_s"] for r in rows], 0.4, label="uncompressed write")
        ax.bar(x + 0.2, [r["save_s"] for r in rows], 0.4, label="compressed (pipelined)")
        ax.set_xticks(x, [f"{r['tier']} ({r['codec']})" for r in rows])
        ax.set_ylabel("seconds per save (projection)")
        ax.set_title(f"PROJECTION: {args.ckpt_tb:g} TB on {args.ranks} ranks")
        ax.legend()
        return fig

    chart = chart_or_note("projection", draw)
    local, shared, durable = rows
    return f"""## Projection: a {args.ckpt_tb:g} TB checkpoint on {args.ranks:,} ranks (a projection, not a measurement)

`{cmd}` — {machine_line()}.

**This is a projection.** Measured here, in this run: stored/raw and one core's compress
speed of each codec on real MiniLM fp32 weights with their Adam moments (1:2 by bytes, as
an fp32 master-weight + AdamW state holds them). Everything else is an assumption listed
below; change them on the command line for another cluster. Save time per tier is the larger of
compress time (bytes per rank over cores per rank) and write time (bytes of all ranks sharing the
link over its bandwidth) when frames are compressed while earlier ones are written, and their sum
at worst.

{measured}

The weights + Adam ratio owes part of its saving to Adam moments of embedding rows that received no
gradient in the few real steps taken (as rare tokens do); a state whose moments are all dense compresses
more like the weights alone, which would scale the stored bytes, write times and costs below by up to
{max(wr[c] / speeds[c].ratio for c in speeds):.2f}x.

{assumed}

{table}

{chart}

Each rank holds {summary['per_rank_bytes'] / mb:.0f} MB. With an async save the training loop waits for
the staging copy only, about {summary['staging_copy_s'] * 1000:.0f} ms per rank at the assumed copy speed;
the local write takes {local['save_s']:.2f} s in the background and the shared and durable tiers are
promoted from it later, off the training path. The local tier is bound by
{"compression" if local['compress_s'] > local['write_s'] else "the node's NVMe"}, the shared tier by
{"compression" if shared['compress_s'] > shared['write_s'] else "the filesystem's aggregate bandwidth"}, the
durable tier by {"compression" if durable['compress_s'] > durable['write_s'] else "the object store's aggregate bandwidth"}.
Keeping {local['keep']}/{shared['keep']}/{durable['keep']} checkpoints costs about
{format_usd(summary['monthly_usd'])} a month stored compressed against {format_usd(summary['plain_monthly_usd'])}
uncompressed. What this leaves out: the `.metadata` of 4,000 ranks (written once by the coordinator),
per-request latency and throttling of the object store, and the CPU that data loading takes from
the cores assumed free.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt-tb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=4000)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--cores-per-rank", type=int, default=4)
    ap.add_argument("--local-gbps", type=float, default=5.0, help="node NVMe write GB/s (per node)")
    ap.add_argument("--shared-gbps", type=float, default=500.0, help="shared filesystem aggregate write GB/s")
    ap.add_argument("--object-gbps", type=float, default=200.0, help="object storage aggregate upload GB/s")
    ap.add_argument("--d2h-gbps", type=float, default=20.0, help="device-to-host copy GB/s per rank")
    ap.add_argument("--local-codec", default="lz4")
    ap.add_argument("--shared-codec", default="zstd:1")
    ap.add_argument("--durable-codec", default="zstd:3")
    ap.add_argument("--local-keep", type=int, default=2)
    ap.add_argument("--shared-keep", type=int, default=3)
    ap.add_argument("--durable-keep", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="measure on a 32 MiB slice (smoke run)")
    args = ap.parse_args()
    raw, weights = training_state()
    if args.quick:
        raw, weights = raw[: 32 << 20], weights[: 32 << 20]
    codecs = dict.fromkeys([args.local_codec, args.shared_codec, args.durable_codec])
    speeds = {c: measure(raw, c, args.repeat) for c in codecs}
    weights_only = {c: measure(weights, c, 1) for c in codecs}
    rows, summary = project(args, speeds)
    summary["weights_only_ratio"] = {c: s.ratio for c, s in weights_only.items()}
    cmd = "python -m benchmarks.bench_projection" + (" --quick" if args.quick else "")
    save_results("projection", {"speeds": [s.__dict__ for s in speeds.values()], "rows": rows, "summary": summary,
                                "assumptions": vars(args)})
    write_section("projection", render(args, cmd, speeds, rows, summary))
    for r in rows:
        print(r["tier"], r["codec"], f"save {r['save_s']:.2f}s", format_usd(r["monthly_usd"]))


if __name__ == "__main__":
    main()
