"""The catalog: every checkpoint of every tier, committed or not, with what it holds."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from dcp_tiered.errors import DcpTieredError
from dcp_tiered.names import METADATA_FILE
from dcp_tiered.storage import Storage
from dcp_tiered.tiers.layout import INTENT_FILE, parse_step, read_intent
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.topology import tier_storage

log = logging.getLogger(__name__)



@dataclass
class CheckpointInfo:
    """One checkpoint directory of one tier, as seen from this rank."""

    tier: str
    tier_index: int
    step: int
    name: str
    url: str
    committed: bool
    size_bytes: int
    codec: str | None = None
    keys: frozenset[str] | None = None
    complete: bool = False  # every file the metadata names is visible with its full size
    #: Tiers some rank's promotion intent still owes this step: its data file, or the commit of its
    #: ``.metadata`` (which reads this step's ``.metadata``); a promotion pins its step until both are done.
    pending_promotions: tuple[str, ...] = ()
    problem: str | None = None
    files: dict[str, int] = field(default_factory=dict, repr=False)
    #: Claims this step but must never be used, written or deleted through: the step directory or
    #: its ``.metadata`` is a symbolic link (or not a regular file).  Never ``committed`` nor
    #: ``complete``; ``problem`` says why, so that a restore names it instead of starting from scratch.
    unusable: bool = False
    #: The id of the save that committed it (``.metadata``'s ``storage_meta.save_id``; None if unread).
    save_id: str | None = None

    def has_keys(self, required: Iterable[str]) -> bool:
        """Whether the checkpoint holds every key in ``required`` (flattened, dot-joined)."""
        if self.keys is None:
            return False
        return all(k in self.keys for k in required)

    def has_prefix(self, prefixes: Sequence[str]) -> bool:
        """Whether any key starts with one of ``prefixes`` (e.g. optimizer state)."""
        return self.keys is not None and any(k == p or k.startswith(p + ".") for k in self.keys for p in prefixes)


def inspect_checkpoint(storage: Storage, tier: Tier, index: int, name: str, with_metadata: bool = True,
                       holds: Callable[[str], bool] | None = None,
                       known: Collection[str] | None = None) -> CheckpointInfo:
    """Describe one checkpoint directory ``name`` of ``tier``; ``holds``: which data files the
    directory must hold to be ``complete`` (a node-local directory: its ranks' files), default all;
    ``known``: the job's tier names, so that an intent naming another tier counts as invalid."""
    step = parse_step(name)
    child = storage.child(name)
    if child.is_link():  # never followed: not listed (nor deleted, nor written) through the link
        return CheckpointInfo(
            tier=tier.name, tier_index=index, step=step if step is not None else -1, name=name, url=child.url,
            committed=False, size_bytes=0, unusable=True,
            problem=f"{child.url} is a symbolic link; checkpoints are never used through links (copy the files into "
                    "the tier instead, or remove the link)",
        )
    files = child.file_sizes()
    info = CheckpointInfo(
        tier=tier.name, tier_index=index, step=step if step is not None else -1, name=name, url=child.url,
        committed=METADATA_FILE in files, size_bytes=sum(files.values()), files=files,
    )
    pending: list[str] = []
    for fname in files:
        if INTENT_FILE.match(fname):
            try:  # untrusted input: validated, an invalid one is ignored (and left for gc)
                doc = read_intent(child, fname, dir_name=name, source=tier.name, tiers=known)
                pending += doc["targets"] + doc["meta"]  # a commit still owed reads this step's .metadata
            except (DcpTieredError, ValueError) as exc:
                log.warning("unreadable promotion intent %s/%s: %s", child.url, fname, exc)
    info.pending_promotions = tuple(sorted(set(pending)))
    if not info.committed and child.is_local and os.path.lexists(child.path(METADATA_FILE)):
        # a .metadata that is a link, FIFO or directory: claims a commit, never read
        info.unusable = True
        info.problem = (f"{child.url_of(METADATA_FILE)} is a symbolic link or not a regular file; checkpoint files "
                        "are never read through links (copy the file instead)")
        return info
    if not (info.committed and with_metadata):
        return info
    from dcp_tiered.dcp.format import expected_sizes, record_view
    from dcp_tiered.dcp.metadata_io import load_metadata

    try:
        md = load_metadata(child)
        info.keys = frozenset(md.state_dict_metadata)
        info.save_id = getattr(md.storage_meta, "save_id", None) or ""
        needed = expected_sizes(md.storage_data.values())  # a record table's over its columns: none built
        rest = getattr(md.storage_data, "rest", None)
        codecs = md.storage_data.row_codecs() if rest is not None else set()
        codecs |= {item.codec if item.native else "stock"
                   for item in map(record_view, (md.storage_data if rest is None else rest).values())}
        info.codec = ",".join(sorted(codecs)) or None
        missing = [f for f, size in needed.items() if files.get(f, -1) < size and (holds is None or holds(f))]
        info.complete = not missing
        if missing:
            info.problem = f"files missing or short: {missing[:3]}"
    except DcpTieredError as exc:
        info.problem = str(exc)
    return info


def list_tier(tier: Tier, index: int = 0, rank: int = 0, node: int = 0, with_metadata: bool = True,
              holds: Callable[[str], bool] | None = None, known: Collection[str] | None = None) -> list[CheckpointInfo]:
    """Every checkpoint directory of ``tier`` (newest step first); ``holds`` and ``known`` as for
    :func:`inspect_checkpoint`."""
    storage = tier_storage(tier, rank, node)
    names = sorted((n for n in storage.listdir() if parse_step(n) is not None), key=parse_step, reverse=True)
    infos = [inspect_checkpoint(storage, tier, index, n, with_metadata, holds, known) for n in names]
    return sorted(infos, key=lambda i: i.step, reverse=True)


def list_tiers(tiers: Sequence[Tier], rank: int = 0, node: int = 0, with_metadata: bool = True) -> list[CheckpointInfo]:
    """Every checkpoint of every tier, tier by tier (fastest first), newest first within a tier."""
    out: list[CheckpointInfo] = []
    known = [t.name for t in tiers]
    for i, t in enumerate(tiers):
        try:
            out += list_tier(t, i, rank, node, with_metadata, known=known)
        except DcpTieredError as exc:
            log.warning("cannot list tier %s (%s): %s", t.name, t.url, exc)
    return out
