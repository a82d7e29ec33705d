"""Checkpoint-level helpers for the CLI: describe, verify, load into memory, save.

Adapters over the library's public pieces (``CompressedReader``/``CompressedWriter``,
the frame codec) so that each command stays short.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dcp_tiered.cli.common import EXIT_NOT_FOUND, CliError

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
READ_STEP = 32 << 20


def is_torch_save_path(path: str) -> bool:
    return str(path).endswith(TORCH_SAVE_SUFFIXES)


def open_reader(path: str, storage_options: dict[str, Any] | None = None, verify: bool = True,
                safe_globals: Any = None) -> Any:
    from dcp_tiered.dcp.reader import CompressedReader

    return CompressedReader(path, storage_options=storage_options, verify=verify, safe_globals=safe_globals)


@dataclass
class TensorRow:
    key: str
    kind: str  # "tensor" or "object"
    dtype: str | None
    stored_dtype: str | None
    shape: tuple[int, ...] | None
    raw_bytes: int | None
    stored_bytes: int
    codec: str
    chunks: int = 1
    files: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "kind": self.kind, "dtype": self.dtype, "stored_dtype": self.stored_dtype,
            "shape": list(self.shape) if self.shape is not None else None, "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes, "ratio": round(self.ratio, 4) if self.ratio is not None else None,
            "codec": self.codec, "chunks": self.chunks, "files": self.files,
        }


def _dtype_str(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# What reading a field of the wrong type or range raises; from metadata that means a malformed checkpoint.
_MALFORMED = (TypeError, AttributeError, KeyError, IndexError, ValueError, OverflowError)


@contextmanager
def _untrusted(reader: Any) -> Iterator[None]:
    """Turn a builtin error raised while interpreting ``reader``'s metadata into ``CorruptCheckpointError``."""
    from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError

    try:
        yield
    except DcpTieredError:
        raise
    except _MALFORMED as exc:
        raise CorruptCheckpointError(
            f"{getattr(reader, 'checkpoint_id', 'the checkpoint')}/.metadata is malformed "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); restore from another tier or an older step"
        ) from exc


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def describe(reader: Any) -> tuple[dict[str, Any], list[TensorRow]]:
    """Summary and per-key rows of the checkpoint ``reader`` opened (malformed records: ``CorruptCheckpointError``)."""
    md = reader.read_metadata()
    with _untrusted(reader):
        return _describe(reader, md)


def _describe(reader: Any, md: Any) -> tuple[dict[str, Any], list[TensorRow]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dcp_tiered.dcp.format import FORMAT_VERSION, is_native_record

    rows: dict[str, TensorRow] = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            itemsize = smd.properties.dtype.itemsize
            rows[fqn] = TensorRow(fqn, "tensor", _dtype_str(smd.properties.dtype), None, tuple(int(d) for d in smd.size),
                                  _numel(smd.size) * itemsize, 0, "", chunks=len(smd.chunks))
        else:
            rows[fqn] = TensorRow(fqn, "object", None, None, None, None, 0, "")
    formats, codecs, transforms = set(), set(), set()
    for index, rec in md.storage_data.items():
        row = rows.get(index.fqn)
        if row is None:
            continue
        if is_native_record(rec):
            formats.add(f"dcp_tiered v{rec['fmt']}")
            row.stored_bytes += rec["length"]
            codec = rec["codec"] + ("+" + rec["filter"] if rec["filter"] != "none" else "")
            codecs.add(rec["codec"])
            if rec["kind"] == "tensor":
                row.stored_dtype = rec["dtype"]
            else:
                row.raw_bytes = (row.raw_bytes or 0) + rec["raw"]
            file = rec["file"]
        else:
            formats.add("stock DCP")
            descs = tuple(getattr(rec, "transform_descriptors", None) or ())
            transforms.update(descs)
            codec = "+".join(descs) if descs else "stock (torch.save)"
            codecs.add(codec)
            row.stored_bytes += rec.length
            if row.kind == "tensor":
                row.stored_dtype = row.dtype
            file = rec.relative_path
        row.codec = codec if not row.codec or row.codec == codec else "mixed"
        if file not in row.files:
            row.files.append(file)
    out_rows = sorted(rows.values(), key=lambda r: r.key)
    raw = sum(r.raw_bytes or 0 for r in out_rows)
    stored = sum(r.stored_bytes for r in out_rows)
    summary = {
        "path": reader.checkpoint_id,
        "format": ", ".join(sorted(formats)) or "empty",
        "format_version": FORMAT_VERSION if any(f.startswith("dcp_tiered") for f in formats) else None,
        "dcp_version": getattr(md, "version", None),
        "codecs": sorted(codecs),
        "items": len(out_rows),
        "tensors": sum(r.kind == "tensor" for r in out_rows),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": round(stored / raw, 4) if raw else None,
        "fp32_bytes": fp32_bytes(md),
    }
    return summary, out_rows


def fp32_bytes(md: Any) -> int:
    """Bytes the checkpoint's tensors take uncompressed with every float tensor in fp32."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for smd in md.state_dict_metadata.values():
        if isinstance(smd, TensorStorageMetadata):
            dt = smd.properties.dtype
            total += _numel(smd.size) * (4 if dt.is_floating_point else dt.itemsize)
    return total


# -- verification ------------------------------------------------------------------------


def verify_checkpoint(reader: Any, on_bytes: Callable[[int], None] | None = None) -> tuple[list[str], dict[str, Any]]:
    """Check every referenced file and every frame checksum; return (problems, counts).

    Malformed records raise ``CorruptCheckpointError``; damaged data files are listed as problems.
    """
    md = reader.read_metadata()
    with _untrusted(reader):
        return _verify_records(reader, md, on_bytes)


def _verify_records(reader: Any, md: Any, on_bytes: Callable[[int], None] | None) -> tuple[list[str], dict[str, Any]]:
    from dcp_tiered.codecs import verify_frame
    from dcp_tiered.dcp.format import is_native_record
    from dcp_tiered.errors import DcpTieredError
    from dcp_tiered.storage import MissingFileError

    storage = reader.storage
    problems: list[str] = []
    sizes: dict[str, int | None] = {}
    counts = {"items": 0, "frames": 0, "files": 0, "bytes": 0}

    def size_of(name: str) -> int | None:
        if name not in sizes:
            try:
                sizes[name] = storage.size(name)
            except MissingFileError:
                sizes[name] = None
                problems.append(f"missing file {storage.url_of(name)}")
        return sizes[name]

    records = sorted(md.storage_data.items(), key=lambda kv: (
        kv[1]["file"] if is_native_record(kv[1]) else kv[1].relative_path,
        kv[1]["offset"] if is_native_record(kv[1]) else kv[1].offset))
    for index, rec in records:
        counts["items"] += 1
        key = index.fqn
        native = is_native_record(rec)
        name = rec["file"] if native else rec.relative_path
        end = (rec["offset"] + rec["length"]) if native else (rec.offset + rec.length)
        size = size_of(name)
        if size is None:
            continue
        if size < end:
            problems.append(f"{storage.url_of(name)} is truncated: {key!r} needs {end} bytes, the file has {size}")
            continue
        if not native:
            if on_bytes:
                on_bytes(rec.length)
            continue
        starts = list(itertools.accumulate(rec["frames"], initial=rec["offset"]))
        i = 0
        try:
            while i < len(rec["frames"]):
                j, span = i, 0
                while j < len(rec["frames"]) and (j == i or span + rec["frames"][j] <= READ_STEP):
                    span += rec["frames"][j]
                    j += 1
                data = memoryview(storage.read_range(name, starts[i], starts[j]))
                for k in range(i, j):
                    off = starts[k] - starts[i]
                    counts["frames"] += 1
                    if not verify_frame(data[off: off + rec["frames"][k]], rec["sums"][k]):
                        problems.append(f"checksum mismatch in frame {k} of {key!r} in {storage.url_of(name)}")
                counts["bytes"] += len(data)
                if on_bytes:
                    on_bytes(len(data))
                i = j
        except DcpTieredError as exc:
            problems.append(f"cannot read {key!r} from {storage.url_of(name)}: {exc}")
    counts["files"] = len(sizes)
    return problems, counts


# -- load into memory / save ------------------------------------------------------------------


def load_state(path: str, storage_options: dict[str, Any] | None = None, on_item: Callable[[], None] | None = None,
               safe_globals: Any = None) -> dict[str, Any]:
    """Load a whole checkpoint (or a ``torch.save`` file) into a new state dict, original dtypes.

    ``safe_globals``: the opt-in for non-tensor values beyond ``weights_only`` (see ``CompressedReader``).
    """
    import torch
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if is_torch_save_path(path):
        import fsspec

        from dcp_tiered.dcp.objects import allowing, normalize_safe_globals
        from dcp_tiered.dcp.safe_pickle import check_torch_payload

        try:
            with fsspec.open(path, "rb", **(storage_options or {})) as f, allowing(normalize_safe_globals(safe_globals, "load")):
                check_torch_payload(f, str(path))  # depth/size of the pickle, before torch.load
                sd = torch.load(f, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CliError(f"{path} does not exist", EXIT_NOT_FOUND) from None
        if not isinstance(sd, dict):
            raise CliError(f"{path} holds a {type(sd).__name__}, not a state dict", 2)
        return sd

    class _Counting(_EmptyStateDictLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            super().commit_tensor(read_item, tensor)
            if on_item:
                on_item()

        def load_bytes(self, read_item: Any, value: Any) -> None:
            super().load_bytes(read_item, value)
            if on_item:
                on_item()

    reader = open_reader(path, storage_options, safe_globals=safe_globals)
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=reader, planner=_Counting(), no_dist=True)
    return sd


def count_items(path: str, storage_options: dict[str, Any] | None = None) -> int:
    if is_torch_save_path(path):
        return 0
    return len(open_reader(path, storage_options).read_metadata().storage_data)


def save_state(sd: dict[str, Any], dst: str, codec: str, dtype: Any = None, storage_options: dict[str, Any] | None = None,
               overwrite: bool = False, on_item: Callable[[], None] | None = None, safe_globals: Any = None) -> dict[str, Any]:
    """Save ``sd`` to ``dst``: a directory (``codec`` ``stock`` for stock DCP) or a ``torch.save`` file.

    ``safe_globals``: the opt-in the non-tensor values need (checked at save, see ``CompressedWriter``).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_tiered.dcp.planners import DowncastSavePlanner
    from dcp_tiered.dcp.writer import CompressedWriter

    if is_torch_save_path(dst):
        import fsspec

        fs, p = fsspec.core.url_to_fs(dst, **(storage_options or {}))
        if fs.exists(p) and not overwrite:
            raise CliError(f"{dst} exists; pass --overwrite to replace it", 2)
        if dtype is not None:
            sd = _cast_floats(sd, dtype)
        with fsspec.open(dst, "wb", **(storage_options or {})) as f:
            torch.save(sd, f)
        return {"format": "torch.save", "stored_bytes": fs.size(p)}

    base = DowncastSavePlanner if dtype is not None else DefaultSavePlanner

    class _Counting(base):  # type: ignore[misc, valid-type]
        def resolve_data(self, write_item: Any) -> Any:
            out = super().resolve_data(write_item)
            if on_item:
                on_item()
            return out

    planner = _Counting(dtype) if dtype is not None else _Counting()
    if codec == "stock":
        import fsspec

        fs, root = fsspec.core.url_to_fs(dst, **(storage_options or {}))
        exists = fs.exists(root.rstrip("/") + "/.metadata")
        if "://" in dst and not dst.startswith("file://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer: Any = FsspecWriter(dst, **(storage_options or {}))
        else:
            writer = dcp.FileSystemWriter(dst)
        if exists and not overwrite:
            raise CliError(f"a committed checkpoint already exists at {dst}; pass --overwrite to replace it", 2)
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
        return {"format": "stock DCP"}
    writer = CompressedWriter(dst, codec, storage_options=storage_options, overwrite=overwrite, safe_globals=safe_globals)
    dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
    stats = writer.last_stats
    return {"format": "dcp_tiered", "codec": writer.codec, **(stats.as_dict() if stats else {})}


def _cast_floats(sd: Any, dtype: Any) -> Any:
    import torch

    if isinstance(sd, dict):
        return {k: _cast_floats(v, dtype) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_cast_floats(v, dtype) for v in sd]
    if isinstance(sd, torch.Tensor) and sd.is_floating_point() and sd.element_size() > 2:
        return sd.to(dtype)
    return sd


def dir_size(path: str, storage_options: dict[str, Any] | None = None) -> int:
    from dcp_tiered.storage import Storage

    return sum(Storage(path, storage_options).file_sizes().values())
