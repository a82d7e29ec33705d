"""Accelerate integration: ``Accelerator.save_state``/``load_state`` through a
:class:`~dcp_tiered.TieredCheckpointer`.

```python
from accelerate import Accelerator
from dcp_tiered import Tier, TieredCheckpointer
from dcp_tiered.integrations.accelerate import load_state, save_state

accelerator = Accelerator()
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
ckpt = TieredCheckpointer([Tier("local", "/nvme/ckpt", every_steps=100, keep=2)])  # after Accelerator()
start = load_state(accelerator, ckpt) or 0          # newest good checkpoint, or None
for step in range(start + 1, total):
    ...
    save_state(accelerator, ckpt, step)             # saves when a tier is due (builds nothing otherwise)
ckpt.close()
```

What it saves, from what ``accelerator.prepare`` registered: every model (unwrapped;
``model``, ``model_1``, ...), every optimizer (keyed by parameter name, under ``optim``
so that ``optimizer_every`` applies), the LR schedulers (``scheduler``, as JSON), objects
registered with ``accelerator.register_for_checkpointing`` (``custom``), an optional
``extra`` dict of your own (or a zero-argument callable returning it), and each process's
random states (``rng_<process index>``: python, numpy, torch, CUDA; restored on load), and
the ``accelerator.scaler`` GradScaler's state (``scaler``: the loss scale of fp16 mixed
precision, as ``scaler.pt``; restored when the accelerator has a scaler and the checkpoint one).
The state dict is built only on steps where a tier is due.  Not saved (``accelerator.save_state``
saves them): dataloader positions (a ``use_stateful_dataloader`` dataloader's state, a
``SeedableRandomSampler``'s epoch): pass them in ``extra`` if you need them.

Like ``accelerator.save_state``, :func:`save_state` calls the hooks registered with
``accelerator.register_save_state_pre_hook`` as ``hook(accelerator._models, weights, output_dir)``
(``weights``: the models' state dicts, which the hook may edit, replace or pop; what is left
is saved positionally as ``model``, ``model_1``, ...), and :func:`load_state` those of
``register_load_state_pre_hook`` as ``hook(models, input_dir)`` (the models left in the list
are loaded positionally).  ``output_dir``/``input_dir`` name the checkpoint's directory on
the fastest tier written (the tier restored from) as a path or fsspec URL: the tiers own
it, so files a hook writes there are not part of the checkpoint (not promoted, checked
or kept).  Without ``checkpointer`` the ``ProjectConfiguration`` is used (see
:func:`project_checkpointer`).

Importing this module imports ``accelerate``; ``import dcp_tiered`` never does.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import weakref
from collections.abc import Callable
from typing import Any

import accelerate  # noqa: F401 - fail at import when the extra is missing
import fsspec
import torch

from dcp_tiered.dcp.reader import CompressedReader
from dcp_tiered.errors import (
    ConfigError,
    CorruptCheckpointError,
    DcpTieredError,
    RestoreError,
)
from dcp_tiered.integrations._common import (
    OptimizerSnapshot,
    apply_model_state,
    apply_optimizer_state,
    build_checkpointer,
    call_restore,
    check_rng_state,
    conform,
    fill,
    from_json,
    from_one_object,
    model_state,
    one_object,
    optimizer_state,
    rng_state,
    set_rng_state,
    staged,
    to_json,
)
from dcp_tiered.tiers.checkpointer import TieredCheckpointer
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.events import describe_error, root_cause
from dcp_tiered.tiers.layout import step_name
from dcp_tiered.tiers.topology import tier_storage

__all__ = ["save_state", "load_state", "state_dict", "project_checkpointer", "TieredAccelerator"]

log = logging.getLogger(__name__)
_RNG_KEY = re.compile(r"rng_(\d+)")
_SCALER = "scaler"  # the GradScaler's state (accelerate's scaler.pt)
_PROJECT: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _models(accelerator: Any) -> list[torch.nn.Module]:
    return [accelerator.unwrap_model(m) for m in accelerator._models]


def _optimizers(accelerator: Any) -> list[torch.optim.Optimizer]:
    return [getattr(o, "optimizer", o) for o in accelerator._optimizers]


def _schedulers(accelerator: Any) -> list[Any]:
    return [getattr(s, "scheduler", s) for s in accelerator._schedulers]


def _all_params(models: list[torch.nn.Module]) -> torch.nn.Module:
    """One module holding every model, so any optimizer's parameters have names."""
    return torch.nn.ModuleDict({str(i): m for i, m in enumerate(models)})


def _model_key(i: int) -> str:
    return "model" if i == 0 else f"model_{i}"


def _rng_key(accelerator: Any) -> str:
    return f"rng_{accelerator.process_index}"  # differs per process: DCP's dedup of replicated items keeps each


def state_dict(accelerator: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state dict that :func:`save_state` saves (tensors shared with the live objects),
    before the save hooks and without the random states and the GradScaler's state."""
    models = _models(accelerator)
    sd: dict[str, Any] = {_model_key(i): model_state(m) for i, m in enumerate(models)}
    optimizers = _optimizers(accelerator)
    if optimizers:
        holder = _all_params(models)
        sd["optim"] = {str(i): optimizer_state(holder, o) for i, o in enumerate(optimizers)}
    schedulers = _schedulers(accelerator)
    if schedulers:
        sd["scheduler"] = to_json([s.state_dict() for s in schedulers], "the LR scheduler state")
    custom = accelerator._custom_objects
    if custom:
        sd["custom"] = {str(i): obj.state_dict() for i, obj in enumerate(custom)}
    if extra:
        sd["extra"] = extra
    return sd


Extra = dict[str, Any] | Callable[[], dict[str, Any]] | None  # a dict, or a callable building it when a save is due


def project_checkpointer(accelerator: Any, **options: Any) -> Any:
    """The checkpointer :func:`save_state`/:func:`load_state` use when given none, built once per
    accelerator from its ``ProjectConfiguration``: one tier ``project`` at
    ``project_dir/checkpoints``, due on every save, ``keep=total_limit`` (every checkpoint when
    ``total_limit`` is None).  Checkpoints are named ``step_<iteration>`` (not ``checkpoint_<i>``).
    ``options`` go to ``TieredCheckpointer`` when it is built.  Close it (or the accelerator's
    :class:`TieredAccelerator`) at the end of training.
    """
    ck = _PROJECT.get(accelerator)
    if ck is not None and not getattr(ck, "_closed", False):
        return ck
    pc = accelerator.project_configuration
    if not pc.automatic_checkpoint_naming or not pc.project_dir:
        raise ConfigError("no checkpointer given and the accelerator's ProjectConfiguration has no "
                          f"automatic_checkpoint_naming with a project_dir (project_dir={pc.project_dir!r}): pass a "
                          "TieredCheckpointer, or Accelerator(project_config=ProjectConfiguration(project_dir=..., "
                          "automatic_checkpoint_naming=True))")
    limit = pc.total_limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"ProjectConfiguration.total_limit must be a positive integer or None, got {limit!r}")
    tier = Tier("project", os.path.join(os.fspath(pc.project_dir), "checkpoints"), keep=limit or 2**31 - 1)
    ck = _PROJECT[accelerator] = TieredCheckpointer([tier], **options)
    return ck


def _checkpointer(accelerator: Any, checkpointer: Any) -> Any:
    return project_checkpointer(accelerator) if checkpointer is None else checkpointer


def _step_url(ck: Any, tier: Any, step: int) -> str:
    return tier_storage(tier, getattr(ck, "rank", 0), getattr(ck, "node", 0)).child(step_name(step)).url


def _output_dir(ck: Any, step: int, force: bool) -> str | None:
    """Where ``step`` is written first: on the fastest tier due (decided now, reused by ``maybe_save``)."""
    tiers = list(getattr(ck, "tiers", ()))
    due = {t.name for t in tiers} if force else set(ck.due_tiers(step)) if tiers else set()
    if not due:
        return None
    first = next((t for t in tiers if t.name in due), tiers[0])
    return _step_url(ck, first, step)


def _payload(accelerator: Any, extra: Extra, output_dir: str | None) -> dict[str, Any]:
    sd = state_dict(accelerator, extra() if callable(extra) else extra)
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if hooks:
        if output_dir is not None and fsspec.core.split_protocol(output_dir)[0] in (None, "file", "local"):
            os.makedirs(fsspec.core.strip_protocol(output_dir), exist_ok=True)  # as accelerate: hooks may write there
        weights = [sd.pop(_model_key(i)) for i in range(len(accelerator._models))]
        for hook in hooks:
            hook(accelerator._models, weights, output_dir)
        sd.update({_model_key(i): w for i, w in enumerate(weights)})
    sd[_rng_key(accelerator)] = one_object(rng_state() | {"step": int(accelerator.step)})
    if getattr(accelerator, "scaler", None) is not None:
        sd[_SCALER] = one_object(accelerator.scaler.state_dict())
    return sd


def save_state(accelerator: Any, checkpointer: Any = None, step: int | None = None, *, extra: Extra = None,
               force: bool = False) -> Any:
    """``checkpointer.maybe_save(step, state)``: saves when a tier is due (every tier with
    ``force=True``); returns the ``SaveReport`` or None.  Call it on every process.

    The state dict (and ``extra``, when it is a zero-argument callable) is built, and the save
    hooks called, only when a save is due: on the other steps this costs a few microseconds.
    ``checkpointer=None``: :func:`project_checkpointer`.  ``step=None``: the
    ``ProjectConfiguration.iteration``, which is then incremented (as ``accelerator.save_state``
    does); after a save at an explicit step it becomes ``step + 1``.
    """
    ck = _checkpointer(accelerator, checkpointer)
    pc = accelerator.project_configuration
    implicit = step is None
    if implicit:
        step = int(pc.iteration)
    output_dir = _output_dir(ck, step, force) if accelerator._save_model_state_pre_hook else None
    snapshot = OptimizerSnapshot(_optimizers(accelerator))  # the state-dict helper steps fresh ones at lr 0
    try:
        report = ck.maybe_save(step, lambda: _payload(accelerator, extra, output_dir), force=force)
    finally:  # the save holds its copy (async: staged): the live optimizers go back as they were
        snapshot.undo()
    if implicit or report is not None:
        pc.iteration = step + 1
    return report


class _RestoreWatch:
    """The tier a restore loaded from, from the checkpointer's ``restore`` event."""

    def __init__(self, ck: Any) -> None:
        self.ck, self.tier = ck, None
        self.events = getattr(getattr(ck, "events", None), "hooks", None)

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("event") == "restore":
            self.tier = event.get("tier")

    def __enter__(self) -> "_RestoreWatch":
        if self.events is not None:
            self.events.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.events is not None:
            self.events.remove(self)

    def url(self, step: int) -> tuple[Any, str | None]:
        tier = next((t for t in getattr(self.ck, "tiers", ()) if t.name == self.tier), None)
        return tier, (_step_url(self.ck, tier, step) if tier is not None else None)


def _part_file(url: str, md: Any, key: str) -> str:
    """The data file of checkpoint ``url`` that holds item ``key`` (``url`` itself when unknown)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    record = md.storage_data.get(MetadataIndex(key)) if md is not None else None
    name = record.get("file") if isinstance(record, dict) else getattr(record, "relative_path", None)
    return f"{url.rstrip('/')}/{name}" if isinstance(name, str) else url


def _read_objects(tier: Any, url: str, keys: list[str]) -> dict[str, Any]:
    """The objects saved under ``keys`` in checkpoint ``url``, read by this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    sd: dict[str, Any] = {k: one_object(None) for k in keys}
    try:
        dcp.load(sd, storage_reader=CompressedReader(url, storage_options=tier.storage_options), no_dist=True)
    except CheckpointException as exc:  # DCP's wrapper of the reader's error (a BaseException)
        cause = root_cause(exc)
        if isinstance(cause, DcpTieredError):
            raise cause from exc
        raise CorruptCheckpointError(f"{url}: {keys} could not be read ({describe_error(exc)}); nothing was "
                                     "restored (restore another step)") from exc
    out = {}
    for k, v in sd.items():
        try:
            out[k] = from_one_object(v)
        except ConfigError as exc:
            raise CorruptCheckpointError(f"{url}: {k!r} is not an object saved by this integration ({exc}); "
                                         "nothing was restored (restore another step)") from None
    return out


class _Parts:
    """The non-tensor parts of one restored checkpoint, decoded and checked against the live objects
    they go into before any of those changes: the LR scheduler states, this process's random states,
    the GradScaler's state, and the optimizers' values that are not tensors."""

    def __init__(self, accelerator: Any, tier: Any, url: str | None, step: int, sd: dict[str, Any],
                 live: dict[str, Any]) -> None:
        self.accelerator, self.tier, self.url, self.step = accelerator, tier, url, step
        self.md = CompressedReader(url, storage_options=tier.storage_options).read_metadata() if url else None
        self.schedulers = self._schedulers(sd)
        if "optim" in sd:
            sd["optim"] = conform(sd["optim"], live["optim"], lambda path: f"{self.where('optim' + path)}: optim{path}")
        self.scaler = self._scaler() if self.md is not None else None
        self.rng = self._rng() if self.md is not None else None

    def where(self, key: str) -> str:
        """The file holding item ``key``: named by every error about it."""
        return f"step {self.step}" if self.url is None else _part_file(self.url, self.md, key)

    def _schedulers(self, sd: dict[str, Any]) -> list[Any]:
        schedulers = _schedulers(self.accelerator)
        if not schedulers or "scheduler" not in sd:
            return []
        where = f"{self.where('scheduler')}: the LR scheduler states ('scheduler')"
        states = from_json(sd["scheduler"], where)
        if not isinstance(states, list) or len(states) != len(schedulers):
            what = f"{len(states)} states" if isinstance(states, list) else f"a {type(states).__name__}"
            raise CorruptCheckpointError(f"{where}: {what}, not a list of {len(schedulers)} (one per scheduler "
                                         "prepared); nothing was restored (restore another step)")
        out = []
        for i, (s, state) in enumerate(zip(schedulers, states)):
            here = f"{where}, scheduler {i} ({type(s).__name__})"
            state = conform(state, s.state_dict(), here)
            if not isinstance(state, dict):
                raise CorruptCheckpointError(f"{here}: not a dict; nothing was restored (restore another step)")
            _try_scheduler(s, state, here)
            out.append(state)
        return out

    def _scaler(self) -> dict[str, Any] | None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None:
            return None
        if _SCALER not in self.md.state_dict_metadata:
            log.warning("checkpoint %s holds no GradScaler state (saved without a scaler, or by an earlier version): "
                        "the loss scale starts from its initial value", self.url)
            return None
        where = f"{self.where(_SCALER)}: the GradScaler state ('{_SCALER}')"
        state, live = _read_objects(self.tier, self.url, [_SCALER])[_SCALER], scaler.state_dict()
        if not live:  # a disabled scaler loads nothing
            return None
        if isinstance(state, dict) and not state:
            log.warning("%s was saved from a disabled GradScaler: the loss scale starts from its initial value", where)
            return None
        missing = sorted(set(live) - set(state)) if isinstance(state, dict) else []
        if missing:
            raise CorruptCheckpointError(f"{where}: lacks {missing}; nothing was restored (restore another step)")
        state = conform(state, live, where)
        scale = state.get("scale")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise CorruptCheckpointError(f"{where}: the loss scale is {scale!r}, not a positive number; "
                                         "nothing was restored (restore another step)")
        return state

    def _rng(self) -> dict[str, Any] | None:
        """This process's random states (read by this process alone); a warning when the checkpoint has
        none for it (saved by fewer processes, or before they were saved)."""
        accelerator, url = self.accelerator, self.url
        key = _rng_key(accelerator)
        saved = sorted(int(m.group(1)) for k in self.md.state_dict_metadata if (m := _RNG_KEY.fullmatch(k)))
        now = accelerator.num_processes
        if not saved:
            log.warning("checkpoint %s holds no random states (saved without them, e.g. by an earlier version): "
                        "random states are left as they are", url)
            return None
        if key not in {f"rng_{i}" for i in saved}:
            log.warning("checkpoint %s holds no random state for process %d (saved by %d process(es), restored on "
                        "%d): this process's random states are left as they are", url, accelerator.process_index,
                        len(saved), now)
            return None
        if len(saved) != now and accelerator.is_main_process:
            log.warning("checkpoint %s was saved by %d process(es) and is restored on %d: the random states of "
                        "processes %s are restored, the others left as they are", url, len(saved), now,
                        [i for i in saved if i < now])
        state = _read_objects(self.tier, url, [key])[key]
        return check_rng_state(state, f"{self.where(key)}: this process's random states ('{key}')")

    def apply(self) -> None:
        """Put the checked parts into the live objects (nothing here can fail on their values)."""
        for s, state in zip(_schedulers(self.accelerator), self.schedulers):
            s.load_state_dict(state)
        if self.scaler is not None:
            self.accelerator.scaler.load_state_dict(self.scaler)
        if self.rng is not None:
            rng = dict(self.rng)
            if "step" in rng:
                self.accelerator.step = rng.pop("step")
            set_rng_state(rng)
        elif self.url is None:
            log.warning("step %d restored, but not from a tier this integration can see: random states (and the "
                        "GradScaler's) not restored", self.step)


def _try_scheduler(scheduler: Any, state: dict[str, Any], where: str) -> None:
    """``scheduler.load_state_dict(state)`` on a copy of it (sharing its optimizer), so that a state it
    refuses fails before any live object changes."""
    memo = {id(o): o for o in [getattr(scheduler, "optimizer", None)] if o is not None}
    try:
        trial = copy.deepcopy(scheduler, memo)
    except Exception:  # noqa: BLE001 - a scheduler that cannot be copied: the kinds were checked, apply as is
        return
    try:
        trial.load_state_dict(copy.deepcopy(state))
    except Exception as exc:  # noqa: BLE001 - the scheduler's refusal of an untrusted state
        raise CorruptCheckpointError(f"{where}: the scheduler refuses it ({type(exc).__name__}: {str(exc)[:200]}); "
                                     "nothing was restored (restore another step)") from None


def _apply_rest(accelerator: Any, models: list[torch.nn.Module], sd: dict[str, Any], extra: dict[str, Any] | None) -> None:
    """Optimizers and ``extra`` from a restored ``sd``."""
    optimizers = _optimizers(accelerator)
    if optimizers:
        holder = _all_params(models)
        for i, o in enumerate(optimizers):
            apply_optimizer_state(holder, o, sd["optim"][str(i)])
    if extra is not None and "extra" in sd:
        fill(extra, sd["extra"])


def _custom_objects(accelerator: Any, sd: dict[str, Any], where: str) -> None:
    """The registered objects' ``load_state_dict``, first: one that refuses its state leaves the rest untouched."""
    for i, obj in enumerate(accelerator._custom_objects):
        try:
            obj.load_state_dict(sd["custom"][str(i)])
        except Exception as exc:  # user code: reported as the restore's failure, naming the object
            raise RestoreError(f"{where}: registered object {i} ({type(obj).__name__}) refused its saved state "
                               f"({type(exc).__name__}: {str(exc)[:200]}); the model, optimizers, schedulers and "
                               "random states were not restored") from exc


def _load(accelerator: Any, ck: Any, models: list[torch.nn.Module], step: int | None, extra: dict[str, Any] | None,
          broadcast: Any) -> int | None:
    live = state_dict(accelerator, extra)
    hooks = list(accelerator._load_model_state_pre_hook.values())
    if hooks:
        for i in range(len(models)):
            live.pop(_model_key(i))
    sd = staged(live)  # restored into copies: the live objects change only once every part is checked
    with _RestoreWatch(ck) as watch:
        restored = call_restore(ck, sd, step, broadcast)
    if restored is None:
        return None
    tier, input_dir = watch.url(restored)
    parts = _Parts(accelerator, tier, input_dir, restored, sd, live)
    loading = models
    if hooks:
        listed = list(accelerator._models)
        for hook in hooks:
            hook(listed, input_dir)
        loading = [accelerator.unwrap_model(m) for m in listed]
        weights = {_model_key(i): staged(model_state(m)) for i, m in enumerate(loading)}
        if weights:
            call_restore(ck, weights, restored, broadcast)
        sd.update(weights)
    _custom_objects(accelerator, sd, input_dir or f"step {restored}")
    for i, m in enumerate(loading):
        apply_model_state(m, sd[_model_key(i)])
    _apply_rest(accelerator, models, sd, extra)
    parts.apply()
    return restored


def load_state(accelerator: Any, checkpointer: Any = None, *, step: int | None = None,
               extra: dict[str, Any] | None = None, broadcast: Any = False) -> int | None:
    """Restore the newest good checkpoint (or ``step``) into the prepared objects, and this
    process's random states; returns the step restored, or None (nothing is changed then).

    The checkpoint is read into copies, and every part that is not a tensor (LR scheduler and
    GradScaler states, random states, optimizer hyper-parameters) decoded and checked against the
    object it goes into, before any live object changes: a damaged checkpoint raises a
    :class:`~dcp_tiered.errors.DcpTieredError` naming the part and its file, and leaves the model,
    optimizers, schedulers and random states as they were.  The copies need memory for one more
    model and optimizer state on their devices while loading.

    ``extra``: a template dict of your own values saved with :func:`save_state` (filled in
    place).  ``broadcast``: passed to ``TieredCheckpointer.restore`` (one reader per group,
    replicated state).  ``checkpointer=None``: :func:`project_checkpointer`.  Load hooks run
    once the checkpoint is chosen and checked, before any model is loaded (the models they leave
    are then read from the same step).  ``ProjectConfiguration.iteration`` becomes the step + 1.
    Call it on every process.
    """
    ck = _checkpointer(accelerator, checkpointer)
    snapshot = OptimizerSnapshot(_optimizers(accelerator))  # the template's state init, undone unless restored
    try:
        restored = _load(accelerator, ck, _models(accelerator), step, extra, broadcast)
    except BaseException:
        snapshot.undo()
        raise
    if restored is None:
        snapshot.undo()
        return None
    accelerator.project_configuration.iteration = restored + 1
    return restored


class TieredAccelerator:
    """``save_state``/``load_state`` bound to one accelerator and checkpointer.

    ``TieredAccelerator(accelerator, checkpointer)`` where ``checkpointer`` is a
    ``TieredCheckpointer``, a list of ``Tier``, a YAML path or a factory (built now, so
    create this after ``Accelerator()``), or None for :func:`project_checkpointer`;
    ``**options`` go to ``TieredCheckpointer``.
    """

    def __init__(self, accelerator: Any, checkpointer: Any = None, **options: Any) -> None:
        self.accelerator = accelerator
        self.checkpointer = (project_checkpointer(accelerator, **options) if checkpointer is None
                             else build_checkpointer(checkpointer, options))

    def save_state(self, step: int | None = None, *, extra: Extra = None, force: bool = False) -> Any:
        return save_state(self.accelerator, self.checkpointer, step, extra=extra, force=force)

    def load_state(self, *, step: int | None = None, extra: dict[str, Any] | None = None, broadcast: Any = False) -> int | None:
        return load_state(self.accelerator, self.checkpointer, step=step, extra=extra, broadcast=broadcast)

    def close(self) -> None:
        self.checkpointer.close()

    def __enter__(self) -> "TieredAccelerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
