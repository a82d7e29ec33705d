"""One machine-speed factor for every timeout of the tests.

Every timeout, deadline and bounded wait in tests/ is written in seconds as it would be on a quiet
2-core machine and goes through :func:`scaled`, so a machine that is loaded or slower stretches the
waits (the suite runs longer, it does not fail) while a real hang is still caught.

``SCALE`` is measured once per session: a fixed pure-Python busy loop is timed a few times and its
median wall time is divided by :data:`REFERENCE_S` (the loop's time on a quiet 2-core machine),
clamped to >= 1.  Wall time, not CPU time, so that cores shared with other work count too.  The
value is put into the environment (``DCP_TIERED_TEST_TIMEOUT_SCALE``) as soon as it is known, so
pytest-xdist workers, spawned ranks and ``python -c`` children use the same factor without
measuring again; set that variable yourself to override the measurement (any value > 0).
"""

from __future__ import annotations

import math
import os
import time

ENV = "DCP_TIERED_TEST_TIMEOUT_SCALE"

#: Median time of :func:`_loop` on a quiet 2-core machine (Python 3.11, x86-64).
REFERENCE_S = 0.011
_ROUNDS = 7


def _loop() -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i * i
    return time.perf_counter() - t0


def measure() -> float:
    """The busy loop's median wall time over a few rounds, relative to the quiet machine's (not clamped)."""
    times = sorted(_loop() for _ in range(_ROUNDS))
    return times[_ROUNDS // 2] / REFERENCE_S


def _scale() -> float:
    raw = os.environ.get(ENV, "").strip()
    if raw:
        value = float(raw)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{ENV}={raw!r}: want a number > 0")
        return value
    value = max(1.0, measure())
    os.environ[ENV] = repr(value)  # children inherit it: measured once
    return value


SCALE: float = _scale()


def scaled(seconds: float) -> float:
    """``seconds`` (a timeout on a quiet 2-core machine) on this machine."""
    return seconds * SCALE
