"""Path containment: names read from checkpoint metadata must stay inside the checkpoint."""

from __future__ import annotations

import posixpath

from dcp_tiered.errors import UnsafeCheckpointError


def safe_relative_name(name: object, where: str = "") -> str:
    """Return ``name`` normalised if it is a plain relative path inside its directory.

    Absolute paths, ``..`` components, URLs, backslashes and NUL bytes are refused with
    :class:`UnsafeCheckpointError`, since a crafted checkpoint could otherwise make a reader
    open (or a cleaner delete) files elsewhere.
    """
    where_text = f" in {where}" if where else ""
    if not isinstance(name, str) or not name:
        raise UnsafeCheckpointError(f"file name {name!r}{where_text} is not a non-empty string")
    if "\x00" in name or "\\" in name or "://" in name or name.startswith(("/", "~")) or ":" in name.split("/")[0]:
        raise UnsafeCheckpointError(f"file name {name!r}{where_text} is not a relative path inside the checkpoint")
    norm = posixpath.normpath(name)
    if norm in (".", "..") or norm.startswith("../") or posixpath.isabs(norm):
        raise UnsafeCheckpointError(f"file name {name!r}{where_text} escapes the checkpoint directory")
    return norm
