"""Thin adapters of :class:`~dcp_tiered.TieredCheckpointer` for training frameworks (optional extras)."""
