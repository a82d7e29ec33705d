"""Deterministic test tensors holding the values a lossy or sloppy save/load path would change."""

from __future__ import annotations

import torch


def hard_values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values of ``dtype``; floats start with nan, +-inf, -0.0, 0.0, 1.0 and a subnormal,
    integers span up to +-2**40 (or the dtype's range)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
        flat = t.view(-1)
        if flat.numel() >= 6:
            flat[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.0], dtype=dtype)
            flat[6:7] = torch.finfo(dtype).tiny / 4
        return t
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=g, dtype=dtype)
