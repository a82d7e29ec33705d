"""Durable local writes: writeback overlaps the writing, every byte lands, errors surface."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from dcp_tiered.errors import StorageError
from dcp_tiered.storage import Storage
from dcp_tiered.storage.writeback import WritebackFile


def test_every_byte_lands_and_writeback_runs_while_writing(tmp_path: Path, monkeypatch) -> None:
    synced_sizes: list[int] = []
    real = os.fdatasync

    def observed(fd: int) -> None:  # the real call, noting how much of the file it covered
        real(fd)
        synced_sizes.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fdatasync", observed)
    chunks = [np.random.default_rng(i).integers(0, 256, 100_000, dtype=np.uint8) for i in range(50)]
    with open(tmp_path / "f", "wb") as raw:
        f = WritebackFile(raw, sync_every=300_000)
        for c in chunks[:3]:  # crosses the threshold: a writeback starts now, not at the end
            f.write(c)
        f.join()
        assert synced_sizes == [300_000], "no writeback was started when the threshold was crossed"
        for c in chunks[3:]:
            f.write(c)
        f.sync()
    assert (tmp_path / "f").read_bytes() == b"".join(c.tobytes() for c in chunks)


@pytest.mark.parametrize("where", ["write", "sync"])
def test_a_failed_background_writeback_is_raised_not_swallowed(tmp_path: Path, monkeypatch, where: str) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with open(tmp_path / "f", "wb") as raw:
        f = WritebackFile(raw, sync_every=10)
        f.write(b"x" * 20)  # starts the failing writeback
        f.join()
        with pytest.raises(OSError, match="I/O error"):
            f.write(b"y") if where == "write" else f.sync()


def test_storage_write_error_names_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    st = Storage(str(tmp_path))
    with pytest.raises(StorageError, match="data.bin"):
        with st.open_write("data.bin") as f:
            for _ in range(3):
                f.write(b"z" * (40 << 20))
