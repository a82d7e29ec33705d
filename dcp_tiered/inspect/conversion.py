"""``load_any``, ``save_any``, ``convert``: a whole checkpoint in memory, between formats, codecs and dtypes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dcp_tiered.errors import (CheckpointExistsError, CheckpointNotFoundError, ConfigError, UnsafeCheckpointError,
                               UnsupportedFormatError)
from dcp_tiered.inspect.progress import ProgressFactory, progress_bar
from dcp_tiered.inspect.sources import is_torch_save_path, reader_for, stored_size

if TYPE_CHECKING:
    import torch

#: ``codec`` value of :func:`convert`/:func:`save_any` that writes stock DCP.
STOCK = "stock"


def load_any(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, safe_globals: Any = None,
             progress: ProgressFactory | None = None) -> dict[str, Any]:
    """Load a whole checkpoint (this package's, stock DCP, or a ``torch.save`` file) into a new state dict.

    Tensors keep their original dtypes.  ``safe_globals``: the opt-in for non-tensor values beyond
    ``weights_only`` (see ``CompressedReader``).  ``progress`` counts items (none for ``torch.save`` files).
    """
    path = os.fspath(path)
    if is_torch_save_path(path):
        return _load_torch_file(path, storage_options, safe_globals)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dcp_tiered.dcp.metadata_io import rebuild_problem

    reader = reader_for(path, storage_options, safe_globals=safe_globals)
    md = reader.read_metadata()
    problem = rebuild_problem(md)
    if problem is not None:
        raise UnsupportedFormatError(f"{path}: {problem}; its state dict cannot be rebuilt from the checkpoint "
                                     "alone: load it with dcp.load into a state dict of its shape")
    sd: dict[str, Any] = {}
    with progress_bar(progress, len(md.storage_data), "read") as counter:
        class _Counting(_EmptyStateDictLoadPlanner):
            def commit_tensor(self, read_item: Any, tensor: Any) -> None:
                super().commit_tensor(read_item, tensor)
                counter.update(1)

            def load_bytes(self, read_item: Any, value: Any) -> None:
                super().load_bytes(read_item, value)
                counter.update(1)

        _load_state_dict(sd, storage_reader=reader, planner=_Counting(), no_dist=True)
    return sd


def _load_torch_file(path: str, storage_options: dict[str, Any] | None, safe_globals: Any) -> dict[str, Any]:
    import fsspec
    import torch

    from dcp_tiered.dcp.objects import allowing, normalize_safe_globals
    from dcp_tiered.dcp.pickle_scan import check_torch_payload

    try:
        fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
        kind = fs.info(p).get("type")
        if kind != "file":  # a FIFO blocks the open forever, /dev/zero never ends, a directory is no file
            raise UnsafeCheckpointError(f"{path} is not a regular file ({kind}); refusing to read it")
        with fs.open(p, "rb") as f, allowing(normalize_safe_globals(safe_globals, "load")):
            check_torch_payload(f, str(path))  # depth/size of the pickle, before torch.load
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist") from None
    if not isinstance(sd, dict):
        raise ConfigError(f"{path} holds a {type(sd).__name__}, not a state dict")
    return sd


def save_any(sd: dict[str, Any], dst: str | os.PathLike[str], codec: str = "zstd", dtype: torch.dtype | None = None,
             storage_options: dict[str, Any] | None = None, *, overwrite: bool = False, safe_globals: Any = None,
             progress: ProgressFactory | None = None) -> dict[str, Any]:
    """Save ``sd`` to ``dst``: this package's format with ``codec``, stock DCP (``codec="stock"``), or a
    ``torch.save`` file (``dst`` ending in ``.pt`` ...).  ``dtype``: safe downcast of floating tensors (the rule of
    :class:`~dcp_tiered.dcp.planners.DowncastSavePlanner`; the tensors kept in their own dtype, and why, in ``kept``).

    Refuses to replace an existing ``dst`` unless ``overwrite`` (``CheckpointExistsError``; raised inside
    ``dcp.save`` for this package's format, so wrapped in DCP's ``CheckpointException`` like any error there).
    Returns what was written: ``format``, and for this package's format the codec and ``SaveStats``.
    """
    dst = os.fspath(dst)
    if is_torch_save_path(dst):
        return _save_torch_file(sd, dst, dtype, storage_options, overwrite)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_tiered.dcp.planners import DowncastSavePlanner
    from dcp_tiered.dcp.writer import CompressedWriter

    base = DowncastSavePlanner if dtype is not None else DefaultSavePlanner
    with progress_bar(progress, _count_leaves(sd), "write") as counter:
        class _Counting(base):  # type: ignore[misc, valid-type]
            def resolve_data(self, write_item: Any) -> Any:
                out = super().resolve_data(write_item)
                counter.update(1)
                return out

        planner = _Counting(dtype) if dtype is not None else _Counting()
        if codec == STOCK:
            dcp.save(sd, storage_writer=_stock_writer(dst, storage_options, overwrite), planner=planner, no_dist=True)
            return {"format": "stock DCP", **({"kept": dict(planner.report.kept)} if dtype is not None else {})}
        writer = CompressedWriter(dst, codec=codec, storage_options=storage_options, overwrite=overwrite, safe_globals=safe_globals)
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
    stats = writer.last_stats
    kept = {"kept": dict(planner.report.kept)} if isinstance(planner, DowncastSavePlanner) else {}
    return {"format": "dcp_tiered", "codec": writer.codec, **(stats.as_dict() if stats else {}), **kept}


def _stock_writer(dst: str, storage_options: dict[str, Any] | None, overwrite: bool) -> Any:
    import fsspec
    import torch.distributed.checkpoint as dcp

    fs, root = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    exists = fs.exists(root.rstrip("/") + "/.metadata")
    if "://" in dst and not dst.startswith("file://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer: Any = FsspecWriter(dst, **(storage_options or {}))
    else:
        writer = dcp.FileSystemWriter(dst)
    if exists and not overwrite:
        raise CheckpointExistsError(
            f"a committed checkpoint already exists at {dst}; pass overwrite=True (--overwrite) to replace it")
    return writer


def _save_torch_file(sd: dict[str, Any], dst: str, dtype: Any, storage_options: dict[str, Any] | None,
                     overwrite: bool) -> dict[str, Any]:
    import fsspec
    import torch

    fs, p = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    if fs.exists(p) and not overwrite:
        raise CheckpointExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    kept: dict[str, str] = {}
    if dtype is not None:
        sd = _cast_floats(sd, dtype, "", kept)
    with fsspec.open(dst, "wb", **(storage_options or {})) as f:
        torch.save(sd, f)
    return {"format": "torch.save", "stored_bytes": fs.size(p), **({"kept": kept} if dtype is not None else {})}


def _cast_floats(sd: Any, dtype: Any, key: str, kept: dict[str, str]) -> Any:
    """``sd`` with the tensors that :class:`~dcp_tiered.dcp.planners.DowncastSavePlanner` would store in ``dtype``
    cast to it (same keys, optimizer state and range rule); the others in ``kept`` (dotted key -> why)."""
    import fnmatch

    import torch

    from dcp_tiered.dcp.planners import DEFAULT_EXCLUDE, downcast_problem, narrows

    if isinstance(sd, (dict, list)):
        items = sd.items() if isinstance(sd, dict) else enumerate(sd)
        cast = {k: _cast_floats(v, dtype, f"{key}.{k}" if key else str(k), kept) for k, v in items}
        return cast if isinstance(sd, dict) else list(cast.values())
    if not isinstance(sd, torch.Tensor) or not narrows(sd.dtype) or any(fnmatch.fnmatchcase(key, p) for p in DEFAULT_EXCLUDE):
        return sd
    problem = downcast_problem(sd, dtype)
    if problem:
        kept[key] = problem
        return sd
    return sd.to(dtype)


def _count_leaves(sd: Any) -> int:
    if isinstance(sd, dict):
        return sum(_count_leaves(v) for v in sd.values())
    return 1


@dataclass
class ConvertResult:
    """What :func:`convert` did: sizes before and after, and what :func:`save_any` reported."""

    src: str
    dst: str
    src_bytes: int
    dst_bytes: int
    seconds: float
    saved: dict[str, Any]

    @property
    def ratio(self) -> float | None:
        return round(self.dst_bytes / self.src_bytes, 4) if self.src_bytes else None

    def as_dict(self) -> dict[str, Any]:
        """The ``convert --json`` document; keys of :attr:`saved` (``ratio``: stored over raw) win."""
        return {"src": self.src, "dst": self.dst, "src_bytes": self.src_bytes, "dst_bytes": self.dst_bytes,
                "ratio": self.ratio, "seconds": round(self.seconds, 3), **self.saved}


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], codec: str = "zstd",
            dtype: torch.dtype | None = None, *,
            src_options: dict[str, Any] | None = None, dst_options: dict[str, Any] | None = None,
            overwrite: bool = False, safe_globals: Any = None, progress: ProgressFactory | None = None) -> ConvertResult:
    """Load ``src`` completely (:func:`load_any`) and write it to ``dst`` (:func:`save_any`).

    ``codec``: ``none``, ``lz4``, ``zstd``, ``zstd:N``, a registered codec's spec, or ``"stock"``; checked before
    anything is read.
    Errors raised inside ``dcp.load``/``dcp.save`` arrive wrapped in DCP's ``CheckpointException``
    (the original in ``exc.failures[rank]``).
    """
    from dcp_tiered.codecs import get_codec

    src, dst = os.fspath(src), os.fspath(dst)
    if codec != STOCK:
        codec = str(get_codec(codec))
    t0 = time.perf_counter()
    sd = load_any(src, src_options, safe_globals=safe_globals, progress=progress)
    saved = save_any(sd, dst, codec, dtype, dst_options, overwrite=overwrite, safe_globals=safe_globals, progress=progress)
    src_bytes, dst_bytes = stored_size(src, src_options), stored_size(dst, dst_options)
    return ConvertResult(src, dst, src_bytes, dst_bytes, time.perf_counter() - t0, saved)
