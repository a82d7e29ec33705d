"""Codecs as registered classes, numcodecs-style: an id, a config, a spec string.

A codec is a :class:`Codec` subclass with a ``codec_id``; :func:`register_codec` makes it
known and :func:`get_codec` builds one from a spec string (``"zstd:3"``), a config dict
(``{"id": "zstd", "level": 3}``) or an instance.  The spec string is what a checkpoint
record stores in its ``codec`` field: ``"<id>"`` or ``"<id>:<arg>"``, where the class maps
its argument to and from its config (:meth:`Codec.config_from_arg`, :meth:`Codec.spec_arg`).

Codecs of other packages are found by entry point (group ``dcp_tiered.codecs``, named by
``codec_id``; :mod:`dcp_tiered.plugins`): an id that is not registered is looked up there, and
the class found is registered, so a reader finds the codec a checkpoint names without code of its
own.  Built-in ids are never looked up there: a plugin cannot replace them.

Records are untrusted input, so a spec string is looked up only among registered ids and the
installed distributions' entry points of exactly that id, never imported or resolved as a class
name, and its length is bounded.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from dcp_tiered.errors import CodecError, CorruptCheckpointError
from dcp_tiered.plugins import CODEC_GROUP, Plugin, load_plugin

#: Longest spec string accepted (records are untrusted; real specs are a few characters).
MAX_SPEC_LEN = 64
_ID = re.compile(r"[a-z][a-z0-9_.-]{0,31}")

_REGISTRY: dict[str, type[Codec]] = {}
_BUILTIN_IDS: set[str] = set()
_LOCK = threading.RLock()


class Codec:
    """Base class of block codecs: one buffer in, one block out, and back.

    Subclasses set ``codec_id`` and implement :meth:`compress` and :meth:`decompress`.  A
    codec with parameters also overrides :meth:`get_config` and, to accept ``"<id>:<arg>"``
    spec strings, :meth:`config_from_arg` and :meth:`spec_arg`.  Instances are immutable
    values: equal when their spec strings are equal.
    """

    #: The registered name, also the first part of the spec string (lowercase, no ``:``).
    codec_id: ClassVar[str] = ""
    #: False for a codec that stores bytes as they are: frames then skip the filter and
    #: store every plane raw without calling :meth:`compress`.
    compresses: ClassVar[bool] = True
    #: Largest ratio of raw to compressed size the format allows; it bounds the smallest
    #: stored size a frame may declare (see :meth:`min_stored_size`).
    max_ratio: ClassVar[int] = 1
    #: How the spec strings of this codec read in error messages; ``codec_id`` when empty.
    spec_help: ClassVar[str] = ""

    # -- spec string <-> config ------------------------------------------------------------
    @classmethod
    def config_from_arg(cls, arg: str | None) -> dict[str, Any]:
        """The config (without ``"id"``) for spec ``"<id>:<arg>"``, or for ``"<id>"`` when
        ``arg`` is None.  Raise ``ValueError`` for an argument this codec does not take."""
        if arg is not None:
            raise ValueError(f"codec {cls.codec_id!r} takes no argument")
        return {}

    def spec_arg(self) -> str | None:
        """The argument of this codec's canonical spec string, None for a plain ``"<id>"``."""
        return None

    def get_config(self) -> dict[str, Any]:
        """This codec's parameters as plain builtins, with its ``"id"``."""
        return {"id": self.codec_id}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Build the codec from :meth:`get_config`'s output (the constructor takes the other keys)."""
        return cls(**{k: v for k, v in config.items() if k != "id"})

    @property
    def spec(self) -> str:
        """The canonical spec string: what a record stores in its ``codec`` field."""
        arg = self.spec_arg()
        return self.codec_id if arg is None else f"{self.codec_id}:{arg}"

    @property
    def name(self) -> str:
        return self.codec_id

    # -- bytes -------------------------------------------------------------------------------
    def compress(self, data: object) -> bytes:
        """Compress one buffer (any buffer-protocol object) into one block."""
        raise NotImplementedError

    def decompress(self, data: object, raw_len: int) -> bytes:
        """Decode one block into exactly ``raw_len`` bytes.  Never produce more than
        ``raw_len`` bytes (blocks are untrusted) and raise ``CorruptCheckpointError`` on bad input."""
        raise NotImplementedError

    def min_stored_size(self, raw_len: int) -> int:
        """Smallest block :meth:`compress` can return for ``raw_len`` bytes.  A record that
        declares less is damaged or crafted, and readers refuse it before allocating."""
        return raw_len if not self.compresses else raw_len // self.max_ratio

    def tuned_for_planes(self) -> Codec:
        """The same codec (same bytes on decode) tuned for byte-grouped planes, if it has such tuning."""
        return self

    def __str__(self) -> str:
        return self.spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.spec == self.spec  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.spec))


def _registry() -> dict[str, type[Codec]]:
    return _REGISTRY


def register_builtins(classes: Sequence[type[Codec]]) -> None:
    """Register the built-in codecs (:mod:`~dcp_tiered.codecs.compressors` does, when imported: the
    package imports it before any use of the registry); they can never be unregistered or replaced."""
    with _LOCK:
        for cls in classes:
            _add(cls)
        _BUILTIN_IDS.update(cls.codec_id for cls in classes)


def _add(cls: type[Codec]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise CodecError(f"register_codec takes a Codec subclass, got {cls!r}")
    cid = cls.codec_id
    if not isinstance(cid, str) or not _ID.fullmatch(cid):
        raise CodecError(f"{cls.__name__}.codec_id must be lowercase letters, digits, '_', '.' or '-' "
                         f"(at most 32, starting with a letter), got {cid!r}")
    if type(cls.max_ratio) is not int or cls.max_ratio < 1 or type(cls.compresses) is not bool:
        raise CodecError(f"{cls.__name__}: max_ratio must be an int >= 1 and compresses a bool")
    old = _REGISTRY.get(cid)
    if old is not None and old is not cls:
        raise CodecError(f"codec id {cid!r} is already registered by {old.__module__}.{old.__qualname__}; "
                         "unregister_codec it first, or pick another id")
    try:
        cls.from_config({"id": cid, **cls.config_from_arg(None)})
    except Exception as exc:
        raise CodecError(f"{cls.__name__}: the plain spec {cid!r} must build a codec with default "
                         f"parameters, but it fails: {exc}") from exc
    _REGISTRY[cid] = cls


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Make ``cls`` readable and writable under its ``codec_id`` (usable as a class decorator).

    Registering the same class twice is a no-op; another class under a taken id is refused.
    """
    with _LOCK:
        _registry()
        _add(cls)
        _from_spec.cache_clear()
    return cls


def unregister_codec(codec_id: str) -> None:
    """Forget a registered codec (tests, plugins being unloaded).  Built-in codecs stay."""
    with _LOCK:
        if codec_id in _registry() and codec_id in _BUILTIN_IDS:
            raise CodecError(f"codec {codec_id!r} is built in and cannot be unregistered")
        _REGISTRY.pop(codec_id, None)
        _from_spec.cache_clear()


def registered_codecs() -> dict[str, type[Codec]]:
    """The registered codec classes by id, built-in ones first."""
    return dict(_registry())


def valid_specs() -> str:
    """The accepted spec strings, for error messages."""
    return ", ".join(cls.spec_help or cid for cid, cls in _registry().items())


def get_codec(spec: str | Mapping[str, Any] | Codec) -> Codec:
    """Return the codec for a spec string, a config dict with ``"id"``, or a codec instance.

    An id that is not registered is looked up among the installed plugins (entry point group
    ``dcp_tiered.codecs``).  Raises :class:`CodecError` (a ``ValueError``) for an unknown id, a bad
    parameter, a plugin that fails to load, or an instance of a class that is not registered (a
    checkpoint written with it could not be read).
    """
    if isinstance(spec, Codec):
        if _lookup(spec.codec_id) is not type(spec):
            raise CodecError(f"codec {spec!r} is not registered: call register_codec({type(spec).__name__}) first")
        return spec
    if isinstance(spec, str):
        return _from_spec(spec)
    if isinstance(spec, Mapping):
        cid = spec.get("id")
        cls = _lookup(cid)
        if cls is None:
            raise CodecError(f"unknown codec id {cid!r} in config {dict(spec)!r}; {_how_to_add(cid)}")
        return _build(cls, spec, f"config {dict(spec)!r}")
    raise CodecError(f"codec must be a string such as 'zstd:3', got {spec!r}; valid: {valid_specs()}")


def _how_to_add(cid: object) -> str:
    return (f"valid: {valid_specs()}. A codec of another package is found by entry point: install the package "
            f"that provides {cid!r} in entry point group {CODEC_GROUP!r} (or call register_codec in this process)")


@functools.lru_cache(maxsize=256)
def _from_spec(spec: str) -> Codec:
    # Cached: records repeat a handful of specs; failures are not cached, and
    # register/unregister clear the cache.
    if len(spec) > MAX_SPEC_LEN:
        raise CodecError(f"codec spec of {len(spec)} characters is too long (at most {MAX_SPEC_LEN}); valid: {valid_specs()}")
    cid, sep, arg = spec.strip().lower().partition(":")
    cls = _lookup(cid)
    if cls is None:
        raise CodecError(f"unknown codec {spec!r}; {_how_to_add(cid)}")
    try:
        config = cls.config_from_arg(arg if sep else None)
    except (ValueError, TypeError) as exc:
        raise CodecError(f"invalid codec {spec!r}: {exc}; valid: {valid_specs()}") from exc
    return _build(cls, {"id": cid, **config}, repr(spec))


def _lookup(cid: object) -> type[Codec] | None:
    """The class registered under ``cid``, else the one an installed plugin declares for it (registered
    on first use), else None."""
    if not isinstance(cid, str):
        return None
    cls = _REGISTRY.get(cid)
    if cls is not None or not _ID.fullmatch(cid):
        return cls
    # Loaded without holding _LOCK: a plugin's module may register codecs while it is imported.
    plugin = load_plugin(CODEC_GROUP, cid, CodecError, _BUILTIN_IDS, f"codec {cid!r}")
    if plugin is None:
        return None
    with _LOCK:
        return _register_plugin(cid, plugin)


def _register_plugin(cid: str, plugin: Plugin) -> type[Codec]:
    cls = plugin.obj
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise CodecError(f"{plugin.where} names {cls!r}, which is not a Codec subclass: the entry point must name "
                         "the codec class; report it to the plugin's authors, or uninstall it")
    if cls.codec_id in _BUILTIN_IDS:
        raise CodecError(f"{plugin.where} names {cls.__qualname__}, whose codec_id {cls.codec_id!r} is built in: a "
                         "plugin cannot replace a built-in codec; report it to the plugin's authors, or uninstall it")
    if cls.codec_id != cid:
        raise CodecError(f"{plugin.where} names {cls.__qualname__}, whose codec_id is {cls.codec_id!r}: a codec's "
                         "entry point must be named by its codec_id; report it to the plugin's authors, or uninstall it")
    if _REGISTRY.get(cid) is not cls:  # (its module may have registered it when imported)
        try:
            _add(cls)
        except CodecError as exc:
            raise CodecError(f"{plugin.where}: {exc}") from exc
        _from_spec.cache_clear()
    return cls


def _build(cls: type[Codec], config: Mapping[str, Any], what: str) -> Codec:
    try:
        codec = cls.from_config(config)
    except (ValueError, TypeError) as exc:
        raise CodecError(f"invalid codec {what}: {exc}; valid: {valid_specs()}") from exc
    if not isinstance(codec, cls):
        raise CodecError(f"{cls.__name__}.from_config returned {type(codec).__name__}, not a {cls.__name__}")
    return codec


def check_block_len(out: object, raw_len: int, codec: Codec) -> object:
    """Return ``out`` if it holds exactly ``raw_len`` bytes, else raise ``CorruptCheckpointError``."""
    n = memoryview(out).nbytes
    if n != raw_len:
        raise CorruptCheckpointError(f"{codec.spec} block decoded to {n} bytes, expected {raw_len}")
    return out
