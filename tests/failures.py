"""Helpers shared by the single-process error tests."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException


def failure_of(fn) -> BaseException | None:
    """Run ``fn``; return what it raised, unwrapped from DCP's CheckpointException, or None."""
    try:
        fn()
    except CheckpointException as exc:
        assert exc.failures, exc
        return next(iter(exc.failures.values()))[0]
    except Exception as exc:  # noqa: BLE001 - the tests inspect it
        return exc
    return None
