"""The layout ``CompressedCheckpointIO`` (the Lightning plugin) gives a checkpoint, without Lightning.

The checkpoint dict's tensors are the items ``t.0``, ``t.1``, ... and everything else is one
``skeleton`` object: ``{"format", "tree", "tensors": [path of t.N in the dict], "kinds"}``.
Defined here, below the integrations, so that ``dcp_tiered.inspect`` (``export``) reads such a
checkpoint by its real names without importing Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError

#: The item holding everything but the tensors, and the skeleton's format id.
SKELETON = "skeleton"
FORMAT = "dcp_tiered.lightning/1"
#: Where Lightning keeps the model's weights in its checkpoint dict.
STATE_DICT = "state_dict"


def tensor_item(n: int) -> str:
    """The item name of the checkpoint dict's ``n``-th tensor."""
    return f"t.{n}"


def is_plugin_checkpoint(state_dict_metadata: Mapping[str, Any]) -> bool:
    """Whether a checkpoint directory's items (its ``.metadata``'s ``state_dict_metadata``) are the
    layout :class:`CompressedCheckpointIO` writes (tensors ``t.{n}`` and one ``skeleton``)."""
    return SKELETON in state_dict_metadata and all(k == SKELETON or k.startswith("t.") for k in state_dict_metadata)


def check_format(skeleton: Any, where: str) -> dict[str, Any]:
    """``skeleton`` (as loaded, untrusted) when it is this layout's, else :class:`UnsupportedFormatError`."""
    found = skeleton.get("format") if isinstance(skeleton, dict) else type(skeleton).__name__
    if found != FORMAT:
        raise UnsupportedFormatError(f"{where}: the skeleton is {found!r}, not {FORMAT!r} of CompressedCheckpointIO "
                                     "(written by a newer dcp-tiered, or not by this plugin)")
    return skeleton


def state_dict_items(stored: Any, where: str) -> dict[str, str]:
    """The model's weights in a plugin checkpoint: each name inside ``state_dict`` -> its ``t.{n}`` item.

    ``stored``: the ``skeleton`` item as loaded (the 1-tuple the plugin wraps it in), untrusted."""
    if not (isinstance(stored, (tuple, list)) and len(stored) == 1):
        raise CorruptCheckpointError(f"{where}: the skeleton item is a {type(stored).__name__}, not the plugin's "
                                     "1-tuple; the checkpoint is damaged")
    paths = check_format(stored[0], where).get("tensors")
    if not isinstance(paths, list):
        raise CorruptCheckpointError(f"{where}: the skeleton lists no tensors; the checkpoint is damaged")
    out: dict[str, str] = {}
    for n, path in enumerate(paths):
        if isinstance(path, (list, tuple)) and len(path) == 2 and path[0] == STATE_DICT and isinstance(path[1], str):
            out[path[1]] = tensor_item(n)
    return out
