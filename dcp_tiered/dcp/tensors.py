"""Views between tensors and their raw element bytes, without copies where possible."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch


class _HostBuffers:
    """Host buffers for :class:`DeviceBytes`, reused: a fresh buffer per frame would leave the allocator's
    arenas holding several times the frames in flight.  Each is at least the frame size of the save that
    made it, so any frame of that save reuses any buffer and the list holds one per copy that was in
    flight at once (one per encoder thread); a save of larger frames drops the smaller ones, and at most
    :data:`HOST_BUFFERS` are kept.  They are torch tensors (pinned where CUDA is present, so device copies
    into them are DMA), lent as arrays."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # the address of a lent array -> its whole buffer
        self._lock = threading.Lock()

    def get(self, n: int, frame_size: int) -> tuple[np.ndarray, torch.Tensor]:
        """An array of ``n`` bytes and the tensor it is (to copy into), from a buffer of at least
        ``frame_size`` bytes (the save's)."""
        with self._lock:  # by position: list.remove would compare tensors element by element
            at = next((i for i, b in enumerate(self._free) if b.numel() >= n), None)
            whole = self._free.pop(at) if at is not None else None
            if whole is None:  # buffers too small for this save's frames would never serve it
                self._free = [b for b in self._free if b.numel() >= frame_size]
        if whole is None:
            whole = torch.empty(max(n, frame_size, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        part = whole[:n]
        arr = part.numpy()
        with self._lock:
            self._lent[arr.ctypes.data] = whole
        return arr, part

    def put(self, arr: np.ndarray) -> None:
        with self._lock:
            whole = self._lent.pop(arr.ctypes.data, None)
            if whole is not None and len(self._free) < HOST_BUFFERS:
                self._free.append(whole)

    def forget(self, arr: np.ndarray) -> None:
        """``arr`` stays with its reader (an encoded frame stores it raw): never lent again."""
        with self._lock:
            self._lent.pop(arr.ctypes.data, None)


#: Most host buffers kept for reuse by :class:`DeviceBytes` (one per encoder thread is what a save keeps).
HOST_BUFFERS = 16
_BUFFERS = _HostBuffers()


class DeviceBytes:
    """The raw element bytes of a tensor on a device (CUDA), copied to host memory one slice at a time.

    ``bytes_[s:e]`` copies those bytes into a host buffer (pinned where CUDA is present) and returns it
    as a uint8 array, so a save never holds a whole device tensor in host memory: the writer's encoders
    each copy the frame they encode, overlapped with the others' encoding, and host memory stays
    bounded by the frames in flight.  The copies are made on the stream that was current where the
    tensor was handed over (the caller's), so they follow the work queued there that wrote it, as a
    copy in the caller's thread would.  :meth:`release` gives a buffer back once its frame is encoded."""

    __slots__ = ("_flat", "nbytes", "_frame_size", "_stream")

    def __init__(self, tensor: torch.Tensor, frame_size: int) -> None:
        self._flat = tensor.reshape(-1).view(torch.uint8)
        self.nbytes = self._flat.numel()
        self._frame_size = frame_size
        self._stream = torch.cuda.current_stream(tensor.device) if tensor.device.type == "cuda" else None

    def __getitem__(self, frame: slice) -> np.ndarray:
        start, stop, _ = frame.indices(self.nbytes)
        host, part = _BUFFERS.get(max(stop - start, 0), self._frame_size)
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                part.copy_(self._flat[start:stop])
        except BaseException:
            _BUFFERS.put(host)
            raise
        return host

    @staticmethod
    def release(host: np.ndarray, kept: "tuple[object, ...]") -> None:
        """Reuse ``host`` unless one of ``kept`` (the encoded frame's pieces) still reads it (a plane stored raw)."""
        if any(isinstance(p, np.ndarray) and np.shares_memory(p, host) for p in kept):
            _BUFFERS.forget(host)
        else:
            _BUFFERS.put(host)


def tensor_bytes(tensor: torch.Tensor, frame_size: int) -> "tuple[np.ndarray | DeviceBytes, torch.Tensor]":
    """Return the raw element bytes of ``tensor`` and the tensor backing them (keep it referenced while
    the bytes are in use): a uint8 array of a CPU tensor's own memory, or :class:`DeviceBytes` of a
    device tensor (copied to the host frame by frame of ``frame_size``, never whole).  Only the view's
    elements are kept: a non-contiguous tensor (a transposed or expanded view) is copied whole into a
    contiguous one first, on its own device, and a lazy conjugate or negation is applied."""
    t = tensor.detach().resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8), t
    if staged_by_frame(t):
        return DeviceBytes(t, frame_size), t
    return t.reshape(-1).view(torch.uint8).numpy(), t


def staged_by_frame(t: torch.Tensor) -> bool:
    """Whether the bytes of ``t`` are copied to the host frame by frame (:class:`DeviceBytes`): any
    tensor not in CPU memory."""
    return t.device.type != "cpu"


def empty_for_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
    """Allocate a CPU tensor and return it with a writable uint8 view of its bytes."""
    t = torch.empty(shape, dtype=dtype)
    return t, writable_bytes(t)


def writable_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 array aliasing a contiguous CPU tensor's memory."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()
