"""Lightning integration: save with a :class:`~dcp_tiered.TieredCheckpointer` on its tiers'
schedules, restore on fit start.

```python
import lightning as L
from dcp_tiered import Tier
from dcp_tiered.integrations.lightning import TieredCheckpointCallback

cb = TieredCheckpointCallback([Tier("local", "/nvme/ckpt", every_steps=100, keep=2, codec="lz4"),
                               Tier("durable", "s3://bucket/run", every="1h", keep=24)])
trainer = L.Trainer(max_steps=10_000, callbacks=[cb], enable_checkpointing=False)
trainer.fit(model, data)       # resumes from the newest good checkpoint when there is one
```

What a checkpoint holds: ``model`` (the LightningModule's state dict), ``optim`` (every
optimizer, keyed by parameter name: ``torch.distributed.checkpoint.state_dict``), and
``trainer`` (the fit loop's progress, so ``global_step`` and epochs resume, and the LR
schedulers, as one JSON string).  Restoring loads all of it in ``on_fit_start``, the
point where Lightning itself restores a ``ckpt_path``.

Works with the ``lightning`` package and, failing that, ``pytorch_lightning``.  Importing
this module imports Lightning; ``import dcp_tiered`` never does.

Not a ``CheckpointIO`` plugin: Lightning's ``CheckpointIO`` receives one path per save
from ``ModelCheckpoint`` and must load a checkpoint with no template, while a
``TieredCheckpointer`` owns paths, schedules, retention and fallback across tiers and loads
into a template.  Use this callback with ``enable_checkpointing=False`` (or alongside
``ModelCheckpoint`` for best-k checkpoints kept by metric).
"""

from __future__ import annotations

import json
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]

from dcp_tiered.integrations._common import (
    CheckpointerSource,
    OptimizerSnapshot,
    apply_model_state,
    apply_optimizer_state,
    build_checkpointer,
    call_restore,
    model_state,
    optimizer_state,
    to_json,
)

__all__ = ["TieredCheckpointCallback"]


class TieredCheckpointCallback(pl.Callback):
    """Save on the tiers' schedules after each training batch; restore on fit start.

    Args:
        checkpointer: a ``TieredCheckpointer``, a list of ``Tier`` (the checkpointer is built
            in ``setup``, once Lightning set up the process group, with ``**options``), a
            YAML tier spec path, or a zero-argument factory.
        restore: load the newest good checkpoint on fit start (default True).
        restore_step: restore this step instead of the newest.
        broadcast: pass to ``TieredCheckpointer.restore`` (one reader per group, for
            replicated DDP state); False by default.
        save_on_train_end: force a save of the final step to every tier when fit ends.
        close_on_end: close the checkpointer (wait for the save in flight and promotions)
            when fit ends.
        **options: ``TieredCheckpointer`` options when it is built here
            (``async_save=True``, ``optimizer_every=5``, ...).

    Attributes: ``checkpointer`` (after setup), ``restored_step`` (the step restored, or None).
    """

    def __init__(
        self,
        checkpointer: CheckpointerSource,
        *,
        restore: bool = True,
        restore_step: int | None = None,
        broadcast: Any = False,
        save_on_train_end: bool = False,
        close_on_end: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self._source, self._options = checkpointer, options
        self.checkpointer: Any = None
        self.restore = restore
        self.restore_step = restore_step
        self.broadcast = broadcast
        self.save_on_train_end = save_on_train_end
        self.close_on_end = close_on_end
        self.restored_step: int | None = None
        self._last_saved: int | None = None

    # -- state ----------------------------------------------------------------------------

    def state(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        """The state dict saved and restored: model, optimizers, trainer progress."""
        sd: dict[str, Any] = {"model": model_state(pl_module)}
        if trainer.optimizers:
            sd["optim"] = {str(i): optimizer_state(pl_module, o) for i, o in enumerate(trainer.optimizers)}
        trainer_state = {
            "fit_loop": trainer.fit_loop.state_dict(),
            "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        }
        sd["trainer"] = to_json(trainer_state, "the Lightning loop/scheduler state")
        return sd

    def _apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", sd: dict[str, Any]) -> None:
        apply_model_state(pl_module, sd["model"])
        for i, o in enumerate(trainer.optimizers):
            apply_optimizer_state(pl_module, o, sd["optim"][str(i)])
        extra = json.loads(sd["trainer"])
        for cfg, s in zip(trainer.lr_scheduler_configs, extra["schedulers"]):
            cfg.scheduler.load_state_dict(s)
        trainer.fit_loop.load_state_dict(extra["fit_loop"])

    # -- hooks ---------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.checkpointer is None and stage == "fit":
            self.checkpointer = build_checkpointer(self._source, self._options)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.checkpointer is None:
            self.checkpointer = build_checkpointer(self._source, self._options)
        if not self.restore:
            return
        snapshot = OptimizerSnapshot(trainer.optimizers)
        sd = self.state(trainer, pl_module)
        step = call_restore(self.checkpointer, sd, self.restore_step, self.broadcast)
        if step is None:
            snapshot.undo()  # nothing restored: leave the fresh optimizers untouched
            return
        self._apply(trainer, pl_module, sd)
        self.restored_step = self._last_saved = step

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_saved:
            return  # e.g. gradient accumulation: no optimizer step since the last save
        report = self.checkpointer.maybe_save(step, self.state(trainer, pl_module))
        if report is not None:
            self._last_saved = step

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.save_on_train_end and trainer.global_step != self._last_saved:
            self.checkpointer.maybe_save(trainer.global_step, self.state(trainer, pl_module), force=True)
            self._last_saved = trainer.global_step

    def _close(self) -> None:
        if self.close_on_end and self.checkpointer is not None:
            ck = self.checkpointer
            if self._source is not ck:
                self.checkpointer = None  # built here: the next fit builds a fresh one
            ck.close()

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - the training error is the one to report
            pass
