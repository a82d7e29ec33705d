"""Tiers: schedules, the routing writer, background promotion, retention, catalog, restore."""

from dcp_tiered.tiers.catalog import CheckpointInfo, list_tiers
from dcp_tiered.tiers.checkpointer import TieredCheckpointer
from dcp_tiered.tiers.promotion import Promoter, PromotionReport
from dcp_tiered.tiers.events import SaveReport
from dcp_tiered.tiers.spec import Tier, load_tiers_yaml, parse_duration
from dcp_tiered.tiers.writer import TieredWriter

__all__ = [
    "CheckpointInfo",
    "Promoter",
    "PromotionReport",
    "SaveReport",
    "Tier",
    "TieredCheckpointer",
    "TieredWriter",
    "list_tiers",
    "load_tiers_yaml",
    "parse_duration",
]
