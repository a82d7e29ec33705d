"""Run a benchmark step in a fresh process and measure its peak host memory.

``run_isolated(setup, measure, *args)`` starts a new Python process and runs ``state = setup(*args)`` there, takes
the process's RSS as the baseline, then runs ``measure(state)`` while tracking the RSS peak,
and returns ``measure``'s result with the peak RSS above that baseline.

The peak is measured two ways and the larger kept:

* a sampling thread reads the RSS (``psutil``) every ``interval_s`` (default 2 ms); it can
  miss a spike shorter than the interval;
* ``getrusage(RUSAGE_SELF).ru_maxrss`` is the kernel's exact high-water mark, but it is
  monotone over the whole process life: it only tells something about ``measure`` when it
  rose above its value at the baseline (i.e. ``measure`` went higher than ``setup`` ever
  did), and then it is exact.

Processes come from multiprocessing's "forkserver": a server process imports the modules of
``setup`` and ``measure`` once (torch included) and forks every child from that clean state, so
a child inherits no heap from the caller and starts in a fraction of a second instead of paying
Python + torch start-up each time.  ``setup`` and ``measure`` must be picklable (module-level
functions).  The first call fixes the preloaded modules for the life of the forkserver.
"""

from __future__ import annotations

import gc
import multiprocessing
import resource
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import psutil

# A child re-runs ``python -m pkg.mod``'s main module as __mp_main__ although the forkserver
# preloaded pkg.mod; runpy then warns once per child. Harmless: silence only that message.
warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)


_preloaded = False


@dataclass
class Isolated:
    """What ``measure`` returned, and the memory it needed above the state built by ``setup``."""

    result: Any
    peak_rss_above_baseline: int  # bytes
    baseline_rss: int  # bytes, right after setup
    sampled_peak_rss: int  # bytes, absolute, from the sampling thread
    ru_maxrss_rose: bool  # whether the exact kernel high-water mark applied


def _child(setup: Callable[..., Any], measure: Callable[[Any], Any], args: tuple, interval_s: float) -> Isolated:
    state = setup(*args)
    gc.collect()
    proc = psutil.Process()
    baseline = proc.memory_info().rss
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = measure(state)
    finally:
        stop.set()
        sampler.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rose = ru_after > ru_before
    top = max(peak[0], ru_after) if rose else peak[0]
    return Isolated(result, max(0, top - baseline), baseline, peak[0], rose)


def _importable(module: str) -> str | None:
    """The importable name of ``module``: ``__main__`` run with ``python -m pkg.mod`` is ``pkg.mod``."""
    if module != "__main__":
        return module
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return spec.name if spec is not None else None


def run_isolated(
    setup: Callable[..., Any], measure: Callable[[Any], Any], *args: Any, interval_s: float = 0.002
) -> Isolated:
    """Run ``measure(setup(*args))`` in a fresh process; see the module docstring."""
    ctx = multiprocessing.get_context("forkserver")
    global _preloaded
    if not _preloaded:
        ctx.set_forkserver_preload(sorted({m for m in map(_importable, (__name__, setup.__module__, measure.__module__)) if m}))
        _preloaded = True
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_child, setup, measure, args, interval_s).result()
