"""Pieces shared by the framework integrations: building the checkpointer late,
gathering/applying model and optimizer state through ``torch.distributed.checkpoint.state_dict``,
and restoring into copies whose every non-tensor part is checked before a live object changes."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcp_tiered.dcp.statedict import OptimizerSnapshot  # noqa: F401 - the integrations use it from here
from dcp_tiered.errors import ConfigError, CorruptCheckpointError
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


#: The longest JSON text a restore decodes (an LR scheduler state is a few KiB).
MAX_JSON_CHARS = 16 << 20


def from_json(text: Any, where: str) -> Any:
    """``json.loads(text)`` of a value read from storage, or :class:`CorruptCheckpointError` naming
    ``where``: not a string, longer than :data:`MAX_JSON_CHARS`, not JSON, or nested too deep."""
    if not isinstance(text, str):
        raise CorruptCheckpointError(f"{where} is of type {type(text).__name__}, not JSON text; nothing was restored "
                                     "(restore another step)")
    if len(text) > MAX_JSON_CHARS:
        raise CorruptCheckpointError(f"{where} is {len(text)} characters of JSON, over {MAX_JSON_CHARS}; "
                                     "nothing was restored (restore another step)")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # a JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{where} is not JSON this version can read ({type(exc).__name__}: "
                                     f"{str(exc)[:200]}); nothing was restored (restore another step)") from None


def staged(tree: Any) -> Any:
    """A copy of state dict ``tree`` to restore into: each tensor a new one like it (device, dtype,
    shape; a DTensor stays one), dicts and lists copied, other values shared.  A restore into it
    changes no live object, so a failure anywhere in it leaves training as it was."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, Mapping):
        return {k: staged(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [staged(v) for v in tree]
    return tree


def fill(live: Any, new: Any) -> Any:
    """``new`` (a restored :func:`staged` copy) put into ``live`` as an in-place restore would:
    tensors copied into, dicts and lists filled, other values replaced; returns what ``live``'s
    holder keeps."""
    if isinstance(live, torch.Tensor) and isinstance(new, torch.Tensor) and live.shape == new.shape:
        with torch.no_grad():
            live.copy_(new)
        return live
    if isinstance(live, dict) and isinstance(new, Mapping):
        for k, v in new.items():
            live[k] = fill(live[k], v) if k in live else v
        return live
    if isinstance(live, list) and isinstance(new, list) and len(live) == len(new):
        live[:] = [fill(a, b) for a, b in zip(live, new)]
        return live
    return new


def _kind(value: Any) -> str:
    return type(value).__name__


def _int_key(key: Any) -> Any:
    if isinstance(key, str) and key.lstrip("-").isdigit() and len(key) < 20:
        return int(key)
    return key


def conform(saved: Any, live: Any, where: str | Callable[[str], str]) -> Any:
    """``saved`` (read from storage) checked against the live value it will replace, or
    :class:`CorruptCheckpointError` naming ``where`` and the path inside it (``.key``, ``.0`` as
    DCP names flattened items; a callable ``where`` gets that path and names both).

    Kinds must match (numbers with numbers, a bool with a bool, ``None`` only where the live
    value is ``None`` or a scalar), a dict holds no key its live dict has not (missing keys are
    left as they are), sequences keep their length (one of a single kind may differ).  JSON
    turned the integer keys of a live dict (``MultiStepLR``'s milestones ``Counter``) into
    strings: they become integers again, and containers get the live value's type back.  The
    walk follows the live value, so its depth is bounded by the live object's, not the input's.
    """
    def bad(path: str, why: str) -> CorruptCheckpointError:
        named = where(path) if callable(where) else f"{where}{path}"
        return CorruptCheckpointError(f"{named}: {why}; nothing was restored (restore another step)")

    def walk(s: Any, v: Any, path: str) -> Any:
        if isinstance(v, bool):
            if not isinstance(s, bool):
                raise bad(path, f"a {_kind(s)} where a bool belongs")
            return s
        if isinstance(v, (int, float)):
            if isinstance(s, bool) or not isinstance(s, (int, float)):
                raise bad(path, f"a {_kind(s)} where a number belongs")
            return s
        if v is None:
            if s is not None and not isinstance(s, (bool, int, float, str)):
                raise bad(path, f"a {_kind(s)} where None or a scalar belongs")
            return s
        if isinstance(v, str):
            if not isinstance(s, str):
                raise bad(path, f"a {_kind(s)} where a str belongs")
            return s
        if isinstance(v, torch.Tensor):
            if not (isinstance(s, torch.Tensor) and s.dtype == v.dtype and s.shape == v.shape):
                got = f"a {s.dtype} tensor of shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else f"a {_kind(s)}"
                raise bad(path, f"{got} where a {v.dtype} tensor of shape {tuple(v.shape)} belongs")
            return s
        if isinstance(v, Mapping):
            if not isinstance(s, Mapping):
                raise bad(path, f"a {_kind(s)} where a dict belongs")
            numbered = bool(v) and all(type(k) is int for k in v)
            items = {(_int_key(k) if numbered else k): x for k, x in s.items()}
            record = bool(v) and all(isinstance(k, str) for k in v)
            extra = [k for k in items if k not in v] if record else []
            if extra:
                raise bad(path, f"keys {sorted(map(str, extra))[:5]} that the live state has not (saved by another "
                                "class or version)")
            sample = next(iter(v.values()), None)
            out = {k: walk(x, v.get(k, sample), f"{path}.{k}") if v else x for k, x in items.items()}
            try:
                holder = copy.copy(v)
                holder.clear()
                holder.update(out)
                return holder
            except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt: a plain dict
                return out
        if isinstance(v, (list, tuple)):
            if not isinstance(s, (list, tuple)):
                raise bad(path, f"a {_kind(s)} where a {_kind(v)} belongs")
            if len(s) == len(v):
                items = [walk(x, y, f"{path}.{i}") for i, (x, y) in enumerate(zip(s, v))]
            elif v and len({_kind(y) for y in v}) == 1:
                items = [walk(x, v[0], f"{path}.{i}") for i, x in enumerate(s)]
            elif v:
                raise bad(path, f"{len(s)} entries where the live value has {len(v)}")
            else:
                items = list(s)
            return tuple(items) if isinstance(v, tuple) else items
        if type(s) is not type(v):
            raise bad(path, f"a {_kind(s)} where a {_kind(v)} belongs")
        return s

    return walk(saved, live, "")


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


_RNG_PARTS = ("python", "numpy", "torch", "cuda")


def check_rng_state(state: Any, where: str) -> dict[str, Any]:
    """A state read from storage for :func:`set_rng_state` (with an optional ``step``), checked: the
    kinds and sizes of its parts, then applied once and this process's states put back, so that
    applying it later cannot fail.  :class:`CorruptCheckpointError` naming ``where`` otherwise."""
    import random

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {why}; nothing was restored (restore another step)")

    def tensor(value: Any, dtype: torch.dtype, numel: int | None, what: str) -> None:
        if not (isinstance(value, torch.Tensor) and value.dtype == dtype and value.dim() == 1
                and (numel is None or value.numel() == numel)):
            got = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                f"a {_kind(value)}"
            raise bad(f"{what} is {got}, not a 1-d {dtype} tensor" + (f" of {numel}" if numel is not None else ""))

    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise bad(f"a {_kind(state)}, not a dict of random states")
    step = state.get("step", 0)
    if type(step) is not int or step < 0:
        raise bad(f"the step is {str(step)[:40]!r}, not a non-negative integer")
    parts = {k: state[k] for k in _RNG_PARTS if k in state}
    if "python" in parts:
        py = parts["python"]
        if not (isinstance(py, (tuple, list)) and len(py) == 3):
            raise bad("the python state is not (version, internal state, gauss)")
        tensor(py[1], torch.int64, len(random.getstate()[1]), "the python internal state")
        if py[2] is not None and (isinstance(py[2], bool) or not isinstance(py[2], (int, float))):
            raise bad(f"the python gauss value is a {_kind(py[2])}")
    if "numpy" in parts:
        npy = parts["numpy"]
        if not (isinstance(npy, (tuple, list)) and len(npy) == 5 and isinstance(npy[0], str)):
            raise bad("the numpy state is not (kind, keys, pos, has_gauss, cached_gaussian)")
        tensor(npy[1], torch.int64, 624, "the numpy keys")
    if "torch" in parts:
        tensor(parts["torch"], torch.uint8, torch.get_rng_state().numel(), "the torch state")
    if "cuda" in parts:
        cuda = parts["cuda"]
        if not isinstance(cuda, (list, tuple)) or len(cuda) > 4096:
            raise bad("the CUDA states are not a list of states")
        for i, s in enumerate(cuda):
            tensor(s, torch.uint8, None, f"the CUDA state of device {i}")
    before = rng_state()
    try:
        set_rng_state(parts)
    except Exception as exc:  # noqa: BLE001 - each setter's refusal of untrusted values (ValueError, OverflowError...)
        raise bad(f"does not apply ({type(exc).__name__}: {str(exc)[:200]})") from None
    finally:
        set_rng_state(before)
    return {**parts, "step": step} if "step" in state else parts
