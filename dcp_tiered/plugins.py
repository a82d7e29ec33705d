"""Plugins: codecs and storage backends that other distributions declare as entry points.

A distribution declares ``name = module:Class`` in the group :data:`CODEC_GROUP` (the name is the
codec id a checkpoint records) or :data:`STORAGE_GROUP` (the name is the URL protocol its backend
serves), as numcodecs and fsspec find theirs.  Nothing is scanned or imported until a name is asked
for that nothing built in serves; then the installed distributions' entry points are listed once per
process (names only, nothing imported) and the entry point of that name is loaded, once: a plugin
that fails to import is reported again on each later request without being imported again.
Entry points named after a built-in are never loaded, and a warning names them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass

from dcp_tiered.errors import ConfigError

log = logging.getLogger(__name__)

#: Entry point group of codec plugins; each name is a codec id (the first part of a spec string).
CODEC_GROUP = "dcp_tiered.codecs"
#: Entry point group of storage backend plugins; each name is the URL protocol the backend serves.
STORAGE_GROUP = "dcp_tiered.storage"

_LOCKS = {CODEC_GROUP: threading.RLock(), STORAGE_GROUP: threading.RLock()}
_LOADED: dict[tuple[str, str], "Plugin | ConfigError"] = {}
_WARNED: set[str] = set()


@dataclass(frozen=True)
class Plugin:
    """A loaded entry point: the object it names, and ``where`` (entry point and distribution) for messages."""

    obj: object
    where: str


def _distribution(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"


def describe(ep: importlib.metadata.EntryPoint) -> str:
    """``entry point 'name' (module:attr) of distribution 'dist version' in group 'group'``."""
    return f"entry point {ep.name!r} ({ep.value}) of distribution {_distribution(ep)!r} in group {ep.group!r}"


@functools.cache
def declared(group: str) -> dict[str, tuple[importlib.metadata.EntryPoint, ...]]:
    """The entry points of ``group`` by name, as the installed distributions declare them (listed once
    per process; nothing is imported)."""
    found: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in importlib.metadata.entry_points(group=group):
        found.setdefault(ep.name, []).append(ep)
    return {name: tuple(eps) for name, eps in found.items()}


def _warn_built_in_names(group: str, built_in: Collection[str]) -> None:
    if group in _WARNED:
        return
    _WARNED.add(group)
    for name in sorted(set(declared(group)) & set(built_in)):
        for ep in declared(group)[name]:
            log.warning("ignoring %s: %r is built in and a plugin cannot replace it; uninstall %r or ask its "
                        "authors to rename the entry point", describe(ep), name, ep.dist.name if ep.dist else ep.value)


def load_plugin(group: str, name: str, error: type[ConfigError], built_in: Collection[str], what: str) -> Plugin | None:
    """The object of the entry point ``name`` in ``group``, loaded once; None when no installed
    distribution declares one.

    ``built_in`` are the names the caller serves itself (never loaded from a plugin; the first call
    warns about entry points that take one).  A name declared by two distributions, or an entry
    point that fails to load, raises ``error`` naming them and ``what`` the plugin provides.
    """
    with _LOCKS[group]:
        _warn_built_in_names(group, built_in)
        known = _LOADED.get((group, name))
        if known is None:
            eps = declared(group).get(name)
            if not eps or name in built_in:
                return None
            known = _load(eps, error, what)
            _LOADED[(group, name)] = known
    if isinstance(known, ConfigError):
        raise known.with_traceback(None)  # the same failure each time, without the earlier raises' frames
    return known


def _load(eps: tuple[importlib.metadata.EntryPoint, ...], error: type[ConfigError], what: str) -> "Plugin | ConfigError":
    if len(eps) > 1:
        return error(f"{len(eps)} installed distributions provide {what}: "
                     + "; ".join(describe(ep) for ep in eps) + ". Uninstall all but one of them")
    ep = eps[0]
    try:
        return Plugin(ep.load(), describe(ep))
    except (Exception, SystemExit) as exc:  # a plugin's import can raise anything (an exit too): its failure
        failure = error(f"{describe(ep)}, which provides {what}, failed to load: {type(exc).__name__}: {exc}. "
                        f"Reinstall or upgrade {_distribution(ep)!r} (and what it needs), or uninstall it if you do not need it")
        failure.__cause__ = exc
        return failure
