"""Views between tensors and their raw element bytes, without copies where possible."""

from __future__ import annotations

import numpy as np
import torch


def tensor_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Return the raw element bytes of ``tensor`` as a uint8 array, and the tensor backing them.

    The tensor is moved to the CPU and made contiguous (only the view's elements are kept);
    the returned tensor must stay referenced while the array is in use.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8), t
    return t.reshape(-1).view(torch.uint8).numpy(), t


def empty_for_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
    """Allocate a CPU tensor and return it with a writable uint8 view of its bytes."""
    t = torch.empty(shape, dtype=dtype)
    return t, writable_bytes(t)


def writable_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 array aliasing a contiguous CPU tensor's memory."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()
