"""``import_safetensors``: a Hugging Face safetensors checkpoint written as a checkpoint of this package.

The files are read with the ``safetensors`` library (no pickle) after their header lengths are
checked (:func:`~dcp_tiered.inspect.safetensors_files.check_header`).  The save is planned from
shapes and dtypes alone and each tensor is read from its file only when the writer encodes it, one
file open at a time: memory stays bounded by one input shard plus the writer's frames in flight.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dcp_tiered.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, MissingFileError
from dcp_tiered.inspect.progress import ProgressFactory, progress_bar
from dcp_tiered.inspect.safetensors_export import normalize_prefix
from dcp_tiered.inspect.safetensors_files import INDEX_NAME, WEIGHTS_NAME, check_header, check_name, read_index
from dcp_tiered.names import METADATA_FILE

if TYPE_CHECKING:
    from dcp_tiered.storage import Storage


@dataclass
class ImportResult:
    """What :func:`import_safetensors` wrote: the files read, the tensors and what the save reported."""

    src: str
    dst: str
    files: list[str]
    tensors: int
    seconds: float
    saved: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The ``import --json`` document."""
        return {**self.saved, "src": self.src, "dst": self.dst, "src_files": list(self.files), "tensors": self.tensors,
                "seconds": round(self.seconds, 3)}


def _locate(src: str, options: dict[str, Any] | None) -> tuple[Storage, str | None, str | None]:
    """(the directory holding ``src``'s files, the index's name, the one file's name): ``src`` is a directory
    (its index, else its ``model.safetensors``), an index (``.json``) or one ``.safetensors`` file."""
    from dcp_tiered.storage import Storage

    from dcp_tiered.storage.base import storage_errors

    here = Storage(src, options)
    with storage_errors(src, "stat"):
        is_dir = here.fs.isdir(here.root)
    if is_dir:
        names = here.listdir()
        if INDEX_NAME in names:
            return here, INDEX_NAME, None
        if WEIGHTS_NAME in names:
            return here, None, WEIGHTS_NAME
        raise CheckpointNotFoundError(f"{src} holds neither {INDEX_NAME} nor {WEIGHTS_NAME}; give the .safetensors "
                                      "file or the index itself")
    parent, name = posixpath.split(src.rstrip("/"))
    folder = Storage(parent or ".", options)
    if not name or not folder.exists(name):
        raise CheckpointNotFoundError(f"{src} does not exist; give a .safetensors file, an index or their directory")
    return (folder, name, None) if name.endswith(".json") else (folder, None, name)


def _followed(folder: Storage, name: str) -> tuple[Storage, str]:
    """(directory, name) to read the file ``name`` of ``folder`` from: on a local filesystem, where its links
    lead (a Hugging Face hub snapshot links each file into the cache's ``blobs/``), else ``name`` itself.

    Import only reads files the user named, so links are followed; what they lead to is then read as any
    file (refused unless a regular file, its header or index size bounded)."""
    if not folder.is_local:
        return folder, name
    from dcp_tiered.storage import Storage

    real = os.path.realpath(folder.path(name))
    return Storage(os.path.dirname(real)), os.path.basename(real)


@contextlib.contextmanager
def _opened(folder: Storage, name: str, safe_open: Any) -> Iterator[Any]:
    """``safe_open`` on the file ``name`` (downloaded to a temporary file off local storage), header checked,
    its errors as :class:`CorruptCheckpointError` naming the file."""
    url = folder.url_of(name)
    folder, name = _followed(folder, name)
    check_header(folder, name)
    with contextlib.ExitStack() as stack:
        if folder.is_local:
            path = folder.path(name)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-tiered-import-"))
            path = os.path.join(tmp, "shard.safetensors")
            from dcp_tiered.storage.base import storage_errors

            with storage_errors(url, "download"):
                folder.fs.get_file(folder.path(name), path)
        try:
            handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
        except Exception as exc:  # the library's SafetensorError (and OSError on a vanished file)
            raise CorruptCheckpointError(f"{url} is not a readable safetensors file ({type(exc).__name__}: "
                                         f"{str(exc)[:200]}); re-download or re-export it") from None
        yield handle


@contextlib.contextmanager
def _reading(url: str, tensor_name: str) -> Iterator[None]:
    """The library's errors reading one tensor (a dtype torch has not, a damaged header) as
    :class:`CorruptCheckpointError` naming the file and the tensor."""
    try:
        yield
    except Exception as exc:  # the library's SafetensorError, TypeError on a dtype torch lacks
        raise CorruptCheckpointError(f"{url}: tensor {tensor_name!r} cannot be read ({type(exc).__name__}: "
                                     f"{str(exc)[:200]}); re-download or re-export it with dtypes torch "
                                     "supports") from None


class _Shards:
    """The one open input file and the tensors read from it on demand (the writer asks in file order)."""

    def __init__(self, folder: Storage, key_file: dict[str, tuple[str, str]]) -> None:
        from safetensors import safe_open

        self.folder, self.key_file, self._safe_open = folder, key_file, safe_open
        self._name: str | None = None
        self._stack = contextlib.ExitStack()
        self._handle: Any = None

    def tensor(self, key: str) -> Any:
        name, tensor_name = self.key_file[key]
        if name != self._name:
            self.close()
            self._handle = self._stack.enter_context(_opened(self.folder, name, self._safe_open))
            self._name = name
        with _reading(self.folder.url_of(name), tensor_name):
            return self._handle.get_tensor(tensor_name)

    def close(self) -> None:
        self._stack.close()
        self._stack, self._handle, self._name = contextlib.ExitStack(), None, None


def _nested(prefix: str, flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` under the dotted ``prefix``: ``"app.model."`` -> ``{"app": {"model": flat}}``."""
    out: dict[str, Any] = flat
    for part in reversed(prefix.rstrip(".").split(".") if prefix else []):
        out = {part: out}
    return out


def import_safetensors(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, prefix: str = "", codec: str = "zstd",
    src_options: dict[str, Any] | None = None, dst_options: dict[str, Any] | None = None, overwrite: bool = False,
    progress: ProgressFactory | None = None,
) -> ImportResult:
    """Write the tensors of the safetensors checkpoint ``src`` to ``dst`` with :class:`CompressedWriter` and
    ``codec``, each under ``prefix`` (``"model."``: the key ``model.<name>``, as ``{"model": model.state_dict()}``
    saves it), so that a training run restores it as its first checkpoint.

    ``src``: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory holding either (a
    Hugging Face hub snapshot directory as it is: its links into ``blobs/`` are followed to regular files).
    Every file is untrusted: header lengths and the index are bounded, the index names files inside its
    directory, names are printable (:class:`CorruptCheckpointError`, :class:`UnsafeCheckpointError`).
    Refuses a committed checkpoint at ``dst`` unless ``overwrite`` (:class:`CheckpointExistsError`, before
    anything is read or written; a save racing this one is still refused inside ``dcp.save``).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_tiered.codecs import get_codec
    from dcp_tiered.dcp.writer import CompressedWriter, exists_error

    t0 = time.perf_counter()
    codec = str(get_codec(codec))
    prefix = normalize_prefix(prefix)
    src_text, dst_text = os.fspath(src), os.fspath(dst)
    folder, index, single = _locate(src_text, src_options)
    writer = CompressedWriter(dst_text, codec=codec, storage_options=dst_options, overwrite=overwrite)
    if not overwrite and writer.storage.exists(METADATA_FILE):
        raise exists_error(writer.storage.url)  # here, not from inside dcp.save, which wraps it in a BaseException
    by_file: dict[str, list[str] | None] = {single: None} if single else {}
    for key, file in (read_index(*_followed(folder, index)).items() if index else ()):
        listed = by_file.setdefault(file, [])
        assert listed is not None
        listed.append(key)
    key_file: dict[str, tuple[str, str]] = {}
    placeholders: dict[str, Any] = {}
    for name, listed in by_file.items():
        url = folder.url_of(name)
        if listed and not folder.exists(name):
            raise MissingFileError(f"{folder.url_of(str(index))} names {name} for tensor {listed[0]!r}, which is missing "
                                   f"({url}): re-download the checkpoint, or re-export it")
        with _opened(folder, name, safe_open) as f:
            present = list(f.keys())
            held = set(present)
            for t in present if listed is None else listed:
                check_name(t, url)
                if t not in held:
                    raise CorruptCheckpointError(f"{url} does not hold tensor {t!r}, which {folder.url_of(str(index))} assigns to it; "
                                                 "the files do not belong together: re-download them")
                with _reading(url, t):
                    piece = f.get_slice(t)
                    shape = piece.get_shape()
                    dtype = piece[:0].dtype if shape else f.get_tensor(t).dtype  # a 0-dim tensor cannot be sliced
                placeholders[t] = torch.empty(shape, dtype=dtype, device="meta")
                key_file[prefix + t] = (name, t)
    if not key_file:
        raise ConfigError(f"{src_text} holds no tensor; nothing to import")
    shards = _Shards(folder, key_file)

    with progress_bar(progress, len(key_file), "import") as counter:
        class _FromFiles(DefaultSavePlanner):
            def resolve_data(self, write_item: Any) -> Any:
                tensor = shards.tensor(write_item.index.fqn)
                counter.update(1)
                return self.transform_object(write_item, tensor)

        try:
            dcp.save(_nested(prefix, placeholders), storage_writer=writer, planner=_FromFiles(), no_dist=True)
        finally:
            shards.close()
    stats = writer.last_stats
    saved = {"format": "dcp_tiered", "codec": writer.codec, **(stats.as_dict() if stats else {})}
    return ImportResult(src_text, dst_text, list(by_file), len(key_file), time.perf_counter() - t0, saved)

