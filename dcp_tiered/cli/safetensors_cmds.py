"""``export`` and ``import``: a checkpoint to and from a Hugging Face safetensors checkpoint.

Argument parsing, the step lookup on the tiers, output and exit codes only; the work is done by
:func:`dcp_tiered.inspect.export_safetensors` and :func:`dcp_tiered.inspect.import_safetensors`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dcp_tiered import inspect as ckpt
from dcp_tiered.cli.args import (
    DOWNCASTS,
    add_codec_arg,
    add_dtype_arg,
    add_storage_args,
    add_tier_location_args,
    parse_dtype,
    storage_options_for,
    tiers_from_args,
)
from dcp_tiered.cli.output import EXIT_NOT_FOUND, EXIT_OK, CliError, human_bytes, kept_line, print_json, progress_for
from dcp_tiered.errors import CheckpointExistsError, CodecError, ConfigError
from dcp_tiered.inspect.safetensors_files import max_shard_bytes
from dcp_tiered.tiers.policy import restore_order

EXPORT_EXAMPLES = """\
examples:
  dcp-tiered export ckpt/local/step_000001000 hf_model/ --prefix model.
  dcp-tiered export 1000 hf_model/ --tiers tiers.yaml --prefix app.model. --dtype bf16
  dcp-tiered export latest hf_model/ --durable-path s3://bucket/run --s3-endpoint-url http://127.0.0.1:9000
  dcp-tiered export ckpt/step_100 hf_model/ --prefix model. --max-shard-size 500MB --exclude '*.lora_*'"""

IMPORT_EXAMPLES = """\
examples:
  dcp-tiered import hf_model/ ckpt/local/step_000000000 --prefix model.      # the run's first checkpoint
  dcp-tiered import hf_model/model.safetensors.index.json ckpt/seed --codec zstd:3
  dcp-tiered import model.safetensors s3://bucket/run/step_000000000 --prefix app.model."""

#: The spellings of STEP_OR_PATH that name a step of the tiers rather than a path.
LATEST = "latest"


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("export", help="the model part of a checkpoint as a Hugging Face safetensors checkpoint",
                       description="Write the tensors of a checkpoint whose keys start with --prefix (prefix stripped) "
                                   "as Hugging Face safetensors files: one model.safetensors, or model-0000N-of-0000M."
                                   "safetensors shards with model.safetensors.index.json, as transformers writes them. "
                                   "Loaded and written one shard at a time: memory stays bounded by one shard. "
                                   "Optimizer state and non-tensor items are left out.",
                       epilog=EXPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="STEP_OR_PATH",
                   help="checkpoint directory or URL; or a step number (or 'latest') of the tiers given by --tiers "
                        "or the path flags, read from the fastest tier that holds it committed and whole")
    p.add_argument("dst", metavar="DST", help="output directory or URL")
    p.add_argument("--format", choices=("safetensors",), default="safetensors", help="output format (safetensors)")
    p.add_argument("--prefix", default="", metavar="PREFIX",
                   help="export only keys under PREFIX and strip it, e.g. model. or app.model. (default: every key)")
    p.add_argument("--include", action="append", metavar="GLOB",
                   help="only keys (prefix included) matching this glob; repeatable (default: all)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="also leave out keys matching this glob; repeatable (optimizer state, e.g. optim.*, "
                        "*.exp_avg, is always left out unless --no-default-exclude)")
    p.add_argument("--no-default-exclude", action="store_true",
                   help="do not leave out optimizer state by default (only --exclude patterns apply)")
    p.add_argument("--max-shard-size", default=ckpt.DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                   help=f"largest shard, bytes or e.g. 500MB, 2GiB (default {ckpt.DEFAULT_MAX_SHARD_SIZE}, as transformers)")
    add_dtype_arg(p, dtype_default=None, dtype_choices=DOWNCASTS,
                  dtype_help="bf16 or fp16: store floating tensors wider than 16 bits in 16 bits (safe downcast: "
                             "a tensor with values past the target's range keeps its dtype); default: every dtype as stored")
    p.add_argument("--overwrite", action="store_true", help="replace an export at DST")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_tier_location_args(p, keep=False)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="a Hugging Face safetensors checkpoint as a checkpoint (a run's first)",
                       description="Read safetensors files (one file, an index.json, or their directory) with the "
                                   "safetensors library, no pickle, one file at a time, and write them as a compressed "
                                   "checkpoint, each tensor under --prefix: a training run restores it as its first "
                                   "checkpoint (import into the tier's step_000000000).",
                       epilog=IMPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="a .safetensors file, a model.safetensors.index.json, or their directory")
    p.add_argument("dst", metavar="DST", help="new checkpoint directory or URL")
    p.add_argument("--prefix", default="", metavar="PREFIX",
                   help="put every tensor under PREFIX, e.g. model. for a run saving {'model': model.state_dict()}")
    add_codec_arg(p, codec_default="zstd", codec_help="none, lz4, zstd, zstd:N (default zstd)")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_args(p)
    p.set_defaults(func=cmd_import)


def _has_tiers(args: argparse.Namespace) -> bool:
    return bool(args.tiers or args.local_path or args.shared_path or args.durable_path)


def resolve_source(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(URL, storage options) of STEP_OR_PATH: with tier flags, a step number or ``latest`` is the committed,
    complete copy a restore would read (:func:`~dcp_tiered.tiers.policy.restore_order`); anything else is a path."""
    text = args.src
    is_step = text == LATEST or (text.isascii() and text.isdigit())
    if not (is_step and _has_tiers(args)):
        if is_step and not os.path.exists(text):
            raise CliError(f"{text!r} is no path; to export step {text} of the tiers give them (--tiers or "
                           "--local-path/--shared-path/--durable-path)", EXIT_NOT_FOUND)
        return text, storage_options_for(text, args)
    from dcp_tiered.tiers.catalog import list_tiers

    tiers, _ = tiers_from_args(args)
    whole = {(i.step, i.tier_index): i for i in list_tiers(tiers) if i.committed and i.complete}
    order = [c for c in restore_order(whole) if text == LATEST or c[0] == int(text)]
    if not order:
        steps = sorted({step for step, _ in whole}, reverse=True)[:8]
        raise CliError(f"step {text} is not committed and whole on any tier ({', '.join(t.name for t in tiers)}); "
                       f"steps there: {steps or 'none'} (dcp-tiered ls lists them)", EXIT_NOT_FOUND)
    best = whole[order[0]]
    tier = tiers[best.tier_index]
    return best.url, dict(tier.storage_options) or storage_options_for(best.url, args)


def cmd_export(args: argparse.Namespace) -> int:
    try:
        max_shard_bytes(args.max_shard_size)
    except ConfigError as exc:  # its words, under the flag's name
        raise CliError(f"--max-shard-size: {str(exc).removeprefix('max_shard_size: ')}") from exc
    if not args.dst.strip():
        raise CliError("DST is empty: give the output directory or URL (an empty one would write into the current "
                       "directory)")
    src, options = resolve_source(args)
    try:
        res = ckpt.export_safetensors(
            src, args.dst, prefix=args.prefix, include=args.include or ("*",), exclude=args.exclude,
            default_exclude=not args.no_default_exclude, dtype=parse_dtype(args.dtype),
            max_shard_size=args.max_shard_size, src_options=options,
            dst_options=storage_options_for(args.dst, args), overwrite=args.overwrite, progress=progress_for(args))
    except CheckpointExistsError as exc:
        raise CliError(f"{args.dst} already holds a safetensors export; pass --overwrite to replace it, or export "
                       "to a new directory") from exc
    if args.json:
        print_json(res.as_dict())
        return EXIT_OK
    files = f"{len(res.files)} shards + {ckpt.INDEX_NAME}" if len(res.files) > 1 else ckpt.WEIGHTS_NAME
    print(f"exported {src} -> {args.dst} (safetensors{', ' + args.dtype if args.dtype else ''}): "
          f"{res.tensors} tensors, {human_bytes(res.total_size)} in {files}")
    if res.kept:
        print(kept_line(res.kept))
    if res.skipped:
        print(f"left out (not tensors): {', '.join(res.skipped[:8])}{' ...' if len(res.skipped) > 8 else ''}")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from dcp_tiered.codecs import get_codec

    try:
        get_codec(args.codec)
    except CodecError as exc:
        raise CliError(f"--codec: {exc}") from exc
    try:
        res = ckpt.import_safetensors(args.src, args.dst, prefix=args.prefix, codec=args.codec,
                                      src_options=storage_options_for(args.src, args),
                                      dst_options=storage_options_for(args.dst, args), overwrite=args.overwrite,
                                      progress=progress_for(args))
    except CheckpointExistsError as exc:  # say the flag, not the keyword
        raise CliError(f"{args.dst} already exists; pass --overwrite to replace it, or import to a new path") from exc
    if args.json:
        print_json(res.as_dict())
    else:
        print(f"imported {args.src} -> {args.dst} ({res.saved.get('codec')}): {res.tensors} tensors from "
              f"{len(res.files)} file(s), {human_bytes(res.saved.get('stored_bytes'))} stored")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m dcp_tiered.cli")
