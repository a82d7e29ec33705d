"""Entry point of ``dcp-tiered``: argument parsing, dispatch, and one-line errors with exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from dcp_tiered import __version__
from dcp_tiered.checks import INSTALL_TORCH, is_missing_torch, torch_available
from dcp_tiered.cli import bench, checkpoint_cmds, safetensors_cmds, tier_cmds, train
from dcp_tiered.cli.output import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    debug_enabled,
    error_line,
    exit_code_for,
    unwrap_error,
)

__all__ = ["build_parser", "exit_code_for", "main"]

DESCRIPTION = "Compressed, tiered PyTorch Distributed Checkpoint (DCP) storage."


class CliParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are the documented one line:
    ``dcp-tiered COMMAND: error: MESSAGE (see dcp-tiered COMMAND --help)``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="dcp-tiered", usage="%(prog)s [-h] [--version] [-v] [--debug] COMMAND ...", epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug logs and tracebacks)")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (or set DCP_TIERED_DEBUG=1)")
    # listed once, in the description below (argparse's own list of the choices is suppressed)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS, prog="dcp-tiered")
    train.add_parsers(sub)
    checkpoint_cmds.add_parsers(sub)
    safetensors_cmds.add_parsers(sub)
    tier_cmds.add_parsers(sub)
    bench.add_parsers(sub)
    for p in sub.choices.values():
        # also after the command; SUPPRESS keeps a --debug given before it
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
        if not p.epilog or "exit codes:" not in p.epilog:
            p.epilog = ((p.epilog + "\n\n") if p.epilog else "") + EXIT_CODES_HELP
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    commands = "\n".join(f"  {a.dest:<9} {a.help}" for a in sub._choices_actions)
    parser.description = f"{DESCRIPTION}\n\ncommands:\n{commands}\n\nRun `dcp-tiered COMMAND --help` for examples."
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an argument the command does not know is that command's usage error (one line)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(args, "command", None)
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        (subs[command] if command in subs else parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


class _OneLineFormatter(logging.Formatter):
    """Log records on one line: an attached exception becomes ``(Type: message)``, never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            text = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        return f"{text} ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})" if exc is not None else text


def _setup_logging(args: argparse.Namespace, debug: bool) -> None:
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler()
    fmt = "%(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt) if debug else _OneLineFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
    if args.verbose < 2:
        logging.getLogger("dcp_tiered.events").setLevel(logging.WARNING)


def _quiet_hooks(command: str) -> dict:
    """Errors in background threads and ignored ones in finalizers: one line each, no traceback."""
    import threading

    saved = {"thread": threading.excepthook, "unraisable": sys.unraisablehook}

    def thread_hook(hook_args: threading.ExceptHookArgs) -> None:
        if hook_args.exc_type is SystemExit or hook_args.exc_value is None:
            return
        name = getattr(hook_args.thread, "name", "a thread")
        print(f"{error_line(command, hook_args.exc_value)} [in background thread {name}]", file=sys.stderr)

    def unraisable_hook(u: "sys.UnraisableHookArgs") -> None:
        if u.exc_value is not None:
            print(f"{error_line(command, u.exc_value)} [ignored]", file=sys.stderr)

    threading.excepthook = thread_hook
    sys.unraisablehook = unraisable_hook
    return saved


def _restore_hooks(saved: dict) -> None:
    import threading

    threading.excepthook = saved["thread"]
    sys.unraisablehook = saved["unraisable"]


def _report(command: str, exc: BaseException, debug: bool, path: str | None = None) -> int:
    """Print ``exc`` as one line (and its traceback when debugging); return its exit code."""
    inner = unwrap_error(exc)
    if debug:
        import traceback

        traceback.print_exception(exc)
    try:
        print(error_line(command, inner, path), file=sys.stderr)
    except BaseException:  # a message that cannot even be formatted (str() raising, recursion)
        print(f"dcp-tiered {command}: internal error: {type(inner).__name__}", file=sys.stderr)
    return exit_code_for(inner)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every error becomes one line on stderr and its documented exit code."""
    command, path = "-", None
    debug = debug_enabled()
    saved = None
    try:
        parser = build_parser()
        args = parse_args(parser, argv)
        debug = debug_enabled(args)
        if not getattr(args, "command", None):
            parser.print_help()
            return EXIT_USAGE
        command, path = args.command, getattr(args, "path", None)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _setup_logging(args, debug)
        if not debug:
            saved = _quiet_hooks(command)
            if argv is None:  # the script: keep the hooks for threads that fail while the process exits
                saved = None
        if command not in ("cost", "ls"):  # the only commands that work without torch

            if not torch_available():
                print(f"dcp-tiered {command}: {INSTALL_TORCH}; only `cost` and `ls` work without it", file=sys.stderr)
                return EXIT_USAGE
        return int(args.func(args) or 0)
    except SystemExit:  # argparse: --help, --version, a usage error (exit 2)
        raise
    except KeyboardInterrupt:
        print(f"dcp-tiered {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `dcp-tiered ls | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as exc:
        if is_missing_torch(exc) or is_missing_torch(unwrap_error(exc)):  # e.g. cost/ls on a path that needs it
            print(f"dcp-tiered {command}: {INSTALL_TORCH}; this needs PyTorch ({exc})", file=sys.stderr)
            return EXIT_USAGE
        return _report(command, exc, debug, path)
    finally:
        if saved is not None:
            _restore_hooks(saved)


if __name__ == "__main__":
    sys.exit(main())
