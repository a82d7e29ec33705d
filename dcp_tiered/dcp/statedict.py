"""State-dict traversal as DCP does it: which flattened keys a state dict asks a checkpoint for,
and ``Stateful`` objects (anything with ``state_dict()``/``load_state_dict()``) at any depth."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

Path_ = tuple  # a path of mapping keys and list indices from the state dict root


def is_stateful(value: Any) -> bool:
    """Whether DCP treats ``value`` as a ``Stateful`` (it calls ``state_dict()``/``load_state_dict()``)."""
    return not isinstance(value, (Mapping, torch.Tensor)) and isinstance(value, Stateful)


def _is_leaf(value: Any) -> bool:
    # DCP's rule: mappings are traversed; a list is traversed when it holds (at any depth)
    # a tensor or a mapping; everything else is a leaf.
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and not _is_leaf(v)) for v in value)


def has_stateful(value: Any) -> bool:
    """Whether a ``Stateful`` object occurs anywhere in ``value`` (mappings and lists are searched)."""
    if is_stateful(value):
        return True
    if isinstance(value, Mapping):
        return any(has_stateful(v) for v in value.values())
    if isinstance(value, list):
        return any(has_stateful(v) for v in value)
    return False


def flatten_keys(state_dict: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dot-joined leaf keys exactly as DCP flattens a state dict into metadata keys.

    A ``Stateful`` object, at any depth, stands for its ``state_dict()`` (as :func:`expand_stateful`
    saves it), so ``{"app": AppState(model, optim)}`` asks for ``app.model.weight``, ...
    """
    out: list[str] = []

    def walk(path: str, value: Any) -> None:
        if is_stateful(value):
            value = value.state_dict()
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{path}.{k}", v)
        elif _is_leaf(value):
            out.append(path)
        else:
            for i, v in enumerate(value):
                walk(f"{path}.{i}", v)

    for k, v in state_dict.items():
        walk(f"{prefix}{k}", v)
    return out


def leaves_by_path(state_dict: Mapping[str, Any]) -> dict[Path_, Any]:
    """Every leaf of ``state_dict`` by its path, traversed as DCP does (``Stateful`` objects are
    not expanded: see :func:`expand_stateful`)."""
    out: dict[Path_, Any] = {}

    def walk(path: Path_, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(path + (k,), v)
        elif not _is_leaf(value):
            for i, v in enumerate(value):
                walk(path + (i,), v)
        else:
            out[path] = value

    for k, v in state_dict.items():
        walk((k,), v)
    return out


def set_leaf(state_dict: Any, path: Path_, value: Any) -> None:
    """Replace the leaf at ``path`` (as :func:`leaves_by_path` names it) with ``value``."""
    parent = state_dict
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value


def expand_stateful(state_dict: Mapping[str, Any], *, nested: bool = True) -> tuple[Mapping[str, Any], Callable[[], None]]:
    """``state_dict`` with every ``Stateful`` object (at any depth) replaced by its ``state_dict()``, and
    a ``finish()`` to call after ``dcp.load`` into it.

    DCP itself expands ``Stateful`` objects only at the top level (deeper ones would be pickled
    whole); ``nested=False`` does the same, for loading checkpoints that plain ``dcp.save`` wrote.
    Only the containers on the way to a ``Stateful`` are copied; the rest, tensors included, is
    shared, so DCP still loads tensors in place.  ``finish()`` writes the loaded non-tensor values
    back into the caller's containers and calls each object's ``load_state_dict`` with its loaded
    state, innermost first (an object whose state holds another ``Stateful`` gets that object back,
    already loaded).  Without any ``Stateful``, ``state_dict`` itself is returned.
    """
    steps: list[Callable[[], None]] = []

    def write_back(orig: Any, copy: Any) -> None:
        items = orig.items() if isinstance(orig, Mapping) else enumerate(orig)
        for k, v in list(items):
            if is_stateful(v) or copy[k] is v:
                continue
            if isinstance(v, (Mapping, list)) and has_stateful(v):
                continue  # written back by its own step
            if isinstance(orig, (MutableMapping, list)):
                orig[k] = copy[k]

    def expand(value: Any, depth: int) -> Any:
        if depth > 1 and not nested:
            return value
        if is_stateful(value):
            inner = value.state_dict()
            plain = expand(inner, depth + 1)
            steps.append(lambda obj=value, inner=inner: obj.load_state_dict(inner))
            return plain
        if isinstance(value, (Mapping, list)) and (has_stateful(value) if nested else any(map(is_stateful, value.values()))):
            if isinstance(value, Mapping):
                copy: Any = {k: expand(v, depth + 1) for k, v in value.items()}
            else:
                copy = [expand(v, depth + 1) for v in value]
            steps.append(lambda orig=value, copy=copy: write_back(orig, copy))
            return copy
        return value

    if not (has_stateful(state_dict) if nested else any(map(is_stateful, state_dict.values()))):
        return state_dict, lambda: None
    expanded = expand(state_dict, 0)

    def finish() -> None:
        for step in steps:  # post-order: children before the object or container holding them
            step()

    return expanded, finish


def _stateful_objects(value: Any, depth: int = 0) -> list[Any]:
    if depth > 64:
        return []
    if is_stateful(value):
        return [value]
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return [s for v in items for s in _stateful_objects(v, depth + 1)]


def reachable_optimizers(state_dict: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers reachable from the ``Stateful`` objects of ``state_dict`` (through attributes, lists,
    tuples and dicts, a few levels deep; modules, tensors and large containers are not entered).

    ``get_state_dict`` (which the DCP tutorial's ``AppState.state_dict()`` calls) initialises an
    optimizer that has not stepped yet with a zero-lr step, so a save, or a restore that found
    nothing, would leave Adam at ``step=1`` and change the run: take an :class:`OptimizerSnapshot`
    of them first.  (Step hooks registered on the optimizer run during that step too; they cannot
    be undone.)"""
    found: dict[int, torch.optim.Optimizer] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(obj, 0) for obj in _stateful_objects(state_dict)]
    while todo:
        value, depth = todo.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, torch.nn.Module, str, bytes, int, float)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.optim.Optimizer):
            found[id(value)] = value
            continue
        if depth >= 4:
            continue
        if isinstance(value, Mapping):
            children: Any = value.values()
        elif isinstance(value, (list, tuple, set)):
            children = value
        else:
            children = getattr(value, "__dict__", {}).values()
        if len(children) <= _MAX_CHILDREN:  # a data loader's long list holds no optimizer: not walked
            todo += [(c, depth + 1) for c in children]
    return list(found.values())


#: Containers with more entries than this are not searched for optimizers (the walk stays cheap per save).
_MAX_CHILDREN = 1024


class OptimizerSnapshot:
    """Undo the state initialisation DCP's ``get_state_dict`` does (a zero-lr step) on the given
    optimizers that have not stepped yet: their state, hyper-parameters and gradients as before."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.saved = [copy.deepcopy(o.state_dict()) if not o.state else None for o in self.optimizers]
        self.grads = [[p.grad for g in o.param_groups for p in g["params"]] for o in self.optimizers]

    def undo(self) -> None:
        for o, saved, grads in zip(self.optimizers, self.saved, self.grads):
            if saved is not None:
                o.load_state_dict(saved)
                o.state.clear()
                params = [p for g in o.param_groups for p in g["params"]]
                for p, g in zip(params, grads):
                    p.grad = g
