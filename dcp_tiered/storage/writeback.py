"""Durable local writes whose disk writeback overlaps the writing.

A checkpoint file written through the page cache and fsynced only at close makes the
caller wait, after the last byte, for the disk to take every byte: with tens of GB of RAM
the kernel starts writeback late, so compression and disk run one after the other.
:class:`WritebackFile` asks for writeback (``fdatasync`` on a helper thread) every
``sync_every`` bytes, so the disk works while the next frames are encoded and the final
``fsync`` only waits for the tail.
"""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

SYNC_EVERY = 64 << 20


class WritebackFile:
    """Wraps an open binary file: ``write`` passes through, ``sync`` makes everything durable.

    At most one ``fdatasync`` runs at a time; a threshold crossed while one runs is served by
    the next.  An error of a background sync is raised by the next ``write`` or by ``sync``.
    """

    def __init__(self, f: BinaryIO, sync_every: int = SYNC_EVERY) -> None:
        self._f = f
        self._fd = f.fileno()
        self._sync_every = sync_every
        self._unsynced = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, data: object) -> int:
        self._raise_background_error()
        n = self._f.write(data)  # type: ignore[arg-type]
        self._unsynced += n
        if self._unsynced >= self._sync_every and (self._thread is None or not self._thread.is_alive()):
            self._f.flush()  # hand the bytes to the kernel; the helper thread only syncs the fd
            self._unsynced = 0
            self._thread = threading.Thread(target=self._datasync, name="dcp_tiered-writeback", daemon=True)
            self._thread.start()
        return n

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._fd

    def sync(self) -> None:
        """Flush, wait for a running writeback, and fsync: every byte written is on disk."""
        self._f.flush()
        self.join()
        self._raise_background_error()
        os.fsync(self._fd)

    def join(self) -> None:
        """Wait for a running background writeback (also on error paths, before the file closes)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _datasync(self) -> None:
        try:
            os.fdatasync(self._fd)
        except BaseException as exc:  # raised in the writing thread at its next write or sync
            self._error = exc

    def _raise_background_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
