"""The configuration of tiers and of the checkpointer, torch-free: ``Tier`` (where a class of
checkpoints goes, how often, how many are kept, how encoded), ``CheckpointerOptions`` (the
one list of ``TieredCheckpointer`` options) and the parsers they share (durations, sizes,
whether a path lives in RAM).

``TieredCheckpointer(tiers, **kwargs)``, ``TieredCheckpointer.from_yaml`` and
``dcp-tiered train`` all build their options here, so the fields, their types, their
defaults and their error messages exist once.  Options are a stdlib frozen dataclass with
one checker per field (the ``check`` metadata) rather than a validation library: the
package depends on none (``import dcp_tiered`` must stay light), and the checks are short.

This module is the ground floor of ``tiers/``: it imports nothing of the package above
``codecs``, ``storage`` and the root modules, so every other tier module may use ``Tier``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import fsspec

from dcp_tiered.checks import check_count, check_frame_size, parse_bytes
from dcp_tiered.codecs import get_codec
from dcp_tiered.errors import CodecError, ConfigError, StorageError
from dcp_tiered.ranks import default_threads
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.storage.paths import location

# One "number unit" part of a duration; longer unit names first so "ms" is not read as "m".
# ASCII only: Python's \s also matches control characters such as \x1f, which float() refuses.
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|sec|min|hr|s|m|h|d)", re.IGNORECASE | re.ASCII)
_NUMBER = re.compile(r"\s*(\d+(?:\.\d+)?)\s*", re.ASCII)
_SPACE = " \t\n\r\f\v"
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0}
DTYPES = ("bf16", "fp16")
KINDS = ("memory", "storage")


#: File system types whose files live in RAM.
MEMORY_FSTYPES = frozenset({"tmpfs", "ramfs"})


#: Where Linux keeps its shared-memory tmpfs.
SHM_DIR = "/dev/shm"


def mount_fstype(mounts: str, path: str) -> str | None:
    """The file system type of the mount holding absolute ``path``, from ``/proc/mounts`` text (the longest
    mount point containing it wins; mount points use octal escapes for spaces)."""
    best, fstype = "", None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype


def existing_parent(path: str) -> str:
    """``path`` or, when it does not exist yet, its nearest existing parent."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def is_memory_path(path: str) -> bool:
    """Whether local ``path`` (or, when it does not exist yet, its nearest existing parent) is on a tmpfs."""
    real = os.path.realpath(existing_parent(os.path.abspath(os.path.expanduser(path))))
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            fstype = mount_fstype(f.read(), real)
    except OSError:  # no /proc (not Linux): only the well-known place
        fstype = None
    if fstype is not None:
        return fstype in MEMORY_FSTYPES
    return real == SHM_DIR or real.startswith(SHM_DIR + "/")


class _Default:
    """Marks a field left to its default, which depends on the tier's kind (see :class:`Tier`)."""

    def __repr__(self) -> str:
        return "<default>"


DEFAULT: Any = _Default()


def _duration_seconds(text: str) -> float | None:
    """Seconds of ``"90"``, ``"5m"`` or a compound ``"1h30m"``/``"1d 2h"`` (units from the largest
    down, each once); None when ``text`` is not such a duration."""
    number = _NUMBER.fullmatch(text)
    if number:
        return float(number.group(1))
    pos, total, last = 0, 0.0, float("inf")
    text = text.strip(_SPACE)
    while pos < len(text):
        m = _PART.match(text, pos)
        if not m:
            return None
        unit = _UNIT_SECONDS[m.group(2).lower()]
        if unit >= last:  # "30m1h", "1h1h": a typo, not a sum
            return None
        total, last = total + float(m.group(1)) * unit, unit
        pos = m.end()
        while pos < len(text) and text[pos] in _SPACE:
            pos += 1
    return total if text else None


def parse_duration(value: "str | float | int | None", where: str = "duration") -> float | None:
    """``"5m"`` -> 300.0, ``"1h30m"`` -> 5400.0; numbers are seconds; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration such as '5m' or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds: float | None = float(value)
    else:
        seconds = _duration_seconds(str(value))
        if seconds is None:
            raise ConfigError(f"{where}: cannot read {value!r} as a duration; use e.g. '30s', '5m', '1h30m' or seconds")
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
        keep: committed checkpoints kept by retention (at least 1; default 2, 1 for a memory tier).
        codec: ``"none"``, ``"lz4"``, ``"zstd"``, ``"zstd:N"``, or a registered codec's spec (default
            ``"zstd"``, ``"none"`` for a memory tier).
        storage_options: passed to fsspec.
        dtype: ``"bf16"`` or ``"fp16"`` to store floating tensors in 16 bits (safe downcast).
        memory_budget: most bytes the tier may hold on one node, as bytes or ``"8GiB"``/``"512MiB"``;
            a save that would not fit fails before writing anything (see :mod:`dcp_tiered.tiers.save.budget`).
        kind: ``"memory"`` or ``"storage"``; inferred when omitted: ``"memory"`` for a local path on
            ``/dev/shm`` or another tmpfs.
        replicas: copies of each rank's files on a node-local tier, its own included (default 1: no
            replication); the others go to peer ranks ``replication_jump`` apart, see
            :mod:`dcp_tiered.tiers.replicas.replicate`.
        replication_jump: rank distance between the copies (default: ranks per node, so that no copy
            shares the owner's node).

    A tier with neither ``every`` nor ``every_steps`` is due on every save.  A memory tier survives a
    crashed training process, not a lost node; it is always checked against the free RAM of its file
    system before a save, and against ``memory_budget`` when given.
    """

    name: str
    url: str
    every: float | None = None
    every_steps: int | None = None
    max_per_hour: int | None = None
    keep: int = DEFAULT  # type: ignore[assignment]
    codec: str = DEFAULT  # type: ignore[assignment]
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    memory_budget: int | str | None = None
    kind: str | None = None
    replicas: int = 1
    replication_jump: int | None = None

    def __post_init__(self) -> None:
        where = f"tier {self.name!r}"
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ConfigError(f"tier name must be letters, digits, '_', '.', '-', got {self.name!r}")
        if not isinstance(self.url, (str, os.PathLike)) or not str(self.url):
            raise ConfigError(f"{where}: field 'url' must be a path or fsspec URL, got {self.url!r}")
        object.__setattr__(self, "url", os.fspath(self.url))
        if any(ord(c) < 32 for c in self.url):
            raise ConfigError(f"{where}: field 'url' contains a control character: {self.url!r}")
        object.__setattr__(self, "every", parse_duration(self.every, f"{where}: field 'every'"))
        self._memory_fields(where)
        for name in ("every_steps", "max_per_hour", "keep", "replicas", "replication_jump"):
            value = getattr(self, name)
            if value is None and name not in ("keep", "replicas"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: field {name!r} must be a positive integer, got {value!r}")
        try:
            object.__setattr__(self, "codec", str(get_codec(self.codec)))
        except CodecError as exc:
            raise ConfigError(f"{where}: field 'codec': {exc}") from exc
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"{where}: field 'storage_options' must be a mapping, got {type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.replicas > 1 and not self.node_local:
            raise ConfigError(f"{where}: field 'replicas' needs a node-local URL ({{node}} or {{rank}} in it), got {self.url!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"{where}: field 'dtype' must be one of {DTYPES} or omitted, got {self.dtype!r}")

    def _memory_fields(self, where: str) -> None:
        """Resolve ``kind``, ``memory_budget`` and the defaults of ``keep``/``codec`` that depend on the kind."""
        if self.kind is not None and self.kind not in KINDS:
            raise ConfigError(f"{where}: field 'kind' must be one of {KINDS} or omitted, got {self.kind!r}")
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget, f"{where}: field 'memory_budget'"))
        if self.kind is None:
            protocol, path = fsspec.core.split_protocol(self.resolved_url())
            memory = protocol in (None, "file", "local") and is_memory_path(path)
            object.__setattr__(self, "kind", "memory" if memory else "storage")
        memory = self.kind == "memory"
        if self.keep is DEFAULT:
            object.__setattr__(self, "keep", 1 if memory else 2)
        if self.codec is DEFAULT:
            object.__setattr__(self, "codec", "none" if memory else "zstd")

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


def _nested(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _check_local_dir(tier: Tier, path: str, probe: bool) -> None:
    where = f"tier {tier.name!r}: field 'url'"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{where}: {path} exists and is not a directory")
    if not probe:
        return
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{where}: cannot create {path}: {existing} is not a directory")
    read_only = bool(os.statvfs(existing).f_flag & getattr(os, "ST_RDONLY", 1))
    if read_only or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {existing} is not writable" + (" (read-only filesystem)" if read_only else ""))


def _probe_remote(tier: Tier, url: str) -> None:
    try:
        Storage(url, tier.storage_options).check_reachable()
    except MissingFileError as exc:
        raise ConfigError(f"tier {tier.name!r}: field 'url': {exc}") from exc
    except StorageError as exc:
        raise StorageError(f"tier {tier.name!r} is not reachable: {exc}") from exc


def validate_tiers(tiers: Sequence[Tier], *, probe: bool = True, rank: int = 0, node: int = 0) -> list[Tier]:
    """Check a tier list (fastest first) and return it as a list.

    Always: non-empty, only :class:`Tier` objects, unique names, and no two tiers at the same
    or nested places (URLs are compared after :func:`~dcp_tiered.storage.paths.location`, so ``/x`` and ``/x/`` are
    one path); a local tier path that exists must be a directory.

    With ``probe`` (the default) each tier is also reached, as seen by ``rank`` on ``node``:
    the bucket of an object store must exist, and a local directory must be writable (or
    creatable: its nearest existing parent writable).  Nothing is created.  Pass
    ``probe=False`` to check the configuration only (offline tools, a list checked before).
    """
    if isinstance(tiers, (str, bytes, Mapping)):
        raise ConfigError(f"tiers must be a list of Tier objects, got {type(tiers).__name__}")
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
    # Compare the templates and what they resolve to here: '/a/{rank}' and '/a/{node}' meet at '/a/0'.
    for resolve in (False, True):
        places = [location(t.resolved_url(rank, node) if resolve else t.url, t.storage_options) for t in tiers]
        for i, a in enumerate(places):
            for j, b in enumerate(places):
                if i != j and a[:2] == b[:2] and _nested(b[2], a[2]):
                    how = "the URLs name the same place" if a[2] == b[2] else f"the URLs are nested: {tiers[j].url!r} is inside {tiers[i].url!r}"
                    raise ConfigError(
                        f"tiers {tiers[i].name!r} and {tiers[j].name!r}: field 'url': {how} ({b[2]}); "
                        "each tier needs a directory of its own (retention of one would delete the other's checkpoints)"
                    )
    for t in tiers:
        url = t.resolved_url(rank, node)
        family, _, path = location(url, t.storage_options)
        if family == "file":
            _check_local_dir(t, path, probe)
        elif probe:
            _probe_remote(t, url)
    return tiers


def check_str_list(value: object, field: str) -> tuple[str, ...]:
    """A list of strings (e.g. ``optimizer_keys``); a bare ``str`` is an error, not a list of letters."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"{field} must be a list of strings, got {value!r}" +
                          (f"; write [{value!r}]" if isinstance(value, str) else ""))
    if not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{field} must hold non-empty strings, got {list(value)!r}")
    return tuple(value)


def check_step(step: object) -> int:
    """A checkpoint step: a non-negative integer (``-5`` would name ``step_-00000005``, which no listing finds)."""
    return check_count(step, "step", 0)  # type: ignore[return-value]


def load_tiers_yaml(path: "str | os.PathLike[str]") -> tuple[list[Tier], dict[str, Any]]:
    """Read ``tiers:`` (a list of tier mappings) and optional checkpointer options from YAML.

    The tiers come back validated; the options as written (a dict), to be read with
    :meth:`CheckpointerOptions.from_mapping <dcp_tiered.tiers.config.CheckpointerOptions.from_mapping>`,
    as ``TieredCheckpointer.from_yaml`` and ``dcp-tiered train`` do.
    """
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
    tiers = validate_tiers([Tier.from_dict(t, i) for i, t in enumerate(doc["tiers"])], probe=False)
    options = {k: v for k, v in doc.items() if k != "tiers"}
    return tiers, options


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
    this rank (:func:`~dcp_tiered.ranks.default_threads`, or ``threads``) less torch's intra-op
    threads, which the training step uses, and at least 1."""
    import torch  # the options stay importable without torch; this runs when a checkpointer is built

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
