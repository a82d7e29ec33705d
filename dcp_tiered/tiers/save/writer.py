"""``TieredWriter``: a ``StorageWriter`` that serializes once to the fastest due tier and
promotes the committed files to the other due tiers in the background."""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_tiered.dcp.format import record_view
from dcp_tiered.dcp.protocol import completed
from dcp_tiered.dcp.save_stats import SaveStats
from dcp_tiered.dcp.writer import (
    CompressedWriter,
    RankFilePrefix,
    check_count,
    check_frame_size,
    claim_checkpoint,
    uncommit,
    unique_tag,
)
from dcp_tiered.errors import ConfigError, UnsafeCheckpointError
from dcp_tiered.names import data_file, node_copies_list, node_copies_prefix, rank_prefix
from dcp_tiered.storage import Storage, safe_relative_name
from dcp_tiered.thread_priority import yield_to_caller
from dcp_tiered.tiers.layout import parse_step, step_name
from dcp_tiered.tiers.save.budget import check_save_fits
from dcp_tiered.tiers.save.node_commit import (
    HeldItems, NodeCommit, commit_node, copies_list, copies_node_local, place_replicated, with_copies,
)
from dcp_tiered.tiers.topology import dir_leaders, node_of, shares_coordinator_dir, step_dir
from dcp_tiered.tiers.promote.promoter import Promoter
from dcp_tiered.tiers.policy import SaveSchedule
from dcp_tiered.tiers.config import Tier, validate_tiers


def _refuse_link(target: Storage) -> None:
    """A step directory that is a symbolic link is never written through (it may be another checkpoint)."""
    if target.is_link():
        raise UnsafeCheckpointError(f"{target.url} is a symbolic link; a save never writes through links (it could "
                                    "overwrite the checkpoint it points to): remove the link or save another step")


@dataclasses.dataclass(frozen=True)
class TieredPlan:
    """What every rank learns from the coordinator through the save plan."""

    prefix: str
    tiers: tuple[str, ...]  # due tiers, the first one is written, the others promoted to
    save_id: str = ""  # one id for the whole save, on every rank (ties promotions to it)
    copies: tuple = ()  # the items this rank writes node copies of (MetadataIndex; see node_commit)


class TieredWriter(StorageWriter):
    """Route a DCP save to tiers: write to the fastest due one, promote to the rest.

    Args:
        tiers: tiers, fastest first.
        due: names of the tiers to save to, decided by the caller (``TieredCheckpointer``
            passes them); when omitted the coordinator decides with
            :class:`~dcp_tiered.tiers.policy.SaveSchedule` and ``clock`` (a tier never
            saved by this writer is due; if none is due the fastest is used).
        promoter: the background promoter to use (default: one owned by this writer;
            call :meth:`wait` / :meth:`close` to finish its work).
        clock: wall-clock function for schedules.
        threads, frame_size, nice, cpu_slots, overwrite: passed to each tier's ``CompressedWriter`` (``overwrite``
            replaces a checkpoint of the same name, e.g. after a restore from an older step).

    ``checkpoint_id`` (``dcp.save(..., checkpoint_id="step_000000100")``, see
    :func:`~dcp_tiered.tiers.layout.step_name`) names the checkpoint
    directory inside every tier.

    On a node-local tier without ``replicas`` every directory gets what its ranks hold: items that
    several ranks hold (DCP stores them once) are kept in the coordinator's directory and copied into
    each other one (node copies, :mod:`~dcp_tiered.tiers.save.node_commit`; the ``Metadata`` that
    ``dcp.save`` returns carries their records for :meth:`commit_node`).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        due: Sequence[str] | None = None,
        promoter: Promoter | None = None,
        clock: Callable[[], float] = time.time,
        threads: int | None = None,
        frame_size: int | None = None,
        step: int | None = None,
        nice: int | None = None,
        cpu_slots: threading.Semaphore | None = None,
        overwrite: bool = False,
        safe_globals: "Sequence[Any] | None" = None,
    ) -> None:
        super().__init__()
        self.safe_globals = safe_globals
        # Structure only: probing every tier on every save would cost a request per tier;
        # TieredCheckpointer probes once at construction, the primary is probed at write.
        self.tiers = validate_tiers(tiers, probe=False)
        check_count(threads, "threads", optional=True)
        check_frame_size(frame_size, optional=True)
        self.by_name = {t.name: t for t in self.tiers}
        if due is not None:
            unknown = [d for d in due if d not in self.by_name]
            if unknown or not due:
                raise ConfigError(f"due tiers {list(due)} must be a non-empty subset of {list(self.by_name)}")
            due = [t.name for t in self.tiers if t.name in due]
        self.due = tuple(due) if due is not None else None
        self._own_promoter = promoter is None
        self.promoter = promoter
        self.clock = clock
        self.threads = threads
        self.frame_size = frame_size
        self.nice, self.cpu_slots = nice, cpu_slots
        self.overwrite = overwrite
        self.step = step
        self.name: str | None = None
        self.rank = 0
        self.is_coordinator = True
        self.schedule = SaveSchedule(self.tiers) if due is None else None
        self.last_tiers: tuple[str, ...] = ()
        self.last_stats: SaveStats | None = None
        self._inner: CompressedWriter | None = None
        self._intent: Any = None  # the Promoter's record of what this rank owes (opaque here)
        self._plan_tiers: tuple[str, ...] = ()
        self._local_items: list = []  # this rank's local plan (before DCP drops duplicates): node copies come from it

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["promoter"] = None if self._own_promoter else state["promoter"]
        state["clock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.clock = time.time

    # -- helpers ------------------------------------------------------------------

    def _promoter(self) -> Promoter:
        if self.promoter is None:
            self.promoter = Promoter(self.tiers, rank=self.rank, node=node_of(self.rank), is_coordinator=self.is_coordinator)
        return self.promoter

    def wait(self) -> None:
        """Block until this writer's promotions finished; raise if any failed."""
        if self.promoter is not None:
            self.promoter.wait()

    def close(self) -> None:
        """Finish promotions and stop the promoter this writer owns."""
        if self.promoter is not None and self._own_promoter:
            self.promoter.close()

    def _due(self) -> tuple[str, ...]:
        if self.due is not None:
            return self.due
        assert self.schedule is not None
        step = self.step if self.step is not None else (parse_step(self.name or "") or 0)
        return self.schedule.decide(step, self.clock(), fallback=True)

    def _target(self, tier: Tier) -> Storage:
        """The checkpoint directory inside ``tier`` as this rank sees it (never through a link)."""
        assert self.name is not None
        target = step_dir(tier, self.rank, self.name)
        _refuse_link(target)
        return target

    def _coordinator_dir(self, tier: Tier) -> bool:
        """Whether this rank writes into the coordinator's directory of node-local ``tier``."""
        return shares_coordinator_dir(tier, self.rank)

    # -- DCP protocol -------------------------------------------------------------

    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        if checkpoint_id is not None:
            name = os.fspath(checkpoint_id)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(f"checkpoint_id {name!r} must be a plain directory name such as 'step_000000100'")
            self.name = safe_relative_name(name)
        elif self.step is not None:
            self.name = step_name(self.step)
        self._inner = None
        self._intent = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError("TieredWriter needs DCP's collectives (use_collectives=True)")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if self.name is None:
            raise ConfigError("TieredWriter needs a checkpoint name: pass checkpoint_id='step_000000100' to dcp.save or step=")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Un-commit this rank's directory of a node-local primary tier (not the coordinator's, which
        :meth:`prepare_global_plan` un-commits under its claim) when replacing a step: every rank does
        it here, before the global plan's collective, so no rank writes a data file while a
        ``.metadata`` of an earlier save of the step still stands in any node's directory."""
        primary = self.by_name[self.due[0]] if self.due else None
        if primary is not None and primary.node_local and self.overwrite and not self._coordinator_dir(primary):
            uncommit(self._target(primary))
        self._local_items = list(plan.items)
        if any(copies_node_local(t) for t in ([primary] if primary is not None else self.tiers)):
            # what this rank holds, for the coordinator's placement of replicated items (the indexes are
            # the plan's own objects: pickled with it, each costs a reference)
            plan = dataclasses.replace(plan, storage_data=HeldItems(tuple(item.index for item in plan.items)))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        tiers = self._due()
        primary = self.by_name[tiers[0]]
        copies: list[list[Any]] = [[] for _ in plans]
        if copies_node_local(primary) and plans and all(isinstance(p.storage_data, HeldItems) for p in plans):
            plans, copies = place_replicated(plans, [p.storage_data.indexes for p in plans],
                                             dir_leaders(primary, len(plans)))
        # A memory tier refuses a save that would not fit before anything (even the claim) is written.
        check_save_fits(primary, with_copies(plans, copies), self.name, rank=self.rank, frame_size=self.frame_size)
        target = self._target(self.by_name[tiers[0]])
        # Claimed before any rank writes: of two concurrent saves to one path exactly one goes on.
        self._release()
        self._lock, replacing = claim_checkpoint(target, self.overwrite)
        if replacing:
            # Un-commit before any rank rewrites a data file, so the old .metadata never
            # describes files that are being replaced.
            uncommit(target)
        save_id = uuid.uuid4().hex
        tag = unique_tag(target)
        return [dataclasses.replace(p, storage_data=TieredPlan(rank_prefix(i) + tag, tiers, save_id,
                                                               tuple(item.index for item in copies[i])))
                for i, p in enumerate(plans)]

    def _release(self, committed: bool = False) -> None:
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.release(unlink=committed)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        tp: TieredPlan = plan.storage_data
        self._plan_tiers = tp.tiers
        primary = self.by_name[tp.tiers[0]]
        kwargs: dict[str, Any] = {"storage_options": primary.storage_options, "threads": self.threads,
                                  "nice": self.nice,
                                  "cpu_slots": self.cpu_slots}
        if self.frame_size:
            kwargs["frame_size"] = self.frame_size
        target = self._target(primary)  # each rank: node-local tiers differ per node
        if primary.node_local and not self._coordinator_dir(primary):
            # Un-commit a directory that an earlier save of this step committed before rewriting its
            # files (done already in prepare_local_plan where every rank knew the tier; the
            # coordinator's is un-committed in prepare_global_plan); the save's node commit
            # (:mod:`~dcp_tiered.tiers.save.node_commit`) commits it again once its files are in.
            uncommit(target)
        url = target.url
        inner = CompressedWriter(url, codec=primary.codec, overwrite=self.overwrite, safe_globals=self.safe_globals,
                                 save_id=tp.save_id or None, **kwargs)
        inner.set_up_storage_writer(self.is_coordinator, rank=self.rank)
        inner_plan = inner.prepare_local_plan(dataclasses.replace(plan, storage_data=RankFilePrefix(tp.prefix)))
        self._inner = inner

        def write() -> list[WriteResult]:
            results = inner.write_data(inner_plan, planner).value()  # CompressedWriter completes synchronously
            targets = tp.tiers[1:]
            if targets:
                records = [(r.index, r.storage_data) for r in results]
                data_file = record_view(records[0][1]).file if records else None
                promoter = self._promoter()
                self._intent = promoter.record_intent(self.name, primary, targets, data_file, records,
                                                      self.is_coordinator, tp.save_id or None)
                if self._intent is not None and not self.is_coordinator:
                    promoter.submit(self._intent)  # data files are final; the coordinator commits targets later
            if primary.node_local and not self._coordinator_dir(primary):
                self._write_node_copies(inner, inner_plan, planner, tp, target)
            return results

        return completed(write)

    def _write_node_copies(self, inner: CompressedWriter, plan: SavePlan, planner: SavePlanner, tp: TieredPlan,
                           target: Storage) -> None:
        """Write this rank's node copies (items of its local plan that the coordinator named) into its
        node-copies file and list them, with their records, for its directory's leader (an empty list
        where it wrote none): they stay out of the results DCP gathers and the Metadata it broadcasts."""
        prefix = node_copies_prefix(tp.prefix)
        wanted = set(tp.copies)
        items = [item for item in self._local_items if item.index in wanted]
        copies: list = []
        if items:
            done = inner.write_data(dataclasses.replace(plan, items=items, storage_data=RankFilePrefix(prefix)), planner)
            copies = [(r.index, r.storage_data) for r in done.value()]
        elif self.overwrite and target.exists(data_file(prefix)):
            target.remove(data_file(prefix))  # an earlier save's copies, which no .metadata names now
        target.commit_bytes(node_copies_list(self.rank), copies_list(tp.save_id or None, copies))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self._inner is not None, "finish called before write_data"
        committed = False
        try:
            self._inner.finish(metadata, results)
            committed = True
        finally:
            self._release(committed=committed)
        self.last_stats = self._inner.last_stats
        self.last_tiers = self._plan_tiers
        promoter = self._promoter()
        if self._intent is not None:
            promoter.submit(self._intent)
        step = parse_step(self.name or "")
        if step is not None:
            promoter.mark_saved(self._plan_tiers[0], step)
        promoter.retention(self.by_name[self._plan_tiers[0]], protect=[step] if step is not None else [])

    def commit_node(self, metadata: Metadata, world: int) -> NodeCommit | None:
        """After ``dcp.save`` returned ``metadata`` on this rank: commit this rank's directory of a
        node-local tier saved to, where this rank leads it (see :mod:`~dcp_tiered.tiers.save.node_commit`).
        ``TieredCheckpointer`` does this itself; call it on every rank when using this writer alone."""
        primary = self.by_name.get(self._plan_tiers[0]) if self._plan_tiers else None
        if primary is None or self.name is None:
            return None
        return commit_node(primary, self.name, metadata, rank=self.rank, world=world, overwrite=self.overwrite,
                           step=parse_step(self.name))

    def storage_meta(self) -> StorageMeta | None:
        yield_to_caller()  # DCP's first call of every save: a caller waiting for the GIL gets it now
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike[str]") -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
