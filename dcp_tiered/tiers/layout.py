"""Where checkpoints live inside a tier: ``{tier url}/step_{step:09d}/``, plus promotion files."""

from __future__ import annotations

import re

STEP_DIR = re.compile(r"^step_(\d+)$")
INTENT_PREFIX = ".promote-"
FRAGMENT_SUFFIX = ".records.json"


def step_name(step: int) -> str:
    """Directory name of ``step`` (zero padded so names sort by step)."""
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    """Step number of a checkpoint directory name, or None if it is not one."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def intent_name(rank: int) -> str:
    """Per-rank file in a source checkpoint recording promotions still to do."""
    return f"{INTENT_PREFIX}{rank}.json"


def fragment_name(data_file: str) -> str:
    """File in a target checkpoint written once ``data_file`` was promoted (its new records)."""
    return f".{data_file}{FRAGMENT_SUFFIX}"
