"""The coordinator's part of a save at scale: what DCP broadcasts and what ``finish`` asks of storage.

DCP's ``finish`` step runs on the coordinator and broadcasts the committed ``Metadata`` to every
rank, so its pickled size is paid once per rank; ``finish`` itself runs while every rank waits.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_tiered.dcp.writer import CompressedWriter
from dcp_tiered.errors import StorageError
from dcp_tiered.storage import Storage


def _state(n: int = 300) -> dict:
    # Many small tensors: the records, not the data, decide the Metadata's size.
    return {f"layers.{i}.weight": torch.full((64,), float(i)) for i in range(n)} | {"step": 7, "name": "run"}


def test_the_broadcast_metadata_is_no_larger_than_stocks(tmp_path) -> None:
    ours = dcp.save(_state(), storage_writer=CompressedWriter(tmp_path / "ours"), no_dist=True)
    stock = dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)
    assert len(pickle.dumps(ours)) <= len(pickle.dumps(stock))
    # what a rank receives reads as records keyed by DCP's indexes, like the committed file
    back = pickle.loads(pickle.dumps(ours))
    assert dict(back.storage_data) == dict(ours.storage_data)
    rec = next(r for i, r in back.storage_data.items() if i.fqn == "layers.3.weight")
    assert rec["file"] == "__0_0.distcp" and rec["raw"] == 64 * 4


def test_finish_asks_storage_nothing_per_rank(tmp_path, monkeypatch) -> None:
    """Each rank checks its own data file once written: the coordinator's ``finish`` makes no request per
    rank (at 16k ranks on S3, 16k serial HEADs while every rank waits)."""
    state = _state(8)
    writer = CompressedWriter(tmp_path / "ck")
    calls: list[str] = []
    for name in ("size", "file_sizes", "exists"):
        real = getattr(Storage, name)
        monkeypatch.setattr(Storage, name, lambda self, *a, _r=real, _n=name, **k: calls.append(_n) or _r(self, *a, **k))
    real_finish = CompressedWriter.finish

    def finish(self, metadata, results):
        calls.clear()
        # the same rank's results as 64 ranks' files: a coordinator that stats each file costs 64 requests
        real_finish(self, metadata, results)
        finish.calls = list(calls)

    monkeypatch.setattr(CompressedWriter, "finish", finish)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert finish.calls.count("size") == 0 and len(finish.calls) <= 2


def test_a_rank_whose_file_is_short_fails_its_write(tmp_path, monkeypatch) -> None:
    real = Storage.size
    monkeypatch.setattr(Storage, "size", lambda self, name: real(self, name) - 1 if name.endswith(".distcp") else real(self, name))
    with pytest.raises(BaseException) as info:  # DCP wraps a rank's failure in its CheckpointException
        dcp.save(_state(4), storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    err = info.value
    assert isinstance(err, StorageError) or any(isinstance(e, StorageError) for e in _causes(err)), err
    assert "__0_0.distcp" in str(err)
    assert not (tmp_path / "ck" / ".metadata").exists()


def _causes(err: BaseException) -> list:
    out = []
    for failure in getattr(err, "failures", {}).values():
        out.append(failure[0] if isinstance(failure, tuple) else failure)
    return out
