"""``CheckpointerOptions``: the one list of ``TieredCheckpointer`` options.

``TieredCheckpointer(tiers, **kwargs)``, ``TieredCheckpointer.from_yaml`` and
``dcp-tiered train`` all build their options here, so the fields, their types, their
defaults and their error messages exist once.

A stdlib frozen dataclass with one checker per field (the ``check`` metadata) rather than a
validation library: the package depends on none (pydantic is not a dependency, and
``import dcp_tiered`` must stay light), and the checks are short: strict booleans,
positive counts, durations and a list of strings.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from dcp_tiered.checks import check_count, check_frame_size
from dcp_tiered.errors import ConfigError
from dcp_tiered.tiers.spec import check_str_list, parse_duration


def _flag(value: object, name: str) -> bool:
    """A real bool: YAML ``"false"`` or ``"no"`` in quotes is a string, and a string is refused
    (it would be truthy), with the hint to write the boolean unquoted."""
    if not isinstance(value, bool):
        hint = "; write true or false without quotes" if isinstance(value, str) else ""
        raise ConfigError(f"{name} must be True or False, got {value!r}{hint}")
    return value


def _on_busy(value: object, name: str) -> str:
    if value not in ("wait", "skip"):
        raise ConfigError(f"{name} must be 'wait' or 'skip', got {value!r}")
    return str(value)


def parse_grace(value: object, name: str = "leftover_grace") -> float:
    """A duration (``"1h"``, ``"1h30m"``, seconds) or 0 (``0``, ``"0"``, ``"0s"``: remove leftovers at once), in seconds."""
    if not isinstance(value, bool) and (value == 0 or (isinstance(value, str) and value.strip() in ("0", "0s"))):
        return 0.0
    if value is None:  # YAML "leftover_grace:" with no value; retention would fail on every run
        raise ConfigError(f"{name} must be a duration such as '1h' or 0, got None")
    return parse_duration(value, name)  # type: ignore[arg-type, return-value]


def _path(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"{name} must be a file path or omitted, got {value!r}")
    return os.fspath(value)  # type: ignore[return-value]


def _nice(value: object, name: str) -> int:
    return check_count(value, name, 0, 19)  # type: ignore[return-value]


def default_background_threads(threads: int | None = None) -> int:
    """Encode threads of a background save when ``background_threads`` is not given: the cores of
    this rank (:func:`~dcp_tiered.dcp.writer.default_threads`, or ``threads``) less torch's intra-op
    threads, which the training step uses, and at least 1."""
    import torch

    from dcp_tiered.dcp.writer import default_threads

    share = threads or default_threads()
    return max(1, min(share, default_threads() - torch.get_num_threads()))


def _field(default: Any, check: Callable[[Any, str], Any]) -> Any:
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True)
class CheckpointerOptions:
    """Options of :class:`~dcp_tiered.tiers.checkpointer.TieredCheckpointer` (validated, normalized).

    Args:
        async_save: stage the state to host memory and write in the background; at most
            one save is in flight, staging buffers are reused between saves.
        optimizer_every: every Nth save holds the optimizer state (the entries named by
            ``optimizer_keys``); the others hold the model only.
        optimizer_keys: top-level keys, or dotted paths into the (``Stateful``-expanded)
            state, of the optimizer state: ``["app.optim"]`` for the DCP tutorial's
            ``{"app": AppState(model, optimizer)}``.  A warning says when none matches.
        on_busy: ``"wait"`` (default) or ``"skip"`` when a save is due while one is in flight.
        event_log: path of a JSON-lines file receiving every save/promotion/restore report.
        threads: compression threads per save (default: the cores of the node over its ranks).
            Synchronous saves use them all (the training loop waits anyway).
        background_threads: the CPU budget of an async save while training runs: its encode
            threads (default: this rank's cores less torch's intra-op threads, at least 1:
            :func:`default_background_threads`).  Promotions run one thread per target tier,
            and their re-encodes share these coder slots with async saves.
        nice: CPU priority offset (0 to 19) of async saves and promotions, so the training
            loop gets the cores first (default 10; 0: the training's priority).
        frame_size: raw bytes per compressed frame (default 4 MiB).
        resume_promotions: resume the unfinished promotions of an earlier run (after the
            first restore, or at the first save, ``wait`` or ``close``).
        via_fastest: when only slower tiers are due, write to the fastest tier too and
            promote from there (the default), so a slow tier never blocks the training loop
            for longer than a fast-tier save.
        leftover_grace: retention removes an uncommitted leftover only once it is this old
            (another process may still be writing it): a duration such as ``"1h"``,
            ``"1h30m"`` or seconds; ``0`` removes leftovers at once.  Kept in seconds.

    Every error is a short :class:`~dcp_tiered.errors.ConfigError` naming the field.
    """

    async_save: bool = _field(False, _flag)
    optimizer_every: int = _field(1, lambda v, n: check_count(v, n))
    optimizer_keys: tuple[str, ...] = _field(("optim", "optimizer"), check_str_list)
    on_busy: str = _field("wait", _on_busy)
    event_log: str | None = _field(None, _path)
    threads: int | None = _field(None, lambda v, n: check_count(v, n, optional=True))
    background_threads: int | None = _field(None, lambda v, n: check_count(v, n, optional=True))
    nice: int = _field(10, _nice)
    frame_size: int | None = _field(None, lambda v, n: check_frame_size(v, optional=True))
    resume_promotions: bool = _field(True, _flag)
    via_fastest: bool = _field(True, _flag)
    leftover_grace: float = _field(3600.0, parse_grace)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f.name))

    @classmethod
    def names(cls) -> list[str]:
        """The option names, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str | None = None,
                     base: "CheckpointerOptions | None" = None) -> "CheckpointerOptions":
        """Options from a mapping (a YAML document, command-line flags) over ``base``.

        Unknown keys and values of the wrong type give a short :class:`ConfigError`
        naming the field, prefixed with ``where`` (e.g. the YAML file).
        """
        prefix = f"{where}: " if where else ""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{prefix}options must be a mapping, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in cls.names())
        if unknown:
            raise ConfigError(f"{prefix}unknown option(s) {unknown}; known: {sorted(cls.names())}")
        try:
            return dataclasses.replace(base or cls(), **data)
        except ConfigError as exc:
            raise ConfigError(f"{prefix}{exc}") from None

    @classmethod
    def merged(cls, base: "CheckpointerOptions | None", changes: Mapping[str, Any],
               caller: str = "TieredCheckpointer") -> "CheckpointerOptions":
        """``base`` (default options when None) with keyword ``changes``; an unknown keyword is a
        ``TypeError`` as for any Python call, listing the options."""
        if base is not None and not isinstance(base, cls):
            raise ConfigError(f"options must be a CheckpointerOptions, got {type(base).__name__}")
        unknown = sorted(k for k in changes if k not in cls.names())
        if unknown:
            raise TypeError(f"{caller}() got unexpected keyword argument(s) {unknown}; options: {cls.names()}")
        if not changes:
            return base or cls()
        return dataclasses.replace(base or cls(), **changes)

    def background_threads_or_default(self) -> int:
        """``background_threads``, or :func:`default_background_threads` of ``threads`` when not given."""
        return self.background_threads or default_background_threads(self.threads)

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments of ``TieredCheckpointer``."""
        return {name: getattr(self, name) for name in self.names()}
