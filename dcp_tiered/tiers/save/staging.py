"""The staging of async saves: a copy of the state at the call, in buffers kept from save to save.

DCP's ``DefaultStager`` deep-copies the state object by object in Python, so a state of many
tensors pays a per-tensor cost above the copy itself (1.5x one ``copy_()`` of a 64 MiB state of
530 tensors).  :class:`KeepStaged` stages a state that is a tree of dicts, lists and tuples over
dense CPU tensors and plain values with one walk and one ``copy_`` per tensor, into the buffers
of the last stage of the same structure; anything else goes through ``DefaultStager``, whose
guarantees the fast path keeps: nothing of the copy is shared with the live state.  The buffers
are reused only by the next save, which the checkpointer starts after the last one finished.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager

# Values shared as they are by the staged copy: immutable.
_VALUES = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, list, tuple)


def _walk(obj: Any, tensors: list[torch.Tensor], shape: list) -> bool:
    """Append the tensors of ``obj`` and its structure (types, keys, tensor shapes and dtypes) in order;
    False where it holds anything the fast path does not stage."""
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if obj.device.type != "cpu" or obj.layout is not torch.strided or obj.is_quantized or obj.is_meta:
            return False
        tensors.append(obj)
        shape.append((obj.shape, obj.dtype))
        return True
    if kind in _VALUES:
        shape.append(kind)
        return True
    if kind is dict or kind is OrderedDict:
        keys = tuple(obj)
        if not all(type(k) in _VALUES for k in keys):
            return False
        shape.append((kind, keys))
        return all(_walk(v, tensors, shape) for v in obj.values())
    if kind is list or kind is tuple:
        shape.append((kind, len(obj)))
        return all(_walk(v, tensors, shape) for v in obj)
    return False


def _rebuild(obj: Any, buffers: Any) -> Any:
    """``obj`` with new containers and each tensor replaced by the next of ``buffers`` (as :func:`_walk` ordered them)."""
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return next(buffers)
    if kind is dict or kind is OrderedDict:
        return kind((k, _rebuild(v, buffers)) for k, v in obj.items())
    if kind is list or kind is tuple:
        return kind(_rebuild(v, buffers) for v in obj)
    return obj


class KeepStaged(DefaultStager):
    """A stager that keeps the last staged state (:attr:`staged`: the fallback of a refused async save
    writes it again) and reuses its buffers for the next state of the same structure."""

    staged: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept: tuple[list, list[torch.Tensor]] | None = None  # (structure, buffers) of the last fast stage

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        tensors: list[torch.Tensor] = []
        shape: list = []
        if not _walk(state_dict, tensors, shape):
            self._kept = None
            self.staged = super().stage(state_dict, **kwargs)
            return self.staged
        if self._kept is None or self._kept[0] != shape:
            self._kept = (shape, [torch.empty_like(t, memory_format=torch.preserve_format) for t in tensors])
        buffers = self._kept[1]
        with torch.no_grad():
            for buffer, t in zip(buffers, tensors):
                buffer.copy_(t)
        self.staged = _rebuild(state_dict, iter(buffers))
        return self.staged

    def again(self, staged: Any) -> "AlreadyStaged":
        """A stager for writing ``staged`` (a state this stager staged) once more, kept as :attr:`staged`."""
        self.staged = staged
        return AlreadyStaged()

    def close(self) -> None:
        self._kept = None
        super().close()


class AlreadyStaged(AsyncStager):
    """Stages nothing: for a state that is a staged copy already (the fallback of an async save)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
