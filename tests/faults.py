"""A fault-injecting filesystem for tests: local files behind the ``faulty://`` protocol.

Faults are set on ``FaultyFS.faults`` (class level, so every fsspec instance sees them):
fail the next N writes, raise ENOSPC after N bytes, stall writes until released, fail deletes.
Also: fail deletes after N succeeded (``fail_deletes_after``), slow every write down
(``write_delay``), and count files open for writing at once (``open_writes``/``max_open_writes``).
"""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
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
        self.fail_deletes_after: int | None = None  # deletes that succeed before every delete fails
        self.deletes = 0  # deletes that succeeded
        self.write_delay = 0.0  # seconds each write() waits (slow storage)
        self.open_writes = 0  # files open for writing right now
        self.max_open_writes = 0
        self.lock = threading.Lock()

    def delete_allowed(self) -> bool:
        with self.lock:
            if self.fail_deletes or (self.fail_deletes_after is not None and self.deletes >= self.fail_deletes_after):
                return False
            self.deletes += 1
            return True


class _FaultyFile(LocalFileOpener):
    _counted = False

    def _count_open(self) -> None:
        f = FaultyFS.faults
        with f.lock:
            f.open_writes += 1
            f.max_open_writes = max(f.max_open_writes, f.open_writes)
        self._counted = True

    def _count_close(self) -> None:
        if self._counted:
            self._counted = False
            f = FaultyFS.faults
            with f.lock:
                f.open_writes -= 1

    def close(self) -> None:
        self._count_close()
        super().close()

    def __exit__(self, *exc: Any) -> None:
        self._count_close()
        super().__exit__(*exc)

    def write(self, data: Any) -> int:
        f = FaultyFS.faults
        if f.write_delay:
            time.sleep(f.write_delay)
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
            opened = _FaultyFile(path, mode, fs=self, **kwargs)
            opened._count_open()
            return opened
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        with self._open(path, "wb") as f:
            f.write(value)

    def rm_file(self, path: str) -> None:
        if not FaultyFS.faults.delete_allowed():
            raise PermissionError("injected delete failure")
        super().rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        if not FaultyFS.faults.delete_allowed():
            raise PermissionError("injected delete failure")
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


def register() -> type[FaultyFS]:
    fsspec.register_implementation("faulty", FaultyFS, clobber=True)
    return FaultyFS


@pytest.fixture
def reset_faults():
    """Clear every fault before and after a test (use with ``pytest.mark.usefixtures`` or autouse)."""
    FaultyFS.faults.reset()
    yield
    FaultyFS.faults.reset()


def committed_steps(path: Path) -> list[int]:
    """Steps committed (``.metadata`` present) in the tier directory ``path``."""
    if not path.exists():
        return []
    return sorted(int(p.name[5:]) for p in path.iterdir() if p.name.startswith("step_") and (p / ".metadata").exists())
