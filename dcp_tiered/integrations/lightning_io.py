"""Lightning ``CheckpointIO`` plugin: every ``.ckpt`` Lightning writes is a compressed DCP checkpoint.

```python
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from dcp_tiered.integrations.lightning import CompressedCheckpointIO

trainer = L.Trainer(plugins=[CompressedCheckpointIO("zstd")],
                    callbacks=[ModelCheckpoint(every_n_train_steps=500, save_last=True)])
trainer.fit(model, data, ckpt_path="last")
```

A ``.ckpt`` is then a directory written by :class:`~dcp_tiered.CompressedWriter`: one DCP
tensor per tensor of the checkpoint dict (``t.0``, ``t.1``, ...: compressed, checksummed)
and one object, ``skeleton``, holding everything else with the place of each tensor, loaded
with ``torch.load(weights_only=True)``.  The commit is atomic (``.metadata`` last).  Keeping
the structure in one object avoids DCP's flattening, under which ``optimizer_states.0.state.0``
(int keys) and a string key ``"0"`` would collide.  Lightning's ``AttributeDict``
(``hyper_parameters``) is stored as a dict and rebuilt on load; other objects must pass
``weights_only`` (give ``safe_globals=``), else the save raises ``UnsafeObjectError``
naming them.

Regular files (checkpoints of the stock ``TorchCheckpointIO``) still load through the plugin,
locally and on fsspec URLs.  Local saves are swapped in atomically (``_lightning_files``).
Lightning calls save and remove on global rank 0 only, so the save is ``dcp.save(no_dist=True)``;
every rank loads.  ``LightningModule.load_from_checkpoint`` does not use the plugin: use
:func:`load_from_checkpoint` here, or opt in with ``lightning_loader.read_plugin_checkpoints``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.cloud_io import _load as pl_load
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
except ImportError:  # pragma: no cover - the standalone package
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
    from lightning_fabric.utilities.cloud_io import _load as pl_load  # type: ignore[no-redef]
    from lightning_fabric.utilities.data import AttributeDict  # type: ignore[no-redef]
    from pytorch_lightning.plugins.io.async_plugin import AsyncCheckpointIO  # type: ignore[no-redef]

from dcp_tiered.codecs import get_codec
from dcp_tiered.dcp.format import MAX_OBJECT_BYTES, is_native_record, record_view
from dcp_tiered.dcp.plugin_layout import FORMAT, SKELETON, check_format, tensor_item
from dcp_tiered.dcp.plugin_layout import is_plugin_checkpoint  # noqa: F401  (lightning_io.is_plugin_checkpoint, as before)
from dcp_tiered.dcp.reader import CompressedReader
from dcp_tiered.dcp.statedict import set_leaf
from dcp_tiered.dcp.writer import CompressedWriter, uncommit
from dcp_tiered.errors import (CheckpointExistsError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                               UnsupportedFormatError)
from dcp_tiered.integrations import _lightning_files as _files
from dcp_tiered.integrations._common import CheckpointerSource, build_checkpointer, from_one_object, one_object
from dcp_tiered.storage import Storage
from dcp_tiered.storage.base import storage_errors
from dcp_tiered.tiers.events import root_cause

__all__ = ["AsyncCompressedCheckpointIO", "CompressedCheckpointIO", "export_checkpoint", "load_from_checkpoint"]

_Path = tuple[Any, ...]


# -- the checkpoint dict as (tensors, skeleton) --------------------------------------------------

def split_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """A flat DCP state dict: ``t.{n}`` per tensor and one ``skeleton`` object for the rest."""
    tensors: list[torch.Tensor] = []
    paths: list[_Path] = []
    kinds: list[tuple[_Path, str]] = []

    def strip(value: Any, path: _Path) -> Any:
        if isinstance(value, torch.Tensor):
            _check_tensor(value, path)
            tensors.append(value.detach())
            paths.append(path)
            return None
        if type(value) in (tuple, list):
            if type(value) is tuple:
                kinds.append((path, "tuple"))
            return [strip(v, path + (i,)) for i, v in enumerate(value)]
        if type(value) in (dict, OrderedDict, AttributeDict):
            if type(value) is AttributeDict:
                kinds.append((path, "attrdict"))
            out = OrderedDict() if type(value) is OrderedDict else {}
            for k, v in value.items():
                out[k] = strip(v, path + (k,))
            return out
        return value

    tree = strip(dict(checkpoint), ())
    flat: dict[str, Any] = {tensor_item(n): t for n, t in enumerate(tensors)}
    flat[SKELETON] = one_object({"format": FORMAT, "tree": tree, "tensors": paths, "kinds": kinds})
    return flat


def _check_tensor(value: torch.Tensor, path: _Path) -> None:
    kind = ("quantized" if value.is_quantized else "meta" if value.is_meta
            else None if value.layout == torch.strided else f"sparse ({value.layout})")
    if kind is not None:
        key = ".".join(map(str, path))
        raise UnsupportedFormatError(
            f"checkpoint key {key!r}: a {kind} tensor is not supported by CompressedCheckpointIO (it would not "
            "load back as it was saved); dequantize() / to_dense() / materialize it first, or save this "
            "checkpoint with Lightning's stock TorchCheckpointIO")


def _check_skeleton(flat: Mapping[str, Any], path: Any, limit: int) -> None:
    """Refuse at save a non-tensor part the reader (``max_object_bytes``) would refuse at load."""
    def size(value: Any) -> int:
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
        except Exception:  # noqa: BLE001 - not picklable: the writer raises it, naming the object
            return 0
        return buf.tell()

    total = size(flat[SKELETON])
    if total > limit:
        tree = flat[SKELETON][0]["tree"]
        key = max(tree, key=lambda k: size(tree[k])) if tree else None
        raise ConfigError(
            f"{path}: the checkpoint's non-tensor part is {total} bytes (largest key {key!r}), over "
            f"max_object_bytes={limit}, so it could not be loaded back: store large data as tensors, or pass "
            "CompressedCheckpointIO(max_object_bytes=...) a larger limit (for saving and loading)")


def join_checkpoint(flat: Mapping[str, Any], where: str = "checkpoint") -> dict[str, Any]:
    """The checkpoint dict from what :func:`split_checkpoint` made, as loaded back."""
    skel = check_format(from_one_object(flat[SKELETON]), where)
    try:
        tree = skel["tree"]
        for n, path in enumerate(skel["tensors"]):
            set_leaf(tree, tuple(path), flat[tensor_item(n)])
        for path, kind in sorted(skel["kinds"], key=lambda pk: -len(pk[0])):
            node = tree
            for key in path:
                node = node[key]
            if path:
                set_leaf(tree, tuple(path), tuple(node) if kind == "tuple" else AttributeDict(node))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: the skeleton does not match the checkpoint's tensors ({exc!r}); "
                                     "the checkpoint is damaged, restore another one") from exc
    return tree


def template_from(reader: Any) -> dict[str, Any]:
    """An empty flat state dict matching a checkpoint's metadata (tensors allocated on CPU)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    if SKELETON not in metadata.state_dict_metadata:
        raise ConfigError(f"{reader.storage.url} is a DCP checkpoint but not one written by CompressedCheckpointIO "
                          "(no 'skeleton' entry); load it with dcp.load or dcp-tiered convert")
    _check_backed(reader.storage, metadata)
    out: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        out[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    return out


def _check_backed(storage: Any, metadata: Any) -> None:
    """Before any tensor is allocated at the size ``.metadata`` declares: every record is one this
    plugin's writer makes (frames whose stored sizes bound the raw bytes) and lies inside a data file
    that is there, so a crafted size is refused instead of allocated."""
    sizes = storage.file_sizes()
    for index, record in metadata.storage_data.items():
        if not is_native_record(record):
            raise CorruptCheckpointError(f"{storage.url}: the record of {index.fqn!r} was not written by "
                                         "CompressedCheckpointIO; load it with dcp.load or dcp-tiered convert")
        view = record_view(record)
        if sizes.get(view.file, -1) < view.end:
            raise CorruptCheckpointError(f"{storage.url_of(view.file)} is missing or shorter than the {view.end} "
                                         f"bytes {index.fqn!r} needs; restore another checkpoint")


def _map(checkpoint: dict[str, Any], map_location: Any) -> dict[str, Any]:
    if map_location is None:
        return checkpoint
    from lightning.fabric.utilities.apply_func import apply_to_collection

    if callable(map_location):  # torch.load's contract: None leaves the tensor as it is
        return apply_to_collection(checkpoint, torch.Tensor,
                                   lambda t: t if (mapped := map_location(t, "cpu")) is None else mapped)
    if isinstance(map_location, dict):
        target = map_location.get("cpu", "cpu")
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(target))
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP's ``CheckpointException`` (a ``BaseException``) as the error that caused it, e.g. ``UnsafeObjectError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True is meant
        try:
            yield
        except CheckpointException as exc:
            cause = root_cause(exc)
            if cause is exc or not isinstance(cause, Exception):
                raise
            raise cause from exc


def _local(path: "str | os.PathLike[str]") -> bool:
    return "://" not in os.fspath(path)


# -- the plugin -----------------------------------------------------------------------------

REF_KEY = "dcp_tiered_tier_ref"

#: The most bytes a reference file may hold (one is written well under 100).
MAX_REF_BYTES = 64 * 1024


def parse_ref(head: bytes, path: str = "") -> dict[str, Any] | None:
    """The reference in a file's first ``MAX_REF_BYTES + 1`` bytes, or None for anything else (a stock
    ``.ckpt``, which ``torch.save`` starts with a zip or pickle header, never with ``{``).

    Untrusted: a file that starts like JSON (after white space or a byte order mark) but is not a
    reference of marker 1 to a non-negative integer step, is too long, or nests too deep to read, is a
    :class:`CorruptCheckpointError` naming the file."""
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if not text.startswith(b"{"):
        return None

    def damaged(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: not a torch.save checkpoint, and a damaged dcp-tiered reference "
                                      f"({why}); restore another checkpoint")

    if len(head) > MAX_REF_BYTES:
        raise damaged(f"over {MAX_REF_BYTES} bytes")
    try:
        ref = json.loads(text)
    except (ValueError, RecursionError):
        raise damaged("not JSON, or nested too deep") from None
    if not isinstance(ref, dict) or REF_KEY not in ref:
        raise damaged(f"no {REF_KEY!r} key")
    if ref[REF_KEY] != 1 or type(ref[REF_KEY]) is not int:
        raise damaged(f"marker {str(ref[REF_KEY])[:20]!r}, not 1: written by another version of dcp-tiered?")
    step = ref.get("step")
    if type(step) is not int or step < 0:
        raise damaged(f"step {str(step)[:40]!r}, not a step number")
    return ref


def write_ref(path: str, step: int) -> None:
    """Atomically put a reference to ``step`` at local ``path`` (whatever was there is replaced)."""
    _files.recover(path)  # a reference or save killed before its swap
    tmp = _files.hidden(path, "partial")
    with open(tmp, "w") as f:
        json.dump({REF_KEY: 1, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    _files.swap_in(tmp, path)


class CompressedCheckpointIO(CheckpointIO):
    """Write each Lightning checkpoint as a compressed, checksummed, atomically committed DCP directory.

    Args:
        codec: the codec of :class:`~dcp_tiered.CompressedWriter` (``"zstd"``, ``"lz4"``, ...).
        storage_options: fsspec options for non-local paths (``s3://...``).
        threads: compression/decompression threads.
        safe_globals: classes the non-tensor parts (hyper-parameters, callback states) need
            beyond ``weights_only``'s allow-list; for writer and reader.
        checkpointer: route saves into a ``TieredCheckpointer`` (or a list of ``Tier``, a YAML
            path, a factory) instead of Lightning's path: see docs/integrations.md.  Single
            process only; Lightning's path then receives a small reference file, written once
            the step is committed in the tiers.  Each checkpoint needs a ``global_step``.
        max_object_bytes: the largest non-tensor part (hyper-parameters, loop and callback
            states) saved and loaded; a save over it raises ``ConfigError`` naming the largest key.

    Lightning re-saves ``last.ckpt`` in place, so saves overwrite (``overwrite=True``).
    """

    def __init__(self, codec: str = "zstd", *, storage_options: dict[str, Any] | None = None,
                 threads: int | None = None, safe_globals: Any = None,
                 checkpointer: CheckpointerSource | None = None, max_object_bytes: int = MAX_OBJECT_BYTES) -> None:
        super().__init__()
        self.codec = str(get_codec(codec))
        self.storage_options = dict(storage_options or {})
        self.threads = threads
        self.safe_globals = list(safe_globals or [])
        self.max_object_bytes = int(max_object_bytes)
        self._init_routing(checkpointer)

    # -- Lightning API --------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CompressedCheckpointIO takes storage_options in its constructor, not per save "
                            f"(got {storage_options!r} for {path})")
        flat = split_checkpoint(checkpoint)
        self._check_skeleton(flat, path)
        if self._source is not None:
            self._save_routed(checkpoint, flat, path)
            return
        path = os.fspath(path)
        if not _local(path):
            self._write(flat, path, overwrite=True)  # replaced in place: un-committed while it is rewritten
            return
        with storage_errors(path, "prepare the checkpoint directory"):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            _files.recover(path)  # what a killed save or swap left: a newer committed one is kept
        with _files.writing(path) as tmp:  # no cleanup deletes it while this save runs
            self._write(flat, tmp, overwrite=False)
            # Swap the committed directory in: the previous checkpoint at the path (last.ckpt is re-saved) stays
            # whole until then, and the swap is atomic, so a save killed at any point leaves the old one or the new.
            with storage_errors(path, f"move the committed checkpoint {tmp} to its name"):
                old = _files.swap_in(tmp, path, keep_old=True)
        if old is not None:  # deleted once this save's lock is gone: a load of the new one need not wait for it
            with storage_errors(path, f"delete the previous checkpoint {old}"):
                _files.discard(old)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        path = os.fspath(path)
        if _local(path):
            # save_last="link" makes last.ckpt a symlink (the reader refuses links); a swap killed half-way
            # without an atomic exchange leaves the checkpoint under a hidden name
            path = os.path.realpath(_files.resolve(path))
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    return self._load_file(f, path, map_location, weights_only)
            if not os.path.exists(path):
                raise CheckpointNotFoundError(f"Checkpoint file not found: {path}")
            with _files.reading(path) as stable:  # a save of the same name meanwhile changes nothing under it
                return self._load_dir(stable, path, map_location)
        else:
            fs, _ = fsspec.core.url_to_fs(path, **self.storage_options)
            if fs.isfile(path):  # a stock .ckpt file (or a reference) on an object store
                with fs.open(path, "rb") as f:
                    return self._load_file(f, path, map_location, weights_only)

        return self._load_dir(path, path, map_location)

    def _load_dir(self, where: str, path: str, map_location: Any) -> dict[str, Any]:
        """Load the checkpoint directory ``where`` (``path`` as the user named it, for messages)."""
        reader = CompressedReader(where, storage_options=self.storage_options, threads=self.threads,
                                  safe_globals=self.safe_globals, max_object_bytes=self.max_object_bytes)
        flat = template_from(reader)
        with _unwrapped():
            dcp.load(flat, storage_reader=reader, no_dist=True)
        return _map(join_checkpoint(flat, path), map_location)

    def remove_checkpoint(self, path: Any) -> None:
        path = os.fspath(path)
        self._pending = [(p, r) for p, r in self._pending if p != os.path.abspath(path)]
        if _local(path):
            with storage_errors(path, "remove"):
                _files.remove(path)
            return
        storage = Storage(path, self.storage_options)
        uncommit(storage)  # first: a crash mid-delete leaves no half checkpoint
        storage.remove_tree()

    def teardown(self) -> None:
        self._finish_routing()  # the references of the steps committed meanwhile

    # -- helpers --------------------------------------------------------------------------------

    def _write(self, flat: dict[str, Any], path: str, overwrite: bool) -> None:
        writer = CompressedWriter(path, codec=self.codec, storage_options=self.storage_options, threads=self.threads,
                                  overwrite=overwrite, safe_globals=self.safe_globals)
        with _unwrapped():
            dcp.save(flat, storage_writer=writer, no_dist=True)

    def _check_skeleton(self, flat: dict[str, Any], path: Any) -> None:
        _check_skeleton(flat, path, self.max_object_bytes)

    def _load_file(self, f: Any, path: str, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """A regular file: a reference into the tiers, or a stock ``torch.save`` checkpoint."""
        ref = parse_ref(f.read(MAX_REF_BYTES + 1), path)
        if ref is not None:
            return _map(self._load_routed(ref, path), map_location)
        f.seek(0)
        return pl_load(f, map_location=map_location, weights_only=weights_only)

    # -- routing into a TieredCheckpointer (checkpointer=...): Lightning's path holds a reference --

    def _init_routing(self, source: Any) -> None:
        self._source = source
        self._ck = None
        self._last_routed: tuple[int, frozenset[Any]] | None = None
        self._last_report: Any = None
        self._pending: list[tuple[str, Any]] = []  # (reference path, SaveReport of its step), oldest first

    def _checkpointer(self) -> Any:
        if self._ck is None:
            self._ck = build_checkpointer(self._source, {})
        if self._ck.distributed and torch.distributed.get_world_size() > 1:
            raise ConfigError(
                "CompressedCheckpointIO(checkpointer=...) supports a single process only: Lightning calls "
                "save_checkpoint on rank 0 alone, while a TieredCheckpointer saves collectively. With several "
                "ranks use TieredCheckpointCallback (dcp_tiered.integrations.lightning) for the tiers"
            )
        return self._ck

    def _save_routed(self, checkpoint: Mapping[str, Any], flat: dict[str, Any], path: Any) -> None:
        path = os.fspath(path)
        if "://" in path:
            raise ConfigError(f"with checkpointer=..., Lightning's checkpoint path must be local, got {path}")
        if "global_step" not in checkpoint:
            raise ConfigError(
                f"{path}: CompressedCheckpointIO(checkpointer=...) files each save under its step, and this "
                "checkpoint has no 'global_step' (states saved with Lightning Fabric's fabric.save have none): "
                "put 'global_step': <step> into the state you save, or use the plugin without checkpointer=")
        step, keys = int(checkpoint["global_step"]), frozenset(checkpoint)
        ck = self._checkpointer()
        last = self._last_routed
        # ModelCheckpoint saves one step twice with save_last=True: the same content is saved once; a save
        # of the step with more (a full one after a weights-only one) replaces it in the tiers
        if last is None or last[0] != step or not keys <= last[1]:
            self._last_report = ck.save_now(step, flat)
            self._last_routed = (step, keys)
        self._pending.append((os.path.abspath(path), self._last_report))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._flush_refs()

    def _flush_refs(self) -> None:
        """Write the references whose step is committed; drop those whose save failed (the checkpointer raises it)."""
        waiting = []
        for path, report in self._pending:
            if report.ok is None:
                waiting.append((path, report))
            elif report.ok:
                write_ref(path, report.step)
        self._pending = waiting

    def _finish_routing(self) -> None:
        if self._ck is not None:
            self._ck.wait()
            self._flush_refs()

    def _load_routed(self, ref: dict[str, Any], path: str) -> dict[str, Any]:
        step = ref.get("step")
        if self._source is None:
            raise ConfigError(
                f"{path} is a reference to step {step} of a TieredCheckpointer, written by "
                "CompressedCheckpointIO(checkpointer=...): the checkpoint itself is in the tiers. Load it with "
                "CompressedCheckpointIO(checkpointer=<the same tiers>), and with load_from_checkpoint pass "
                "checkpoint_io=that plugin (dcp_tiered.integrations.lightning.load_from_checkpoint)")
        ck = self._checkpointer()
        if self._pending:
            self._finish_routing()
        committed = [i for i in ck.list() if i.committed]
        hits = [i for i in committed if i.step == step]
        if not hits:
            steps = sorted({i.step for i in committed})
            if any(s > step for s in steps):
                why = ("tier retention (keep) removed it. ModelCheckpoint's save_top_k names best checkpoints "
                       "by metric while the tiers keep the newest steps: give each tier keep >= save_top_k + 1, "
                       "or use a metric-free ModelCheckpoint")
            else:
                why = "its save never committed (the process was killed or the save failed before its commit)"
            raise CheckpointNotFoundError(f"{path} refers to step {step}, which no tier holds committed: {why}. "
                                          f"The tiers hold steps {steps}")
        flat = template_from(CompressedReader(hits[0].url, storage_options=self.storage_options,
                                              safe_globals=self.safe_globals, max_object_bytes=self.max_object_bytes))
        if ck.restore(flat, step=step) != step:
            raise CheckpointNotFoundError(f"{path}: step {step} could not be restored from the tiers")
        return join_checkpoint(flat, f"{path} (step {step} of the tiers)")



class AsyncCompressedCheckpointIO(AsyncCheckpointIO):
    """:class:`CompressedCheckpointIO` saved in Lightning's ``AsyncCheckpointIO`` background thread.

    Tensors are cloned on the training thread; a failed save raises at the next save or at
    ``teardown``.  Loads and removals first wait for the saves in flight.
    Takes the arguments of :class:`CompressedCheckpointIO` (or ``checkpoint_io=`` one).
    """

    def __init__(self, codec: str | None = None, *, checkpoint_io: CompressedCheckpointIO | None = None,
                 **kwargs: Any) -> None:
        if checkpoint_io is not None and (codec is not None or kwargs):
            given = ([f"codec={codec!r}"] if codec is not None else []) + sorted(kwargs)
            raise TypeError(f"AsyncCompressedCheckpointIO takes checkpoint_io= or the arguments of "
                            f"CompressedCheckpointIO, not both (got checkpoint_io= and {', '.join(given)}): "
                            "set them on the CompressedCheckpointIO you pass")
        inner = checkpoint_io or CompressedCheckpointIO(codec or "zstd", **kwargs)
        if inner._source is not None:
            raise ConfigError("AsyncCompressedCheckpointIO cannot route into a TieredCheckpointer (it would save from "
                              "a second thread): use CompressedCheckpointIO(checkpointer=...) with the checkpointer's "
                              "async_save option")
        super().__init__(inner)

    def _drain(self) -> None:
        if self._executor is not None:
            self._executor.submit(lambda: None).result()
        if self._error:
            raise self._error

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._drain()
        return super().load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self._drain()
        super().remove_checkpoint(*args, **kwargs)


def export_checkpoint(path: Any, dst: Any, *, storage_options: dict[str, Any] | None = None,
                      overwrite: bool = False) -> int:
    """Write the plugin checkpoint ``path`` as one normal Lightning ``.ckpt`` file at ``dst`` (``torch.save``
    of the checkpoint dict), which ``Model.load_from_checkpoint``, ``trainer.fit(ckpt_path=...)`` and
    ``torch.load`` tooling read without the plugin.  Local files are written to a temporary name and
    renamed.  Returns the bytes written; raises :class:`CheckpointExistsError` for an existing ``dst``
    unless ``overwrite``."""
    ckpt = CompressedCheckpointIO(storage_options=storage_options).load_checkpoint(path)
    dst = os.fspath(dst)
    fs, target = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    if fs.exists(target) and not overwrite:
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    data = buf.getvalue()
    with storage_errors(dst, "write the Lightning checkpoint"):
        if _local(dst):
            parent = os.path.dirname(os.path.abspath(dst))
            os.makedirs(parent, exist_ok=True)
            tmp = _files.hidden(dst, "partial")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst)
            _files.fsync_dir(parent)
        else:
            fs.pipe_file(target, data)
    return len(data)


def load_from_checkpoint(cls: Any, path: Any, *, checkpoint_io: CompressedCheckpointIO | None = None,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint`` for a checkpoint of the plugin (Lightning's own bypasses ``CheckpointIO``).

    Loads the checkpoint dict, ``torch.save``s it into memory and hands that to
    ``cls.load_from_checkpoint(buffer, **kwargs)``: it costs twice the checkpoint in memory.
    For a reference written with ``checkpointer=``, pass ``checkpoint_io=`` a plugin routing
    into the same tiers.
    """
    ckpt = (checkpoint_io or CompressedCheckpointIO()).load_checkpoint(path)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    del ckpt
    buf.seek(0)
    # What the buffer holds was loaded under weights_only already (AttributeDict rebuilt by us).
    kwargs.setdefault("weights_only", False)
    return cls.load_from_checkpoint(buf, **kwargs)
