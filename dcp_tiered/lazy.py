"""Lazily loaded package attributes, so that importing a package imports none of its heavy modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_attributes(package: str, names: Mapping[str, str], namespace: dict[str, Any],
                    public: Iterable[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps an attribute to the module
    defining it, imported on first access and then cached in ``namespace`` (the package's globals)."""
    listed = sorted(set(public))

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as exc:
            if exc.name != "torch" or not module.startswith("dcp_tiered"):
                raise
            raise ModuleNotFoundError(f"{package}.{name} needs torch: install torch first (pip install torch); "
                                      "Tier, the cost model and `dcp-tiered cost`/`ls` work without it",
                                      name="torch") from exc
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return listed

    return __getattr__, __dir__
