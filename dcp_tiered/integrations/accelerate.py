"""Accelerate integration: ``Accelerator.save_state``/``load_state`` through a
:class:`~dcp_tiered.TieredCheckpointer`.

```python
from accelerate import Accelerator
from dcp_tiered import Tier, TieredCheckpointer
from dcp_tiered.integrations.accelerate import load_state, save_state

accelerator = Accelerator()
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
ckpt = TieredCheckpointer([Tier("local", "/nvme/ckpt", every_steps=100, keep=2)])  # after Accelerator()
start = load_state(accelerator, ckpt) or 0          # newest good checkpoint, or None
for step in range(start + 1, total):
    ...
    save_state(accelerator, ckpt, step)             # saves when a tier is due (builds nothing otherwise)
ckpt.close()
```

What it saves, from what ``accelerator.prepare`` registered: every model (unwrapped;
``model``, ``model_1``, ...), every optimizer (keyed by parameter name, under ``optim``
so that ``optimizer_every`` applies), the LR schedulers (``scheduler``, as JSON), objects
registered with ``accelerator.register_for_checkpointing`` (``custom``) and an optional
``extra`` dict of your own (or a zero-argument callable returning it).  The state dict is
built only on steps where a tier is due.  Not saved: RNG states and dataloader positions (Accelerate's
own ``save_state`` writes those to a local folder; add them to ``extra`` if you need them).

Importing this module imports ``accelerate``; ``import dcp_tiered`` never does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import accelerate  # noqa: F401 - fail at import when the extra is missing
import torch

from dcp_tiered.integrations._common import (
    OptimizerSnapshot,
    apply_model_state,
    apply_optimizer_state,
    call_restore,
    model_state,
    optimizer_state,
    to_json,
)

__all__ = ["save_state", "load_state", "state_dict", "TieredAccelerator"]


def _models(accelerator: Any) -> list[torch.nn.Module]:
    return [accelerator.unwrap_model(m) for m in accelerator._models]


def _optimizers(accelerator: Any) -> list[torch.optim.Optimizer]:
    return [getattr(o, "optimizer", o) for o in accelerator._optimizers]


def _schedulers(accelerator: Any) -> list[Any]:
    return [getattr(s, "scheduler", s) for s in accelerator._schedulers]


def _all_params(models: list[torch.nn.Module]) -> torch.nn.Module:
    """One module holding every model, so any optimizer's parameters have names."""
    return torch.nn.ModuleDict({str(i): m for i, m in enumerate(models)})


def _model_key(i: int) -> str:
    return "model" if i == 0 else f"model_{i}"


def state_dict(accelerator: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state dict that :func:`save_state` saves (tensors shared with the live objects)."""
    models = _models(accelerator)
    sd: dict[str, Any] = {_model_key(i): model_state(m) for i, m in enumerate(models)}
    optimizers = _optimizers(accelerator)
    if optimizers:
        holder = _all_params(models)
        sd["optim"] = {str(i): optimizer_state(holder, o) for i, o in enumerate(optimizers)}
    schedulers = _schedulers(accelerator)
    if schedulers:
        sd["scheduler"] = to_json([s.state_dict() for s in schedulers], "the LR scheduler state")
    custom = accelerator._custom_objects
    if custom:
        sd["custom"] = {str(i): obj.state_dict() for i, obj in enumerate(custom)}
    if extra:
        sd["extra"] = extra
    return sd


Extra = dict[str, Any] | Callable[[], dict[str, Any]] | None  # a dict, or a callable building it when a save is due


def save_state(accelerator: Any, checkpointer: Any, step: int, *, extra: Extra = None,
               force: bool = False) -> Any:
    """``checkpointer.maybe_save(step, state)``: saves when a tier is due (every tier with
    ``force=True``); returns the ``SaveReport`` or None.  Call it on every process, every step.

    The state dict (and ``extra``, when it is a zero-argument callable) is built only when a
    save is due: on the other steps this costs a few microseconds.
    """
    return checkpointer.maybe_save(
        step, lambda: state_dict(accelerator, extra() if callable(extra) else extra), force=force)


def load_state(accelerator: Any, checkpointer: Any, *, step: int | None = None, extra: dict[str, Any] | None = None,
               broadcast: Any = False) -> int | None:
    """Restore the newest good checkpoint (or ``step``) into the prepared objects.

    ``extra``: a template dict of your own values saved with :func:`save_state` (filled in
    place).  ``broadcast``: passed to ``TieredCheckpointer.restore`` (one reader per group,
    replicated state).  Returns the step restored, or None (nothing is changed then).
    Call it on every process.
    """
    models = _models(accelerator)
    optimizers = _optimizers(accelerator)
    snapshot = OptimizerSnapshot(optimizers)
    sd = state_dict(accelerator, extra)
    restored = call_restore(checkpointer, sd, step, broadcast)
    if restored is None:
        snapshot.undo()
        return None
    for i, m in enumerate(models):
        apply_model_state(m, sd[_model_key(i)])
    if optimizers:
        holder = _all_params(models)
        for i, o in enumerate(optimizers):
            apply_optimizer_state(holder, o, sd["optim"][str(i)])
    if "scheduler" in sd:
        for s, st in zip(_schedulers(accelerator), json.loads(sd["scheduler"])):
            s.load_state_dict(st)
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(sd["custom"][str(i)])
    if extra is not None and "extra" in sd:
        extra.update(sd["extra"])
    return restored


class TieredAccelerator:
    """``save_state``/``load_state`` bound to one accelerator and checkpointer.

    ``TieredAccelerator(accelerator, checkpointer)`` where ``checkpointer`` is a
    ``TieredCheckpointer``, a list of ``Tier``, a YAML path or a factory (built now, so
    create this after ``Accelerator()``); ``**options`` go to ``TieredCheckpointer``.
    """

    def __init__(self, accelerator: Any, checkpointer: Any, **options: Any) -> None:
        from dcp_tiered.integrations._common import build_checkpointer

        self.accelerator = accelerator
        self.checkpointer = build_checkpointer(checkpointer, options)

    def save_state(self, step: int, *, extra: Extra = None, force: bool = False) -> Any:
        return save_state(self.accelerator, self.checkpointer, step, extra=extra, force=force)

    def load_state(self, *, step: int | None = None, extra: dict[str, Any] | None = None, broadcast: Any = False) -> int | None:
        return load_state(self.accelerator, self.checkpointer, step=step, extra=extra, broadcast=broadcast)

    def close(self) -> None:
        self.checkpointer.close()

    def __enter__(self) -> "TieredAccelerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
