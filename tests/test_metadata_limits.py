"""No save commits a checkpoint its readers refuse, and readers bound their work by records.

Readers cap ``.metadata`` at ``MAX_METADATA_BYTES`` and ``MAX_METADATA_RECORDS``; a pure-FSDP 70B
+ Adam save crosses them at a few thousand ranks.  The writer used to commit such a ``.metadata``
and report success; every restore then failed.  Now the save fails before its commit, saying why.
The limits are lowered (monkeypatched) so that a small save crosses them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_tiered.dcp.metadata_io as mio
from dcp_tiered import CompressedWriter, CorruptCheckpointError, MetadataTooLargeError


def _save(path, monkeypatch, records: int, nbytes: int) -> list[BaseException]:
    """Save 100 tensors under the given limits; the errors the save raised (none when it committed)."""
    monkeypatch.setattr(mio, "MAX_METADATA_RECORDS", records)
    monkeypatch.setattr(mio, "MAX_METADATA_BYTES", nbytes)
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(100)}
    try:
        dcp.save(state, storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - DCP wraps the writer's error in a CheckpointException
        return [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()] or [exc]
    return []


def test_a_save_over_the_record_limit_fails_before_its_commit(tmp_path, monkeypatch):
    errors = _save(tmp_path / "ckpt", monkeypatch, records=50, nbytes=256 << 20)
    assert errors and isinstance(errors[0], MetadataTooLargeError), errors
    assert "100 storage records" in str(errors[0]) and "nothing was committed" in str(errors[0])
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_a_save_over_the_byte_limit_fails_before_its_commit(tmp_path, monkeypatch):
    errors = _save(tmp_path / "ckpt", monkeypatch, records=1 << 22, nbytes=2000)
    assert errors and isinstance(errors[0], MetadataTooLargeError), errors
    assert "bytes, over the 2000-byte limit" in str(errors[0])
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_a_save_within_the_limits_commits(tmp_path, monkeypatch):
    assert _save(tmp_path / "ckpt", monkeypatch, records=100, nbytes=256 << 20) == []
    assert (tmp_path / "ckpt" / ".metadata").is_file()


def test_a_metadata_declaring_more_records_than_the_limit_is_refused_before_its_records_are_read(tmp_path, monkeypatch):
    assert _save(tmp_path / "ckpt", monkeypatch, records=1 << 22, nbytes=256 << 20) == []
    data = (tmp_path / "ckpt" / ".metadata").read_bytes()
    mio._DECODED.clear()
    monkeypatch.setattr(mio, "MAX_METADATA_RECORDS", 50)
    with pytest.raises(CorruptCheckpointError, match="declares 100 records"):
        mio.decode_metadata(data, "crafted")
