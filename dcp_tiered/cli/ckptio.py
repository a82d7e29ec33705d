"""Moved to :mod:`dcp_tiered.inspect`; these aliases stay until their last importers switch, then this file goes.

Importers left: ``cli/tier_cmds.py`` (``cost``), ``cli/train.py`` (``demo``), ``tests/test_objects.py``.
"""

from __future__ import annotations

from typing import Any

from dcp_tiered.inspect import fp32_bytes, open_reader, verify
from dcp_tiered.inspect import load_any as load_state

__all__ = ["fp32_bytes", "load_state", "open_reader", "verify_checkpoint"]


def verify_checkpoint(reader: Any) -> tuple[list[str], dict[str, int]]:
    """``(problems, counts)`` of :func:`dcp_tiered.inspect.verify`."""
    result = verify(reader)
    return result.problems, result.counts()
