"""Path containment (names read from checkpoint metadata must stay inside the checkpoint) and places
(which directory a URL with its options names)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec

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


def location(url: str, storage_options: "Mapping[str, Any] | None" = None) -> tuple[str, str, str]:
    """``(filesystem, endpoint, path)`` naming the directory ``url`` points at: the one rule by which
    two tiers, or two storages, are the same place.

    The protocol is stripped, local paths are made absolute with links resolved (``/x``,
    ``/x/``, ``file:///x`` and a link to ``/x`` are one place), and object-store keys lose
    their trailing ``/``; two URLs on different endpoints are different places.
    """
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        return "file", "", os.path.realpath(os.path.expanduser(path))
    try:
        cls = fsspec.get_filesystem_class(protocol)
        family = cls.protocol if isinstance(cls.protocol, str) else cls.protocol[0]
        path = cls._strip_protocol(url)
    except (ValueError, ImportError):  # unknown or chained protocol: compare the text
        family = protocol
    options = storage_options or {}
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url") or ""
    return str(family), str(endpoint), str(path).rstrip("/") or "/"
