"""The source side of a promotion: the intent a rank records in the source checkpoint.

``.promote-{rank}.json`` holds what one rank still owes for one source checkpoint: its data
file and records, the tiers still to receive that file (``targets``) and, on the coordinator,
the tiers whose ``.metadata`` it still has to commit (``meta``).  It is rewritten as work is
done and removed when nothing is owed.  Read back, it is untrusted input: validated by
:func:`~dcp_tiered.tiers.layout.parse_intent` and checked against the committed source
(:func:`intent_mismatch`) before anything is copied.

The source's ``.metadata`` is decoded once for all of an intent's promotions
(:meth:`PromotionIntent.source_metadata`, a :class:`SourceMetadata`): the check of a resumed intent,
the coordinator's wait and its commit to every target use it; the commit reads the bytes again
(a save may have replaced them) and decodes them only if they changed.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from dcp_tiered.dcp.format import METADATA_FILE, builtin_from_json, is_native_record, records_in_file
from dcp_tiered.dcp.metadata_io import decode_metadata, read_metadata_bytes
from dcp_tiered.errors import DcpTieredError
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.tiers.layout import INTENT_FIELDS, intent_name, parse_intent

log = logging.getLogger(__name__)

#: The intent's records do not belong to the save committed in the source (see :func:`intent_mismatch`).
STALE = "stale"


def index_to_json(index: MetadataIndex) -> list:
    return [index.fqn, list(index.offset) if index.offset is not None else None, index.index]


def index_from_json(data: list) -> MetadataIndex:
    fqn, offset, idx = data
    return MetadataIndex(fqn, torch.Size(offset) if offset is not None else None, idx)


@dataclass(frozen=True)
class SourceMetadata:
    """A promotion source's decoded ``.metadata`` (shared: never changed), its size and the digest of its bytes."""

    md: Metadata
    size: int
    digest: bytes

    @property
    def save_id(self) -> str:
        """The save id it was committed with ("" if none)."""
        return getattr(self.md.storage_meta, "save_id", None) or ""

    def records_by_file(self) -> dict[str, dict[MetadataIndex, dict]]:
        """The native records (plain, by index) of each data file, grouped in one pass over the records."""
        out: dict[str, dict[MetadataIndex, dict]] = {}
        for i, r in self.md.storage_data.items():
            if is_native_record(r):
                out.setdefault(r["file"], {})[i] = r
        return out


def read_source(src: Storage, held: SourceMetadata | None = None) -> SourceMetadata:
    """Read the ``.metadata`` of ``src`` (size checked first); decode it unless it holds ``held``'s bytes."""
    raw = read_metadata_bytes(src)
    digest = xxhash.xxh3_128_digest(raw)
    if held is not None and held.digest == digest:
        return held
    return SourceMetadata(decode_metadata(raw, src.url_of(METADATA_FILE)), len(raw), digest)


@dataclass
class PromotionIntent:
    """What one rank still has to do for one source checkpoint (``.promote-{rank}.json``)."""

    name: str
    source: str
    data_file: str | None
    records: list  # [[index json, record], ...]
    targets: list[str]  # tiers still to receive this rank's data file
    meta: list[str] = field(default_factory=list)  # tiers whose .metadata this rank (coordinator) commits
    save_id: str | None = None  # the save this intent belongs to (all ranks share it)
    rank: int = 0  # the rank that wrote it (also in its file name)
    resumed: bool = False  # picked up from storage after a restart (or from another process)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    #: The source's decoded ``.metadata`` while this intent's promotions need it (:meth:`source_metadata`).
    source_md: SourceMetadata | None = field(default=None, init=False, repr=False, compare=False)
    _source_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def to_json(self) -> bytes:
        return json.dumps({k: getattr(self, k) for k in INTENT_FIELDS}).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "(bytes)", **expect: Any) -> "PromotionIntent":
        """Parse and validate (see :func:`~dcp_tiered.tiers.layout.parse_intent`); ``ValueError`` if invalid."""
        return cls(**parse_intent(data, where, **expect))

    @property
    def owes(self) -> bool:
        """Whether any data copy or commit is still owed."""
        return bool(self.targets or self.meta)

    def record(self, src: Storage, temp_grace: float = 3600.0) -> None:
        """Commit the remaining work into the source checkpoint ``src``, or remove the intent once all is done
        (with the temp files of rewrites killed more than ``temp_grace`` seconds ago)."""
        if self.owes:
            src.commit_bytes(intent_name(self.rank), self.to_json())
            return
        try:
            src.remove(intent_name(self.rank))
            src.remove_temps(intent_name(self.rank), older_than=temp_grace)
        except DcpTieredError as exc:  # cleanup only: the promotion itself succeeded
            log.warning("could not remove finished promotion intent in %s: %s", src.url, exc)

    def drop(self, src: Storage, target: str, data: bool = True, meta: bool = True, temp_grace: float = 3600.0) -> None:
        """Take ``target`` off the remaining work and record that durably in ``src``."""
        with self.lock:
            if data and target in self.targets:
                self.targets.remove(target)
            if meta and target in self.meta:
                self.meta.remove(target)
            self.record(src, temp_grace)
            if not self.owes:
                self.source_md = None  # nothing left to promote: the decoded .metadata goes

    def source_metadata(self, src: Storage, again: bool = False) -> SourceMetadata:
        """The source checkpoint's ``.metadata`` (``src``), decoded once for every target of this intent.

        ``again``: read its bytes again (a save may have replaced it); decoded again only if they
        changed.  Raises ``MissingFileError`` when it is not there, as reads do."""
        with self._source_lock:
            if self.source_md is None or again:
                self.source_md = read_source(src, self.source_md)
            return self.source_md


def intent_mismatch(src: Storage, intent: PromotionIntent) -> str | None:
    """Why the records of a (resumed, untrusted) intent are not exactly the committed source
    checkpoint's records of its data file, or None when they are (:data:`STALE`: the intent is of
    another save than the committed one).  A promotion copies and commits the records it is given:
    records swapped or altered between keys would commit wrong values."""
    try:
        md = intent.source_metadata(src).md
    except MissingFileError:  # a node-local source: only the coordinator's node holds .metadata
        return None  # the commit checks the records this copy used (its fragment) against the source's
    except DcpTieredError as exc:
        return f"cannot read {src.url_of(METADATA_FILE)} to check the promotion intent: {exc}"
    if intent.save_id is not None and (getattr(md.storage_meta, "save_id", None) or "") != intent.save_id:
        return STALE
    want = {(i.fqn, tuple(i.offset) if i.offset is not None else None): r
            for i, r in records_in_file(md.storage_data, intent.data_file).items()}
    got: dict = {}
    for i, r in intent.records:
        got[(i[0], tuple(i[1]) if i[1] is not None else None)] = builtin_from_json(r)
    if got.keys() != want.keys():
        return (f"the promotion intent in {src.url} lists other items of {intent.data_file} than its .metadata; "
                "not promoting it (left for `dcp-tiered gc`)")
    bad = sorted(k for k, r in got.items() if r != want[k])
    if bad:
        return (f"the promotion intent in {src.url} holds records of {[k for k, _ in bad[:3]]} that differ from "
                f"the committed .metadata of {intent.data_file}; not promoting it (left for `dcp-tiered gc`)")
    return None
