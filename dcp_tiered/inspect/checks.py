"""``verify``: every data file a checkpoint names is there and long enough, every frame checksum matches."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_tiered.errors import DcpTieredError
from dcp_tiered.inspect.progress import ProgressFactory, progress_bar
from dcp_tiered.inspect.records import untrusted
from dcp_tiered.inspect.sources import reader_for
from dcp_tiered.inspect.summary import describe

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_tiered.dcp.format import ItemRecord
    from dcp_tiered.dcp.reader import CompressedReader
    from dcp_tiered.storage import Storage

#: Largest ranged read while checking frames.
READ_STEP = 32 << 20


@dataclass
class VerifyResult:
    """What :func:`verify` checked and found: ``problems`` (one line each) and the counts."""

    path: str
    problems: list[str] = field(default_factory=list)
    items: int = 0
    frames: int = 0
    files: int = 0
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        """The counts as a JSON-ready dict: ``items``, ``frames``, ``files``, ``bytes``."""
        return {"items": self.items, "frames": self.frames, "files": self.files, "bytes": self.bytes_read}

    def counts_text(self, size: Callable[[int], str] = "{} bytes".format) -> str:
        """The counts in words, ``size`` formatting the bytes read."""
        return f"{self.items} items, {self.frames} frames checksummed, {self.files} files, {size(self.bytes_read)} read"


def verify(source: str | os.PathLike[str] | CompressedReader, storage_options: dict[str, Any] | None = None,
           progress: ProgressFactory | None = None) -> VerifyResult:
    """Check every data file a checkpoint names (present, long enough) and every frame checksum.

    Damaged data files are listed in :attr:`VerifyResult.problems`, each naming the file and
    the key; a missing or malformed ``.metadata`` raises (``CheckpointNotFoundError``,
    ``CorruptCheckpointError``, ...).  Stock DCP items carry no checksums: presence and length only.
    ``progress`` counts stored bytes.
    """
    reader = reader_for(source, storage_options)
    total = describe(reader).stored_bytes
    md = reader.read_metadata()
    with progress_bar(progress, total, "verify", unit="B") as counter, untrusted(reader):
        return _verify_items(reader.storage, reader.checkpoint_id, md, counter.update)


def _verify_items(storage: Storage, path: str, md: Metadata, on_bytes: Callable[[int], None]) -> VerifyResult:
    from dcp_tiered.dcp.format import record_view
    from dcp_tiered.storage import MissingFileError

    result = VerifyResult(path)
    sizes: dict[str, int | None] = {}

    def size_of(name: str) -> int | None:
        if name not in sizes:
            try:
                sizes[name] = storage.size(name)
            except MissingFileError:
                sizes[name] = None
                result.problems.append(f"missing file {storage.url_of(name)}")
        return sizes[name]

    items = sorted(((index.fqn, record_view(rec)) for index, rec in md.storage_data.items()),
                   key=lambda ki: (ki[1].file, ki[1].offset))
    for key, item in items:
        result.items += 1
        size = size_of(item.file)
        end = item.end
        if size is None:
            continue
        if size < end:
            result.problems.append(
                f"{storage.url_of(item.file)} is truncated: {key!r} needs {end} bytes, the file has {size}")
        elif not item.native:
            on_bytes(item.length)
        else:
            problems, frames, read = _check_frames(storage, key, item, on_bytes)
            result.problems += problems
            result.frames += frames
            result.bytes_read += read
    result.files = len(sizes)
    return result


def _check_frames(storage: Storage, key: str, item: ItemRecord,
                  on_bytes: Callable[[int], None]) -> tuple[list[str], int, int]:
    """Checksum every stored frame of one native item, reading up to ``READ_STEP`` at a time.

    Returns (problems, frames checked, bytes read).
    """
    from dcp_tiered.codecs import verify_frame

    problems: list[str] = []
    starts = item.frame_starts()
    checked = read = 0
    try:
        for run in item.read_batches(READ_STEP):
            data = memoryview(storage.read_range(item.file, starts[run.start], starts[run.stop]))
            for k in run:
                off = starts[k] - starts[run.start]
                checked += 1
                if not verify_frame(data[off: off + item.frame_lengths[k]], item.frame_sums[k]):
                    problems.append(f"checksum mismatch in frame {k} of {key!r} in {storage.url_of(item.file)}")
            read += len(data)
            on_bytes(len(data))
    except DcpTieredError as exc:
        problems.append(f"cannot read {key!r} from {storage.url_of(item.file)}: {exc}")
    return problems, checked, read
