"""The flags commands share: storage options, tiers from a YAML file or flags, dtypes."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dcp_tiered.cli.output import CliError
from dcp_tiered.errors import ConfigError

# -- storage options ---------------------------------------------------------------------


def storage_options_for(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """fsspec options for ``url`` from ``--s3-endpoint-url`` and the AWS_* environment."""
    endpoint = getattr(args, "s3_endpoint_url", None)
    if not str(url).startswith(("s3://", "s3a://")):
        return {}
    opts: dict[str, Any] = {}
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint, "region_name": os.environ.get("AWS_DEFAULT_REGION", "us-east-1")}
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        opts["key"], opts["secret"] = key, secret
    return opts


def add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--s3-endpoint-url", metavar="URL",
                   help="S3-compatible endpoint for s3:// paths (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")


# -- tiers from a YAML file or flags ---------------------------------------------------------

TIER_NAMES = ("local", "shared", "durable")
# zstd (level 1) for the hot tier: on floats it encodes faster than lz4 and stores less (docs/benchmarks.md)
DEFAULT_CODECS = {"local": "zstd", "shared": "zstd", "durable": "zstd:3"}
DEFAULT_KEEP = {"local": 2, "shared": 4, "durable": 24}


#: One spelling per concept across every command (tests/test_cli.py walks the parsers against it).
#: The old spellings still parse, hidden from ``--help``, into the same ``dest``: old scripts keep working.
ALIASES = {"--compression": "--codec", "--codecs": "--codec", "--checkpoint-dtype": "--dtype", "--dtypes": "--dtype"}
DTYPES = ("fp32", "bf16", "fp16")
#: The ``--dtype`` of commands that rewrite a checkpoint (``convert``, ``export``): a safe downcast or nothing.
DOWNCASTS = ("bf16", "fp16")


def add_alias(p: Any, old: str, action: argparse.Action) -> None:
    """Accept ``old`` (an entry of :data:`ALIASES`) as a hidden spelling of ``action``'s flag."""
    assert ALIASES[old] in action.option_strings, old
    p.add_argument(old, dest=action.dest, type=action.type, choices=action.choices, metavar=action.metavar,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_codec_dtype_args(p: Any, *, codec_help: str, codec_default: str | None, dtype_help: str,
                         dtype_default: str | None = "fp32", dtype_choices: Any = DTYPES) -> None:
    """``--codec`` and ``--dtype``, with every old spelling of :data:`ALIASES` hidden: the one builder of
    these flags, so every command that has the concept accepts the same spellings."""
    add_codec_arg(p, codec_help=codec_help, codec_default=codec_default)
    add_dtype_arg(p, dtype_help=dtype_help, dtype_default=dtype_default, dtype_choices=dtype_choices)


def add_codec_arg(p: Any, *, codec_help: str, codec_default: str | None) -> None:
    """``--codec`` alone (with its old spellings hidden), for a command without ``--dtype``."""
    _with_aliases(p, p.add_argument("--codec", default=codec_default, metavar="CODEC", help=codec_help))


def add_dtype_arg(p: Any, *, dtype_help: str, dtype_default: str | None = "fp32", dtype_choices: Any = DTYPES) -> None:
    """``--dtype`` alone (with its old spellings hidden), for a command without ``--codec``."""
    _with_aliases(p, p.add_argument("--dtype", choices=dtype_choices, default=dtype_default,
                                    metavar=None if dtype_choices else "DTYPE", help=dtype_help))


def _with_aliases(p: Any, action: argparse.Action) -> None:
    for old, new in ALIASES.items():
        if new in action.option_strings:
            add_alias(p, old, action)


def add_tier_location_args(p: argparse.ArgumentParser, keep: bool = True) -> None:
    """Where the tiers are (``--tiers`` or one path flag per tier), and with ``keep`` how many each keeps."""
    g = p.add_argument_group("tiers (a YAML file, or one flag per tier)")
    g.add_argument("--tiers", metavar="YAML", help="tier spec file (a 'tiers:' list with the fields of Tier)")
    g.add_argument("--local-path", metavar="PATH", help="fast node-local tier (e.g. /nvme/ckpt)")
    g.add_argument("--shared-path", metavar="PATH", help="shared filesystem tier (e.g. /fsx/run/ckpt)")
    g.add_argument("--durable-path", metavar="URL", help="durable tier, any fsspec URL (e.g. s3://bucket/run)")
    if keep:
        for name in TIER_NAMES:
            g.add_argument(f"--keep-{name}", type=int, metavar="N",
                           help=f"checkpoints kept on the {name} tier (default {DEFAULT_KEEP[name]})")
    add_storage_args(p)


def add_tier_encoding_args(p: argparse.ArgumentParser) -> None:
    """How saves are encoded (``--codec``, ``--dtype``) and when each tier saves (the schedules)."""
    g = p.add_argument_group("encoding")
    add_codec_dtype_args(g, codec_default=None,
                         codec_help="codec for every tier: none, lz4, zstd, zstd:N (default zstd local and shared, zstd:3 durable)",
                         dtype_help="store floating weights in 16 bits (optimizer state stays fp32); default fp32")
    s = p.add_argument_group("schedules (minutes, seconds for short runs, or steps)")
    for flag, name in (("checkpoint", "local"), ("shared", "shared"), ("durable", "durable")):
        s.add_argument(f"--{flag}-interval-min", type=float, metavar="MIN", help=f"{name} tier interval in minutes")
    for flag, name in (("checkpoint", "local"), ("shared", "shared"), ("durable", "durable")):
        s.add_argument(f"--{flag}-interval-s", type=float, metavar="S", help=f"{name} tier interval in seconds")
    for flag, name in (("checkpoint", "local"), ("shared", "shared"), ("durable", "durable")):
        s.add_argument(f"--{flag}-every-steps", type=int, metavar="N", help=f"{name} tier: save every N steps")
    s.add_argument("--max-durable-hourly", type=int, metavar="N", help="cap on durable saves per rolling hour")


def _interval(args: argparse.Namespace, name: str) -> float | None:
    prefix = "checkpoint" if name == "local" else name
    minutes = getattr(args, f"{prefix}_interval_min", None)
    seconds = getattr(args, f"{prefix}_interval_s", None)
    if minutes is not None and seconds is not None:
        raise CliError(f"give --{prefix}-interval-min or --{prefix}-interval-s, not both")
    value = minutes * 60 if minutes is not None else seconds
    if value is not None and value <= 0:
        raise CliError(f"--{prefix}-interval-* must be positive, got {value}")
    return value


def tiers_from_args(args: argparse.Namespace, required: bool = True) -> tuple[list[Any], dict[str, Any]]:
    """Build the tier list (fastest first) and checkpointer options from ``--tiers`` or the path flags."""
    from dcp_tiered.tiers.config import DEFAULT, Tier, load_tiers_yaml, validate_tiers

    paths = {n: getattr(args, f"{n}_path", None) for n in TIER_NAMES}
    dtype = None if getattr(args, "dtype", "fp32") in (None, "fp32") else args.dtype
    if getattr(args, "tiers", None):
        if any(paths.values()):
            raise CliError("give either --tiers YAML or --local-path/--shared-path/--durable-path, not both")
        tiers, options = load_tiers_yaml(args.tiers)
        out = []
        for t in tiers:
            opts = dict(t.storage_options) or storage_options_for(t.url, args)
            changes: dict[str, Any] = {"storage_options": opts}
            keep = getattr(args, f"keep_{t.name}", None)
            if keep is not None:
                changes["keep"] = keep
            if getattr(args, "codec", None):
                changes["codec"] = args.codec
            if dtype:
                changes["dtype"] = dtype
            out.append(Tier(**{**_tier_fields(t), **changes}))
        _check_keep_has_tier(args, [t.name for t in out])
        return out, options
    tiers = []
    for name in TIER_NAMES:
        url = paths[name]
        if not url:
            continue
        every = _interval(args, name) if hasattr(args, "shared_interval_min") else None
        prefix = "checkpoint" if name == "local" else name
        every_steps = getattr(args, f"{prefix}_every_steps", None)
        max_per_hour = getattr(args, "max_durable_hourly", None) if name == "durable" else None
        keep = getattr(args, f"keep_{name}", None)
        memory = _on_tmpfs(url)  # a memory tier: Tier's own defaults (keep 1, codec none)
        try:
            tiers.append(Tier(
                name, url, every=every, every_steps=every_steps, max_per_hour=max_per_hour,
                keep=keep if keep is not None else DEFAULT if memory else DEFAULT_KEEP[name],
                codec=getattr(args, "codec", None) or (DEFAULT if memory else DEFAULT_CODECS[name]),
                storage_options=storage_options_for(url, args), dtype=dtype,
            ))
        except ConfigError as exc:
            raise CliError(str(exc)) from exc
    if not tiers and required:
        raise CliError("no tiers: give --tiers tiers.yaml or at least one of --local-path/--shared-path/--durable-path")
    if tiers:
        _check_keep_has_tier(args, [t.name for t in tiers])
    # the structure only (a regular file or FIFO given as a tier is refused); reading commands create nothing
    return validate_tiers(tiers, probe=False) if tiers else tiers, {}


def _check_keep_has_tier(args: argparse.Namespace, names: list[str]) -> None:
    """A ``--keep-X`` without an X tier would be ignored: refuse it (exit 2)."""
    for name in TIER_NAMES:
        if getattr(args, f"keep_{name}", None) is not None and name not in names:
            where = f"the --tiers file has {', '.join(names)}" if getattr(args, "tiers", None) else f"no --{name}-path"
            raise CliError(f"--keep-{name} without a {name} tier ({where}): add the {name} tier or drop --keep-{name}")


def _on_tmpfs(url: str) -> bool:
    import fsspec

    from dcp_tiered.tiers.config import is_memory_path

    protocol, path = fsspec.core.split_protocol(url)
    return protocol in (None, "file", "local") and is_memory_path(path)


def _tier_fields(t: Any) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(t, f.name) for f in fields(t)}


def parse_dtype(name: str | None) -> Any:
    import torch

    return {None: None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
