"""Clique streams: a data file broadcast from its owner to the other ranks of a replication clique
over gloo, in bounded chunks that carry the sender's status, and the clique groups that failed.

Every rank of the clique takes part in every collective whatever its storage does, so a clique
stays in step: only a failed collective (a peer gone, a timeout) leaves a group unusable, and it
is then marked broken and never used again (:func:`check_group`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from dcp_tiered.errors import ReplicationError
from dcp_tiered.storage import Storage


#: Largest piece of a file sent in one broadcast.
CHUNK_BYTES = 64 << 20


FileEntry = tuple[str, int, str]  # (name, size, xxh3-64 hex digest)


def file_digest(storage: Storage, name: str, size: int, chunk: int = CHUNK_BYTES) -> str:
    """xxh3-64 (hex) of the first ``size`` bytes of ``name``."""
    h = xxhash.xxh3_64()
    for off in range(0, size, chunk):
        h.update(storage.read_range(name, off, min(size, off + chunk)))
    return h.hexdigest()


#: id(group) -> (group, why): clique groups whose collective failed (timed out); never used again.  The
#: group itself is held so that its id is never reused by another object.
_BROKEN: dict[int, tuple[Any, str]] = {}


def mark_broken(group: Any, why: str) -> None:
    """Remember that a collective on ``group`` failed: gloo leaves it unusable, later uses fail fast."""
    _BROKEN[id(group)] = (group, why)


def check_group(group: Any, clique: Sequence[int]) -> None:
    """Raise :class:`ReplicationError` when ``group`` (of ``clique``) failed earlier, instead of hanging on it."""
    why = _BROKEN.get(id(group), (None, None))[1]
    if why is not None:
        raise ReplicationError(f"the process group of clique {list(clique)} failed earlier ({why}) and is not used "
                               "again in this job; restart the job to replicate or fetch through this clique")


def broadcast_header(header: list[Any], src: int, group: Any, what: str) -> None:
    """``broadcast_object_list`` of ``header`` from ``src`` on a clique's ``group``; a failure marks the
    group broken (:func:`check_group`) and is raised."""
    try:
        dist.broadcast_object_list(header, src=src, group=group)
    except Exception as exc:
        mark_broken(group, f"{what}: {exc}")
        raise


def stream_file(group: Any, src: int, me: int, entry: FileEntry, read: Storage | None, write: Storage | None,
                chunk: int = CHUNK_BYTES) -> str | None:
    """Broadcast one file from global rank ``src`` (reading it from ``read``) to the other ranks of
    ``group``; a rank with ``write`` stores it there and checks the digest.  Every rank of the group
    calls it with the same ``entry`` and takes part in every chunk, so the group stays in step: a
    receiver whose write fails discards the rest; each chunk carries a status byte of the sender, so
    when the sender cannot read (or its file is short) every rank stops at that chunk and nothing
    more is sent.  A receiver deletes its file on any failure.  Returns None, or why this rank
    failed; a failed collective (a peer gone, a timeout) raises and marks ``group`` broken."""
    name, size, digest = entry
    h = xxhash.xxh3_64()
    error: str | None = None
    buf = torch.empty(max(1, min(chunk, size)) + 1, dtype=torch.uint8)  # the last byte: the sender's status
    stack = contextlib.ExitStack()
    out = None
    if write is not None:
        try:
            out = stack.enter_context(write.open_write(name))
        except Exception as exc:  # noqa: BLE001 - any failure: this rank discards what it receives
            error = f"cannot write {write.url_of(name)}: {exc}"
    done = False
    try:
        try:
            for off in range(0, size, chunk):
                n = min(chunk, size - off)
                t = buf[:n + 1]
                if me == src:
                    error = error or _read_chunk(read, name, off, t[:n])
                    t[n] = 0 if error else 1
                try:
                    dist.broadcast(t, src=src, group=group)
                except Exception as exc:
                    mark_broken(group, f"broadcast of {name} from rank {src}: {exc}")
                    raise
                if int(t[n]) == 0:  # the sender failed: every rank stops here
                    error = error or f"rank {src} could not read its {name}; nothing more of it was sent"
                    break
                if out is not None and error is None:
                    try:
                        h.update(t[:n].numpy())
                        out.write(memoryview(t[:n].numpy()))
                    except Exception as exc:  # noqa: BLE001 - keep taking part in every chunk, discarding
                        error = f"cannot write {write.url_of(name)}: {exc}"  # type: ignore[union-attr]
        finally:
            try:
                stack.close()  # flush and close: may fail too (ENOSPC)
            except Exception as exc:  # noqa: BLE001
                error = error or f"cannot write {write.url_of(name)}: {exc}"  # type: ignore[union-attr]
        if write is not None and error is None and h.hexdigest() != digest:
            error = f"{write.url_of(name)}: received bytes have xxh3 {h.hexdigest()}, the sender's file {digest}"
        done = True
    finally:
        if write is not None and (error is not None or not done):
            with contextlib.suppress(Exception):
                write.remove(name)  # never leave a partial or mismatched file
    return error


def _read_chunk(read: Storage | None, name: str, off: int, t: torch.Tensor) -> str | None:
    """Read ``len(t)`` bytes of ``name`` at ``off`` into ``t``; why not, or None."""
    if read is None:
        return f"rank has no storage to read {name} from"
    try:
        got = read.read_range_into(name, off, t.numpy())
    except Exception as exc:  # noqa: BLE001 - the receivers are told through the status byte
        return f"cannot read {read.url_of(name)}: {exc}"
    if got < len(t):
        return f"{read.url_of(name)} is shorter than the {off + len(t)} bytes offered"
    return None
