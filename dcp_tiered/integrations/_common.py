"""Pieces shared by the framework integrations: building the checkpointer late, and
gathering/applying model and optimizer state through ``torch.distributed.checkpoint.state_dict``."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcp_tiered.dcp.statedict import OptimizerSnapshot  # noqa: F401 - the integrations use it from here
from dcp_tiered.errors import ConfigError
from dcp_tiered.tiers.checkpointer import TieredCheckpointer
from dcp_tiered.tiers.config import Tier

CheckpointerSource = Any  # TieredCheckpointer | Sequence[Tier] | YAML path | zero-argument factory


def build_checkpointer(source: CheckpointerSource, options: dict[str, Any]) -> Any:
    """A TieredCheckpointer from an instance, a list of tiers, a YAML path or a factory.

    Called late (once the framework set up its process group): TieredCheckpointer reads the
    distributed state when constructed.
    """
    if isinstance(source, TieredCheckpointer):
        if options:
            raise ConfigError(f"checkpointer options {sorted(options)} given with a ready TieredCheckpointer")
        return source
    if isinstance(source, (str, os.PathLike)):
        return TieredCheckpointer.from_yaml(source, **options)
    if isinstance(source, Sequence) and source and all(isinstance(t, Tier) for t in source):
        return TieredCheckpointer(list(source), **options)
    if callable(source):
        ck = source()
        if not isinstance(ck, TieredCheckpointer):
            raise ConfigError(f"the checkpointer factory returned {type(ck).__name__}, not a TieredCheckpointer")
        return ck
    raise ConfigError(
        "expected a TieredCheckpointer, a list of Tier, a YAML path or a factory, "
        f"got {type(source).__name__}"
    )


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    return get_model_state_dict(model)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameter-name keyed optimizer state; initializes empty state (a zero-lr step)."""
    return get_optimizer_state_dict(model, optimizer)


def apply_model_state(model: torch.nn.Module, sd: dict[str, Any]) -> None:
    set_model_state_dict(model, sd)


def apply_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    set_optimizer_state_dict(model, optimizer, sd)


def to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} is not JSON-serializable ({exc}); it cannot be checkpointed by this integration") from exc


def one_object(value: Any) -> tuple[Any]:
    """Wrap ``value`` so DCP stores it as one object instead of flattening it.

    DCP flattens mappings (and lists holding tensors or mappings) into one entry per leaf,
    which a restore template must then match key for key; any other value, such as this
    1-tuple, is one entry, written with ``torch.save`` and read back with
    ``torch.load(weights_only=True)``: builtins, containers and tensors only.
    """
    return (value,)


def from_one_object(stored: Any) -> Any:
    """The value wrapped by :func:`one_object`, as loaded back."""
    if not (isinstance(stored, (tuple, list)) and len(stored) == 1):
        raise ConfigError(f"expected a 1-tuple written by one_object(), got {type(stored).__name__}")
    return stored[0]


def restore_kwargs(step: int | None, broadcast: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"step": step}
    if broadcast is not False and broadcast is not None:
        kwargs["broadcast"] = broadcast
    return kwargs


def call_restore(ck: Any, state: dict[str, Any], step: int | None, broadcast: Any) -> int | None:
    import inspect

    kwargs = restore_kwargs(step, broadcast)
    if "broadcast" in kwargs and "broadcast" not in inspect.signature(ck.restore).parameters:
        raise ConfigError("broadcast=True needs TieredCheckpointer.restore(..., broadcast=) (not in this version)")
    return ck.restore(state, **kwargs)



def rng_state() -> dict[str, Any]:
    """This process's random states, as ``accelerator.save_state`` saves them: python ``random``,
    numpy (when installed), torch CPU and every CUDA device (when available).

    Only builtins and tensors (numpy's key array becomes an int64 tensor), so the state
    loads with ``torch.load(weights_only=True)`` without any safe-globals opt-in.
    """
    import random

    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"python": (int(version), torch.tensor(internal, dtype=torch.int64), gauss),
                           "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch and accelerate
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available():
        out["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Apply a state of :func:`rng_state` (the parts present; CUDA devices beyond this machine's are skipped)."""
    import random

    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal.tolist()), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
