"""State-dict traversal as DCP does it: which flattened keys a state dict asks a checkpoint for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _is_leaf(value: Any) -> bool:
    # DCP's rule: mappings are traversed; a list is traversed when it holds (at any depth)
    # a tensor or a mapping; everything else is a leaf.
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and not _is_leaf(v)) for v in value)


def flatten_keys(state_dict: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dot-joined leaf keys exactly as DCP flattens a state dict into metadata keys."""
    out: list[str] = []

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{path}.{k}", v)
        elif _is_leaf(value):
            out.append(path)
        else:
            for i, v in enumerate(value):
                walk(f"{path}.{i}", v)

    for k, v in state_dict.items():
        walk(f"{prefix}{k}", v)
    return out
