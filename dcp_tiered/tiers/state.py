"""What one save holds: the state without its optimizer entries (on the saves that skip them,
see ``optimizer_every``) and its raw size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def without_paths(state_dict: Mapping[str, Any], paths: Sequence[str]) -> tuple[dict[str, Any], bool]:
    """``state_dict`` without the entries at the dotted ``paths`` (``"optim"``, ``"app.optim"``),
    copying only the mappings on the way; and whether any path was there."""
    out = dict(state_dict)
    found = False
    for path in paths:
        *parents, last = path.split(".")
        node: Any = out
        for i, part in enumerate(parents):
            child = node.get(part) if isinstance(node, Mapping) else None
            if not isinstance(child, Mapping):
                node = None
                break
            node[part] = dict(child)  # a copy: the caller's state dict is never changed
            node = node[part]
        if isinstance(node, dict) and last in node:
            del node[last]
            found = True
    return out, found


def state_bytes(state_dict: Mapping[str, Any]) -> int:
    """Bytes of the tensors in ``state_dict`` (nested mappings included), as held in memory."""
    total = 0
    for v in state_dict.values():
        if isinstance(v, Mapping):
            total += state_bytes(v)
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def committed_stats(writer_stats: Any, metadata: Any) -> Any:
    """Sizes of a committed save: the coordinator's writer computed them at commit; every other
    rank reads them from the committed ``Metadata`` that ``dcp.save`` returns everywhere (so a
    save's raw/stored bytes are the same on every rank, for its report and the metrics)."""
    if writer_stats is not None or not getattr(metadata, "storage_data", None):
        return writer_stats
    from dcp_tiered.dcp.save_stats import stats_from_records

    return stats_from_records((getattr(k, "fqn", k), r) for k, r in metadata.storage_data.items())
