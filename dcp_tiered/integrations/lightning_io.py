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

Regular files (checkpoints of the stock ``TorchCheckpointIO``) still load through the plugin.
Lightning calls save and remove on global rank 0 only, so the save is ``dcp.save(no_dist=True)``;
every rank loads.  ``LightningModule.load_from_checkpoint`` does not use the plugin: use
:func:`load_from_checkpoint` here.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shutil
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
except ImportError:  # pragma: no cover - the standalone package
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO  # type: ignore[no-redef]
    from lightning_fabric.utilities.data import AttributeDict  # type: ignore[no-redef]
    from pytorch_lightning.plugins.io.async_plugin import AsyncCheckpointIO  # type: ignore[no-redef]

from dcp_tiered.dcp.statedict import set_leaf
from dcp_tiered.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UnsupportedFormatError
from dcp_tiered.integrations._common import CheckpointerSource, build_checkpointer, from_one_object, one_object
from dcp_tiered.storage.base import storage_errors

__all__ = ["AsyncCompressedCheckpointIO", "CompressedCheckpointIO", "load_from_checkpoint"]

SKELETON = "skeleton"
_FORMAT = "dcp_tiered.lightning/1"
_REF_KEY = "dcp_tiered_tier_ref"
_Path = tuple[Any, ...]


# -- the checkpoint dict as (tensors, skeleton) --------------------------------------------------

def split_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """A flat DCP state dict: ``t.{n}`` per tensor and one ``skeleton`` object for the rest."""
    tensors: list[torch.Tensor] = []
    paths: list[_Path] = []
    kinds: list[tuple[_Path, str]] = []

    def strip(value: Any, path: _Path) -> Any:
        if isinstance(value, torch.Tensor):
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
    flat: dict[str, Any] = {f"t.{n}": t for n, t in enumerate(tensors)}
    flat[SKELETON] = one_object({"format": _FORMAT, "tree": tree, "tensors": paths, "kinds": kinds})
    return flat


def join_checkpoint(flat: Mapping[str, Any], where: str = "checkpoint") -> dict[str, Any]:
    """The checkpoint dict from what :func:`split_checkpoint` made, as loaded back."""
    skel = from_one_object(flat[SKELETON])
    found = skel.get("format") if isinstance(skel, dict) else type(skel).__name__
    if found != _FORMAT:
        raise UnsupportedFormatError(f"{where}: the skeleton is {found!r}, not {_FORMAT!r} of CompressedCheckpointIO "
                                     "(written by a newer dcp-tiered, or not by this plugin)")
    try:
        tree = skel["tree"]
        for n, path in enumerate(skel["tensors"]):
            set_leaf(tree, tuple(path), flat[f"t.{n}"])
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

    out: dict[str, Any] = {}
    for fqn, md in reader.read_metadata().state_dict_metadata.items():
        out[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    if SKELETON not in out:
        raise ConfigError(f"{reader.storage.url} is a DCP checkpoint but not one written by CompressedCheckpointIO "
                          "(no 'skeleton' entry); load it with dcp.load or dcp-tiered convert")
    return out


def _map(checkpoint: dict[str, Any], map_location: Any) -> dict[str, Any]:
    if map_location is None:
        return checkpoint
    from lightning.fabric.utilities.apply_func import apply_to_collection

    if callable(map_location):
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: map_location(t, "cpu"))
    if isinstance(map_location, dict):
        target = map_location.get("cpu", "cpu")
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(target))
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP's ``CheckpointException`` (a ``BaseException``) as the error that caused it, e.g. ``UnsafeObjectError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_tiered.tiers.events import root_cause

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
            process only; Lightning's path then receives a small reference file.

    Lightning re-saves ``last.ckpt`` in place, so saves overwrite (``overwrite=True``).
    """

    def __init__(self, codec: str = "zstd", *, storage_options: dict[str, Any] | None = None,
                 threads: int | None = None, safe_globals: Any = None,
                 checkpointer: CheckpointerSource | None = None) -> None:
        super().__init__()
        from dcp_tiered.codecs import parse_codec

        self.codec = str(parse_codec(codec))
        self.storage_options = dict(storage_options or {})
        self.threads = threads
        self.safe_globals = list(safe_globals or [])
        self._source = checkpointer
        self._ck: Any = None
        self._last_routed: int | None = None

    # -- Lightning API --------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CompressedCheckpointIO takes storage_options in its constructor, not per save "
                            f"(got {storage_options!r} for {path})")
        flat = split_checkpoint(checkpoint)
        if self._source is not None:
            self._save_routed(checkpoint, flat, path)
            return
        path = os.fspath(path)
        if not _local(path):
            self._write(flat, path, overwrite=True)  # replaced in place: un-committed while it is rewritten
            return
        parent, name = os.path.split(os.path.abspath(path))
        with storage_errors(path, "prepare the checkpoint directory"):
            os.makedirs(parent, exist_ok=True)
            for leftover in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.*.partial")):
                shutil.rmtree(leftover, ignore_errors=True)  # of a save that was killed
        tmp = os.path.join(parent, f".{name}.{uuid.uuid4().hex[:12]}.partial")
        self._write(flat, tmp, overwrite=False)
        # Swap the committed directory in: the previous checkpoint at the path (last.ckpt is re-saved) stays
        # whole until then, so a save killed at any point leaves the old checkpoint or the new one.
        with storage_errors(path, f"move the committed checkpoint {tmp} to its name"):
            old = self._move_aside(path)
            os.rename(tmp, path)
            _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        path = os.fspath(path)
        if _local(path):
            path = os.path.realpath(path)  # save_last="link" makes last.ckpt a symlink; the reader refuses links
            if os.path.isfile(path):
                ref = _read_ref(path)
                if ref is None:
                    return TorchCheckpointIO().load_checkpoint(path, map_location=map_location,
                                                               weights_only=weights_only)
                return _map(self._load_routed(ref, path), map_location)
            if not os.path.exists(path):
                raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
        from dcp_tiered.dcp.reader import CompressedReader

        reader = CompressedReader(path, storage_options=self.storage_options, threads=self.threads,
                                  safe_globals=self.safe_globals)
        flat = template_from(reader)
        with _unwrapped():
            dcp.load(flat, storage_reader=reader, no_dist=True)
        return _map(join_checkpoint(flat, path), map_location)

    def remove_checkpoint(self, path: Any) -> None:
        from dcp_tiered.dcp.format import METADATA_FILE
        from dcp_tiered.storage import Storage

        path = os.fspath(path)
        if _local(path):
            with storage_errors(path, "remove"):
                old = self._move_aside(path)  # gone from its name at once, then deleted
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return
        storage = Storage(path, self.storage_options)
        if storage.exists(METADATA_FILE):
            storage.remove(METADATA_FILE)  # un-commit first: a crash mid-delete leaves no half checkpoint
        storage.remove_tree()

    def teardown(self) -> None:
        if self._ck is not None:
            self._ck.wait()

    # -- helpers --------------------------------------------------------------------------------

    def _write(self, flat: dict[str, Any], path: str, overwrite: bool) -> None:
        from dcp_tiered.dcp.writer import CompressedWriter

        writer = CompressedWriter(path, codec=self.codec, storage_options=self.storage_options, threads=self.threads,
                                  overwrite=overwrite, safe_globals=self.safe_globals)
        with _unwrapped():
            dcp.save(flat, storage_writer=writer, no_dist=True)

    @staticmethod
    def _move_aside(path: str) -> str | None:
        """Unlink a file or link at local ``path``, or rename a directory to a hidden name returned for deletion."""
        if os.path.islink(path) or os.path.isfile(path):  # save_last="link", or a stock .ckpt file
            os.unlink(path)
        elif os.path.isdir(path):
            parent, name = os.path.split(os.path.abspath(path))
            old = os.path.join(parent, f".{name}.{uuid.uuid4().hex[:12]}.old")
            os.rename(path, old)
            return old
        return None

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
        ck = self._checkpointer()
        step = int(checkpoint.get("global_step", 0))
        if step != self._last_routed:  # ModelCheckpoint saves one step twice with save_last=True
            ck.maybe_save(step, flat, force=True)
            self._last_routed = step
        path = os.fspath(path)
        if not _local(path):
            raise ConfigError(f"with checkpointer=..., Lightning's checkpoint path must be local, got {path}")
        self.remove_checkpoint(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({_REF_KEY: 1, "step": step}, f)
        os.replace(tmp, path)

    def _load_routed(self, ref: dict[str, Any], path: str) -> dict[str, Any]:
        from dcp_tiered.dcp.reader import CompressedReader

        ck = self._checkpointer()
        step = ref["step"]
        infos = [i for i in ck.list() if i.step == step and i.committed]
        if not infos:
            raise CheckpointNotFoundError(f"{path} refers to step {step}, which no tier holds committed any more "
                                          "(tier retention removed it, or its save failed)")
        flat = template_from(CompressedReader(infos[0].url, storage_options=self.storage_options,
                                              safe_globals=self.safe_globals))
        if ck.restore(flat, step=step) != step:
            raise CheckpointNotFoundError(f"{path}: step {step} could not be restored from the tiers")
        return join_checkpoint(flat, f"{path} (step {step} of the tiers)")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_ref(path: str) -> dict[str, Any] | None:
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head.startswith(b"{"):
        return None
    try:
        ref = json.loads(head)
    except ValueError:
        return None
    return ref if isinstance(ref, dict) and ref.get(_REF_KEY) == 1 else None


class AsyncCompressedCheckpointIO(AsyncCheckpointIO):
    """:class:`CompressedCheckpointIO` saved in Lightning's ``AsyncCheckpointIO`` background thread.

    Tensors are cloned on the training thread; a failed save raises at the next save or at
    ``teardown``.  Loads and removals first wait for the saves in flight.
    Takes the arguments of :class:`CompressedCheckpointIO` (or ``checkpoint_io=`` one).
    """

    def __init__(self, codec: str = "zstd", *, checkpoint_io: CompressedCheckpointIO | None = None,
                 **kwargs: Any) -> None:
        inner = checkpoint_io or CompressedCheckpointIO(codec, **kwargs)
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


def load_from_checkpoint(cls: Any, path: Any, *, checkpoint_io: CompressedCheckpointIO | None = None,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint`` for a checkpoint of the plugin (Lightning's own bypasses ``CheckpointIO``).

    Loads the checkpoint dict, ``torch.save``s it into memory and hands that to
    ``cls.load_from_checkpoint(buffer, **kwargs)``: it costs twice the checkpoint in memory.
    """
    ckpt = (checkpoint_io or CompressedCheckpointIO()).load_checkpoint(path)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    del ckpt
    buf.seek(0)
    # What the buffer holds was loaded under weights_only already (AttributeDict rebuilt by us).
    kwargs.setdefault("weights_only", False)
    return cls.load_from_checkpoint(buf, **kwargs)
