"""Promotion: a committed checkpoint copied from the tier it was written to onto slower tiers in the
background, each rank copying its own files, the coordinator committing ``.metadata`` last."""
