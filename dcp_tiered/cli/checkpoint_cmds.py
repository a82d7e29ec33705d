"""``inspect``, ``verify`` and ``convert``: commands on one checkpoint.

Argument parsing, output and exit codes only; the work is done by :mod:`dcp_tiered.inspect`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from dcp_tiered import inspect as ckpt
from dcp_tiered.cli.args import DOWNCASTS, add_codec_dtype_args, add_storage_args, parse_dtype, storage_options_for
from dcp_tiered.cli.output import (
    EXIT_OK,
    EXIT_PROBLEMS,
    CliError,
    debug_enabled,
    error_line,
    exit_code_for,
    human_bytes,
    kept_line,
    one_line,
    print_json,
    progress_for,
    table,
    unwrap_error,
)
from dcp_tiered.errors import CheckpointExistsError, CodecError, DcpTieredError

INSPECT_EXAMPLES = """\
examples:
  dcp-tiered inspect ckpt/local/step_000000100
  dcp-tiered inspect s3://bucket/run/step_000001000 --s3-endpoint-url http://127.0.0.1:9000
  dcp-tiered inspect ckpt/stock_dcp_checkpoint --json | jq '.tensors[] | select(.ratio > 0.9)'"""

VERIFY_EXAMPLES = """\
examples:
  dcp-tiered verify ckpt/durable/step_000001000 && echo good
  dcp-tiered verify ckpt/local/step_* ckpt/shared/step_*
  dcp-tiered verify s3://bucket/run/step_000001000 --json"""

CONVERT_EXAMPLES = """\
examples:
  dcp-tiered convert stock_ckpt/ compressed_ckpt/ --codec zstd            # stock DCP -> compressed
  dcp-tiered convert compressed_ckpt/ stock_ckpt/ --codec stock           # compressed -> stock DCP
  dcp-tiered convert ckpt/step_100 ckpt_lz4/step_100 --codec lz4 --dtype bf16
  dcp-tiered convert ckpt/step_100 model.pt                               # -> one torch.save file
  dcp-tiered convert model.pt ckpt/from_torch --codec zstd:3              # torch.save file -> DCP"""


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("inspect", help="tensors, dtypes, shapes, stored vs raw size, codec, format version",
                       description="List every item of a checkpoint (this package's or stock DCP's): dtype, shape, "
                                   "raw and stored size, codec, and the format version.",
                       epilog=INSPECT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="checkpoint directory or URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_args(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check every checksum and every referenced file",
                       description="Verify checkpoints: .metadata integrity, every data file it names (present, long "
                                   "enough) and every frame checksum (stock DCP items: files present and long enough). "
                                   "Every path is checked and gets a verdict; the exit code is the worst of them "
                                   "(1: damaged data found, 3: no checkpoint, 4: unreadable or unsafe .metadata, ...).",
                       epilog=VERIFY_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint directories or URLs")
    p.add_argument("--json", action="store_true", help="machine-readable output (a list when several paths are given)")
    add_storage_args(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("convert", help="re-encode a checkpoint (codec, dtype, stock DCP, torch.save)",
                       description="Re-encode a checkpoint: stock DCP to compressed, compressed to stock, a codec or "
                                   "dtype change, or to/from a single torch.save file (paths ending in .pt, .pth, "
                                   ".bin, .ckpt).",
                       epilog=CONVERT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="checkpoint directory/URL, or a torch.save file")
    p.add_argument("dst", help="new checkpoint directory/URL, or a torch.save file")
    add_codec_dtype_args(p, codec_default="zstd",
                         codec_help="none, lz4, zstd, zstd:N, or 'stock' for stock DCP (default zstd)",
                         dtype_default=None, dtype_choices=DOWNCASTS,
                         dtype_help="bf16 or fp16: store floating tensors wider than 16 bits in 16 bits (safe "
                                    "downcast; optimizer state kept); default: every dtype as loaded")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_args(p)
    p.set_defaults(func=cmd_convert)


def cmd_inspect(args: argparse.Namespace) -> int:
    desc = ckpt.describe(args.path, storage_options_for(args.path, args))
    if args.json:
        print_json(desc.as_dict())
        return EXIT_OK
    summary = desc.summary()
    print(f"checkpoint  {summary['path']}")
    print(f"format      {summary['format']}" + (f" (format version {summary['format_version']})" if summary["format_version"] else ""))
    print(f"codecs      {', '.join(summary['codecs']) or '-'}")
    print()
    body = [
        (r.key, r.dtype or "object", r.stored_dtype if r.stored_dtype and r.stored_dtype != r.dtype else "",
         "x".join(map(str, r.shape)) if r.shape else ("scalar" if r.shape == () else "-"),
         human_bytes(r.raw_bytes), human_bytes(r.stored_bytes), f"{r.ratio:.3f}" if r.ratio is not None else "-", r.codec)
        for r in desc.rows
    ]
    print(table(body, ["key", "dtype", "stored as", "shape", "raw", "stored", "ratio", "codec"], right=(4, 5, 6)))
    ratio = f"{summary['ratio']:.3f}" if summary["ratio"] is not None else "-"
    print(f"\n{summary['items']} items ({summary['tensors']} tensors): raw {human_bytes(summary['raw_bytes'])}, "
          f"stored {human_bytes(summary['stored_bytes'])}, ratio {ratio}")
    return EXIT_OK


def _verify_one(path: str, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Verify one path: (its JSON verdict, what was checked in words).

    Never raises (but for Ctrl-C): an error becomes the path's verdict and exit code.
    """
    t0 = time.perf_counter()
    try:
        result = ckpt.verify(path, storage_options_for(path, args), progress=progress_for(args))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as raised:
        exc = unwrap_error(raised)
        if debug_enabled(args):
            import traceback

            traceback.print_exception(raised)
        code = exit_code_for(exc)
        return {"path": path, "ok": False, "exit_code": code, "error": error_line("verify", exc, path),
                "error_type": type(exc).__name__, "problems": [f"{type(exc).__name__}: {one_line(exc)}"],
                "seconds": round(time.perf_counter() - t0, 3)}, ""
    return {"path": path, "ok": result.ok, "exit_code": EXIT_OK if result.ok else EXIT_PROBLEMS,
            "problems": result.problems, **result.counts(), "seconds": round(time.perf_counter() - t0, 3)}, \
        result.counts_text(human_bytes)


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify every path, print a verdict per path, exit with the worst (highest) code."""
    results = []
    for path in args.paths:
        r, checked = _verify_one(path, args)
        results.append(r)
        if "error" in r:
            print(r["error"], file=sys.stderr, flush=True)
        elif args.json:
            pass
        elif r["problems"]:
            for p in r["problems"]:
                print(f"PROBLEM  {p}")
            print(f"{r['path']}: {len(r['problems'])} problem(s) found; restore from another tier or an older step", flush=True)
        else:
            print(f"{r['path']}: OK ({checked})", flush=True)
    code = max(r["exit_code"] for r in results)
    if args.json:
        print_json(results[0] if len(results) == 1 else results)
    elif len(results) > 1:
        good = sum(r["ok"] for r in results)
        damaged = sum(r["exit_code"] == EXIT_PROBLEMS for r in results)
        print(f"verified {len(results)} paths: {good} OK, {damaged} with problems, "
              f"{len(results) - good - damaged} could not be verified (exit {code})")
    return code


def _export_lightning(args: argparse.Namespace) -> "int | None":
    """A Lightning plugin checkpoint converted to a ``.ckpt`` (or ``.pt``) file becomes a normal Lightning
    checkpoint (``export_checkpoint``), not the plugin's inner layout: the bytes written, or None when
    ``convert`` does not concern one (or Lightning is not installed)."""
    if not ckpt.is_torch_save_path(args.dst) or ckpt.is_torch_save_path(args.src):
        return None
    try:
        sdm = ckpt.open_reader(args.src, storage_options_for(args.src, args)).read_metadata().state_dict_metadata
    except DcpTieredError:
        return None  # convert says what is wrong with it
    try:
        from dcp_tiered.integrations import lightning_io
    except ImportError:
        return None
    if not lightning_io.is_plugin_checkpoint(sdm):
        return None
    if args.dtype is not None or args.codec not in ("zstd", ckpt.STOCK):
        raise CliError(f"{args.src} is a Lightning checkpoint of CompressedCheckpointIO: it converts to a normal "
                       "Lightning .ckpt as it is (no --dtype or --codec)")
    try:
        return lightning_io.export_checkpoint(args.src, args.dst, storage_options=storage_options_for(args.dst, args),
                                              overwrite=args.overwrite)
    except CheckpointExistsError as exc:
        raise CliError(f"{args.dst} already exists; pass --overwrite to replace it, or convert to a new path") from exc


def cmd_convert(args: argparse.Namespace) -> int:
    from dcp_tiered.codecs import get_codec

    exported = _export_lightning(args)
    if exported is not None:
        if args.json:
            print_json({"src": args.src, "dst": args.dst, "format": "lightning", "dst_bytes": exported})
        else:
            print(f"converted {args.src} -> {args.dst} (a Lightning checkpoint, torch.save): {human_bytes(exported)}")
        return EXIT_OK
    if args.codec != ckpt.STOCK:
        try:
            args.codec = str(get_codec(args.codec))
        except CodecError as exc:
            raise CliError(f"--codec: {exc}; or '{ckpt.STOCK}' for stock DCP") from exc
    try:
        res = ckpt.convert(args.src, args.dst, args.codec, parse_dtype(args.dtype),
                           src_options=storage_options_for(args.src, args), dst_options=storage_options_for(args.dst, args),
                           overwrite=args.overwrite, progress=progress_for(args))
    except BaseException as exc:  # DCP wraps it in CheckpointException (a BaseException); say the flag, not the keyword
        if not isinstance(unwrap_error(exc), CheckpointExistsError):
            raise
        raise CliError(f"{args.dst} already exists; pass --overwrite to replace it, or convert to a new path") from exc
    if args.json:
        print_json(res.as_dict())
    else:
        codec = res.saved.get("codec")
        print(f"converted {args.src} -> {args.dst} ({res.saved.get('format')}{', ' + codec if codec else ''}"
              f"{', ' + args.dtype if args.dtype else ''}): {human_bytes(res.src_bytes)} -> {human_bytes(res.dst_bytes)}")
        if res.saved.get("kept"):
            print(kept_line(res.saved["kept"]))
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m dcp_tiered.cli")
