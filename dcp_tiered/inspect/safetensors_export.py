"""``export_safetensors``: the model part of a checkpoint as a Hugging Face safetensors checkpoint, shard by shard.

The tensors of one output shard at a time are loaded through DCP (a partial state dict of just
those keys, at the sizes and dtypes the checkpoint's metadata describes, resharded into whole
tensors), written with the ``safetensors`` library and dropped: memory stays bounded by one output
shard plus one load group (:data:`LOAD_GROUP_BYTES`), whatever the checkpoint's size.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import posixpath
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_tiered.errors import CheckpointExistsError, ConfigError, CorruptCheckpointError, StorageError
from dcp_tiered.inspect.progress import ProgressFactory, progress_bar
from dcp_tiered.inspect.safetensors_files import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    SHARD_METADATA,
    WEIGHTS_NAME,
    index_document,
    max_shard_bytes,
    name_problem,
    plan_shards,
    shard_name,
)
from dcp_tiered.inspect.sources import TORCH_SAVE_SUFFIXES, is_torch_save_path, reader_for

if TYPE_CHECKING:
    import torch

    from dcp_tiered.dcp.reader import CompressedReader
    from dcp_tiered.storage import Storage

#: Keys an export leaves out unless ``default_exclude=False`` (``--no-default-exclude``): optimizer state,
#: which a model checkpoint does not carry (plain training loops, ``TieredCheckpointer``, Lightning).
DEFAULT_EXPORT_EXCLUDE: tuple[str, ...] = (
    "optim.*", "optimizer.*", "optim_state*", "optimizer_states.*",
    "*.exp_avg", "*.exp_avg_sq", "*.max_exp_avg_sq", "*.momentum_buffer", "*.square_avg",
)

#: Source bytes loaded by one ``dcp.load`` call: with ``dtype``, each group is cast and its wide copy dropped
#: before the next group loads, so a downcast shard never holds the whole shard twice.
LOAD_GROUP_BYTES = 64 << 20


def normalize_prefix(prefix: str) -> str:
    """``"model"`` and ``"model."`` both name the keys under ``model``; ``""`` names every key."""
    if not isinstance(prefix, str):
        raise ConfigError(f"prefix must be a string such as 'model.', got {prefix!r}")
    prefix = prefix.strip()
    if prefix and not prefix.endswith("."):
        prefix += "."
    if prefix and "" in prefix[:-1].split("."):
        raise ConfigError(f"prefix {prefix!r} has an empty component; write it as the keys spell it, e.g. 'app.model.'")
    return prefix


@dataclass
class ExportResult:
    """What :func:`export_safetensors` wrote: the files (name -> tensors), the tensors' bytes, what was left out."""

    src: str
    dst: str
    files: dict[str, list[str]]
    total_size: int
    seconds: float
    dtype: str | None = None
    downcast: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def tensors(self) -> int:
        return sum(len(keys) for keys in self.files.values())

    def as_dict(self) -> dict[str, Any]:
        """The ``export --json`` document."""
        return {"src": self.src, "dst": self.dst, "format": "safetensors", "files": {f: len(k) for f, k in self.files.items()},
                "index": INDEX_NAME if len(self.files) > 1 else None, "tensors": self.tensors,
                "total_size": self.total_size, "dtype": self.dtype, "downcast": len(self.downcast), "kept": self.kept,
                "skipped": self.skipped, "seconds": round(self.seconds, 3)}


@functools.cache
def storable(dtype: torch.dtype) -> bool:
    """Whether the installed ``safetensors`` stores ``dtype`` (asked of its own serializer: its dtype table
    grows between versions)."""
    import torch
    from safetensors.torch import save

    try:
        save({"x": torch.empty(0, dtype=dtype)})
    except Exception:  # KeyError (not in its table), or the library's own error
        return False
    return True


def _keys(reader: CompressedReader, md: Any, where: str) -> dict[str, str]:
    """Each key the export sees -> the checkpoint item holding it: the items themselves, or for a Lightning
    plugin checkpoint (``CompressedCheckpointIO``) the names inside its ``state_dict``, read from its skeleton."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dcp_tiered.dcp.plugin_layout import SKELETON, is_plugin_checkpoint, state_dict_items

    if not is_plugin_checkpoint(md.state_dict_metadata):
        return {k: k for k in md.state_dict_metadata}
    sd: dict[str, Any] = {SKELETON: None}
    _load_state_dict(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    keys = state_dict_items(sd[SKELETON], where)
    missing = [k for k, item in keys.items() if item not in md.state_dict_metadata]
    if missing:
        raise CorruptCheckpointError(f"{where}: its skeleton names tensor {missing[0]!r} as item {keys[missing[0]]!r}, "
                                     "which the checkpoint does not hold; it is damaged, export another one")
    return keys


def _selected(md: Any, keys: dict[str, str], prefix: str, include: Sequence[str],
              exclude: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """(key -> its TensorStorageMetadata for the keys exported, non-tensor keys left out)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    chosen: dict[str, Any] = {}
    skipped: list[str] = []
    for key, name in keys.items():
        item = md.state_dict_metadata[name]
        if not key.startswith(prefix) or len(key) == len(prefix):
            continue
        if not any(fnmatch.fnmatchcase(key, p) for p in include) or any(fnmatch.fnmatchcase(key, p) for p in exclude):
            continue
        if not isinstance(item, TensorStorageMetadata):
            skipped.append(key)
            continue
        problem = name_problem(key[len(prefix):])
        if problem:
            raise ConfigError(f"tensor {key[:200]!r} would be named {key[len(prefix):][:200]!r}, which {problem} (import and "
                              "safetensors' readers refuse it): leave it out with exclude=[...] (--exclude) or give "
                              "another prefix= (--prefix) so that it exports under another name")
        if not storable(item.properties.dtype):
            raise ConfigError(f"tensor {key!r} is {item.properties.dtype}, which the installed safetensors cannot "
                              "store; leave it out with exclude=[...] (--exclude)")
        chosen[key] = item
    return chosen, skipped


def _no_keys_error(src: str, keys: dict[str, str], prefix: str) -> ConfigError:
    tops = sorted({k.split(".")[0] for k in keys})[:12]
    return ConfigError(f"no tensor of {src} matches prefix {prefix!r} and the include/exclude patterns; its keys start "
                       f"with {tops}: give prefix= (--prefix) as the model's keys start, e.g. '{tops[0] if tops else 'model'}.'")


def export_safetensors(
    src: str | os.PathLike[str] | CompressedReader, dst: str | os.PathLike[str], *, prefix: str = "",
    include: Sequence[str] = ("*",), exclude: Sequence[str] = (), default_exclude: bool = True,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None, overwrite: bool = False, underflow_tolerance: float = 1e-3,
    progress: ProgressFactory | None = None,
) -> ExportResult:
    """Write the tensors of ``src`` whose keys start with ``prefix`` to the directory ``dst`` as a Hugging Face
    safetensors checkpoint, ``prefix`` stripped from their names.

    ``src``: a checkpoint directory or URL (this package's or stock DCP), or an open reader; a Lightning
    plugin checkpoint (``CompressedCheckpointIO``) exports its ``state_dict`` under the parameter names
    (``prefix`` applies to those), found through its skeleton without Lightning.  A ``torch.save`` file
    is refused (:class:`ConfigError`: convert it to a directory first).
    ``include``/``exclude``: glob patterns of checkpoint keys (prefix included); ``exclude`` adds to
    :data:`DEFAULT_EXPORT_EXCLUDE` (optimizer state), which ``default_exclude=False`` drops.  Non-tensor
    items are left out (``skipped``).  ``dtype``: ``torch.bfloat16``/``torch.float16``, the safe downcast of
    :class:`~dcp_tiered.dcp.planners.DowncastSavePlanner` (floats wider than 16 bits; a tensor the target
    cannot hold, :func:`~dcp_tiered.dcp.planners.downcast_problem`, keeps its dtype, in ``kept``, and may take
    its shard past ``max_shard_size``).
    ``max_shard_size``: bytes or ``"5GB"``/``"500MB"``; one file ``model.safetensors`` when everything
    fits, else numbered shards and ``model.safetensors.index.json``, written last.  Refuses a ``dst``
    that holds an export unless ``overwrite`` (:class:`CheckpointExistsError`).
    """
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dcp_tiered.dcp.planners import downcast_problem, narrows
    from dcp_tiered.storage import Storage

    t0 = time.perf_counter()
    prefix = normalize_prefix(prefix)
    if isinstance(include, str) or isinstance(exclude, str):
        raise ConfigError("include/exclude take a list of glob patterns, not a single string")
    if dtype is not None:
        downcast_problem(torch.zeros(0), dtype)  # the dtype is checked before anything is read
    limit = max_shard_bytes(max_shard_size)
    if not os.fspath(dst).strip():
        raise ConfigError("dst is empty: give the output directory or URL (an empty one would write into the current "
                          "directory)")
    src_text = src if isinstance(src, str) else os.fspath(src) if isinstance(src, os.PathLike) else src.storage.url
    if isinstance(src, (str, os.PathLike)) and is_torch_save_path(src):
        raise ConfigError(f"{src_text} is a torch.save file ({', '.join(TORCH_SAVE_SUFFIXES)}), not a checkpoint "
                          f"directory, which is what export reads: convert it first (dcp-tiered convert {src_text} "
                          "DIR) and export DIR; a Lightning .ckpt file's weights are then under --prefix state_dict.")
    reader = reader_for(src, src_options)
    md = reader.read_metadata()
    leave_out = (DEFAULT_EXPORT_EXCLUDE if default_exclude else ()) + tuple(exclude)
    item_of = _keys(reader, md, src_text)
    chosen, skipped = _selected(md, item_of, prefix, tuple(include), leave_out)
    if not chosen:
        raise _no_keys_error(src_text, item_of, prefix)
    out_dtype = {k: dtype if dtype is not None and narrows(m.properties.dtype) else m.properties.dtype for k, m in chosen.items()}
    numel = {k: int(torch.Size(m.size).numel()) for k, m in chosen.items()}
    shards = plan_shards(((k, numel[k] * out_dtype[k].itemsize) for k in chosen), limit)
    names = [shard_name(i + 1, len(shards)) for i in range(len(shards))]
    dst_text = os.fspath(dst)
    out = Storage(dst_text, dst_options)
    _claim(out, names, overwrite)
    result = ExportResult(src_text, dst_text, {}, 0, 0.0, str(dtype).removeprefix("torch.") if dtype is not None else None,
                          skipped=skipped)
    source_bytes = {k: numel[k] * chosen[k].properties.dtype.itemsize for k in chosen}
    with progress_bar(progress, len(chosen), "export") as counter, tempfile.TemporaryDirectory(prefix="dcp-tiered-export-") as tmp:
        for keys, name in zip(shards, names):
            tensors: dict[str, torch.Tensor] = {}
            for group in plan_shards(((k, source_bytes[k]) for k in keys), min(limit, LOAD_GROUP_BYTES)):
                sd = {item_of[k]: torch.empty(chosen[k].size, dtype=chosen[k].properties.dtype) for k in group}
                _load_state_dict(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
                for k in group:
                    t = sd.pop(item_of[k])
                    if out_dtype[k] != t.dtype:
                        problem = downcast_problem(t, out_dtype[k], underflow_tolerance)
                        if problem:
                            result.kept[k[len(prefix):]] = problem
                        else:
                            t = t.to(out_dtype[k])
                            result.downcast.append(k[len(prefix):])
                    tensors[k[len(prefix):]] = t
                    result.total_size += t.numel() * t.element_size()
                counter.update(len(group))
            _write_shard(out, name, tensors, tmp)
            result.files[name] = list(tensors)
            del tensors
        if len(names) > 1:
            weight_map = {k: f for f, ks in result.files.items() for k in ks}
            out.commit_bytes(INDEX_NAME, index_document(weight_map, result.total_size))
    _remove_stale(out, names)
    result.seconds = time.perf_counter() - t0
    return result


def _claim(out: Storage, names: list[str], overwrite: bool) -> None:
    """Refuse a ``dst`` holding an export (unless ``overwrite``); create it.

    An overwrite first removes what makes the old export look whole (its index, and a ``model.safetensors``
    that the new export does not replace): an export interrupted after some shards is then incomplete to
    ``import`` and ``transformers``, never a mix of the old shards and the new under the old index."""
    held = [n for n in out.listdir() if n in (WEIGHTS_NAME, INDEX_NAME) or _is_shard(n)] if out.exists() else []
    if held and not overwrite:
        raise CheckpointExistsError(f"{out.url} already holds a safetensors export ({held[0]}); pass overwrite=True "
                                    "(--overwrite) to replace it, or export to a new directory")
    for entry in (INDEX_NAME, WEIGHTS_NAME):
        if entry in held and entry not in names:
            out.remove(entry)
    out.makedirs()


def _is_shard(name: str) -> bool:
    return name.startswith("model-") and "-of-" in name and name.endswith(".safetensors")


def _remove_stale(out: Storage, names: list[str]) -> None:
    """An overwrite leaves no shard of an earlier export that the new one does not name."""
    for n in out.listdir():
        if (_is_shard(n) or n == WEIGHTS_NAME) and n not in names:
            out.remove(n)


def _write_shard(out: Storage, name: str, tensors: dict[str, Any], tmp: str) -> None:
    """Serialize one shard with ``safetensors`` (no copy of the tensors) and publish it with
    :meth:`~dcp_tiered.storage.Storage.commit_file`: a reader never sees a half-written shard.
    A local shard is staged next to its place (a temp name), so that publishing it is a rename."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from dcp_tiered.storage.base import temp_name

    staged = temp_name(out.path(name)) if out.is_local else posixpath.join(tmp, name)
    try:
        save_file(tensors, staged, metadata=SHARD_METADATA)
    except BaseException as exc:
        if os.path.exists(staged):
            os.remove(staged)
        if isinstance(exc, (SafetensorError, OSError)):  # the disk's error (ENOSPC, EIO, a read-only place)
            place = f"DST {out.url}" if out.is_local else f"the local staging directory {tmp} (TMPDIR)"
            raise StorageError(f"{out.url_of(name)}: writing the shard failed ({type(exc).__name__}: {str(exc)[:300]}); "
                               f"check that {place} is a writable directory with space for it") from exc
        raise
    out.commit_file(name, staged)
