"""Retention: which checkpoints of a tier to delete, and deleting them.

The one place that turns a tier's listing into :class:`~dcp_tiered.tiers.policy.CheckpointFacts`
for the pure rule :func:`~dcp_tiered.tiers.policy.retention_victims`.  The promoter's retention
job and ``dcp-tiered gc`` (``--dry-run`` too) both go through :meth:`Retention.plan`, so what gc
lists is what retention deletes on the same tier state.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from dcp_tiered.dcp.format import expected_sizes
from dcp_tiered.dcp.metadata_io import load_metadata
from dcp_tiered.dcp.writer import uncommit
from dcp_tiered.errors import DcpTieredError
from dcp_tiered.names import METADATA_FILE, rank_of_file
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.catalog import CheckpointInfo, list_tier
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.layout import FRAGMENT_SUFFIX
from dcp_tiered.tiers.pins import StepMarks
from dcp_tiered.tiers.policy import CheckpointFacts, retention_victims
from dcp_tiered.tiers.replicas.markers import is_replicated, job_topology, read_markers
from dcp_tiered.tiers.topology import clique_peers, tier_storage

log = logging.getLogger(__name__)


def checkpoint_facts(info: CheckpointInfo, *, ages: dict[str, float], busy: Collection[int], own: Collection[int],
                     known_tiers: Collection[str], optimizer_keys: Sequence[str] = ()) -> CheckpointFacts:
    """The retention facts of one (usable) checkpoint directory.

    Busy: in ``busy``, or with a pending intent naming a known tier (one naming no known tier
    pins nothing; a listing given the job's tiers, ``list_tier(known=)``, already drops intents
    naming another), or uncommitted with promotion fragments (an incoming promotion).  Committed
    means ``.metadata`` is there, on every rank: each node's directory of a node-local tier gets
    its own once that node's files are in (``tiers/save/node_commit.py``).  A step in ``own`` has an infinite
    age (no grace period); else the age of its newest file, from ``ages`` (path -> seconds).
    """
    committed = info.committed
    intents = bool(set(info.pending_promotions) & set(known_tiers))
    incoming = any(f.endswith(FRAGMENT_SUFFIX) for f in info.files)
    file_ages = [a for n, a in ages.items() if n.startswith(info.name + "/")]
    age = float("inf") if info.step in own else (min(file_ages) if file_ages else None)
    # Unreadable metadata (keys None) is not known to hold the optimizer state: it never stands in
    # for the newest checkpoint that does.
    full = not optimizer_keys or (info.keys is not None and info.has_prefix(optimizer_keys))
    busy_now = info.step in busy or intents or (incoming and not committed)
    return CheckpointFacts(info.step, committed, busy=busy_now, full=full, age=age)


@dataclass
class RetentionPlan:
    """What retention of one tier deletes (``victims``, newest first) and what it leaves alone as unusable."""

    tier: Tier
    storage: Storage
    victims: list[CheckpointInfo] = field(default_factory=list)
    unusable: list[CheckpointInfo] = field(default_factory=list)

    def as_rows(self, infos: Sequence[CheckpointInfo] | None = None) -> list[dict]:
        """One plain dict per victim, or per checkpoint of ``infos`` (e.g. those deleted): ``dcp-tiered gc`` output."""
        return [{"tier": self.tier.name, "step": i.step, "name": i.name, "url": i.url, "committed": i.committed,
                 "size_bytes": i.size_bytes, "keep": self.tier.keep} for i in (self.victims if infos is None else infos)]


class Retention:
    """Retention of ``tiers`` as one rank sees them: the facts builder, the victim rule, the deletes.

    ``leftover_grace``: an uncommitted leftover not written by this process is deleted only once
    untouched that long; ``optimizer_keys``: keep the newest committed checkpoint holding them;
    ``marks``: this process's own and pinned steps (:class:`StepMarks`).
    """

    def __init__(self, tiers: Sequence[Tier], *, rank: int = 0, node: int = 0, is_coordinator: bool = True,
                 optimizer_keys: Sequence[str] = (), leftover_grace: float = 3600.0,
                 marks: StepMarks | None = None, world: int | None = None) -> None:
        self.tiers = list(tiers)
        self.rank, self.node, self.is_coordinator = rank, node, is_coordinator
        self.world = world  # the job's world (its process group); None: the default group's, else the markers
        self.optimizer_keys = tuple(optimizer_keys)
        self.leftover_grace = leftover_grace
        self.marks = marks if marks is not None else StepMarks()
        self._locks: dict[str, threading.Lock] = {}

    def applies_to(self, tier: Tier) -> bool:
        """Only the coordinator applies retention to a shared tier; every rank to its node-local ones."""
        return tier.node_local or self.is_coordinator

    def plan(self, tier: Tier, protect: Iterable[int] = (), busy: Iterable[int] = ()) -> RetentionPlan:
        """List ``tier`` and decide what to delete; raises :class:`~dcp_tiered.errors.DcpTieredError` if it cannot list."""
        storage = tier_storage(tier, self.rank, self.node)
        pinned_before = self.marks.pinned(tier.name)  # a save pinned during the listing may have committed since
        infos = list_tier(tier, self.tiers.index(tier), self.rank, self.node, with_metadata=bool(self.optimizer_keys),
                          known=[t.name for t in self.tiers])
        ages = storage.file_ages(time.time()) if self.leftover_grace > 0 else {}
        busy_now = set(busy) | pinned_before | self.marks.pinned(tier.name)
        own = self.marks.own(tier.name)
        known = {t.name for t in self.tiers}
        usable = [i for i in infos if not i.unusable]  # a link (or a .metadata that is no file): never deleted
        facts = [checkpoint_facts(i, ages=ages, busy=busy_now, own=own, known_tiers=known,
                                  optimizer_keys=self.optimizer_keys) for i in usable]
        replicated = newest_replicated(tier, storage, infos, self.rank, self.world or world_size())
        protect = [*protect, *([replicated] if replicated is not None else [])]
        victims = set(retention_victims(facts, tier.keep, protect, self.leftover_grace))
        return RetentionPlan(tier, storage, [i for i in usable if i.step in victims], [i for i in infos if i.unusable])

    def apply(self, plan: RetentionPlan,
              on_failure: Callable[[CheckpointInfo, DcpTieredError], None] | None = None) -> list[CheckpointInfo]:
        """Delete the plan's victims (``.metadata`` first, then the directory); return those deleted.

        A failed delete is logged and passed to ``on_failure``; it does not stop the others."""
        for info in plan.unusable:
            log.warning("retention of tier %s: leaving %s alone: %s", plan.tier.name, info.name, info.problem)
        deleted = []
        for info in plan.victims:
            if not info.committed and self._written_since(plan, info):
                continue
            self.marks.mark_own(plan.tier.name, info.step)  # whatever a failed delete leaves needs no grace
            try:
                delete_checkpoint(plan.storage.child(info.name))
            except DcpTieredError as exc:
                log.warning("retention: could not delete %s of tier %s: %s", info.name, plan.tier.name, exc)
                if on_failure is not None:
                    on_failure(info, exc)
                continue
            log.info("retention: deleted %s", info.url)
            deleted.append(info)
        return deleted

    def _written_since(self, plan: RetentionPlan, info: CheckpointInfo) -> bool:
        """Whether a step listed as an uncommitted leftover is being saved or got committed since the
        listing (a save of this process started after it): then it is no leftover."""
        if info.step in self.marks.pinned(plan.tier.name):
            return True
        try:
            return plan.storage.child(info.name).exists(METADATA_FILE)
        except DcpTieredError:
            return True  # cannot tell: leave it for the next pass

    def run(self, tier: Tier, protect: Iterable[int] = (), busy: Iterable[int] = (),
            on_failure: Callable[[CheckpointInfo, DcpTieredError], None] | None = None) -> list[CheckpointInfo]:
        """:meth:`plan` and :meth:`apply` where this rank applies retention; a tier it cannot list is logged and left."""
        if not self.applies_to(tier):
            return []
        with self._locks.setdefault(tier.name, threading.Lock()):  # one at a time per tier: a lane's and a save's
            try:
                plan = self.plan(tier, protect, busy)
            except DcpTieredError as exc:
                log.warning("retention: cannot list tier %s: %s", tier.name, exc)
                return []
            return self.apply(plan, on_failure)


def world_size() -> int | None:
    """The default group's world size, or None outside ``torch.distributed`` (``dcp-tiered gc``)."""
    dist = sys.modules.get("torch.distributed")  # never imports torch: outside a job there is no world
    return dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else None


def newest_replicated(tier: Tier, storage: Storage, infos: Sequence[CheckpointInfo], rank: int,
                      world: int | None) -> int | None:
    """On a tier with ``replicas > 1``: the newest committed step of the directory ``storage`` that is fully
    replicated there (:func:`~dcp_tiered.tiers.replicas.markers.is_replicated`), which retention keeps until
    a newer one is; None otherwise.

    Inside a job the peers come from ``world`` and ``LOCAL_WORLD_SIZE``; outside one (``world`` None:
    ``dcp-tiered gc``) from the world and ranks per node the step's markers record, so both keep the same
    step.  So a step whose replication is still running (or was killed) never leaves a node without a
    replicated copy, even with ``keep=1``."""
    if tier.replicas <= 1:
        return None
    peers_of: dict[tuple, set[int]] = {}  # per topology: one computation for every step
    for info in sorted((i for i in infos if i.committed and not i.unusable), key=lambda i: -i.step):
        try:
            child = storage.child(info.name)
            markers = read_markers(child)
            topology = (world, None) if world else job_topology(markers)
            if topology is None:
                continue
            if topology not in peers_of:
                peers_of[topology] = clique_peers(tier, rank, *topology)
            save_id, writers = save_writers(child)
        except DcpTieredError:
            continue
        if is_replicated(markers, peers_of[topology], save_id, info.files or None, writers):
            return info.step
    return None


def save_writers(child: Storage) -> "tuple[str | None, set[int]]":
    """The save id of the checkpoint committed in ``child`` and the ranks whose data files its records name."""
    md = load_metadata(child)
    names = expected_sizes(md.storage_data.values())
    return getattr(md.storage_meta, "save_id", None), {r for f in names if (r := rank_of_file(f)) is not None}


def delete_checkpoint(child: Storage) -> None:
    """Delete one checkpoint directory: un-commit first, so a half-deleted checkpoint is never listed."""
    uncommit(child)
    child.remove_tree()
