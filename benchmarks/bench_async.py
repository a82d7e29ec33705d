"""How long does a checkpoint save block the training loop? Sync vs async, stock DCP vs ours.

Run:  .venv/bin/python -m benchmarks.bench_async [--sizes-mib 64,512] [--repeat 5] [--dir /var/tmp]
      (``--mib N`` measures one size only; ``--quick`` is a small smoke run)

For each state size (real MiniLM fp32 weights and Adam moments, repeated under distinct keys
and cloned, so every key has its own memory) it measures, on local disk:

* one memory copy of the state, the floor of any async save: ``clone()`` into fresh tensors
  and ``copy_()`` into preallocated (already touched) tensors;
* synchronous ``dcp.save`` with ``CompressedWriter`` (defaults) and stock ``FileSystemWriter``
  (``thread_count=2``);
* ``dcp.async_save`` (thread mode) with both writers, with torch's default staging (fresh
  staging tensors every call: ``FileSystemWriter`` stages itself as a ``BlockingAsyncStager``,
  other writers get a new ``DefaultStager`` per call) and with one
  ``DefaultStager(StagingOptions(False, False, False, False))`` reused across calls (its
  staging storages are cached and refilled with ``copy_``; pinned memory needs an
  accelerator, so not pinned here), and with that stager staging on its own thread
  (``use_async_staging=True``: the call returns at once, the state may be mutated only
  once ``staging_completion`` is done);
* ``TieredCheckpointer.maybe_save`` with one local tier (codec defaults), async and sync.

Writes the section "async" of docs/benchmarks.md, a chart, and bench_results/async.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks.common import (
    adam_state,
    chart_or_note,
    machine_line,
    md_table,
    minilm_weights,
    nbytes,
    repeated_state,
    save_results,
    timed,
    write_section,
)
from dcp_tiered import CompressedWriter, Tier, TieredCheckpointer
from dcp_tiered.tiers.save.staging import KeepStaged

# One sample of a mode: seconds blocked in the call, seconds until the state may be mutated
# again, seconds until the checkpoint is durable (committed and fsynced).
Sample = tuple[float, float, float]


def sized_state(mib: int, base: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """``{"model": ..., "optim": ...}`` of exactly ``mib`` MiB: the real tensors repeated under
    distinct keys, each cloned into its own memory."""
    sd: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
    for key, t in repeated_state(dict(base), mib << 20, clone=True).items():
        sd["optim" if key.endswith((".exp_avg", ".exp_avg_sq")) else "model"][key] = t
    return sd


def leaves(sd: dict[str, dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [t for part in sd.values() for t in part.values()]


def state_bytes(sd: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(nbytes(part) for part in sd.values())


def measure(repeat: int, one: Callable[[int], Sample], after: Callable[[], None] = lambda: None) -> list[Sample]:
    """Run ``one(i)`` once as a warm-up (allocates buffers, starts pools) and then ``repeat`` times;
    ``after`` (cleanup) runs outside the timed region after each call."""
    out = []
    for i in range(repeat + 1):
        s = one(i)
        after()
        if i:
            out.append(s)
    return out


def copy_modes(sd: dict, repeat: int) -> dict[str, list[Sample]]:
    src = leaves(sd)

    def clone(_: int) -> Sample:
        t = timed(lambda: [x.clone() for x in src])  # the clones are freed before the next call
        return t, t, t

    dst = [torch.empty_like(x).fill_(0) for x in src]

    def copy_(_: int) -> Sample:
        def run() -> None:
            for d, s in zip(dst, src):
                d.copy_(s)

        t = timed(run)
        return t, t, t

    return {"memory copy: clone() into fresh tensors": measure(repeat, clone),
            "memory copy: copy_() into preallocated": measure(repeat, copy_)}


def writer_for(kind: str, path: Path) -> Any:
    if kind == "CompressedWriter":
        return CompressedWriter(str(path))
    return dcp.FileSystemWriter(str(path), thread_count=2)


def save_modes(sd: dict, repeat: int, root: Path) -> dict[str, list[Sample]]:
    """dcp.save and dcp.async_save (thread mode) with both writers and three staging choices."""
    results: dict[str, list[Sample]] = {}
    clean = lambda: shutil.rmtree(root, ignore_errors=True)
    for kind in ("CompressedWriter", "FileSystemWriter"):
        def sync(i: int, kind: str = kind) -> Sample:
            w = writer_for(kind, root / f"s{i}")
            t = timed(lambda: dcp.save(sd, storage_writer=w, no_dist=True))
            return t, t, t

        results[f"dcp.save, {kind}"] = measure(repeat, sync, clean)

        for label, options in (("default staging (fresh copy per call)", None),
                               ("reused stager", StagingOptions(False, False, False, False)),
                               ("reused stager, staging thread", StagingOptions(False, False, True, False))):
            stager = DefaultStager(options) if options is not None else None

            def run_async(i: int, kind: str = kind, stager: DefaultStager | None = stager) -> Sample:
                w = writer_for(kind, root / f"a{i}")
                t0 = time.perf_counter()
                res = dcp.async_save(sd, storage_writer=w, async_stager=stager, no_dist=True)
                blocked = time.perf_counter() - t0
                if isinstance(res, Future):
                    staged = blocked
                    res.result()
                else:  # AsyncSaveResponse: staging runs on the stager's thread
                    res.staging_completion.result()
                    staged = time.perf_counter() - t0
                    res.upload_completion.result()
                return blocked, staged, time.perf_counter() - t0

            results[f"dcp.async_save, {kind}, {label}"] = measure(repeat, run_async, clean)
            if stager is not None:
                stager.close()
    return results


def tiered_modes(sd: dict, repeat: int, root: Path) -> dict[str, list[Sample]]:
    """TieredCheckpointer.maybe_save with one local tier of default codec, async and sync."""
    results: dict[str, list[Sample]] = {}
    for async_save in (True, False):
        shutil.rmtree(root, ignore_errors=True)
        ck = TieredCheckpointer([Tier("local", str(root / "local"))], async_save=async_save)

        def one(i: int, ck: TieredCheckpointer = ck) -> Sample:
            t0 = time.perf_counter()
            ck.maybe_save(i + 1, sd)
            blocked = time.perf_counter() - t0
            ck.wait()  # the previous save is finished before the next timed call
            return blocked, blocked, time.perf_counter() - t0

        results[f"TieredCheckpointer(async_save={async_save}).maybe_save"] = measure(repeat, one)
        ck.close()
    shutil.rmtree(root, ignore_errors=True)
    return results


def staging_only(sd: dict, repeat: int) -> dict[str, float]:
    """``stager.stage(sd)`` alone (no save): the staging part of the blocked time."""
    fresh = measure(repeat, lambda _: (timed(lambda: DefaultStager(StagingOptions(False, False, False, False)).stage(sd)),) * 3)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    reused = measure(repeat, lambda _: (timed(lambda: stager.stage(sd)),) * 3)
    stager.close()
    kept = KeepStaged(StagingOptions(False, False, False, False))  # TieredCheckpointer's own
    ours = measure(repeat, lambda _: (timed(lambda: kept.stage(sd)),) * 3)
    kept.close()
    return {"new stager": statistics.median(s[0] for s in fresh), "reused stager": statistics.median(s[0] for s in reused),
            "KeepStaged": statistics.median(s[0] for s in ours)}


def run_size(mib: int, base: list[tuple[str, torch.Tensor]], repeat: int, root: Path) -> dict[str, Any]:
    sd = sized_state(mib, base)
    samples = {**copy_modes(sd, repeat), **save_modes(sd, repeat, root / "dcp"), **tiered_modes(sd, repeat, root / "tiered")}
    rows = []
    for mode, ss in samples.items():
        rows.append({"mode": mode, "blocked_s": statistics.median(s[0] for s in ss),
                     "mutable_s": statistics.median(s[1] for s in ss), "durable_s": statistics.median(s[2] for s in ss),
                     "samples": ss})
    return {"mib": mib, "bytes": state_bytes(sd), "tensors": len(leaves(sd)), "rows": rows,
            "staging_s": staging_only(sd, repeat)}


def ms(s: float) -> str:
    return f"{s * 1000:.0f}" if s >= 0.01 else f"{s * 1000:.1f}"


def table(res: dict[str, Any]) -> str:
    by = {r["mode"]: r for r in res["rows"]}
    floor = by["memory copy: copy_() into preallocated"]["blocked_s"]
    clone = by["memory copy: clone() into fresh tensors"]["blocked_s"]
    rows = []
    for r in res["rows"]:
        saves = not r["mode"].startswith("memory copy")
        rows.append([r["mode"], ms(r["blocked_s"]), ms(r["mutable_s"]) if saves else "", ms(r["durable_s"]) if saves else "",
                     f"{r['blocked_s'] / floor:.2f}x", f"{r['blocked_s'] / clone:.2f}x",
                     f"{res['bytes'] / r['durable_s'] / 2**20:.0f}" if saves else f"({res['bytes'] / r['blocked_s'] / 2**20:.0f} copied)"])
    return md_table(["mode", "blocked ms (median)", "state mutable after ms", "durable after ms",
                     "blocked / copy_()", "blocked / clone()", "MiB/s until durable"], rows)


def draw(results: list[dict[str, Any]]) -> Callable:
    def fig(plt: Any) -> Any:
        f, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 7), squeeze=False)
        for ax, res in zip(axes[0], results):
            rows = [r for r in res["rows"] if not r["mode"].startswith("memory copy")]
            by = {r["mode"]: r for r in res["rows"]}
            labels = [r["mode"].replace("dcp.async_save, ", "async_save, ").replace(".maybe_save", "")
                      .replace(" (fresh copy per call)", "").replace("CompressedWriter", "Compressed")
                      .replace("FileSystemWriter", "FileSystem").replace("stager, staging thread", "stager + thread") for r in rows]
            y = range(len(rows))
            ax.barh(y, [r["durable_s"] * 1000 for r in rows], color="#dddddd", label="until durable")
            ax.barh(y, [r["blocked_s"] * 1000 for r in rows], color="#3366aa", label="blocked in the call")
            for name, style in (("copy_() into preallocated", "-"), ("clone() into fresh tensors", "--")):
                ax.axvline(by[f"memory copy: {name}"]["blocked_s"] * 1000, color="#cc3333", ls=style, label=f"one {name}")
            ax.set_yticks(list(y), labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("ms (median)")
            ax.set_title(f"{res['mib']} MiB state")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2)
        return f

    return fig


def reading(results: list[dict[str, Any]]) -> str:
    """The honest reading of the largest size (and the fixed costs at the smallest), from the numbers."""
    def modes(res: dict[str, Any]) -> dict[str, float]:
        return {r["mode"]: r["blocked_s"] for r in res["rows"]}

    big = modes(results[-1])
    copy_, clone = big["memory copy: copy_() into preallocated"], big["memory copy: clone() into fresh tensors"]
    ours, stage = big["TieredCheckpointer(async_save=True).maybe_save"], results[-1]["staging_s"]["KeepStaged"]
    text = (
        f"At {results[-1]['mib']} MiB, `TieredCheckpointer(async_save=True)` blocks for {ms(ours)} ms "
        f"({ours / copy_:.1f}x one `copy_()` of the state, {ms(copy_)} ms; target < 2x), against "
        f"{ms(big['TieredCheckpointer(async_save=False).maybe_save'])} ms for a synchronous save. Stock `async_save` "
        f"blocks for {ms(big['dcp.async_save, FileSystemWriter, default staging (fresh copy per call)'])} ms with its "
        f"default staging (fresh staging tensors every call; one `clone()` takes {ms(clone)} ms) and "
        f"{ms(big['dcp.async_save, FileSystemWriter, reused stager'])} ms with a reused stager. In thread mode the "
        f"blocked time is the staging copy (the checkpointer's `KeepStaged.stage` alone: {ms(stage)} ms) plus the rest "
        f"({ms(max(0.0, ours - stage))} ms for TieredCheckpointer: deciding the due tiers, building the writer, "
        f"starting the save thread and getting the GIL back from it); planning, encoding and writing run on that "
        f"thread, which afterwards competes with the training loop for the GIL and the 2 cores (not measured here). "
        f"With a staging thread the call returns at once, but the state may be mutated only once staging is done."
    )
    if len(results) > 1:
        small = modes(results[0])
        s_ours, s_stage = small["TieredCheckpointer(async_save=True).maybe_save"], results[0]["staging_s"]["KeepStaged"]
        text += (
            f" At {results[0]['mib']} MiB the same call blocks for {ms(s_ours)} ms "
            f"({s_ours / small['memory copy: copy_() into preallocated']:.1f}x `copy_()`), of which "
            f"{ms(max(0.0, s_ours - s_stage))} ms is not the copy: the fixed cost per save."
        )
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="64,512", help="comma-separated state sizes in MiB")
    ap.add_argument("--mib", type=int, default=None, help="measure this one size only (overrides --sizes-mib)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per mode after one warm-up call")
    ap.add_argument("--dir", default="/var/tmp", help="local-disk folder for the checkpoints")
    ap.add_argument("--quick", action="store_true", help="smoke run: 32 MiB, 2 repeats")
    args = ap.parse_args()
    sizes = [args.mib] if args.mib else [int(s) for s in args.sizes_mib.split(",")]
    repeat = args.repeat
    if args.quick:
        sizes, repeat = [32], 2

    w = minilm_weights()
    base = list(w.items()) + list(adam_state(w).items())
    t_all = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for mib in sizes:
            results.append(run_size(mib, base, repeat, Path(d)))
            print(f"{mib} MiB done after {time.perf_counter() - t_all:.0f} s", flush=True)

    cmd = ".venv/bin/python -m benchmarks.bench_async" + (" --quick" if args.quick else
          (f" --mib {args.mib}" if args.mib else f" --sizes-mib {args.sizes_mib}") + f" --repeat {repeat}")
    parts = []
    for res in results:
        st = res["staging_s"]
        parts.append(f"### {res['mib']} MiB ({res['bytes'] / 1e6:.0f} MB, {res['tensors']} tensors)\n\n{table(res)}\n\n"
                     f"`stager.stage(state)` alone: {ms(st['new stager'])} ms with a new stager, "
                     f"{ms(st['reused stager'])} ms with a reused one; TieredCheckpointer's `KeepStaged` (one "
                     f"`copy_` per tensor into the buffers of the last save): {ms(st['KeepStaged'])} ms.")
    text = reading(results)
    write_section(
        "async",
        f"## How long does a save block the training loop?\n\n`{cmd}` — {machine_line()}.\n\n"
        f"State: real MiniLM fp32 weights and Adam moments repeated under distinct keys (each key its own memory) "
        f"up to the size, as `{{'model': ..., 'optim': ...}}`, saved to local disk (`{args.dir}`) with fsync, single "
        f"process (`no_dist=True`). Each mode runs one warm-up call (discarded: it allocates staging buffers and "
        f"pools) and then {repeat} timed calls; the median is shown. *Blocked* = time inside the call; *mutable "
        f"after* = until the state may be changed again (differs from blocked only with a staging thread); "
        f"*durable after* = until the save's future completes (committed, fsynced). Between calls the previous save "
        f"is finished outside the timed region (`ck.wait()` for TieredCheckpointer) and, for `dcp.save`/`dcp.async_save`, "
        f"its files removed (TieredCheckpointer's own retention removes its older steps). "
        f"`async_save` runs in thread mode (`AsyncCheckpointerType.THREAD`, the default; process mode spawns a "
        f"checkpoint process and needs an initialized process group, so it is not measured here); 'default staging' passes no stager: `FileSystemWriter` is itself "
        f"a `BlockingAsyncStager` and copies into fresh CPU tensors every call (its `cache_staged_state_dict=True` "
        f"pins memory and fails without an accelerator), for `CompressedWriter` torch builds a new "
        f"`DefaultStager(StagingOptions(False, False, False, False))` per call; 'reused stager' passes one such "
        f"stager to every call (cached storages refilled with `copy_`, not pinned: pinning needs an accelerator), "
        f"'staging thread' the same with `use_async_staging=True`. TieredCheckpointer uses one local tier with "
        f"the default codec (zstd) and keeps its own reused stager.\n\n"
        + "\n\n".join(parts)
        + "\n\n" + chart_or_note("async", draw(results)) + "\n\n" + text,
    )
    save_results("async", [{k: v for k, v in r.items()} for r in results])
    for p in parts:
        print(p, "\n")
    print(f"total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
