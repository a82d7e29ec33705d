"""Reports of saves and restores, and the JSON-lines event log they go to."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("dcp_tiered.events")


def _first_failure(exc: BaseException) -> "tuple[int, BaseException] | None":
    """``(rank, error)`` of the lowest rank's failure inside DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return None
    from torch.distributed.checkpoint.api import CheckpointException  # loaded already: DCP raised exc

    if not isinstance(exc, CheckpointException):
        return None
    rank, (inner, _) = min(failures.items(), key=lambda kv: kv[0])
    return rank, inner


def describe_error(exc: BaseException, limit: int = 800) -> str:
    """``Type: message`` of ``exc`` on one line, at most ``limit`` characters; for DCP's
    ``CheckpointException`` (whose text holds every rank's traceback) the first failure's."""
    first = _first_failure(exc)
    rank, exc = first if first is not None else (None, exc)
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    if rank is not None:
        text += f" (rank {rank})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def root_cause(exc: BaseException) -> BaseException:
    """The first rank's failure inside DCP's ``CheckpointException``, else ``exc``."""
    first = _first_failure(exc)
    return first[1] if first is not None else exc


@dataclass
class SaveReport:
    """One save: where it went, how big, how long training was blocked, how long in total."""

    step: int
    tiers: list[str]
    optimizer: bool
    async_save: bool
    raw_bytes: int = 0
    stored_bytes: int = 0
    blocked_s: float = 0.0  # time maybe_save kept the training loop waiting (includes waited_s)
    waited_s: float = 0.0  # part of blocked_s spent waiting for the previous save in flight
    total_s: float | None = None
    ok: bool | None = None  # None while an async save is in flight
    error: str | None = None
    downcast_kept: dict[str, str] = field(default_factory=dict)
    #: Bytes this rank sent to its clique's peers for this save (its files x ``replicas - 1``) on a tier
    #: with ``replicas > 1``.  Replication runs after the save's event was emitted: None until it ends
    #: (filled at ``wait()`` through :class:`SaveReports`; its own ``replication`` event holds it too).
    replicated_bytes: int | None = None
    replication_error: str | None = None  # why this save's replication failed (then ``replicated_bytes`` stays None)
    event: str = "save"

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def throughput_mb_s(self) -> float | None:
        return self.raw_bytes / 1e6 / self.total_s if self.total_s else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = round(self.ratio, 4)
        d["throughput_mb_s"] = round(self.throughput_mb_s, 1) if self.throughput_mb_s else None
        return d


class SaveReports(list):
    """The list of a checkpointer's :class:`SaveReport` objects that fills in each one's replication outcome.

    Subscribed to the ``EventLog``: a ``replication`` event (``tier``, ``step``, ``ok``, ``sent_bytes``
    or ``error``, emitted by the background replication) sets ``replicated_bytes`` or ``replication_error``
    of the newest report of that step written to that tier that has none yet.  An outcome that arrives
    before its report is appended is kept until then."""

    def __init__(self, events: "EventLog | None" = None) -> None:
        super().__init__()
        self._early: dict[tuple[str, int], dict[str, Any]] = {}
        self._lock = threading.Lock()
        if events is not None:
            events.hooks.append(self.observe)

    def observe(self, event: dict[str, Any]) -> None:
        if event.get("event") != "replication":
            return
        key = (str(event.get("tier")), event.get("step"))
        with self._lock:
            report = next((r for r in reversed(self) if r.tiers[:1] == [key[0]] and r.step == key[1]
                           and r.replicated_bytes is None and r.replication_error is None), None)
            if report is None:
                self._early[key] = dict(event)
                while len(self._early) > 64:  # bounded: outcomes of reports never appended
                    del self._early[next(iter(self._early))]
            else:
                _fill(report, event)

    def append(self, report: SaveReport) -> None:  # type: ignore[override]
        with self._lock:
            super().append(report)
            early = self._early.pop((report.tiers[0] if report.tiers else "", report.step), None)
            if early is not None:
                _fill(report, early)


def _fill(report: SaveReport, event: dict[str, Any]) -> None:
    report.replicated_bytes = int(event.get("sent_bytes") or 0)  # also what a failed replication had sent
    report.replication_error = None if event.get("ok") else str(event.get("error") or "replication failed")


class EventLog:
    """Fan-out of report dicts: a JSON-lines file, the ``dcp_tiered.events`` logger, and hooks."""

    def __init__(self, path: "str | os.PathLike[str] | None" = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.hooks: list[Callable[[dict[str, Any]], None]] = []
        self._lock = threading.Lock()

    def emit(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, default=str, sort_keys=True)
        log.info(line)
        if self.path is not None:
            with self._lock:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(line + "\n")
        for hook in list(self.hooks):
            try:
                hook(event)
            except Exception:  # observers must never break checkpointing
                log.exception("event hook failed")
