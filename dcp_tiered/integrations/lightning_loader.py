"""Opt-in: Lightning's own loaders read the plugin's checkpoints, so ``Model.load_from_checkpoint(path)``
keeps working.

A checkpoint of :class:`~dcp_tiered.integrations.lightning_io.CompressedCheckpointIO` is a
directory; ``LightningModule.load_from_checkpoint(path)`` and a ``Trainer`` without the plugin
(``fit/validate/test(ckpt_path=...)`` through the stock ``TorchCheckpointIO``) open the path as one
file and raise ``IsADirectoryError``.  Both go through one loader, Lightning's ``pl_load``, which
``read_plugin_checkpoints()`` points at the plugin for local and fsspec paths until it is undone.
The plugin loads a stock ``.ckpt`` file with Lightning's own loader, so those load as before;
``http(s)`` URLs and in-memory buffers go to Lightning's loader untouched.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import TracebackType
from typing import Any

from dcp_tiered.errors import ConfigError
from dcp_tiered.integrations.lightning_io import CompressedCheckpointIO

#: The modules that bind Lightning's loader as ``pl_load``: ``LightningModule.load_from_checkpoint``'s
#: and ``TorchCheckpointIO``'s, for the unified package and for the standalone ones.
LOADER_MODULES = (("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io"),
                  ("pytorch_lightning.core.saving", "lightning_fabric.plugins.io.torch_io"))


#: The open handles, oldest first: the newest one's plugin loads; Lightning's loaders are replaced
#: while any is open (``_originals``) and put back when the last one closes, in whatever order.
_open: list[PluginCheckpointReading] = []
_originals: list[tuple[Any, Any]] = []  # (module, the pl_load it had before the first handle)
_LOCK = threading.Lock()  # handles opened and closed from several threads patch and restore once


def _loaders() -> list[tuple[Any, Any]]:
    """Every module of :data:`LOADER_MODULES` that can be imported and binds ``pl_load``, with it."""
    found = []
    for group in LOADER_MODULES:
        for name in group:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if callable(getattr(module, "pl_load", None)):
                found.append((module, module.pl_load))
    return found


def _loader(original: Any) -> Any:
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: "bool | None" = None) -> Any:
        if _open and isinstance(path_or_url, (str, os.PathLike)) and not str(path_or_url).startswith(("http://", "https://")):
            return _open[-1].checkpoint_io.load_checkpoint(path_or_url, map_location=map_location,
                                                           weights_only=weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    return pl_load


class PluginCheckpointReading:
    """The handle :func:`read_plugin_checkpoints` returns: ``close()`` (or the end of a ``with``
    block) ends it; Lightning's loaders are as they were once every handle is closed."""

    def __init__(self, checkpoint_io: CompressedCheckpointIO) -> None:
        self.checkpoint_io = checkpoint_io
        with _LOCK:
            self._register()

    def _register(self) -> None:
        if not _open:
            found = _loaders()
            if not found:
                raise ConfigError("this Lightning version loads checkpoints in a way dcp-tiered does not know (no "
                                  "pl_load in lightning.pytorch.core.saving): load a plugin checkpoint with "
                                  "dcp_tiered.integrations.lightning.load_from_checkpoint(Model, path), or turn it "
                                  "into a normal .ckpt file with `dcp-tiered convert PATH model.ckpt`")
            for module, original in found:
                module.pl_load = _loader(original)
            _originals[:] = found
        _open.append(self)

    def close(self) -> None:
        """End this handle (again: nothing); the last one open puts Lightning's loaders back."""
        with _LOCK:
            if self in _open:
                _open.remove(self)
                if not _open:
                    for module, original in _originals:
                        module.pl_load = original
                    _originals.clear()

    def __enter__(self) -> PluginCheckpointReading:
        return self

    def __exit__(self, exc_type: "type[BaseException] | None", exc: "BaseException | None",
                 tb: "TracebackType | None") -> None:
        self.close()


def read_plugin_checkpoints(checkpoint_io: "CompressedCheckpointIO | None" = None) -> PluginCheckpointReading:
    """Make ``Model.load_from_checkpoint(path)`` and a ``Trainer``'s ``ckpt_path=`` read the plugin's
    checkpoints (directories, and references into tiers when ``checkpoint_io`` routes into them),
    in this process until the returned handle is closed; use it as a context manager or keep it."""
    return PluginCheckpointReading(checkpoint_io or CompressedCheckpointIO())
