"""Tensors broadcast from one rank of a group in buckets of bounded size.

Used by :func:`~dcp_tiered.dcp.broadcast.load_and_broadcast` once every rank of the group
agreed on the structure: the leader sends, the others receive into their own tensors.
Small tensors are packed into one buffer per bucket; large ones go whole-bucket slices at a
time, straight from and into the tensor when it is contiguous on the communication device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Buckets of (tensor index, byte start, byte end) segments, each at most ``bucket_bytes``.

    Small tensors are packed together and never split; a tensor of ``bucket_bytes`` or more
    starts a bucket of its own and is sent in whole-bucket slices (straight from and into the
    tensor when it is contiguous on the communication device).
    """
    buckets: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= bucket_bytes:
            if cur:
                buckets.append(cur)
                cur, used = [], 0
            for s in range(0, n, bucket_bytes):
                buckets.append([(i, s, min(n, s + bucket_bytes))])
            continue
        if used + n > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append((i, 0, n))
        used += n
    if cur:
        buckets.append(cur)
    return buckets


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class _Staging:
    """Byte views of the tensors to send or fill; tensors that are not contiguous on the
    communication device go through a contiguous stand-in there."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        self.tensors = tensors
        self.device = device
        self.staged: dict[int, torch.Tensor] = {}

    def source(self, i: int) -> torch.Tensor:
        t = self.tensors[i]
        if not (t.is_contiguous() and t.device == self.device):
            staged = self.staged
            t = staged.get(i) if i in staged else staged.setdefault(i, t.detach().to(self.device).contiguous())
        return byte_view(t)

    def dest(self, i: int) -> torch.Tensor:
        t = self.tensors[i]
        if t.is_contiguous() and t.device == self.device:
            return byte_view(t)
        if i not in self.staged:
            self.staged[i] = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return byte_view(self.staged[i])

    def done(self, i: int, receiver: bool) -> None:
        """Tensor ``i``'s last byte went out or arrived: a receiver copies its stand-in back."""
        if i in self.staged:
            staged = self.staged.pop(i)
            if receiver:
                self.tensors[i].copy_(staged)


def broadcast_tensors(tensors: list[torch.Tensor], sizes: list[int], bucket_bytes: int, *, leader: bool, src: int,
                      group: Any, device: torch.device) -> int:
    """Broadcast ``tensors`` (``sizes`` bytes each) from global rank ``src`` over ``group`` in
    buckets of at most ``bucket_bytes``; ``leader``: this rank sends.  Returns the number of buckets."""
    buckets = plan_buckets(sizes, bucket_bytes)
    staging = _Staging(tensors, device)
    buf: torch.Tensor | None = None
    with torch.no_grad():
        for bucket in buckets:
            if len(bucket) == 1:
                i, s, e = bucket[0]
                view = (staging.source(i) if leader else staging.dest(i))[s:e]
                dist.broadcast(view, src=src, group=group)
            else:
                n = sum(e - s for _, s, e in bucket)
                if buf is None:
                    buf = torch.empty(min(bucket_bytes, sum(sizes)), dtype=torch.uint8, device=device)
                flat = buf[:n]
                if leader:
                    off = 0
                    for i, s, e in bucket:
                        flat[off:off + e - s].copy_(staging.source(i)[s:e])
                        off += e - s
                dist.broadcast(flat, src=src, group=group)
                if not leader:
                    off = 0
                    for i, s, e in bucket:
                        staging.dest(i)[s:e].copy_(flat[off:off + e - s])
                        off += e - s
            for i, _, e in bucket:
                if e == sizes[i]:  # a staged tensor is complete once its last byte went out or arrived
                    staging.done(i, receiver=not leader)
    return len(buckets)
