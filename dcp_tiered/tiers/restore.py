"""``Restorer``: choose and load the newest good checkpoint across tiers, with fallback.

Used by :meth:`TieredCheckpointer.restore <dcp_tiered.tiers.checkpointer.TieredCheckpointer.restore>`.
Every rank lists what it answers for (its node-local tiers, and the shared tiers on the
coordinator), the ranks agree on one ordered candidate list with one all-gather, and they
try the candidates in that order until one loads on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed.checkpoint as dcp

from dcp_tiered.dcp.agree import agree, failures
from dcp_tiered.dcp.broadcast import check_broadcastable, load_and_broadcast
from dcp_tiered.dcp.metadata_io import decoded_once
from dcp_tiered.dcp.reader import CompressedReader
from dcp_tiered.dcp.statedict import expand_stateful, flatten_keys
from dcp_tiered.errors import ConfigError, RestoreError
from dcp_tiered.tiers.catalog import list_tier
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.events import EventLog, describe_error
from dcp_tiered.tiers.save.node_commit import lacking_files
from dcp_tiered.tiers.policy import restore_order
from dcp_tiered.tiers.promote.promoter import Promoter
from dcp_tiered.tiers.replicas import fetch as peer_fetch
from dcp_tiered.tiers.replicas.replicate import Replicator
from dcp_tiered.tiers.topology import holds_file, step_dir

log = logging.getLogger(__name__)

Candidate = tuple[int, int]  # (step, tier index)
#: Start of the reason a rank refuses a candidate whose load needs another node's files (:meth:`Restorer._lacking`):
#: a fetch from peers brings a rank's own files only, so such a candidate is never made usable through peers.
NEEDS_OTHERS = "its load needs "
View = tuple[int, int, "str | None", "str | None"]  # (step, tier index, why unusable or None, save id)


#: Listing problems the coordinator's decision carries to every rank (then a count): one line per rank
#: would make it N lines to N ranks.
MAX_PROBLEM_LINES = 8


class Restorer:
    """Restore for one checkpointer: its tiers as ``rank`` on ``node`` sees them.

    ``promoter`` pins each candidate against retention while the restore runs;
    ``list_group`` carries the agreement collectives, ``load_group`` the loads;
    ``reader_options`` go to every :class:`CompressedReader`.
    """

    def __init__(self, tiers: Sequence[Tier], *, rank: int, node: int, world: int, distributed: bool,
                 promoter: Promoter, events: EventLog, replicator: Replicator, list_group: Any = None,
                 load_group: Any = None, reader_options: "dict[str, Any] | None" = None) -> None:
        self.tiers = list(tiers)
        self.rank, self.node, self.world, self.distributed = rank, node, world, distributed
        self.promoter = promoter
        self.events = events
        self.list_group, self.load_group = list_group, load_group
        self.reader_options = dict(reader_options or {})
        self.replicator = replicator  # restore fetches a lost node's files through its clique groups
        self._fetch: dict[Candidate, peer_fetch.Plan] = {}  # candidates usable through peers' replicas
        #: Candidates that failed to load, over every restore (each was skipped for the next).
        self.failures = 0

    def restore(self, state_dict: dict[str, Any], step: int | None = None, broadcast: Any = False,
                bucket_bytes: int = 64 << 20) -> "tuple[int, set[int]] | None":
        """Load the newest good candidate into ``state_dict`` (collective).

        Returns the restored step and the indexes of the tiers that offered candidates, or
        None when no tier holds a committed checkpoint; raises :class:`RestoreError` when
        committed checkpoints exist but none could be restored, naming each and why.  Each candidate's
        ``.metadata`` is decoded once on this rank, whatever its size (:func:`decoded_once`).
        """
        with decoded_once():
            return self._restore(state_dict, step, broadcast, bucket_bytes)

    def _restore(self, state_dict: dict[str, Any], step: int | None, broadcast: Any,
                 bucket_bytes: int) -> "tuple[int, set[int]] | None":
        if self._nothing_to_restore():
            return None  # decided before any Stateful's state_dict() runs: it may change the live state
        plain = expand_stateful(state_dict)[0]
        if self._broadcasting(broadcast):  # refused once, before any candidate, on every rank alike
            self._refuse_unbroadcastable(plain)
        # A node-local candidate is refused up front where this rank's load would need another node's files.
        precheck = plain if not self._broadcasting(broadcast) else None
        rejected: dict[Candidate, str] = {}
        tried: set[Candidate] = set()
        committed = False
        pinned: set[Candidate] = set()
        unlisted: list[str] = []
        try:
            for _ in range(3):  # listed again after all failed: a resumed promotion may have committed
                candidates, reasons, found = self._agree_candidates(plain, step, pinned, unlisted, precheck)
                committed = committed or found
                for cand, why in reasons.items():
                    rejected.setdefault(cand, why)
                fresh = [c for c in candidates if c not in tried]
                if not fresh:
                    break
                for cand in fresh:
                    tried.add(cand)
                    rejected.pop(cand, None)
                    why = self._attempt(cand, state_dict, broadcast, bucket_bytes)
                    if why is None:
                        self._warn_skipped(cand, rejected, step)
                        return cand[0], {c[1] for c in candidates}
                    rejected[cand] = why
        finally:
            for s, i in pinned:
                self.promoter.set_writing([self.tiers[i].name], s, False)
        if not committed and not unlisted:
            return None
        raise self._error(rejected, unlisted, step)

    def _refuse_unbroadcastable(self, plain: dict[str, Any]) -> None:
        """Raise :class:`ConfigError` on every rank where any rank's state cannot be broadcast (sharded)."""
        error = None
        try:
            check_broadcastable(plain)
        except ConfigError as exc:
            error = str(exc)
        count, failed = self._failures(error)
        if count:
            raise ConfigError(f"restore(broadcast=...): rank {failed[0][0]}: {failed[0][1]}"
                              + (f" (and {count - 1} more rank(s))" if count > 1 else ""))

    def _warn_skipped(self, restored: Candidate, rejected: dict[Candidate, str], step: int | None) -> None:
        """Say which newer checkpoints restore passed over and why (e.g. a node-local step whose
        load needs another node's file), so that going back in steps is never silent."""
        if step is not None or self.rank != 0:
            return
        newer = [(s, i) for s, i in restore_order(rejected) if s > restored[0]]
        if newer:
            log.warning("restore: restored step %d from tier %s; newer checkpoint(s) skipped: %s", restored[0],
                        self.tiers[restored[1]].name,
                        "; ".join(f"step {s} on {self.tiers[i].name}: {rejected[(s, i)]}" for s, i in newer[:4]))

    def _error(self, rejected: dict[Candidate, str], unlisted: list[str], step: int | None) -> RestoreError:
        order = restore_order(rejected)
        listed = [(self.tiers[i].name, s, rejected[(s, i)]) for s, i in order]
        lines = "; ".join([f"step {s} on tier {t!r}: {why}" for t, s, why in listed[:8]] + unlisted[:4])
        more = f"; and {len(listed) - 8} more" if len(listed) > 8 else ""
        wanted = f" of step {step}" if step is not None else ""
        return RestoreError(f"no committed checkpoint{wanted} could be restored ({len(listed)} candidate(s)): "
                            f"{lines}{more}", listed)

    def _local_view(self, plain: dict[str, Any], pinned: set[Candidate], unlisted: list[str],
                    precheck: dict[str, Any] | None) -> list[View]:
        """``(step, tier index, why unusable or None, save id)`` of each committed checkpoint this rank
        answers for: the node-local tiers as this rank sees them (complete when the files of the
        directory's own ranks are in; with ``precheck``, the state dict to load, unusable when its
        load would need files only other nodes hold), and the shared tiers on the coordinator.
        Each one is pinned against retention at once; tiers that cannot be listed go to ``unlisted``."""
        required = flatten_keys(plain)
        out: list[View] = []
        for i, tier in enumerate(self.tiers):
            if not tier.node_local and self.rank != 0:
                continue
            holds = holds_file(tier, self.rank, self.world) if tier.node_local else None
            try:  # any problem of one tier leaves the other tiers' candidates in
                infos = list_tier(tier, i, self.rank, self.node, holds=holds)
            except Exception as exc:  # noqa: BLE001
                log.warning("restore: cannot list tier %s: %s", tier.name, exc)
                unlisted.append(f"tier {tier.name!r} cannot be listed: {describe_error(exc)}")
                continue
            for info in infos:
                if not (info.committed or info.unusable):  # a linked checkpoint is named, never skipped
                    continue
                if (info.step, i) not in pinned:
                    self.promoter.set_writing([tier.name], info.step, True)
                    pinned.add((info.step, i))
                why = None
                if not info.complete or info.keys is None:
                    why = info.problem or "files missing or unreadable metadata"
                else:
                    missing = [k for k in required if k not in info.keys]
                    if missing:
                        extra = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                        why = f"lacks key(s) {missing[:3]}{extra} of the state dict"
                if why is None and holds is not None and precheck is not None:
                    why = self._lacking(tier, info, precheck, holds)
                out.append((info.step, i, why, info.save_id))
        return out

    def _nothing_to_restore(self) -> bool:
        """Whether no rank sees any checkpoint directory that claims a commit (one all-gather; the listing
        reads no ``.metadata``).  A tier that cannot be listed counts as holding something: the full
        restore then names the problem."""
        found = False
        for i, tier in enumerate(self.tiers):
            if found or (not tier.node_local and self.rank != 0):
                continue
            try:
                found = any(info.committed or info.unusable for info in
                            list_tier(tier, i, self.rank, self.node, with_metadata=False))
            except Exception:  # noqa: BLE001 - decided by the full restore, which reports it
                found = True
        return not self._agree(found, any)

    def _agree(self, value: Any, decide: Callable[[list[Any]], Any]) -> Any:
        """``decide`` over every rank's ``value`` (gathered on the coordinator only: O(N) bytes), the same
        answer on every rank."""
        return agree(value, decide, self.list_group, alone=not self.distributed)

    def _failures(self, error: "str | None") -> tuple[int, list[tuple[int, str]]]:
        """How many ranks report an error, and the first few ``(rank, error)``: the same on every rank."""
        return failures(error, self.list_group, alone=not self.distributed)

    def _agree_candidates(self, plain: dict[str, Any], step: int | None, pinned: set[Candidate], unlisted: list[str],
                          precheck: dict[str, Any] | None) -> tuple[list[Candidate], dict[Candidate, str], bool]:
        """The candidate list every rank agrees on (decided on the coordinator over every rank's view), the
        rejected ones with why, and whether any committed checkpoint exists; listing problems of any rank
        go to ``unlisted``."""
        problems: list[str] = []
        held: list[peer_fetch.Held] = []
        view: list[View] = []
        try:
            view = self._local_view(plain, pinned, problems, precheck)
        except Exception as exc:  # noqa: BLE001 - this rank must still take part in the collective below
            problems.append(f"listing the tiers failed: {describe_error(exc)}")
        try:  # apart: a problem with the replicas never drops the candidates listed above
            held = peer_fetch.holdings(self.tiers, self.rank, self.node) if self.replicator.plans else []
        except Exception as exc:  # noqa: BLE001
            problems.append(f"listing the replicas failed: {describe_error(exc)}")
        candidates, reasons, found, lines, fetch = self._agree((view, problems, held), lambda views: self._decide(views, step))
        unlisted.extend(line for line in lines if line not in unlisted)
        self._fetch.update(fetch)
        return candidates, reasons, found

    def _decide(self, views: list[Any], step: int | None) -> tuple:
        """The coordinator's decision over every rank's ``(view, problems, held)``: the usable candidates in
        restore order, why each other one is not, whether any exists, every rank's listing problems and
        the plans of the candidates usable through peers."""
        lines: list[str] = []
        more = 0
        seen: dict[Candidate, dict[int, str | None]] = {}
        save_ids: dict[Candidate, set[str | None]] = {}
        for rank, (v, probs, _held) in enumerate(views):
            for p in probs:
                line = f"rank {rank}: {p}" if self.distributed else p
                if line in lines:
                    continue
                if len(lines) < MAX_PROBLEM_LINES:
                    lines.append(line)
                else:
                    more += 1
            for s, i, why, save_id in v:
                seen.setdefault((s, i), {})[rank] = why
                save_ids.setdefault((s, i), set()).add(save_id)
        usable: list[Candidate] = []
        reasons: dict[Candidate, str] = {}
        fetch: dict[Candidate, peer_fetch.Plan] = {}
        for (s, i), by_rank in seen.items():
            if step is not None and s != step:
                reasons[(s, i)] = f"not the requested step {step}"
                continue
            if self.tiers[i].node_local:
                problems = [f"rank {r}: {by_rank[r]}" if r in by_rank else f"rank {r}: not committed there"
                            for r in range(len(views)) if by_rank.get(r, "") is not None]
                if not problems and len(save_ids[(s, i)]) > 1:  # the nodes committed different saves of the step
                    problems = [f"the nodes hold different saves of this step (save ids {sorted(map(str, save_ids[(s, i)]))})"]
                elif problems:
                    plan = self._through_peers((s, i), by_rank, save_ids[(s, i)], [h for _v, _p, h in views])
                    if plan is not None:
                        fetch[(s, i)], problems = plan, []
            else:
                problems = [by_rank[0]] if by_rank.get(0) is not None else []
            if problems:
                reasons[(s, i)] = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} ranks)" if len(problems) > 3 else "")
            else:
                usable.append((s, i))
        if more:
            lines.append(f"(and {more} more listing problems on other ranks)")
        return restore_order(usable), reasons, bool(seen), lines, fetch

    def _through_peers(self, cand: Candidate, by_rank: dict[int, str | None], save_ids: set[str | None],
                       held: list[list[peer_fetch.Held]]) -> "peer_fetch.Plan | None":
        """The plan by which the ranks lacking node-local candidate ``cand`` fetch their files from clique
        peers holding committed replicas (:meth:`_prepare` fetches them), or None where they cannot."""
        if self.replicator.group_of(self.tiers[cand[1]].name) is None or len(save_ids - {None}) != 1:
            return None
        if any(why is not None and why.startswith(NEEDS_OTHERS) for why in by_rank.values()):
            return None  # the fetch would bring the rank's own files, not the other node's it needs
        ok = {r for r, why in by_rank.items() if why is None}
        lacking = [r for r in range(len(held)) if r not in ok]
        cliques = [c for c, _g in self.replicator.all_groups[self.tiers[cand[1]].name]]
        return peer_fetch.plan_fetch(cand, lacking, ok, next(iter(save_ids - {None})), held, cliques)

    def _lacking(self, tier: Tier, info: Any, state_dict: dict[str, Any], own: Callable[[str], bool]) -> str | None:
        """Why this rank cannot load the node-local checkpoint ``info`` from its own node, or None: its load
        needs a file of another directory's rank that is not here as a committed replica of this save."""
        try:
            lacking = lacking_files(step_dir(tier, self.rank, info.name, self.node), info.files, state_dict,
                                    own)
        except Exception as exc:  # noqa: BLE001 - e.g. a malformed marker: this candidate only is unusable
            return f"cannot check what its load needs: {describe_error(exc)}"
        if not lacking:
            return None
        return (f"{NEEDS_OTHERS}{lacking[:3]}{' ...' if len(lacking) > 3 else ''}, held by another node only, "
                "not as a committed replica of this save here (items DCP stored once, e.g. replicated state)")

    def _broadcasting(self, broadcast: Any) -> bool:
        return broadcast is not False and broadcast is not None and self.distributed

    def _load(self, url: str, tier: Tier, state_dict: dict[str, Any], broadcast: Any, bucket_bytes: int,
              reader: CompressedReader | None) -> None:
        plain, finish = expand_stateful(state_dict)

        def make_reader() -> CompressedReader:
            return CompressedReader(url, storage_options=tier.storage_options, **self.reader_options)

        if self._broadcasting(broadcast):
            groups = self.load_group if broadcast is True else broadcast
            load_and_broadcast(plain, make_reader, process_group=groups, bucket_bytes=bucket_bytes)
        else:
            kwargs: dict[str, Any] = {"process_group": self.load_group} if self.distributed else {"no_dist": True}
            dcp.load(plain, storage_reader=reader or make_reader(), **kwargs)
        finish()

    def _prepare(self, cand: Candidate, url: str) -> int:
        """Make the files this rank needs of candidate ``cand`` reachable at ``url`` (every rank calls it).

        A node-local directory holds its own ranks' files and, with replication, other ranks' files
        as replicas; a candidate where a rank's load needs another node's file (an item DCP
        deduplicated into it, e.g. replicated DDP state) that is not here as a committed replica of
        this save is refused when listing (:meth:`_lacking`); a file lost after the listing fails the
        load in ``CompressedReader``'s check of the files of its read plan, before any data is read,
        and every rank moves on to the next candidate together.

        A candidate usable through peers (:meth:`_through_peers`) first gets the files of the ranks
        lacking them from their clique peers (:func:`~dcp_tiered.tiers.replicas.fetch.fetch`); when that
        fails on any rank (any exception, a collective's timeout too), every rank raises here after the
        same gathers and moves on together; each node's ``.metadata`` is committed only once every
        rank's fetch succeeded."""
        plan = self._fetch.get(cand)
        if plan is None:
            return 0
        tier = self.tiers[cand[1]]
        error, received, metadata = None, 0, None
        try:
            error, received, metadata = peer_fetch.fetch(tier, cand[0], plan, rank=self.rank, node=self.node,
                                                         clique_groups=self.replicator.all_groups[tier.name])
        except Exception as exc:  # noqa: BLE001 - a gloo timeout too: every rank must still gather below
            error = f"fetch failed: {describe_error(exc)}"
        self._raise_failed(cand, error)
        try:  # the node's .metadata only now that every receiving rank of every node verified its files
            error = peer_fetch.commit_node_metadata(tier, cand[0], plan, metadata, rank=self.rank, node=self.node)
        except Exception as exc:  # noqa: BLE001
            error = describe_error(exc)
        self._raise_failed(cand, error)
        return received

    def _raise_failed(self, cand: Candidate, error: "str | None") -> None:
        """Raise on every rank where any rank's step of a fetch failed (collective)."""
        count, failed = self._failures(error or None)
        if count:
            raise RestoreError(f"fetching the files of step {cand[0]} from peers failed on rank {failed[0][0]}: "
                               f"{failed[0][1]}")

    def _everywhere(self, fn: Callable[[], None]) -> tuple[int, list[tuple[int, str]]]:
        """Run ``fn`` on every rank; how many ranks failed and the first ``(rank, error)``, the same on every rank."""
        error = None
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = describe_error(exc)
        return self._failures(error)

    def _attempt(self, cand: Candidate, state_dict: dict[str, Any], broadcast: Any, bucket_bytes: int) -> str | None:
        """Load one candidate on every rank; None if every rank succeeded, else why (the same on every rank).

        Every rank first opens the candidate (its ``.metadata``) and the ranks agree that all did,
        so that a rank failing there never leaves the others waiting inside ``dcp.load``."""
        s, i = cand
        tier = self.tiers[i]
        t0 = time.perf_counter()
        opened: dict[str, Any] = {}

        def open_candidate() -> None:
            url = opened["url"] = step_dir(tier, self.rank, s, self.node).url
            opened["fetched"] = self._prepare(cand, url)
            if not self._broadcasting(broadcast):  # with broadcast only each group's leader reads
                opened["reader"] = CompressedReader(url, storage_options=tier.storage_options, **self.reader_options)

        count, failed = self._everywhere(open_candidate)
        if not count:
            count, failed = self._everywhere(lambda: self._load(opened["url"], tier, state_dict, broadcast,
                                                                bucket_bytes, opened.get("reader")))
        if not count:
            peers = {"through_peers": True, "fetched_bytes": opened.get("fetched", 0)} if cand in self._fetch else {}
            self.events.emit({"event": "restore", "step": s, "tier": tier.name, "seconds": time.perf_counter() - t0,
                              **peers})
            return None
        why = failed[0][1] if count == self.world else f"rank {failed[0][0]}: {failed[0][1]}"
        self.failures += 1
        log.warning("restore: step %d on tier %s failed (%s); trying the next candidate", s, tier.name, why)
        self.events.emit({"event": "restore_failure", "step": s, "tier": tier.name, "error": why})
        return why
