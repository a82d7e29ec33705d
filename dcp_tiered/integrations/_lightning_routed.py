"""``CompressedCheckpointIO(checkpointer=...)``: Lightning's saves routed into a TieredCheckpointer.

Lightning's path then holds a small JSON reference (``{"dcp_tiered_tier_ref": 1, "step": N}``);
the checkpoint itself is step ``N`` of the tiers.  A reference is written only once its step
is committed in the tiers (with the checkpointer's ``async_save``, at the next save or at
teardown), so after a SIGKILL every reference names a step the tiers hold.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from dcp_tiered.errors import CheckpointNotFoundError, ConfigError
from dcp_tiered.integrations import _lightning_files as _files
from dcp_tiered.integrations._common import build_checkpointer

REF_KEY = "dcp_tiered_tier_ref"


def parse_ref(head: bytes) -> dict[str, Any] | None:
    """The reference in a file's first bytes, or None for anything else (a stock ``.ckpt``)."""
    if not head.startswith(b"{"):
        return None
    try:
        ref = json.loads(head)
    except ValueError:
        return None
    return ref if isinstance(ref, dict) and ref.get(REF_KEY) == 1 else None


def write_ref(path: str, step: int) -> None:
    """Atomically put a reference to ``step`` at local ``path`` (whatever was there is replaced)."""
    _files.recover(path)  # a reference or save killed before its swap
    tmp = _files.hidden(path, "partial")
    with open(tmp, "w") as f:
        json.dump({REF_KEY: 1, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    _files.swap_in(tmp, path)


class RoutedMixin:
    """The routing half of :class:`~dcp_tiered.integrations.lightning_io.CompressedCheckpointIO`."""

    _source: Any
    _ck: Any
    storage_options: dict[str, Any]
    safe_globals: list[Any]
    max_object_bytes: int

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
        from dcp_tiered.dcp.reader import CompressedReader
        from dcp_tiered.integrations.lightning_io import join_checkpoint, template_from

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
