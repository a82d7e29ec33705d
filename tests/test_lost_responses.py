"""A storage request that was applied but whose response was lost must not be taken for a competitor.

On S3 an exclusive commit is a conditional PUT (``If-None-Match: *``).  When the PUT is applied
but its response is lost, the client retries, gets 412 and reports that the object exists.  The
writer used to conclude that another save had won, delete its own data file and raise, leaving a
committed ``.metadata`` over a missing data file: the only save of that path, lost.
A refused exclusive commit now reads back what is there; its own bytes mean the commit succeeded.
"""

from __future__ import annotations

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CheckpointExistsError, CompressedReader, CompressedWriter
from dcp_tiered.storage import Storage


@pytest.fixture
def lost_create_responses(monkeypatch):
    """Every conditional PUT (``mode="create"``) is applied, then answered as a retried request is: 412."""
    real = s3fs.S3FileSystem._pipe_file
    lost = []

    async def applied_then_412(self, path, data, mode="overwrite", **kwargs):
        out = await real(self, path, data, mode=mode, **kwargs)
        if mode == "create":
            lost.append(path)
            raise FileExistsError(path)  # what s3fs raises on 412 Precondition Failed
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", applied_then_412)
    return lost


def test_a_lost_response_to_the_exclusive_commit_keeps_the_save(s3_bucket, lost_create_responses):
    url, options = s3_bucket
    state = {"w": torch.arange(1000.0), "b": torch.ones(7)}
    dcp.save(state, storage_writer=CompressedWriter(f"{url}/run/step_1", storage_options=options), no_dist=True)
    assert lost_create_responses, "the fault was never injected"
    out = {"w": torch.zeros(1000), "b": torch.zeros(7)}
    dcp.load(out, storage_reader=CompressedReader(f"{url}/run/step_1", storage_options=options), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


def test_a_real_competitor_still_wins_and_the_loser_keeps_nothing(s3_bucket):
    url, options = s3_bucket
    path = f"{url}/run/step_2"
    dcp.save({"w": torch.ones(10)}, storage_writer=CompressedWriter(path, storage_options=options), no_dist=True)
    before = Storage(path, options).file_sizes()
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.zeros(10)}, storage_writer=CompressedWriter(path, storage_options=options), no_dist=True)
    failures = [f[0] if isinstance(f, tuple) else f for f in getattr(info.value, "failures", {}).values()]
    assert isinstance(info.value, CheckpointExistsError) or any(
        isinstance(e, CheckpointExistsError) for e in failures), info.value
    assert Storage(path, options).file_sizes() == before  # the winner's files only
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=CompressedReader(path, storage_options=options), no_dist=True)
    assert torch.equal(out["w"], torch.ones(10))


def test_storage_commit_bytes_reads_back_a_refused_exclusive_commit(s3_bucket, lost_create_responses):
    url, options = s3_bucket
    store = Storage(f"{url}/x", options)
    assert store.commit_bytes("marker", b"mine", exclusive=True)  # applied, 412 on the retry: still ours
    assert not store.commit_bytes("marker", b"theirs", exclusive=True)  # someone else's bytes are there
    assert store.read_bytes("marker") == b"mine"
