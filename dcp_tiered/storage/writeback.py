"""Durable local writes whose disk writeback overlaps the writing.

A checkpoint file written through the page cache and fsynced only at close makes the
caller wait, after the last byte, for the disk to take every byte: with tens of GB of RAM
the kernel starts writeback late, so compression and disk run one after the other.
:class:`WritebackFile` asks for writeback (``fdatasync`` on a helper thread) every
``sync_every`` bytes, so the disk works while the next frames are encoded and the final
``fsync`` only waits for the tail.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from typing import BinaryIO

SYNC_EVERY = 64 << 20
#: Most buffers one ``writev`` takes (POSIX ``IOV_MAX``; Linux: 1024).
IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))


def _nbytes(piece: object) -> int:
    if isinstance(piece, (bytes, bytearray)):
        return len(piece)
    n = getattr(piece, "nbytes", None)  # memoryview, numpy array: no buffer export needed
    return n if isinstance(n, int) else memoryview(piece).nbytes  # type: ignore[arg-type]


def writev_all(fd: int, pieces: Sequence[object]) -> int:
    """Write every byte of ``pieces`` (contiguous buffers, in order) to ``fd`` with ``os.writev``.

    No piece is copied or joined in Python, and the GIL is released during each call.  At
    most :data:`IOV_MAX` buffers go per call, and a short write (a signal, the kernel's 2 GiB
    cap per call) continues where it stopped.  Returns the bytes written.
    """
    rest = list(pieces)
    total = 0
    while rest:
        batch = rest[:IOV_MAX]
        got = n = os.writev(fd, batch)
        total += got
        done = 0
        for piece in batch:
            size = _nbytes(piece)
            if n < size:
                break
            n -= size
            done += 1
        if done == len(batch):
            rest = rest[done:]
            continue
        if got == 0:  # a non-empty write that moved nothing would loop forever
            raise OSError(errno.EIO, "writev wrote nothing")
        rest = [memoryview(batch[done]).cast("B")[n:], *rest[done + 1 :]]
    return total


class RawFile:
    """An unbuffered file on a descriptor (owned: closed by :meth:`close`) whose writes always complete.

    ``write`` and ``writev`` go straight to the kernel, without a copy into a Python buffer.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, data: object) -> int:
        return writev_all(self._fd, (data,))

    def writev(self, pieces: Sequence[object]) -> int:
        return writev_all(self._fd, pieces)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> "RawFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        return self._wrote(self._f.write(data))  # type: ignore[arg-type]

    def writev(self, pieces: Sequence[object]) -> int:
        """Write ``pieces`` in order: one vectored write where the file has it."""
        self._raise_background_error()
        writev = getattr(self._f, "writev", None)
        return self._wrote(writev(pieces) if writev else sum(self._f.write(p) for p in pieces))  # type: ignore[arg-type]

    def _wrote(self, n: int) -> int:
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
