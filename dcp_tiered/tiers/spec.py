"""``Tier``: where a class of checkpoints goes, how often, how many are kept, and how encoded."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from dcp_tiered.codecs import parse_codec
from dcp_tiered.errors import CodecError, ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|m|min|h|hr|d)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {None: 1.0, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0}
DTYPES = ("bf16", "fp16")


def parse_duration(value: "str | float | int | None", where: str = "duration") -> float | None:
    """``"5m"`` -> 300.0; numbers are seconds; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration such as '5m' or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(f"{where}: cannot read {value!r} as a duration; use e.g. '30s', '5m', '1h' or seconds")
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2).lower() if m.group(2) else None]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{where}: must be a positive finite number of seconds, got {value!r}")
    return seconds


@dataclass(frozen=True)
class Tier:
    """One storage tier.

    Args:
        name: unique name (``"local"``, ``"shared"``, ``"durable"``).
        url: any fsspec URL or local path; may contain ``{rank}`` or ``{node}`` for
            node-local storage (each rank writes its own files there).
        every: minimum time between saves to this tier (``"5m"``, ``"30s"``, seconds).
        every_steps: minimum steps between saves to this tier.
        max_per_hour: cap on saves per rolling hour (for object stores billed per request).
        keep: committed checkpoints kept by retention (at least 1).
        codec: ``"none"``, ``"lz4"``, ``"zstd"``, ``"zstd:N"``.
        storage_options: passed to fsspec.
        dtype: ``"bf16"`` or ``"fp16"`` to store floating tensors in 16 bits (safe downcast).

    A tier with neither ``every`` nor ``every_steps`` is due on every save.
    """

    name: str
    url: str
    every: float | None = None
    every_steps: int | None = None
    max_per_hour: int | None = None
    keep: int = 2
    codec: str = "zstd"
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None

    def __post_init__(self) -> None:
        where = f"tier {self.name!r}"
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ConfigError(f"tier name must be letters, digits, '_', '.', '-', got {self.name!r}")
        if not isinstance(self.url, (str, os.PathLike)) or not str(self.url):
            raise ConfigError(f"{where}: field 'url' must be a path or fsspec URL, got {self.url!r}")
        object.__setattr__(self, "url", os.fspath(self.url))
        object.__setattr__(self, "every", parse_duration(self.every, f"{where}: field 'every'"))
        for name in ("every_steps", "max_per_hour", "keep"):
            value = getattr(self, name)
            if value is None and name != "keep":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: field {name!r} must be a positive integer, got {value!r}")
        try:
            object.__setattr__(self, "codec", str(parse_codec(self.codec)))
        except CodecError as exc:
            raise ConfigError(f"{where}: field 'codec': {exc}") from exc
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"{where}: field 'storage_options' must be a mapping, got {type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"{where}: field 'dtype' must be one of {DTYPES} or omitted, got {self.dtype!r}")

    def __hash__(self) -> int:
        return hash((self.name, self.url))

    @property
    def node_local(self) -> bool:
        """Whether the URL is per rank or per node (``{rank}`` / ``{node}``)."""
        return "{rank}" in self.url or "{node}" in self.url

    def resolved_url(self, rank: int = 0, node: int = 0) -> str:
        """The URL with ``{rank}`` and ``{node}`` filled in."""
        return self.url.replace("{rank}", str(rank)).replace("{node}", str(node))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], index: int = 0) -> "Tier":
        """Build a tier from a mapping of the same fields (YAML), with errors naming the tier and field."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"tier #{index + 1}: expected a mapping of fields, got {type(data).__name__}")
        name = data.get("name", f"#{index + 1}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise ConfigError(f"tier {name!r}: unknown field(s) {unknown}; known: {sorted(known)}")
        for required in ("name", "url"):
            if required not in data:
                raise ConfigError(f"tier {name!r}: missing required field {required!r}")
        return cls(**dict(data))


def validate_tiers(tiers: Sequence[Tier]) -> list[Tier]:
    """Check a tier list (fastest first): non-empty, unique names and URLs."""
    tiers = list(tiers)
    if not tiers:
        raise ConfigError("at least one tier is needed")
    for t in tiers:
        if not isinstance(t, Tier):
            raise ConfigError(f"expected Tier objects, got {type(t).__name__}")
    names = [t.name for t in tiers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"tier names must be unique; repeated: {dup}")
    urls = [t.url for t in tiers]
    dup = sorted({u for u in urls if urls.count(u) > 1})
    if dup:
        raise ConfigError(f"tier URLs must differ; repeated: {dup}")
    return tiers


def load_tiers_yaml(path: "str | os.PathLike[str]") -> tuple[list[Tier], dict[str, Any]]:
    """Read ``tiers:`` (a list of tier mappings) and optional checkpointer options from YAML."""
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - optional extra
        raise ConfigError("reading tiers from YAML needs PyYAML: pip install 'dcp-tiered[yaml]'") from exc
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read tier file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"tier file {path} is not valid YAML: {exc}") from exc
    if isinstance(doc, list):
        doc = {"tiers": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("tiers"), list):
        raise ConfigError(f"tier file {path}: expected a top-level 'tiers:' list")
    tiers = validate_tiers([Tier.from_dict(t, i) for i, t in enumerate(doc["tiers"])])
    options = {k: v for k, v in doc.items() if k != "tiers"}
    return tiers, options
