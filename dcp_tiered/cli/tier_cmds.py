"""``ls``, ``promote``, ``gc`` and ``cost``: commands over a set of tiers."""

from __future__ import annotations

import argparse
from typing import Any

from dcp_tiered.checks import INSTALL_TORCH, torch_available
from dcp_tiered.cli.args import DEFAULT_KEEP, TIER_NAMES, add_tier_location_args, tiers_from_args
from dcp_tiered.cli.output import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PROBLEMS,
    CliError,
    human_bytes,
    print_json,
    progress_for,
    table,
    ticking,
)
from dcp_tiered.cost import TierUsage, estimate, format_usd, parse_prices, usage_from_listing
from dcp_tiered.errors import ConfigError, DcpTieredError
from dcp_tiered.inspect import fp32_bytes, open_reader
from dcp_tiered.tiers.events import EventLog

LS_EXAMPLES = """\
examples:
  dcp-tiered ls --tiers tiers.yaml
  dcp-tiered ls --local-path /nvme/ckpt --durable-path s3://bucket/run --s3-endpoint-url http://127.0.0.1:9000
  dcp-tiered ls --tiers tiers.yaml --json | jq '.[] | select(.committed | not)'
  dcp-tiered ls --local-path '/nvme/ckpt/{node}' --replicas 2 --ranks-per-node 8   # replica state per step"""

PROMOTE_EXAMPLES = """\
examples:
  dcp-tiered promote --tiers tiers.yaml --dry-run     # list promotions a crash left unfinished
  dcp-tiered promote --tiers tiers.yaml               # run them now"""

GC_EXAMPLES = """\
examples:
  dcp-tiered gc --tiers tiers.yaml --dry-run          # what retention would delete
  dcp-tiered gc --local-path /nvme/ckpt --keep-local 1"""

COST_EXAMPLES = """\
examples:
  dcp-tiered cost --tiers tiers.yaml                          # from the newest checkpoint of each tier
  dcp-tiered cost --tiers tiers.yaml --price durable=0.0125   # S3 Standard-IA
  dcp-tiered cost --durable-path s3://b/run --keep-durable 48 --stored-gb 12 --fp32-gb 40   # what-if"""


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("ls", help="every checkpoint per tier: committed, step, size, optimizer, promotion state",
                       description="List every checkpoint directory of every tier, committed or not, with its step, "
                                   "size, codec, whether it holds optimizer state, and its promotion state.",
                       epilog=LS_EXAMPLES)
    add_tier_location_args(p, keep=False)  # ls lists; retention (keep) is not its business
    g = p.add_argument_group("peer replication (the --tiers file's replicas/replication_jump, or these for --local-path)")
    g.add_argument("--replicas", type=int, metavar="F", help="copies of each rank's files on the node-local --local-path "
                   "tier (its Tier replicas): show each step's replica state")
    g.add_argument("--replication-jump", type=int, metavar="J", help="rank distance between the copies (default: the "
                   "ranks per node)")
    g.add_argument("--ranks-per-node", type=int, metavar="N", help="ranks per node of a {node} tier (default: "
                   "LOCAL_WORLD_SIZE, else the world size over the node directories)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("promote", help="run pending promotions now (--dry-run to list them)",
                       description="Run the promotions recorded in the tiers (.promote-*.json intents left by a crash "
                                   "or a process that exited early) and wait for them.",
                       epilog=PROMOTE_EXAMPLES)
    add_tier_location_args(p)
    p.add_argument("--dry-run", action="store_true", help="list pending promotions, change nothing")
    p.add_argument("--event-log", metavar="PATH", help="append promotion reports as JSON lines")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_promote)

    p = sub.add_parser("gc", help="apply retention now (--dry-run to list what would go)",
                       description="Apply each tier's retention (keep N committed checkpoints; never the newest, never "
                                   "one with a pending promotion) and remove uncommitted leftovers older than the "
                                   "newest committed checkpoint.",
                       epilog=GC_EXAMPLES)
    add_tier_location_args(p)
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    p.add_argument("--leftover-grace", default=None, metavar="DURATION",
                   help="remove an uncommitted leftover only once untouched this long (another process may be "
                        "writing it); 0 removes leftovers at once (default: the --tiers file's leftover_grace, "
                        "else 1h)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("cost", help="monthly storage cost per tier and the saving vs uncompressed fp32",
                       description="Estimate monthly storage cost per tier: stored bytes of a checkpoint x price per "
                                   "GB-month x checkpoints kept. Default prices (USD/GB-month): object storage 0.023, "
                                   "shared filesystem 0.14, node-local SSD 0.08.",
                       epilog=COST_EXAMPLES)
    add_tier_location_args(p)
    p.add_argument("--price", action="append", default=[], metavar="TIER=USD",
                   help="price per GB-month for a tier name or kind (object, shared, local); repeatable")
    p.add_argument("--stored-gb", type=float, help="what-if: stored GB per checkpoint (instead of measuring)")
    p.add_argument("--fp32-gb", type=float, help="what-if: GB of the same state uncompressed in fp32")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_cost)


def _check_reachable(tiers: list, must_exist: bool = False) -> None:
    """Fail now, with the storage error, when a tier's bucket or endpoint cannot be reached, and
    (``must_exist``) when no tier's local directory exists at all: a mistyped path, not an empty tier.

    (``list_tiers`` logs unreachable tiers and goes on, which would print an empty listing.)
    """
    from dcp_tiered.tiers.topology import tier_storage

    missing = []
    for t in tiers:
        store = tier_storage(t)
        store.check_reachable()
        if store.is_local and not t.node_local and not store.exists():
            missing.append(f"tier {t.name!r}: {store.url}")
    if must_exist and tiers and len(missing) == len(tiers):
        raise CliError(f"{'; '.join(missing)} does not exist (a mistyped path?)", EXIT_NOT_FOUND)


def _catalog(tiers: list) -> list:
    from dcp_tiered.tiers.catalog import list_tiers

    _check_reachable(tiers)
    return list_tiers(tiers)


def _ls_tiers(args: argparse.Namespace) -> tuple[list, dict]:
    """``tiers_from_args`` with ``--replicas``/``--replication-jump`` applied to the ``--local-path`` tier,
    and the checkpointer options of the ``--tiers`` file."""
    from dataclasses import replace

    tiers, options = tiers_from_args(args)
    given = {k: v for k in ("replicas", "replication_jump") if (v := getattr(args, k, None)) is not None}
    per_node = getattr(args, "ranks_per_node", None)  # (the demo's ls passes none of these)
    if per_node is not None and per_node < 1:
        raise CliError(f"--ranks-per-node must be a positive integer, got {per_node}")
    if not given:
        return tiers, options
    if args.tiers or not args.local_path:
        raise CliError("--replicas/--replication-jump apply to --local-path; a --tiers file gives them per tier")
    try:
        return [replace(t, **given) if t.name == "local" else t for t in tiers], options
    except ConfigError as exc:
        raise CliError(str(exc)) from exc


def _ls_listing(tiers: list, full: bool, per_node: int | None) -> tuple[list, dict]:
    """Every checkpoint of every tier; a replicated tier's over all its node directories, with each
    step's replica state (``(tier, step) -> state``; needs torch)."""
    from dcp_tiered.cli.replicas import replicated_infos, step_state, tier_dirs
    from dcp_tiered.tiers.catalog import list_tier

    infos, states = [], {}
    for index, t in enumerate(tiers):
        if not (full and t.replicas > 1):
            infos += list_tier(t, index, with_metadata=full)
            continue
        infos += replicated_infos(t, index, full)
        dirs = tier_dirs(t)
        for i in infos:
            if i.tier == t.name and i.step >= 0:
                states[(t.name, i.step)] = step_state(t, i.step, dirs, per_node)
    return infos, states


def cmd_ls(args: argparse.Namespace) -> int:
    import sys

    from dcp_tiered.cli.replicas import summary
    from dcp_tiered.tiers.layout import FRAGMENT_SUFFIX

    tiers, options = _ls_tiers(args)
    optim_keys = tuple(_file_options(args, options).optimizer_keys)  # what retention (gc) takes for optimizer state
    full = torch_available()  # without torch: names and sizes only (.metadata is a torch pickle)
    _check_reachable(tiers, must_exist=True)
    infos, states = _ls_listing(tiers, full, getattr(args, "ranks_per_node", None))
    committed_on: dict[int, list[str]] = {}
    for i in infos:
        if i.committed:
            committed_on.setdefault(i.step, []).append(i.tier)
    incoming = {(t, i.step): i.tier for i in infos for t in i.pending_promotions}  # target -> its source
    rows = []
    for i in infos:
        optim = None if i.keys is None else i.has_prefix(optim_keys)
        source = incoming.get((i.tier, i.step))
        if i.pending_promotions:
            promo = "pending -> " + ",".join(i.pending_promotions)
        elif not i.committed and (source or any(f.endswith(FRAGMENT_SUFFIX) for f in i.files)):
            promo = f"incoming{f' from {source}' if source else ''} (promotion not committed yet)"
        elif not i.committed:
            promo = ""
        else:
            others = [t for t in committed_on.get(i.step, []) if t != i.tier]
            promo = ("also on " + ",".join(others)) if others else ""
        state = ("UNUSABLE" if i.unusable else "committed" if i.committed and (i.complete or not full)
                 else "INCOMPLETE" if i.committed else "uncommitted")
        rows.append({"tier": i.tier, "step": i.step, "name": i.name, "url": i.url, "committed": i.committed,
                     "complete": i.complete if full else None, "state": state, "size_bytes": i.size_bytes, "codec": i.codec,
                     "optimizer": optim, "pending_promotions": list(i.pending_promotions), "promotion": promo,
                     "problem": i.problem, "unusable": i.unusable})
        if (i.tier, i.step) in states:  # only tiers with replicas > 1
            rows[-1]["replication"] = states[(i.tier, i.step)]
    if not full:
        print(f"note: torch is not installed: committed means .metadata is present; keys, codec, optimizer, "
              f"completeness and replica state need torch ({INSTALL_TORCH})", file=sys.stderr)
    if args.json:
        print_json(rows)
        return EXIT_OK
    if not rows:
        print("no checkpoints in " + ", ".join(f"{t.name} ({t.url})" for t in tiers))
        return EXIT_OK
    body = [(r["tier"], r["step"], r["state"], human_bytes(r["size_bytes"]), r["codec"] or "-",
             "-" if r["optimizer"] is None else "yes" if r["optimizer"] else "no", r["promotion"] or "-",
             r["problem"] or "") for r in rows]
    headers = ["tier", "step", "state", "size", "codec", "optim", "promotion", "problem"]
    if states:  # a column of its own, only when a tier replicates
        body = [(*b[:7], summary(r["replication"]) if "replication" in r else "", b[7]) for b, r in zip(body, rows)]
        headers.insert(7, "replicas")
    print(table(body, headers, right=(1, 3)))
    return EXIT_OK


def cmd_promote(args: argparse.Namespace) -> int:
    from dcp_tiered.tiers.promote.promoter import Promoter

    tiers, options = tiers_from_args(args)
    keys = _file_options(args, options).optimizer_keys
    infos = [i for i in _catalog(tiers) if i.pending_promotions]
    pending = [{"tier": i.tier, "step": i.step, "name": i.name, "targets": list(i.pending_promotions)} for i in infos]
    if args.dry_run:
        if args.json:
            print_json({"dry_run": True, "pending": pending})
        elif pending:
            print(table([(p["tier"], p["step"], ",".join(p["targets"])) for p in pending], ["source", "step", "to"], right=(1,)))
            print(f"{len(pending)} pending promotion(s); run without --dry-run to do them")
        else:
            print("no pending promotions")
        return EXIT_OK
    events = EventLog(args.event_log)
    failed = None
    total = sum((i.size_bytes or 0) * len(i.pending_promotions) for i in infos)
    with progress_for(args)(total, "promote", unit="B") as bar, ticking(bar):
        def on_report(r: Any) -> None:
            events.emit({"event": "promotion", **r.as_dict()})
            if r.kind == "data":
                bar.update(max(0, min(r.bytes, total - bar.n)))

        promoter = Promoter(tiers, on_report=on_report, optimizer_keys=keys, retain_sources=False)
        try:
            n = promoter.resume()
            try:
                promoter.wait()
            except Exception as exc:  # PromotionError: reported below, exit 1
                failed = exc
        finally:
            promoter.close(wait=False)
    reports = [r.as_dict() for r in promoter.reports]
    bad = [r for r in reports if not r["ok"]]
    if failed is None and bad:  # resumed work is only reported by the promoter: here every failure counts
        failed = "; ".join(f"step {r['step']} {r['source']}->{r['target']} ({r['kind']}): {r['error']}" for r in bad[:8])
    if args.json:
        print_json({"dry_run": False, "resumed": n, "reports": reports, "ok": failed is None,
                    "error": str(failed) if failed else None})
    else:
        if reports:
            print(table([(r["step"], r["source"], r["target"], r["kind"], human_bytes(r["bytes"]), f"{r['seconds']:.2f}",
                          "ok" if r["ok"] else f"FAILED: {r['error']}") for r in reports],
                        ["step", "from", "to", "what", "bytes", "seconds", "result"], right=(0, 4, 5)))
        print(f"{n} pending promotion(s) run" + (f"; failures: {failed}" if failed else ""))
    return EXIT_OK if failed is None else EXIT_PROBLEMS


def _file_options(args: argparse.Namespace, options: dict) -> Any:
    """The checkpointer options of the ``--tiers`` YAML (defaults without one): ``gc`` and ``promote``
    apply retention as the checkpointer does (its ``optimizer_keys``: keep the newest checkpoint holding them)."""
    from dcp_tiered.tiers.config import CheckpointerOptions

    return CheckpointerOptions.from_mapping(options, where=getattr(args, "tiers", None))


def cmd_gc(args: argparse.Namespace) -> int:
    from dcp_tiered.tiers.config import parse_grace
    from dcp_tiered.tiers.retention import Retention

    tiers, options = tiers_from_args(args)
    _check_reachable(tiers, must_exist=True)
    opts = _file_options(args, options)  # what the checkpointer built from the same YAML uses
    grace = parse_grace(args.leftover_grace, "--leftover-grace") if args.leftover_grace is not None else opts.leftover_grace
    retention = Retention(tiers, leftover_grace=grace, optimizer_keys=opts.optimizer_keys)
    plans = [retention.plan(t) for t in tiers]  # what the promoter's retention job would delete now
    if args.dry_run:
        rows = [row for plan in plans for row in plan.as_rows()]
    else:
        rows = [row for plan in plans for row in plan.as_rows(_apply_with_progress(retention, plan, args))]
    if args.json:
        print_json({"dry_run": args.dry_run, "deleted" if not args.dry_run else "would_delete": rows})
        return EXIT_OK
    verb = "would delete" if args.dry_run else "deleted"
    if rows:
        print(table([(p["tier"], p["step"], "committed" if p["committed"] else "uncommitted", human_bytes(p["size_bytes"]))
                     for p in rows], ["tier", "step", "state", "size"], right=(1, 3)))
    total = sum(p["size_bytes"] for p in rows)
    print(f"{verb} {len(rows)} checkpoint(s), {human_bytes(total)}")
    return EXIT_OK


def _apply_with_progress(retention: Any, plan: Any, args: argparse.Namespace) -> list:
    """``retention.apply(plan)`` one victim at a time, with a progress bar in bytes deleted."""
    from dataclasses import replace

    deleted = retention.apply(replace(plan, victims=[])) if plan.unusable else []  # logs what it leaves alone
    with progress_for(args)(sum(i.size_bytes or 0 for i in plan.victims), f"gc {plan.tier.name}", unit="B") as bar:
        for info in plan.victims:
            deleted += retention.apply(replace(plan, victims=[info], unusable=[]))
            bar.update(info.size_bytes or 0)
    return deleted


def _fp32_sizes(tiers: list, infos: list) -> dict[tuple[str, int], int]:
    """The fp32 uncompressed size of each checkpoint retention keeps, read from its metadata (where readable)."""
    out = {}
    for i in infos:
        t = next(t for t in tiers if t.name == i.tier)
        try:
            out[(t.name, i.step)] = fp32_bytes(open_reader(i.url, t.storage_options, verify=False).read_metadata())
        except DcpTieredError:
            pass  # priced at its stored size
    return out


def _retained(args: argparse.Namespace, tiers: list, options: dict, full: bool) -> tuple[list, set]:
    """What retention keeps of each tier now and which of those lack the optimizer state (a set of
    ``(tier, step)``).  With ``optimizer_every`` > 1 in the ``--tiers`` file: ``gc``'s plan (committed
    minus its victims) and its ``optimizer_keys``; else every committed checkpoint, one whose keys are
    a strict subset of another's counting as partial (the tiers were written with ``optimizer_every``).
    Without torch (``full`` False) nothing tells them apart: every committed checkpoint, all full."""
    from dcp_tiered.tiers.catalog import list_tiers

    if not full:
        return [i for i in list_tiers(tiers, with_metadata=False) if i.committed], set()
    opts = _file_options(args, options)
    keys = tuple(opts.optimizer_keys) if opts.optimizer_every > 1 else ()
    victims: set = set()
    if keys:
        from dcp_tiered.tiers.retention import Retention

        retention = Retention(tiers, leftover_grace=opts.leftover_grace, optimizer_keys=keys)
        victims = {(p.tier.name, i.step) for p in (retention.plan(t) for t in tiers) for i in p.victims}
    infos = [i for i in list_tiers(tiers) if i.committed and i.complete and (i.tier, i.step) not in victims]
    if keys:
        return infos, {(i.tier, i.step) for i in infos if not i.has_prefix(keys)}
    sets = {i.keys for i in infos if i.keys is not None}
    return infos, {(i.tier, i.step) for i in infos if i.keys is not None and any(i.keys < k for k in sets)}


def cmd_cost(args: argparse.Namespace) -> int:
    tiers, options = tiers_from_args(args, required=args.stored_gb is None)
    if not tiers:  # a what-if without tiers: the three default tiers and their default retention
        from types import SimpleNamespace

        tiers = [SimpleNamespace(name=n, url="", keep=getattr(args, f"keep_{n}", None) or DEFAULT_KEEP[n])
                 for n in TIER_NAMES]
    try:
        prices = parse_prices(args.price)
    except ValueError as exc:
        raise CliError(f"--price: {exc}") from exc
    if (args.stored_gb is None) != (args.fp32_gb is None) and args.stored_gb is None:
        raise CliError("--fp32-gb needs --stored-gb")
    full = args.stored_gb is None and torch_available()  # without torch: stored sizes only, fp32 unknown
    if args.stored_gb is not None:
        stored = int(args.stored_gb * (1 << 30))
        fp32 = int((args.fp32_gb if args.fp32_gb is not None else args.stored_gb) * (1 << 30))
        usages = [TierUsage(t.name, stored, fp32, t.keep, t.url) for t in tiers]
        measured = {t.name: {"source": "what-if"} for t in tiers}
    else:
        _check_reachable(tiers)
        infos, partial = _retained(args, tiers, options, full)
        usages = usage_from_listing(tiers, infos, fp32=_fp32_sizes(tiers, infos) if full else None, partial=partial,
                                    fp32_known=full)
        measured = {}
        for t in tiers:
            held = [i for i in infos if i.tier == t.name]
            measured[t.name] = ({"source": f"step {max(i.step for i in held)}", "checkpoints": len(held),
                                 "current_bytes": sum(i.size_bytes for i in held)} if held else {"source": "no checkpoint"})
    report = estimate(usages, prices)
    if args.json:
        out = report.as_dict()
        for d in out["tiers"]:
            d.update(measured.get(d["tier"], {}))
        print_json(out)
        return EXIT_OK
    def known(x: Any, fmt: Any) -> str:
        return "-" if x is None else fmt(x)

    body = [(c.tier, c.kind, measured[c.tier]["source"], human_bytes(c.stored_bytes), human_bytes(c.kept_bytes),
             known(c.fp32_bytes, human_bytes), c.keep, f"{c.price_gb_month:.4f}", format_usd(c.monthly_usd),
             known(c.fp32_monthly_usd, format_usd), known(c.saving_fraction, lambda f: f"{f * 100:.0f}%"))
            for c in report.tiers]
    print(table(body, ["tier", "kind", "measured", "newest", "kept", "fp32 raw", "keep", "$/GB-mo", "$/month", "fp32 $/mo",
                      "saving"], right=(3, 4, 5, 6, 7, 8, 9, 10)))
    if report.fp32_monthly_usd is None:
        print(f"total {format_usd(report.monthly_usd)}/month; the uncompressed fp32 size is unknown without torch "
              "(pip install torch)")
    else:
        print(f"total {format_usd(report.monthly_usd)}/month; uncompressed fp32 would cost "
              f"{format_usd(report.fp32_monthly_usd)}/month (saving {format_usd(report.saving_usd)}/month)")
    return EXIT_OK
