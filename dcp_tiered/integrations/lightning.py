"""Lightning integration: save with a :class:`~dcp_tiered.TieredCheckpointer` on its tiers'
schedules, restore on fit start.

```python
import lightning as L
from dcp_tiered import Tier
from dcp_tiered.integrations.lightning import TieredCheckpointCallback

cb = TieredCheckpointCallback([Tier("local", "/nvme/ckpt", every_steps=100, keep=2, codec="zstd"),
                               Tier("durable", "s3://bucket/run", every="1h", keep=24)])
trainer = L.Trainer(max_steps=10_000, callbacks=[cb], enable_checkpointing=False)
trainer.fit(model, data)       # resumes from the newest good checkpoint when there is one
```

What a checkpoint holds: what ``trainer.save_checkpoint`` writes, split in two.  The
tensors of the model (``model``) and of every optimizer (``optim``, keyed by parameter name:
``torch.distributed.checkpoint.state_dict``) are DCP tensors (sharded, compressed,
``optimizer_every`` applies).  Everything else (``trainer``): loop progress, LR schedulers,
callback states, the precision plugin's state (GradScaler), a stateful datamodule's state
and what ``on_save_checkpoint`` hooks add, is one object of builtins and small tensors,
loaded with ``torch.load(weights_only=True)``.  Restoring loads all of it in
``on_fit_start``, the point where Lightning itself restores a ``ckpt_path``, through the
same hooks (``on_load_checkpoint``, ``load_state_dict``).

The state dict is built only on steps where a tier is due (``maybe_save`` with a callable).

Works with the ``lightning`` package and, failing that, ``pytorch_lightning``.  Importing
this module imports Lightning; ``import dcp_tiered`` never does.

The callback is not a ``CheckpointIO`` plugin: a ``TieredCheckpointer`` owns paths,
schedules, retention and fallback across tiers.  Use it with ``enable_checkpointing=False`` (or
alongside ``ModelCheckpoint`` for best-k checkpoints kept by metric).  For Lightning's own
checkpoint paths compressed, use the plugin ``CompressedCheckpointIO`` (re-exported here from
:mod:`dcp_tiered.integrations.lightning_io`; docs/integrations.md says when to use which).
"""

from __future__ import annotations

import copy
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError:  # pragma: no cover - the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.utilities.rank_zero import rank_zero_warn  # type: ignore[no-redef]

from dcp_tiered.errors import ConfigError
from dcp_tiered.integrations._common import (
    CheckpointerSource,
    OptimizerSnapshot,
    apply_model_state,
    apply_optimizer_state,
    build_checkpointer,
    call_restore,
    from_one_object,
    model_state,
    one_object,
    optimizer_state,
)

__all__ = ["TieredCheckpointCallback"]


class TieredCheckpointCallback(pl.Callback):
    """Save on the tiers' schedules after each training batch; restore on fit start.

    Args:
        checkpointer: a ``TieredCheckpointer``, a list of ``Tier`` (the checkpointer is built
            in ``setup``, once Lightning set up the process group, with ``**options``), a
            YAML tier spec path, or a zero-argument factory.
        restore: load the newest good checkpoint on fit start (default True).  An explicit
            ``trainer.fit(ckpt_path=...)`` wins: the callback warns and does not restore.
        restore_step: restore this step instead of the newest.
        broadcast: pass to ``TieredCheckpointer.restore`` (one reader per group, for
            replicated DDP state); False by default.
        save_on_train_end: save the last step to every tier when training ends (default
            True; skipped when that step is already saved or no step was trained).  At
            ``max_steps`` it is saved after the last batch, a state that resumes exactly.
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
        save_on_train_end: bool = True,
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
        self._last_seen = 0  # the last global step offered to the checkpointer
        self._train_start = 0

    # -- state ----------------------------------------------------------------------------

    def _tensors(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        sd: dict[str, Any] = {"model": model_state(pl_module)}
        if trainer.optimizers:
            sd["optim"] = {str(i): optimizer_state(pl_module, o) for i, o in enumerate(trainer.optimizers)}
        return sd

    def state(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        """The state dict saved: ``model`` and ``optim`` tensors, and under ``trainer`` the rest
        of what ``trainer.save_checkpoint`` writes (hooks called as Lightning calls them)."""
        sd = self._tensors(trainer, pl_module)
        checkpoint: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "state_dict": sd["model"],
            "loops": {name: getattr(trainer, name).state_dict()
                      for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")},
            "callbacks": {cb.state_key: s for cb in trainer.callbacks if (s := cb.state_dict())},
            "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        }
        precision = trainer.precision_plugin
        if precision_state := precision.state_dict():
            checkpoint[type(precision).__qualname__] = precision_state
        precision.on_save_checkpoint(checkpoint)
        datamodule = trainer.datamodule
        if datamodule is not None and (dm_state := datamodule.state_dict()):
            checkpoint[type(datamodule).__qualname__] = dm_state
        for cb in trainer.callbacks:
            cb.on_save_checkpoint(trainer, pl_module, checkpoint)
        pl_module.on_save_checkpoint(checkpoint)
        sd["model"] = checkpoint.pop("state_dict")  # a hook may have edited it
        # a copy: the live objects may change while an async save is still writing them
        sd["trainer"] = one_object(copy.deepcopy(checkpoint))
        return sd

    def _apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", sd: dict[str, Any]) -> None:
        """Load a restored state dict into the trainer, in the order Lightning restores a
        ``ckpt_path`` (datamodule, model, callbacks, precision, loops, optimizers, schedulers)."""
        if isinstance(sd["trainer"], str):
            raise ConfigError(
                "this checkpoint was written by an earlier TieredCheckpointCallback (trainer state as JSON, no "
                "callback or precision state); resume it with that version, or pass restore_step= to pick a newer one"
            )
        checkpoint: dict[str, Any] = dict(from_one_object(sd["trainer"]))
        checkpoint["state_dict"] = sd["model"]
        datamodule = trainer.datamodule
        if datamodule is not None and type(datamodule).__qualname__ in checkpoint:
            datamodule.load_state_dict(checkpoint[type(datamodule).__qualname__])
        pl_module.on_load_checkpoint(checkpoint)
        apply_model_state(pl_module, checkpoint["state_dict"])
        callback_states = checkpoint.get("callbacks", {})
        for cb in trainer.callbacks:
            cb.on_load_checkpoint(trainer, pl_module, checkpoint)
        for cb in trainer.callbacks:
            if cb_state := callback_states.get(cb.state_key):
                cb.load_state_dict(copy.deepcopy(cb_state))
        precision = trainer.precision_plugin
        precision.on_load_checkpoint(checkpoint)
        if type(precision).__qualname__ in checkpoint:
            precision.load_state_dict(checkpoint[type(precision).__qualname__])
        trainer.fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"])
        for i, o in enumerate(trainer.optimizers):
            apply_optimizer_state(pl_module, o, sd["optim"][str(i)])
        for cfg, s in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"]):
            cfg.scheduler.load_state_dict(s)

    # -- hooks ---------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.checkpointer is None and stage == "fit":
            self.checkpointer = build_checkpointer(self._source, self._options)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.checkpointer is None:
            self.checkpointer = build_checkpointer(self._source, self._options)
        self.restored_step = self._last_saved = None
        if not self.restore:
            return
        # Strategies that restore ckpt_path after on_fit_start (FSDP, ModelParallel, DeepSpeed) set
        # trainer.ckpt_path only then: for them on_train_start checks it instead.
        if not trainer.strategy.restore_checkpoint_after_setup and trainer.ckpt_path:
            rank_zero_warn(
                f"TieredCheckpointCallback: trainer.fit(ckpt_path={str(trainer.ckpt_path)!r}) restores that checkpoint; "
                "the tiered restore is skipped (pass ckpt_path=None to resume from the tiers)"
            )
            return
        snapshot = OptimizerSnapshot(trainer.optimizers)
        sd = self._tensors(trainer, pl_module)
        sd["trainer"] = None  # any value: the loaded object replaces it
        step = call_restore(self.checkpointer, sd, self.restore_step, self.broadcast)
        if step is None:
            snapshot.undo()  # nothing restored: leave the fresh optimizers untouched
            return
        self._apply(trainer, pl_module, sd)
        self.restored_step = self._last_saved = step

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.restored_step is not None and trainer.ckpt_path:
            rank_zero_warn(
                f"TieredCheckpointCallback: Lightning restored ckpt_path={str(trainer.ckpt_path)!r} over the "
                f"tiered restore of step {self.restored_step}; training continues from ckpt_path"
            )
            self.restored_step = self._last_saved = None
        self._last_seen = self._train_start = trainer.global_step

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_seen:
            return  # gradient accumulation: no optimizer step since the last batch
        self._last_seen = step
        # The last step of max_steps is saved here rather than in on_train_end: after fit stops,
        # Lightning's loops hold an epoch that a resume would close once more (an extra epoch-end
        # scheduler step), while a batch-end state resumes exactly like an uninterrupted run.
        last = self.save_on_train_end and trainer.max_steps not in (None, -1) and step >= trainer.max_steps
        build = lambda: self.state(trainer, pl_module)  # noqa: E731
        report = self.checkpointer.save_now(step, build) if last else self.checkpointer.maybe_save(step, build)
        if report is not None:
            self._last_saved = step

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # training ended otherwise (max_epochs, max_time, early stopping): save the state as it is now
        step = trainer.global_step
        if self.save_on_train_end and step != self._last_saved and step > self._train_start:
            self.checkpointer.save_now(step, lambda: self.state(trainer, pl_module))
            self._last_saved = step

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

# The CheckpointIO plugin lives in lightning_io; re-exported here, where the issue names it.
from dcp_tiered.integrations.lightning_io import (  # noqa: E402
    AsyncCompressedCheckpointIO,
    CompressedCheckpointIO,
    export_checkpoint,
    load_from_checkpoint,
)
from dcp_tiered.integrations.lightning_loader import read_plugin_checkpoints  # noqa: E402

__all__ += ["AsyncCompressedCheckpointIO", "CompressedCheckpointIO", "export_checkpoint", "load_from_checkpoint",
            "read_plugin_checkpoints"]
