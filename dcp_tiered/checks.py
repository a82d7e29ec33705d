"""Argument checks shared by the writer, the tier specs and the options, and the torch probe.

Torch-free on purpose: ``Tier``, the options, the cost model and ``dcp-tiered cost``/``ls``
import this module in an environment without torch.
"""

from __future__ import annotations

import re

from dcp_tiered.errors import ConfigError

#: Smallest and largest frame sizes a checkpoint may declare (the writer refuses smaller ones).
#: Defined here, in layer 0, for ``check_frame_size``; ``codecs/frames.py`` re-exports them.
MIN_FRAME_SIZE = 4096
MAX_FRAME_SIZE = 1 << 30

#: What the CLI and the no-torch paths tell a user whose environment lacks torch.
INSTALL_TORCH = "install torch first (pip install torch)"


def check_count(value: object, field: str, minimum: int = 1, maximum: int | None = None, optional: bool = False) -> int | None:
    """``value`` as an int in ``[minimum, maximum]`` (None allowed when ``optional``), else a ConfigError naming ``field``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ConfigError(f"{field} must be {bound}, got {value!r}")
    return value


def check_frame_size(value: object, optional: bool = False) -> int | None:
    """A valid ``frame_size`` (bytes, ``MIN_FRAME_SIZE`` .. ``MAX_FRAME_SIZE``) or a ConfigError."""
    return check_count(value, "frame_size", MIN_FRAME_SIZE, MAX_FRAME_SIZE, optional)


def check_timeout(timeout: object) -> None:
    """A wait/close timeout: None or a finite number of seconds >= 0."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 <= timeout < float("inf")):
        raise ConfigError(f"timeout must be None or a non-negative number of seconds, got {timeout!r}")


def is_missing_torch(exc: BaseException) -> bool:
    """Whether ``exc`` (or the error it was raised ``from``) is torch not being installed."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and (seen.name or "").split(".")[0] == "torch":
            return True
        seen = seen.__cause__
    return False


def torch_available() -> bool:
    """Whether ``import torch`` works here (imports it when it does)."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if not is_missing_torch(exc):
            raise
        return False
    return True


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)


def parse_bytes(value: "int | str | None", where: str = "size") -> int | None:
    """``"8GiB"`` -> 8589934592, ``"512MiB"``, ``"1.5GB"`` (decimal), or a positive int of bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected bytes or a size such as '8GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)) and m.group(2).lower() in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(f"{where}: cannot read {value!r} as a size; use bytes or e.g. '512MiB', '8GiB', '2GB'")
    if n < 1:
        raise ConfigError(f"{where}: must be at least 1 byte, got {value!r}")
    return n
