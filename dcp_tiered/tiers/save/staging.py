"""The staging of async saves: a copy of the state at the call, in buffers kept from save to save.

DCP's ``DefaultStager`` deep-copies the state object by object in Python, so a state of many
tensors pays a per-tensor cost above the copy itself (1.5x one ``copy_()`` of a 64 MiB state of
530 tensors).  :class:`KeepStaged` stages a state that is a tree of dicts, lists and tuples over
dense CPU or CUDA tensors and plain values with one walk and one ``copy_`` per tensor, into host
buffers kept per path (a save without the optimizer and the next full one reuse each other's);
tensors that are views of the same memory (tied weights) share one buffer, as with
``DefaultStager``.  A CUDA tensor's buffer is pinned where the options ask for it
(:func:`_host_buffer`), and its copy is queued on its device's current stream without blocking,
one synchronisation per device at the end: the copy holds the work queued on that stream before
the call (work on other streams must be ordered before it by the caller), as DCP's does.
Anything else (DTensors, objects) goes through a ``DefaultStager``, whose guarantees the fast path
keeps: nothing of the copy is shared with the live state.  Only one of the two holds buffers at a
time.  The buffers are reused only by the next save, which the checkpointer starts after the last
one finished.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cache
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

# Values shared as they are by the staged copy: immutable.
_VALUES = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)


def _walk(obj: Any, path: tuple, tensors: list[tuple[tuple, torch.Tensor]]) -> bool:
    """Append ``(path, tensor)`` for each tensor of ``obj`` in order; False where it holds anything the
    fast path does not stage."""
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if obj.device.type not in ("cpu", "cuda") or obj.layout is not torch.strided or obj.is_quantized or obj.is_meta:
            return False
        tensors.append((path, obj))
        return True
    if kind in _VALUES:
        return True
    if kind is dict or kind is OrderedDict:
        return all(type(k) in _VALUES and _walk(v, (*path, k), tensors) for k, v in obj.items())
    if kind is list or kind is tuple:
        return all(_walk(v, (*path, i), tensors) for i, v in enumerate(obj))
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


def _memory(t: torch.Tensor) -> tuple:
    """What makes two tensors the same values in the same memory (tied weights, one tensor under two keys)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _host_buffer(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host tensor shaped like ``t``, pinned where ``pin`` (the buffer of a CUDA tensor).  Pinned blocks come
    from torch's caching host allocator, which rounds each up to a power of two and keeps it for the process
    after it is freed: up to twice the state's bytes stay pinned."""
    return torch.empty_like(t, device="cpu", memory_format=torch.preserve_format, pin_memory=pin)


@cache
def default_stager_reusable() -> bool:
    """Whether a ``DefaultStager`` stages again after its first stage.  torch 2.11's closes its copier at the
    end of every stage (pytorch/pytorch#183413): the next stage raises ``KeyError: <class 'type'>``."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"t": torch.zeros(1)})
        return True
    except Exception:  # KeyError on 2.11; any other failure of a second stage means the same
        return False
    finally:
        stager.close()


class KeepStaged(AsyncStager):
    """A stager that keeps the last staged state (:attr:`staged`: the fallback of a refused async save
    writes it again) and reuses its buffers for the next save (see the module docstring)."""

    staged: Any = None

    def __init__(self, options: StagingOptions) -> None:
        self.options = options
        self._kept: dict[tuple, torch.Tensor] = {}  # (path, shape, dtype, on a device) -> buffer, of the last two stages
        self._last: set[tuple] = set()
        self._fallback: DefaultStager | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._fallback is not None and self._fallback.should_synchronize_after_execute

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        tensors: list[tuple[tuple, torch.Tensor]] = []
        if not _walk(state_dict, (), tensors):
            self._kept, self._last = {}, set()
            if self._fallback is not None and not default_stager_reusable():
                self._fallback.close()
                self._fallback = None
            self._fallback = self._fallback or DefaultStager(self.options)
            self.staged = self._fallback.stage(state_dict, **kwargs)
            return self.staged
        if self._fallback is not None:  # its cached copy of the state goes
            self._fallback.close()
            self._fallback = None
        try:
            # buffers made inside an inference_mode block would refuse later copies outside it
            with torch.inference_mode(False), torch.no_grad():
                buffers, used, alias, devices = [], set(), {}, set()
                for path, t in tensors:
                    memory = _memory(t)
                    same = alias.get(memory)
                    if same is None:
                        on_device = t.device.type == "cuda"
                        key = (path, t.shape, t.dtype, on_device)
                        same = self._kept.get(key)
                        if same is None:
                            same = self._kept[key] = _host_buffer(t, on_device and self.options.use_pinned_memory)
                        if on_device:
                            same.copy_(t, non_blocking=True)
                            devices.add(t.device)
                        else:
                            same.copy_(t)
                        used.add(key)
                        alias[memory] = same
                    buffers.append(same)
                for device in devices:  # the host buffers hold the copies before the writers read them
                    torch.cuda.current_stream(device).synchronize()
        except BaseException:
            self._kept, self._last = {}, set()
            raise
        keep = used | self._last  # this save's and the one before's: saves with and without the optimizer alternate
        self._kept = {k: v for k, v in self._kept.items() if k in keep}
        self._last = used
        self.staged = _rebuild(state_dict, iter(buffers))
        return self.staged

    def synchronize_staging(self) -> None:
        if self._fallback is not None:
            self._fallback.synchronize_staging()

    def again(self, staged: Any) -> "AlreadyStaged":
        """A stager for writing ``staged`` (a state this stager staged) once more, kept as :attr:`staged`."""
        self.staged = staged
        return AlreadyStaged()

    def close(self) -> None:
        self._kept, self._last = {}, set()
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None


class AlreadyStaged(AsyncStager):
    """Stages nothing: for a state that is a staged copy already (the fallback of an async save)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
