"""``describe``: what a checkpoint holds, from its ``.metadata`` alone."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_tiered.inspect.records import untrusted
from dcp_tiered.inspect.sources import reader_for

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_tiered.dcp.reader import CompressedReader


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass
class ItemRow:
    """One key of a checkpoint: what it is, how large raw and stored, with which codec."""

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


@dataclass
class Description:
    """What :func:`describe` found: the format, the codecs and one :class:`ItemRow` per key (sorted)."""

    path: str
    format: str
    format_version: int | None
    dcp_version: str | None
    codecs: list[str]
    rows: list[ItemRow]
    fp32_bytes: int

    @property
    def raw_bytes(self) -> int:
        return sum(r.raw_bytes or 0 for r in self.rows)

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored_bytes for r in self.rows)

    @property
    def ratio(self) -> float | None:
        return round(self.stored_bytes / self.raw_bytes, 4) if self.raw_bytes else None

    def summary(self) -> dict[str, Any]:
        """The totals as a JSON-ready dict (``tensors``: how many items are tensors)."""
        return {"path": self.path, "format": self.format, "format_version": self.format_version,
                "dcp_version": self.dcp_version, "codecs": self.codecs, "items": len(self.rows),
                "tensors": sum(r.kind == "tensor" for r in self.rows), "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes, "ratio": self.ratio, "fp32_bytes": self.fp32_bytes}

    def as_dict(self) -> dict[str, Any]:
        """The summary with ``tensors`` replaced by the rows (the ``inspect --json`` document)."""
        return {**self.summary(), "tensors": [r.as_dict() for r in self.rows]}


def describe(source: str | os.PathLike[str] | CompressedReader,
             storage_options: dict[str, Any] | None = None) -> Description:
    """Describe a checkpoint directory (path/URL, or an open reader) from its ``.metadata`` alone.

    Raises ``CheckpointNotFoundError`` without a committed checkpoint, ``CorruptCheckpointError``
    for malformed records.
    """
    reader = reader_for(source, storage_options)
    md = reader.read_metadata()
    with untrusted(reader):
        return _describe(reader.checkpoint_id, md)


def _rows(md: Metadata) -> dict[str, ItemRow]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dcp_tiered.dcp.format import dtype_name

    rows: dict[str, ItemRow] = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            dtype = smd.properties.dtype
            rows[fqn] = ItemRow(fqn, "tensor", dtype_name(dtype), None, tuple(int(d) for d in smd.size),
                                _numel(smd.size) * dtype.itemsize, 0, "", chunks=len(smd.chunks))
        else:
            rows[fqn] = ItemRow(fqn, "object", None, None, None, None, 0, "")
    return rows


def _describe(path: str, md: Metadata) -> Description:
    from dcp_tiered.dcp.format import record_view

    rows = _rows(md)
    formats, codecs, versions = set(), set(), set()
    for index, rec in md.storage_data.items():
        row = rows.get(index.fqn)
        if row is None:
            continue
        item = record_view(rec)
        row.stored_bytes += item.length
        if item.native:
            formats.add(f"dcp_tiered v{item.version}")
            versions.add(item.version)
            codec = item.codec + ("+" + item.filter_name if item.filter_name != "none" else "")
            codecs.add(item.codec)
            if item.kind == "tensor":
                row.stored_dtype = item.dtype
            else:
                row.raw_bytes = (row.raw_bytes or 0) + item.raw_length
        else:
            formats.add("stock DCP")
            codec = "+".join(item.transforms) if item.transforms else "stock (torch.save)"
            codecs.add(codec)
            if row.kind == "tensor":
                row.stored_dtype = row.dtype
        row.codec = codec if not row.codec or row.codec == codec else "mixed"
        if item.file not in row.files:
            row.files.append(item.file)
    return Description(path, ", ".join(sorted(formats)) or "empty", max(versions) if versions else None,
                       getattr(md, "version", None), sorted(codecs), sorted(rows.values(), key=lambda r: r.key),
                       fp32_bytes(md))


def fp32_bytes(md: Metadata) -> int:
    """Bytes the checkpoint's tensors take uncompressed with every float tensor in fp32."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for smd in md.state_dict_metadata.values():
        if isinstance(smd, TensorStorageMetadata):
            dt = smd.properties.dtype
            total += _numel(smd.size) * (4 if dt.is_floating_point else dt.itemsize)
    return total
