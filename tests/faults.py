"""A fault-injecting filesystem for tests: local files behind the ``faulty://`` protocol.

Faults are set on ``FaultyFS.faults`` (class level, so every fsspec instance sees them):
fail the next N writes, raise ENOSPC after N bytes, stall writes until released, fail deletes.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem, LocalFileOpener


class Faults:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.fail_writes = 0  # number of file opens for writing that fail
        self.enospc_after: int | None = None  # bytes written (all files) before ENOSPC
        self.written = 0
        self.stall = threading.Event()  # writes wait while this is clear and `stalling` is set
        self.stall.set()
        self.stalled = threading.Event()  # set once a write is blocked
        self.fail_deletes = False
        self.write_opens = 0


class _FaultyFile(LocalFileOpener):
    def write(self, data: Any) -> int:
        f = FaultyFS.faults
        if not f.stall.is_set():
            f.stalled.set()
            f.stall.wait()
        n = memoryview(data).nbytes
        if f.enospc_after is not None and f.written + n > f.enospc_after:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        f.written += n
        return super().write(data)


class FaultyFS(LocalFileSystem):
    protocol = ("faulty",)
    root_marker = "/"
    faults = Faults()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = str(path)
        if path.startswith("faulty://"):
            path = path[len("faulty://"):]
        return LocalFileSystem._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any):  # type: ignore[override]
        if "w" in mode or "a" in mode:
            f = FaultyFS.faults
            f.write_opens += 1
            if f.fail_writes > 0:
                f.fail_writes -= 1
                raise ConnectionError("injected write failure (503 SlowDown)")
            path = self._strip_protocol(path)
            if self.auto_mkdir:
                self.makedirs(self._parent(path), exist_ok=True)
            return _FaultyFile(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        with self._open(path, "wb") as f:
            f.write(value)

    def rm_file(self, path: str) -> None:
        if FaultyFS.faults.fail_deletes:
            raise PermissionError("injected delete failure")
        super().rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        if FaultyFS.faults.fail_deletes:
            raise PermissionError("injected delete failure")
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


def register() -> type[FaultyFS]:
    fsspec.register_implementation("faulty", FaultyFS, clobber=True)
    return FaultyFS
