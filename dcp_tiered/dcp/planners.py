"""``DowncastSavePlanner``: store floating tensors in 16 bits, safely, and get dtypes back on load.

The planner keeps DCP's metadata in the original dtype and hands the storage writer a
16-bit copy of each selected tensor.  Readers copy the 16-bit values into destinations of
the original dtype (``copy_`` upcasts), and loading into an empty state dict creates
tensors from the metadata, so the original dtypes come back either way.  Each tensor is
range-checked against its target (:func:`downcast_problem`): a finite value past the target's
largest (65504 for float16, about 3.39e38 for bfloat16; it would become inf) or nonzero values
that would flush to zero (beyond ``underflow_tolerance``) keep the tensor in its own dtype.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from dcp_tiered.errors import ConfigError

log = logging.getLogger(__name__)

#: Keys left in their own dtype unless ``exclude`` is given: optimizer state, whose small
#: second moments are exactly what 16-bit storage destroys.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "optim.*",
    "optimizer.*",
    "optim_state*",
    "*.exp_avg",
    "*.exp_avg_sq",
    "*.max_exp_avg_sq",
    "*.momentum_buffer",
    "*.square_avg",
)
_TARGETS = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: Elements the range check examines at a time: its temporaries stay a few MiB whatever the tensor's size.
RANGE_CHUNK = 1 << 20

@dataclass
class DowncastReport:
    """What the planner did on the last save: keys stored in 16 bits, keys kept and why."""

    dtype: str
    downcast: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    unmatched_patterns: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "downcast": list(self.downcast),
            "kept": dict(self.kept),
            "unmatched_patterns": list(self.unmatched_patterns),
        }


def _chunks(tensor: torch.Tensor) -> Any:
    """``tensor``'s elements as 1-D pieces of about :data:`RANGE_CHUNK`, views where the layout allows."""
    t = tensor.detach()
    if t.is_contiguous() or t.dim() < 2:
        flat = t.reshape(-1)  # a view, except for a strided 1-D tensor (a copy of it)
        return (flat[i:i + RANGE_CHUNK] for i in range(0, flat.numel(), RANGE_CHUNK))
    rows = max(1, RANGE_CHUNK // max(1, t[0].numel()))
    return (t[i:i + rows].reshape(-1) for i in range(0, t.shape[0], rows))


def range_problem(tensor: torch.Tensor, dtype: torch.dtype, underflow_tolerance: float) -> str | None:
    """Why the values of ``tensor`` would not survive a cast to ``dtype``, or None if they would.

    Refused: a finite value past ``dtype``'s largest (it would become inf, or at best round to the largest),
    and more than ``underflow_tolerance`` of the nonzero values at or under half ``dtype``'s smallest
    subnormal (they would become 0).  NaN and Inf stay what they are and count as neither.  Linear: a few
    vectorised operations on one chunk of :data:`RANGE_CHUNK` elements at a time.
    """
    info = torch.finfo(dtype)
    tiny = info.smallest_normal * info.eps / 2  # half the smallest subnormal: rounds to 0
    name = _TARGETS.get(dtype, str(dtype))
    nonzero = flushed = 0
    for piece in _chunks(tensor):
        mag = piece.abs().nan_to_num_(nan=0.0, posinf=0.0)
        if not mag.numel():
            continue
        peak = float(mag.max())
        if peak > info.max:
            return f"overflow: max |x| = {peak:.3g} > {info.max:.4g}, the largest {name}"
        zeros = mag.numel() - int(torch.count_nonzero(mag))
        nonzero += mag.numel() - zeros
        flushed += int(torch.count_nonzero(mag <= tiny)) - zeros
    if nonzero and flushed / nonzero > underflow_tolerance:
        return f"underflow: {flushed} of {nonzero} nonzero values would become 0 in {name}"
    return None


def narrows(src: torch.dtype) -> bool:
    """Whether the downcast applies to tensors of dtype ``src``: floating and wider than 16 bits (the one rule
    of :class:`DowncastSavePlanner`, ``convert --dtype`` and ``export --dtype``)."""
    return src.is_floating_point and src.itemsize > 2


def downcast_problem(tensor: torch.Tensor, dtype: torch.dtype, underflow_tolerance: float = 1e-3) -> str | None:
    """Why ``tensor`` (of a dtype that :func:`narrows`) must keep its own dtype rather than become ``dtype``,
    or None when the downcast is safe: the one rule of the safe downcast, for either target
    (:func:`range_problem`: no finite value becomes inf, few nonzero values become 0)."""
    if dtype not in _TARGETS:
        raise ConfigError(f"downcast dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    return range_problem(tensor, dtype, underflow_tolerance)


class DowncastSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` that stores selected floating tensors as bfloat16 or float16.

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        include: glob patterns of (flattened, dot-joined) keys to downcast; default all.
        exclude: glob patterns never to downcast; default :data:`DEFAULT_EXCLUDE`
            (optimizer state). Pass ``()`` to downcast optimizer state too.
        underflow_tolerance: the fraction of a tensor's nonzero values allowed to flush to
            zero in ``dtype`` before the tensor is kept in its own dtype (0: none).
        **kwargs: passed to ``DefaultSavePlanner``.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] | None = None,
        underflow_tolerance: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if dtype not in _TARGETS:
            raise ConfigError(f"DowncastSavePlanner dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if isinstance(include, str) or (exclude is not None and isinstance(exclude, str)):
            raise ConfigError("include/exclude take a list of glob patterns, not a single string")
        if not 0 <= underflow_tolerance < 1:
            raise ConfigError(f"underflow_tolerance must be in [0, 1), got {underflow_tolerance}")
        self.dtype = dtype
        self.include = tuple(include)
        self.exclude = tuple(DEFAULT_EXCLUDE if exclude is None else exclude)
        # Only patterns the caller wrote are reported when they match nothing.
        self._explicit = (() if tuple(include) == ("*",) else tuple(include)) + (() if exclude is None else tuple(exclude))
        self.underflow_tolerance = underflow_tolerance
        self.report = DowncastReport(_TARGETS[dtype])
        self._cast: set[MetadataIndex] = set()

    def _selected(self, key: str, used: set[str]) -> bool:
        inc = [p for p in self.include if fnmatch.fnmatchcase(key, p)]
        exc = [p for p in self.exclude if fnmatch.fnmatchcase(key, p)]
        used.update(inc, exc)
        return bool(inc) and not exc

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.report = DowncastReport(_TARGETS[self.dtype])
        self._cast = set()
        used: set[str] = set()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            key = item.index.fqn
            src = item.tensor_data.properties.dtype
            if not self._selected(key, used):
                continue
            if not narrows(src):
                continue
            problem = downcast_problem(self.lookup_object(item.index), self.dtype, self.underflow_tolerance)
            if problem:
                self.report.kept[key] = problem
                continue
            self._cast.add(item.index)
            if key not in self.report.downcast:
                self.report.downcast.append(key)
        self.report.unmatched_patterns = [p for p in self._explicit if p not in used]
        if self.report.unmatched_patterns:
            log.warning("DowncastSavePlanner: patterns matched no key: %s", self.report.unmatched_patterns)
        for key, why in self.report.kept.items():
            log.info("DowncastSavePlanner: kept %s in its own dtype (%s)", key, why)
        return plan

    def transform_object(self, write_item: Any, object: Any) -> Any:
        if write_item.index in self._cast and isinstance(object, torch.Tensor):
            object = object.detach().to(self.dtype)
        return super().transform_object(write_item, object)
