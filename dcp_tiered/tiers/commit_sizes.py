"""The sizes a promotion's commit reports (raw and stored bytes of the committed records), for
the metrics: taken from the records the commit just wrote, so a restart or a resumed promotion
reports true sizes without reading ``.metadata`` back."""

from __future__ import annotations

import logging
from typing import Any

from dcp_tiered.dcp.metadata_io import load_metadata
from dcp_tiered.dcp.save_stats import stats_from_records
from dcp_tiered.errors import DcpTieredError
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.fragments import commit_from_fragments

log = logging.getLogger(__name__)


def _sizes(report: Any, storage_data: Any) -> None:
    stats = stats_from_records((i.fqn, r) for i, r in storage_data.items())
    report.raw_bytes, report.stored_bytes = stats.raw_bytes, stats.stored_bytes


def measured(report: Any, dst: Storage, result: Any = None) -> Any:
    """Set a commit ``report``'s sizes from ``dst``'s records (a commit another process made);
    return ``result`` (else the report)."""
    try:  # the commit is done whatever the metrics can read: logged, never raised
        _sizes(report, load_metadata(dst).storage_data)
    except (DcpTieredError, TypeError, ValueError) as exc:
        log.warning("step %s committed on %s, its sizes unreadable: %s", report.step, report.target, exc)
    return report if result is None else result


def commit_measured(report: Any, src: Storage, dst: Storage, save_id: str | None) -> int:
    """:func:`commit_from_fragments`, with ``report``'s sizes from the records it committed (read
    back only when another process committed the same save); returns the bytes of ``.metadata``."""
    n = commit_from_fragments(src, dst, save_id, on_commit=lambda md: _sizes(report, md.storage_data))
    return n if report.stored_bytes else measured(report, dst, n)
