"""A mistyped tier path is an error, not an empty tier: ``ls`` and ``gc`` on a directory that does not
exist said "no checkpoints" (or deleted nothing) and exited 0."""

from __future__ import annotations

import pytest

from dcp_tiered.cli.__main__ import main


@pytest.mark.parametrize("command", [["ls"], ["gc", "--dry-run"]])
def test_a_tier_path_that_does_not_exist_fails_with_exit_3(tmp_path, capsys, command):
    missing = tmp_path / "no-such-dir"
    assert main([*command, "--local-path", str(missing)]) == 3
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err, err
    assert not missing.exists()


def test_an_existing_empty_tier_is_fine(tmp_path, capsys):
    assert main(["ls", "--local-path", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().out


def test_progress_counts_items_as_integers(capsys):
    import io
    import sys

    from dcp_tiered.cli import output

    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    saved, sys.stderr = sys.stderr, FakeTTY()
    try:
        with output.progress(206, "gc") as bar:
            bar.refresh()
        text = sys.stderr.getvalue()
    finally:
        sys.stderr = saved
    assert "0/206 " in text and "206.0" not in text, text


def test_every_option_of_every_command_says_what_it_does() -> None:
    """``--help`` of each command explains each of its options (``train --help`` had none for --batch-size, --lr, --seed...)."""
    import argparse

    from dcp_tiered.cli.__main__ import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {opt.option_strings[0]}" for name, cmd in sub.choices.items() for opt in cmd._actions
            if opt.option_strings and opt.help is None]
    assert not bare, bare
