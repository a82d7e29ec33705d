"""Tiers: schedules, the routing writer, background promotion, retention, catalog, restore.

Names load lazily, as in the top-level package: ``Tier`` and the catalog's listing work
without torch; the checkpointer, writer and promoter import it when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CheckpointInfo": "dcp_tiered.tiers.catalog",
    "list_tiers": "dcp_tiered.tiers.catalog",
    "TieredCheckpointer": "dcp_tiered.tiers.checkpointer",
    "Promoter": "dcp_tiered.tiers.promotion",
    "PromotionReport": "dcp_tiered.tiers.promotion",
    "SaveReport": "dcp_tiered.tiers.events",
    "Tier": "dcp_tiered.tiers.spec",
    "load_tiers_yaml": "dcp_tiered.tiers.spec",
    "parse_duration": "dcp_tiered.tiers.spec",
    "TieredWriter": "dcp_tiered.tiers.writer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_tiered.tiers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
