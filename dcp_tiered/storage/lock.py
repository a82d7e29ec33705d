"""``FileLock``: what :meth:`Storage.try_lock` returns (a real ``flock`` locally, nothing elsewhere)."""

from __future__ import annotations

import contextlib
import os


class FileLock:
    """An exclusive advisory lock (``flock``) on a local file, held until :meth:`release`.

    The kernel drops it when the process dies, so a crashed save never leaves a stale lock.
    A pickled copy is released (a lock belongs to the process that took it).  Without a file
    descriptor it holds nothing: the lock of filesystems that have no locks.
    """

    def __init__(self, fd: int | None = None, path: str = "") -> None:
        self._fd = fd
        self.path = path

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self._fd, self.path = None, state["path"]

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, unlink: bool = False) -> None:
        """Give the lock up; ``unlink`` first removes the lock file (after a commit: nothing to guard)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if unlink:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
        finally:
            os.close(fd)

    def __del__(self) -> None:  # the lock must not outlive a writer dropped after a failed save
        with contextlib.suppress(Exception):
            self.release()
