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
from types import TracebackType
from typing import Any

from dcp_tiered.errors import ConfigError
from dcp_tiered.integrations.lightning_io import CompressedCheckpointIO

#: The modules that bind Lightning's loader as ``pl_load``: ``LightningModule.load_from_checkpoint``'s
#: and ``TorchCheckpointIO``'s, for the unified package and for the standalone ones.
LOADER_MODULES = (("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io"),
                  ("pytorch_lightning.core.saving", "lightning_fabric.plugins.io.torch_io"))


class PluginCheckpointReading:
    """The handle :func:`read_plugin_checkpoints` returns: ``close()`` (or the end of a ``with``
    block) puts Lightning's loaders back as they were."""

    def __init__(self, checkpoint_io: CompressedCheckpointIO) -> None:
        self.checkpoint_io = checkpoint_io
        self._saved: list[tuple[Any, Any]] = []  # (module, the pl_load it had)
        for group in LOADER_MODULES:
            for name in group:
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                if callable(getattr(module, "pl_load", None)):
                    self._saved.append((module, module.pl_load))
        if not self._saved:
            raise ConfigError("this Lightning version loads checkpoints in a way dcp-tiered does not know (no "
                              "pl_load in lightning.pytorch.core.saving): load a plugin checkpoint with "
                              "dcp_tiered.integrations.lightning.load_from_checkpoint(Model, path), or turn it "
                              "into a normal .ckpt file with `dcp-tiered convert PATH model.ckpt`")
        for module, original in self._saved:
            module.pl_load = self._loader(original)

    def _loader(self, original: Any) -> Any:
        def pl_load(path_or_url: Any, map_location: Any = None, weights_only: "bool | None" = None) -> Any:
            if isinstance(path_or_url, (str, os.PathLike)) and not str(path_or_url).startswith(("http://", "https://")):
                return self.checkpoint_io.load_checkpoint(path_or_url, map_location=map_location,
                                                          weights_only=weights_only)
            return original(path_or_url, map_location=map_location, weights_only=weights_only)

        return pl_load

    def close(self) -> None:
        """Put back the loaders this handle replaced (handles close in the reverse order of opening)."""
        for module, original in reversed(self._saved):
            module.pl_load = original
        self._saved.clear()

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
