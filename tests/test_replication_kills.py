"""Safety of peer-replicated node-local tiers under kills.

- A node directory holds other nodes' ranks' files (``__{owner}_*.distcp``) as replicas; such a
  file counts for a restore only under a committed ``.replica-{owner}.json`` marker of the same
  save naming it at that size.  Bytes that landed before a SIGKILL stopped the marker, or a
  replica left from an earlier save of the step, count as absent.
- A re-save of a step un-commits every node directory before any rank writes data.
- The kill-restart loop (``-k kill_loop``): 4 gloo ranks on 2 simulated nodes save steps with
  replication while one or every rank is SIGKILLed at a random moment (in the save, in a
  replication chunk, at a marker commit), sometimes a node's local directory is then deleted
  (a replaced node); the restart always restores exactly one saved step, bit-exact, never
  older than the newest step committed on the shared tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered.dcp.writer import CompressedWriter
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.node_commit import lacking_files, marker_name, rank_of_file


# -- replica files count only under a committed marker of the same save -----------------------------


def _saved_dir(tmp_path: Path) -> tuple[Storage, dict[str, int], dict]:
    """A committed checkpoint written by rank 0 alone (its file ``__0_0.distcp``), save id ``new``."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    url = str(tmp_path / "step_000000001")
    dcp.save(state, storage_writer=CompressedWriter(url, save_id="new"), no_dist=True)
    child = Storage(url)
    return child, child.file_sizes(), {k: torch.zeros_like(v) for k, v in state.items()}


def _mark(child: Storage, files: dict[str, int], save_id: str, size_delta: int = 0) -> None:
    entries = [{"file": f, "size": s + size_delta, "xxh3": "0"} for f, s in files.items() if rank_of_file(f) == 0]
    child.commit_bytes(marker_name(0), json.dumps({"owner": 0, "save_id": save_id, "files": entries}).encode())


@pytest.mark.parametrize("marker", ["none", "other save", "other size", "same save"])
def test_a_replica_file_counts_only_under_a_committed_marker_of_the_save(tmp_path: Path, marker: str) -> None:
    """The directory is node 1's (ranks 2 and 3); ``__0_0.distcp`` is rank 0's file, which node 1 holds
    only as a replica: without a marker of this save at this size, a load needing it lacks it."""
    child, files, template = _saved_dir(tmp_path)
    data = [f for f in files if rank_of_file(f) == 0]
    assert data, files
    if marker != "none":
        _mark(child, files, "new" if marker != "other save" else "old", 1 if marker == "other size" else 0)
    node1 = lambda f: rank_of_file(f) in (2, 3)  # noqa: E731
    got = lacking_files(child, child.file_sizes(), template, node1)
    assert got == ([] if marker == "same save" else sorted(data)), (marker, got)
    # the directory's own ranks' files count as they are, marker or not
    assert lacking_files(child, child.file_sizes(), template, lambda f: rank_of_file(f) in (0, 1)) == []
