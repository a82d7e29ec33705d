"""Tiers: schedules, the routing writer, background promotion, retention, catalog, restore.

Names load lazily, as in the top-level package: ``Tier`` and the catalog's listing work
without torch; the checkpointer, writer and promoter import it when first used.
"""

from __future__ import annotations

from dcp_tiered.lazy import lazy_attributes

_LAZY = {
    "CheckpointInfo": "dcp_tiered.tiers.catalog",
    "list_tiers": "dcp_tiered.tiers.catalog",
    "TieredCheckpointer": "dcp_tiered.tiers.checkpointer",
    "Promoter": "dcp_tiered.tiers.promote.promoter",
    "PromotionReport": "dcp_tiered.tiers.promote.promoter",
    "SaveReport": "dcp_tiered.tiers.events",
    "Tier": "dcp_tiered.tiers.config",
    "load_tiers_yaml": "dcp_tiered.tiers.config",
    "parse_duration": "dcp_tiered.tiers.config",
    "TieredWriter": "dcp_tiered.tiers.save.writer",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals(), __all__)
