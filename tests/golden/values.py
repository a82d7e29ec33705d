"""The state every golden checkpoint holds, computed from integers so it is bit-identical on any
platform and torch version (integer arithmetic, exact int->float conversion, one IEEE division)."""

from __future__ import annotations

import torch


def _ramp(n: int, salt: int) -> torch.Tensor:
    ints = (torch.arange(n, dtype=torch.int64) * 2654435761 + salt) % 1000003 - 500001
    return ints.to(torch.float32) / 99991.0


def golden_state() -> dict[str, object]:
    return {
        "model": {
            "w": _ramp(60_000, 1).reshape(120, 500),
            "b": _ramp(500, 2),
            "w16": _ramp(4096, 3).to(torch.bfloat16),
            "h16": (_ramp(4096, 4) / 8).to(torch.float16),
            "w64": _ramp(1000, 5).to(torch.float64),
            "ids": torch.arange(777, dtype=torch.int64) * 3 - 1000,
            "mask": torch.arange(333) % 3 == 0,
        },
        "step": 1234,
        "extra": {"name": "golden-v1", "lr": 0.001, "sizes": [1, 2, 3]},
    }
