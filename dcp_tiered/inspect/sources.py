"""What a path names (a checkpoint directory or a ``torch.save`` file), readers on it, its stored size."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcp_tiered.dcp.reader import CompressedReader

#: File name endings read and written as a single ``torch.save`` file.
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def is_torch_save_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a single ``torch.save`` file (by its ending) rather than a checkpoint directory
    (a local directory is one whatever its name: the Lightning plugin's ``last.ckpt``)."""
    text = os.fspath(path)
    return text.endswith(TORCH_SAVE_SUFFIXES) and not ("://" not in text and os.path.isdir(text))


def open_reader(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, verify: bool = True,
                safe_globals: Any = None) -> CompressedReader:
    """A :class:`CompressedReader` on ``path`` (validates ``.metadata``; raises if it is not a committed checkpoint)."""
    from dcp_tiered.dcp.reader import CompressedReader

    return CompressedReader(path, storage_options=storage_options, verify=verify, safe_globals=safe_globals)


def reader_for(source: str | os.PathLike[str] | CompressedReader, storage_options: dict[str, Any] | None = None,
               safe_globals: Any = None) -> CompressedReader:
    """``source`` itself when it is an open reader, else :func:`open_reader` on the path."""
    if isinstance(source, (str, os.PathLike)):
        return open_reader(os.fspath(source), storage_options, safe_globals=safe_globals)
    return source


def stored_size(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> int:
    """Bytes stored at ``path``: a ``torch.save`` file's size, or the sum of every file of a checkpoint directory."""
    path = os.fspath(path)
    if is_torch_save_path(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
        return int(fs.size(p))
    from dcp_tiered.storage import Storage

    return sum(Storage(path, storage_options).file_sizes().values())
