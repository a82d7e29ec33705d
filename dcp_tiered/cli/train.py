"""``train`` and ``demo``: a real training loop wired to :class:`TieredCheckpointer`.

The model is a small GPT-style transformer (token and position embeddings, pre-norm
blocks of causal self-attention and an MLP, a linear head) trained with AdamW on
synthetic token sequences (``x[t] = (a + b*t) mod vocab`` with random ``a``, ``b`` per
sequence, so the loss really falls).  The batch of step ``s`` depends only on the seed
and ``s``, so a resumed run sees the same data the crashed one would have.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from dcp_tiered.cli.train_model import batch_for_step, build_model, check_resume, fp32_bytes
from dcp_tiered.cli.args import DEFAULT_CODECS, add_tier_encoding_args, add_tier_location_args, tiers_from_args
from dcp_tiered.cli.output import EXIT_OK, EXIT_PROBLEMS, CliError, human_bytes, print_json, table
from dcp_tiered.cli.tier_cmds import cmd_ls
from dcp_tiered.cost import format_usd, monthly_cost, parse_prices, price_for
from dcp_tiered.errors import PromotionError
from dcp_tiered.inspect import verify
from dcp_tiered.metrics import PrometheusExporter
from dcp_tiered.metrics_totals import TierTotals

TRAIN_EXAMPLES = """\
examples:
  # three tiers, the flags of the usual wrapper scripts
  dcp-tiered train --steps 2000 --local-path /nvme/ckpt --shared-path /fsx/run/ckpt \\
      --durable-path s3://bucket/run --checkpoint-interval-min 5 --shared-interval-min 30 \\
      --durable-interval-min 60 --max-durable-hourly 1 --async-checkpoint --optimizer-every 5 --resume
  # short run, seconds-level intervals, Prometheus on :9108, JSON-lines event log
  dcp-tiered train --steps 300 --local-path ckpt/local --durable-path ckpt/durable \\
      --checkpoint-interval-s 2 --durable-interval-s 10 --metrics-port 9108 --event-log events.jsonl
  # tiers from YAML, S3-compatible endpoint (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)
  dcp-tiered train --tiers tiers.yaml --s3-endpoint-url http://127.0.0.1:9000 --resume"""

DEMO_EXAMPLES = """\
examples:
  dcp-tiered demo                       # into ./dcp-tiered-demo, about a minute on 2 CPU cores
  dcp-tiered demo --dir /tmp/demo --json"""


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("train", help="train a small GPT on synthetic tokens with tiered checkpoints",
                       description="A real training loop (small GPT-style transformer, AdamW, synthetic tokens; CPU by "
                                   "default, CUDA when present) wired to TieredCheckpointer. Resumes from the newest good "
                                   "checkpoint with --resume and prints a per-tier summary at the end.",
                       epilog=TRAIN_EXAMPLES)
    add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="one-minute demo: 3 tiers, async saves, a crash, a bit-exact resume, the summary",
                       description="Run `train` with a preset that finishes in about a minute on 2 CPU cores, into a "
                                   "local folder: three tiers, async saves, a simulated crash (SIGKILL), a resume that "
                                   "proves the restored state equals the saved state bit for bit, and the summary.",
                       epilog=DEMO_EXAMPLES)
    p.add_argument("--dir", default="dcp-tiered-demo", help="folder for the demo's tiers (default ./dcp-tiered-demo)")
    p.add_argument("--quick", action="store_true", help="a smaller preset (a few seconds of training; for tests)")
    p.add_argument("--json", action="store_true", help="print the final result as JSON")
    p.set_defaults(func=cmd_demo)


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=200, help="last step to train to (default 200)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    g.add_argument("--vocab", type=int, default=512, help="vocabulary size of the synthetic tokens (default 512)")
    g.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    g.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    g.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    g.add_argument("--seed", type=int, default=0, help="seed of the model init and the batches (default 0)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when present")
    g.add_argument("--torch-threads", type=int, default=1, metavar="N",
                   help="intra-op CPU threads for training (default 1: fastest for this small model, and it leaves "
                        "the other cores to checkpoint compression)")
    g.add_argument("--log-every", type=int, default=50, metavar="N", help="print the loss every N steps")
    add_tier_location_args(p)
    add_tier_encoding_args(p)
    c = p.add_argument_group("checkpointing")
    c.add_argument("--async-checkpoint", action="store_true", default=None, help="stage and write saves in the background")
    c.add_argument("--optimizer-every", type=int, metavar="N", help="optimizer state in every Nth save only (default 1)")
    c.add_argument("--background-threads", type=int, metavar="N",
                   help="encode threads of async saves and promotion re-encodes (default: cores less --torch-threads)")
    c.add_argument("--nice", type=int, metavar="N", help="CPU priority offset of background work, 0-19 (default 10)")
    c.add_argument("--resume", action="store_true", help="resume from the newest good checkpoint (fastest tier first)")
    c.add_argument("--event-log", metavar="PATH", help="append save/promotion/restore reports as JSON lines")
    c.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port (0: any free port)")
    c.add_argument("--metrics-addr", default="0.0.0.0",
                   help="address --metrics-port binds (default 0.0.0.0: every interface, so that a Prometheus on "
                        "another host can scrape it; 127.0.0.1 keeps it to this machine)")
    c.add_argument("--metrics-linger-s", type=float, default=0.0, metavar="S",
                   help="keep serving metrics S seconds after training (for a last scrape)")
    c.add_argument("--price", action="append", default=[], metavar="TIER=USD", help="storage price per GB-month (see `cost`)")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.add_argument("--summary-json", metavar="PATH", help="also write the summary as JSON to PATH")
    d = p.add_argument_group("testing hooks (used by `demo`)")
    d.add_argument("--crash-at-step", type=int, metavar="N", help="SIGKILL this process right after step N")
    d.add_argument("--dump-states", metavar="DIR", help="torch.save the exact state at every save into DIR")
    d.add_argument("--check-resume", metavar="DIR", help="after --resume, compare the restored state with DIR's dump, bit for bit")


# -- train ----------------------------------------------------------------------------------


def _say(msg: str) -> None:
    print(msg, flush=True)


def _checkpointer_options(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    """The YAML file's checkpointer options with the flags over them, read by the one options
    model (:class:`~dcp_tiered.tiers.config.CheckpointerOptions`)."""
    from dcp_tiered.tiers.config import CheckpointerOptions

    flags = {"async_save": args.async_checkpoint, "optimizer_every": args.optimizer_every,
             "event_log": args.event_log or None, "background_threads": args.background_threads, "nice": args.nice}
    given = {k: v for k, v in flags.items() if v is not None}
    CheckpointerOptions.from_mapping(given, where="command line")  # a bad flag is not the file's fault
    return CheckpointerOptions.from_mapping({**options, **given}, where=args.tiers)


def _device(args: argparse.Namespace) -> Any:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available; use --device cpu")
    if args.torch_threads < 1:
        raise CliError("--torch-threads must be at least 1")
    return torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")


def _start_metrics(args: argparse.Namespace, tiers: list, prices: dict, ckpt: Any) -> Any:
    if args.metrics_port is None:
        return None
    exporter = PrometheusExporter(tiers, prices=prices).attach(ckpt)
    port = exporter.start_http_server(args.metrics_port, args.metrics_addr)
    host = "127.0.0.1" if args.metrics_addr in ("0.0.0.0", "") else args.metrics_addr
    _say(f"metrics: http://{host}:{port}/metrics")
    return exporter


def _resume(args: argparse.Namespace, ckpt: Any, totals: Any, model: Any, optim: Any,
            state: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """``--resume``: the step to start after (0 for a fresh run) and the ``--check-resume`` result."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    start, resume_check = 0, None
    if args.resume:
        t0 = time.perf_counter()
        restored = ckpt.restore(state)
        if restored is None:
            _say("resume: no checkpoint found; starting from step 0")
        else:
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = restored
            tier = next((e.get("tier") for e in reversed(totals.restores) if e.get("event") == "restore"), "?")
            _say(f"resume: restored step {restored} from tier {tier} in {time.perf_counter() - t0:.2f} s"
                 + (f" ({ckpt.restore_failures} candidate(s) skipped)" if ckpt.restore_failures else ""))
            if args.check_resume:
                resume_check = check_resume(args.check_resume, restored, model, optim)
    return start, resume_check


def _train_steps(args: argparse.Namespace, ckpt: Any, model: Any, optim: Any, state: dict[str, Any], device: Any,
                 start: int) -> float:
    """Train from ``start + 1`` to ``--steps``, offering every step to the checkpointer; the last loss."""
    import torch

    if start >= args.steps:
        _say(f"nothing to do: already at step {start} of {args.steps}")
    loss_val = math.nan
    for step in range(start + 1, args.steps + 1):
        tokens = batch_for_step(step, args.seed, args.batch_size, args.seq_len, args.vocab, device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        loss_val = float(loss.detach())
        report = ckpt.maybe_save(step, state)
        if report is not None and args.dump_states:
            os.makedirs(args.dump_states, exist_ok=True)
            torch.save(state, os.path.join(args.dump_states, f"step_{step:09d}.pt"))
        if report is not None:
            _say(f"step {step}: save to {'+'.join(report.tiers)} ({'async, ' if report.async_save else ''}"
                 f"{'with' if report.optimizer else 'without'} optimizer), blocked {report.blocked_s * 1000:.0f} ms")
        if args.log_every and step % args.log_every == 0:
            _say(f"step {step}: loss {loss_val:.4f}")
        if args.crash_at_step is not None and step >= args.crash_at_step:
            _say(f"step {step}: simulating a crash (SIGKILL)")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return loss_val


def _report(args: argparse.Namespace, summary: dict[str, Any], exporter: Any) -> None:
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    if args.json:
        print_json(summary)
    else:
        _print_summary(summary)
    if exporter is not None:
        if args.metrics_linger_s > 0:
            _say(f"metrics: serving for {args.metrics_linger_s:g} s more")
            time.sleep(args.metrics_linger_s)
        exporter.close()


def cmd_train(args: argparse.Namespace) -> int:
    # configuration errors first, before the model is built
    if args.steps < 1:
        raise CliError("--steps must be at least 1")
    try:
        prices = parse_prices(args.price)
    except ValueError as exc:
        raise CliError(f"--price: {exc}") from exc
    tiers, file_options = tiers_from_args(args)
    options = _checkpointer_options(args, file_options)
    device = _device(args)

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dcp_tiered.tiers.checkpointer import TieredCheckpointer

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    model = build_model(args.vocab, args.seq_len, args.d_model, args.layers, args.heads).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    msd, osd = get_state_dict(model, optim)  # creates the optimizer state, so a restore has tensors to fill
    state = {"model": msd, "optim": osd}
    n_params = sum(p.numel() for p in model.parameters())
    fp32 = fp32_bytes(state)

    ckpt = TieredCheckpointer(tiers, options=options)
    totals = TierTotals(tiers)
    ckpt.events.hooks.append(totals.observe)
    exporter = _start_metrics(args, tiers, prices, ckpt)
    _say(f"model: {n_params:,} parameters ({human_bytes(fp32)} with AdamW state) on {device}; tiers: "
         + ", ".join(f"{t.name}={t.url} ({t.codec}, keep {t.keep})" for t in tiers))
    try:
        start, resume_check = _resume(args, ckpt, totals, model, optim, state)
        if resume_check is not None and not resume_check["equal"]:
            ckpt.close()
            return EXIT_PROBLEMS
        if start == 0:
            _refuse_existing(ckpt, args.resume)
        t_train = time.perf_counter()
        loss_val = _train_steps(args, ckpt, model, optim, state, device, start)
        train_s = time.perf_counter() - t_train
        close_error = None
        try:
            # saves the last step if the schedule did not, then waits for it and every promotion
            ckpt.close(final_step=args.steps, state_dict=state) if args.steps > start else ckpt.close()
        except PromotionError as exc:  # the summary still shows what did get saved
            close_error = exc
        wall_s = time.perf_counter() - t_train
    except BaseException:
        try:
            ckpt.close()
        except BaseException:
            pass
        if exporter is not None:
            exporter.close()
        raise
    summary = _summary(args, tiers, totals, ckpt, start, loss_val, train_s, wall_s, fp32, prices, resume_check)
    summary["error"] = str(close_error) if close_error is not None else None
    _report(args, summary, exporter)
    if close_error is not None:
        raise close_error
    return EXIT_OK


def _refuse_existing(ckpt: Any, resume: bool) -> None:
    """Starting from step 0 over committed checkpoints would collide with them: say what to do."""
    existing = [i for i in ckpt.list() if i.committed]
    if existing:
        newest = max(existing, key=lambda i: i.step)
        why = ("--resume found no checkpoint holding model and optimizer state" if resume
               else "pass --resume to continue from them")
        raise CliError(f"tier {newest.tier} already holds committed checkpoints (newest: step {newest.step}); {why}, "
                       "or point the tiers at new paths", 2)


def _summary(args: argparse.Namespace, tiers: list, totals: Any, ckpt: Any, start: int, loss: float, train_s: float,
             wall_s: float, fp32: int, prices: dict, resume_check: dict | None) -> dict[str, Any]:
    rows = []
    for t in tiers:
        tt = totals.tiers[t.name]
        price = price_for(t.name, t.url, prices)
        rows.append({
            **tt.as_dict(),
            "url": t.url, "codec": t.codec, "keep": t.keep,
            "blocked_pct": round(100 * tt.blocked_s / train_s, 3) if train_s else 0.0,
            # the part of blocked_s spent waiting for the previous save still being written (the rest: staging)
            "waited_s": round(sum(r.waited_s for r in ckpt.reports if r.ok and r.tiers and r.tiers[0] == t.name), 3),
            "price_gb_month": price,
            "monthly_usd": totals.monthly_cost(t.name, t.keep, t.url, prices),
            "fp32_monthly_usd": monthly_cost(fp32, price, t.keep),
        })
    return {
        "steps": args.steps, "start_step": start, "trained_steps": max(0, args.steps - start),
        "final_loss": None if math.isnan(loss) else round(loss, 5), "train_s": round(train_s, 3), "wall_s": round(wall_s, 3),
        "fp32_state_bytes": fp32, "tiers": rows, "save_failures": totals.save_failures,
        "skipped_saves": ckpt.skipped, "restore_failures": ckpt.restore_failures, "resume_check": resume_check,
        "monthly_usd": sum(r["monthly_usd"] for r in rows), "fp32_monthly_usd": sum(r["fp32_monthly_usd"] for r in rows),
    }


def _print_summary(s: dict[str, Any]) -> None:
    loss = f", final loss {s['final_loss']:.4f}" if s["final_loss"] is not None else ""
    print(f"\ntrained steps {s['start_step'] + 1}..{s['steps']} in {s['train_s']:.1f} s{loss}")
    body = [(r["tier"], f"{r['saves']} ({r['written']}w+{r['promoted']}p)", human_bytes(r["raw_bytes"]),
             human_bytes(r["stored_bytes"]), f"{r['ratio']:.3f}", f"{r['blocked_s']:.2f}", f"{r['blocked_pct']:.1f}%",
             f"{r['keep']}", format_usd(r["monthly_usd"])) for r in s["tiers"]]
    print(table(body, ["tier", "saves", "raw", "stored", "ratio", "blocked s", "blocked %", "keep", "$/month"],
                right=(2, 3, 4, 5, 6, 7, 8)))
    for r in s["tiers"]:
        if r["blocked_s"] and r["waited_s"] > r["blocked_s"] / 2:  # say why, or it reads as async not working
            print(f"{r['tier']}: {r['waited_s']:.2f} of the {r['blocked_s']:.2f} s blocked went to waiting for the "
                  "previous save, still being written (saves are due faster than they finish: a longer interval "
                  "or on_busy='skip' avoids it)")
    saving = s["fp32_monthly_usd"] - s["monthly_usd"]
    print(f"estimated storage {format_usd(s['monthly_usd'])}/month for the retained checkpoints; uncompressed fp32 "
          f"{format_usd(s['fp32_monthly_usd'])}/month (saving {format_usd(saving)})", flush=True)


# -- demo -----------------------------------------------------------------------------------

DEMO_MARKER = ".dcp-tiered-demo"
PRESETS = {
    # ~1 minute on 2 CPU cores: two processes of ~20 s of training each plus start-up
    "full": {"steps": 900, "crash": 480, "local_s": 1.5, "shared_s": 4.0, "durable_s": 8.0, "log_every": 100},
    "quick": {"steps": 100, "crash": 60, "local_s": 0.2, "shared_s": 0.5, "durable_s": 1.0, "log_every": 0,
              "d_model": 64, "vocab": 256, "seq_len": 32},
}


def _prepare_demo_dir(path: str) -> None:
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CliError(f"--dir {path} is a file; choose a folder for the demo")
        if os.listdir(path) and not os.path.exists(os.path.join(path, DEMO_MARKER)):
            raise CliError(f"--dir {path} is not empty and not a previous demo; choose an empty or new folder")
        shutil.rmtree(path)
    os.makedirs(path)
    with open(os.path.join(path, DEMO_MARKER), "w") as f:
        f.write("created by `dcp-tiered demo`; the demo deletes and recreates this folder\n")


def _verify_newest(ls_args: argparse.Namespace, out: Any) -> list[dict]:
    """Verify the newest committed checkpoint of every tier, printing one line per tier to ``out``."""
    from dcp_tiered.tiers.catalog import list_tiers

    tiers, _ = tiers_from_args(ls_args)
    verified = []
    for t in tiers:
        newest = next((i for i in list_tiers([t]) if i.committed), None)
        if newest is None:
            verified.append({"tier": t.name, "step": None, "ok": False, "problems": ["no committed checkpoint"]})
            continue
        result = verify(newest.url)
        problems = result.problems
        verified.append({"tier": t.name, "step": newest.step, "ok": not problems, "problems": problems, **result.counts()})
        print(f"{t.name:<8} step {newest.step}: {'OK' if not problems else 'PROBLEMS: ' + '; '.join(problems)} "
              f"({result.counts_text(human_bytes)})", file=out, flush=True)
    return verified


def cmd_demo(args: argparse.Namespace) -> int:
    preset = PRESETS["quick" if args.quick else "full"]
    root = os.path.abspath(args.dir)
    _prepare_demo_dir(root)
    t0 = time.perf_counter()
    common = [
        sys.executable, "-m", "dcp_tiered.cli", "train", "--steps", str(preset["steps"]),
        "--local-path", os.path.join(root, "local"), "--shared-path", os.path.join(root, "shared"),
        "--durable-path", os.path.join(root, "durable"),
        "--checkpoint-interval-s", str(preset["local_s"]), "--shared-interval-s", str(preset["shared_s"]),
        "--durable-interval-s", str(preset["durable_s"]),
        "--keep-local", "2", "--keep-shared", "3", "--keep-durable", "4",
        "--async-checkpoint", "--optimizer-every", "2", "--event-log", os.path.join(root, "events.jsonl"),
        "--log-every", str(preset["log_every"]), "--device", "cpu",
    ]
    for k in ("d_model", "vocab", "seq_len"):
        if k in preset:
            common += [f"--{k.replace('_', '-')}", str(preset[k])]
    out = sys.stdout if not args.json else sys.stderr
    states = os.path.join(root, "saved-states")

    def banner(text: str) -> None:
        print(f"\n=== {text}", file=out, flush=True)

    codecs = ", ".join(f"{name} {codec}" for name, codec in DEFAULT_CODECS.items())
    banner(f"1/4 train with 3 tiers ({codecs}), async saves; crash at step {preset['crash']}")
    p1 = subprocess.run(common + ["--crash-at-step", str(preset["crash"]), "--dump-states", states], stdout=out, stderr=sys.stderr)
    if p1.returncode != -signal.SIGKILL:
        raise CliError(f"demo: the first run should have been killed at step {preset['crash']}, it exited with {p1.returncode}", EXIT_PROBLEMS)
    print(f"(process killed by SIGKILL, exit status {p1.returncode})", file=out, flush=True)

    banner("2/4 what the crash left behind (`dcp-tiered ls`)")
    ls_args = argparse.Namespace(tiers=None, local_path=os.path.join(root, "local"), shared_path=os.path.join(root, "shared"),
                                 durable_path=os.path.join(root, "durable"), s3_endpoint_url=None, json=False)
    stdout = sys.stdout
    sys.stdout = out
    try:
        cmd_ls(ls_args)
    finally:
        sys.stdout = stdout

    banner("3/4 resume in a new process from the newest good checkpoint, check it bit for bit, train to the end")
    summary_path = os.path.join(root, "summary.json")
    p2 = subprocess.run(common + ["--resume", "--check-resume", states, "--summary-json", summary_path], stdout=out, stderr=sys.stderr)
    if p2.returncode != 0:
        raise CliError(f"demo: the resumed run failed (exit {p2.returncode}); see its output above", EXIT_PROBLEMS)
    with open(summary_path) as f:
        summary = json.load(f)

    banner("4/4 verify the newest checkpoint of every tier")
    verified = _verify_newest(ls_args, out)
    check = summary.get("resume_check") or {}
    ok = bool(check.get("equal")) and all(v["ok"] for v in verified)
    result = {"ok": ok, "dir": root, "seconds": round(time.perf_counter() - t0, 1), "crash_step": preset["crash"],
              "resumed_from": check.get("step"), "resume_bit_exact": bool(check.get("equal")), "verified": verified,
              "summary": summary}
    if args.json:
        print_json(result)
    else:
        print(f"\ndemo {'OK' if ok else 'FAILED'} in {result['seconds']:.0f} s: crashed at step {preset['crash']}, resumed "
              f"from step {check.get('step')} bit for bit, trained to step {summary['steps']}; tiers under {root}", flush=True)
        tier_flags = f"--local-path {root}/local --shared-path {root}/shared --durable-path {root}/durable"
        print(f"next: dcp-tiered ls {tier_flags}\n      dcp-tiered cost {tier_flags}\n"
              f"      dcp-tiered inspect {root}/durable/step_{verified[-1]['step'] or 0:09d}", flush=True)
    return EXIT_OK if ok else EXIT_PROBLEMS
