"""Entry point of ``dcp-tiered``: argument parsing, dispatch, and one-line errors with exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence

from dcp_tiered.cli.common import (
    EXIT_CODES_HELP,
    EXIT_CORRUPT,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_PROBLEMS,
    EXIT_STORAGE,
    EXIT_USAGE,
    CliError,
)

DESCRIPTION = """\
Compressed, tiered PyTorch Distributed Checkpoint (DCP) storage.

commands:
  train     a real training loop (small GPT on synthetic tokens) wired to TieredCheckpointer
  demo      train with a one-minute preset: 3 tiers, async saves, a crash, a bit-exact resume
  inspect   tensors, dtypes, shapes, stored vs raw size, codec, format version
  verify    every checksum and every referenced file (exit 1 on any problem)
  ls        every checkpoint of every tier: committed, step, size, optimizer, promotion state
  convert   re-encode a checkpoint: codec, dtype, stock DCP, torch.save file
  promote   run pending promotions now (--dry-run lists them)
  gc        apply retention now (--dry-run lists what would be deleted)
  cost      monthly storage cost per tier, and the saving against uncompressed fp32
  bench     codec comparison on your checkpoint or a generated model: table and PNG chart

Run `dcp-tiered COMMAND --help` for examples."""


def build_parser() -> argparse.ArgumentParser:
    from dcp_tiered.cli import bench, checkpoint_cmds, tier_cmds, train

    parser = argparse.ArgumentParser(
        prog="dcp-tiered", description=DESCRIPTION, epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train.add_parsers(sub)
    checkpoint_cmds.add_parsers(sub)
    tier_cmds.add_parsers(sub)
    bench.add_parsers(sub)
    for p in sub.choices.values():
        if not p.epilog or "exit codes:" not in p.epilog:
            p.epilog = ((p.epilog + "\n\n") if p.epilog else "") + EXIT_CODES_HELP
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def _version() -> str:
    from dcp_tiered import __version__

    return __version__


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code of an error."""
    from dcp_tiered.errors import (
        CheckpointExistsError,
        CheckpointNotFoundError,
        ConfigError,
        CorruptCheckpointError,
        PromotionError,
        SaveError,
        StorageError,
        UnsupportedFormatError,
    )

    if isinstance(exc, CliError):
        return exc.code
    if isinstance(exc, (CheckpointNotFoundError,)):
        return EXIT_NOT_FOUND
    if isinstance(exc, StorageError) and isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, (CorruptCheckpointError, UnsupportedFormatError)):
        return EXIT_CORRUPT
    if isinstance(exc, (ConfigError, CheckpointExistsError)):
        return EXIT_USAGE
    if isinstance(exc, (PromotionError, SaveError)):
        return EXIT_PROBLEMS
    if isinstance(exc, StorageError):
        return EXIT_STORAGE
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    return EXIT_PROBLEMS


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 600 else text[:597] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose < 2:
        logging.getLogger("dcp_tiered.events").setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("dcp-tiered: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `dcp-tiered ls | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        if args.verbose >= 2:
            raise
        # DCP wraps errors raised inside dcp.save/dcp.load in CheckpointException
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                exc = inner
        code = exit_code_for(exc)
        prefix = "" if isinstance(exc, CliError) else f"{type(exc).__name__}: "
        print(f"dcp-tiered {args.command}: error: {prefix}{_one_line(exc)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
