"""The target side of a promotion: per-rank copies with their fragments, and the commit from them.

Every rank copies its own data file into the target checkpoint (:func:`copy_with_fragment`:
byte for byte, or re-encoded for the target's codec) and then commits a fragment
``.{data_file}.records.json`` with the new records and the save id.  The coordinator commits
the target's ``.metadata`` (:func:`commit_from_fragments`) once every data file of the source
has a fragment of this save, after checking that the fragments describe exactly the source's
items; ``.metadata`` is written last, so the target is committed only when complete.

The coordinator's requests do not grow as ranks times polls: a poll is one listing of the target
(on an object store a paginated list, a request per 1000 objects), and :class:`FragmentReads` reads a
fragment once when a listing shows it (again only when a listing shows it changed), on at most
:data:`FRAGMENT_READERS` threads; the commit reuses those reads.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from dcp_tiered.codecs import FrameCodec, get_codec, verify_frame
from dcp_tiered.codecs.bytegroup import FILTER_NONE
from dcp_tiered.dcp.format import (METADATA_FILE, ItemRecord, builtin_from_json, expected_sizes, native_files,
                                   record_view)
from dcp_tiered.dcp.writer import uncommit
from dcp_tiered.dcp.metadata_io import committed_save_id, encode_metadata
from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError, PromotionError, PromotionIOError
from dcp_tiered.storage import MissingFileError, Storage
from dcp_tiered.storage.base import write_pieces
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.layout import INTENT_MAX_BYTES, fragment_name
from dcp_tiered.tiers.promote.intents import SourceMetadata, index_from_json, index_to_json, read_source

log = logging.getLogger(__name__)

#: Bounds (seconds) of the wait of a promotion's commit for the files of the other ranks.
FRAGMENT_WAIT_FLOOR = 60.0
FRAGMENT_WAIT_CAP = 1800.0
#: Used when neither the source nor the target tier has a time interval (``every``).
FRAGMENT_WAIT_DEFAULT = 600.0
_DATA_RANK = re.compile(r"^__(\d+)_")
#: Most fragment reads (and removals) the coordinator runs at once, whatever the number of ranks.
FRAGMENT_READERS = 32
#: Largest fragment read (checked against the listed size before reading): a rank's records.
FRAGMENT_MAX_BYTES = INTENT_MAX_BYTES
T = TypeVar("T")
R = TypeVar("R")


def _untrusted_view(record: object) -> ItemRecord | None:
    """The typed view of a promoted record read back from a fragment, or None if it lacks a field."""
    try:
        return ItemRecord.from_checked(record)  # type: ignore[arg-type]
    except (KeyError, AttributeError, TypeError):
        return None


def changed_items(new: dict, old: dict) -> list:
    """Items of one data file whose promoted record (``new``) does not describe the source item
    (``old``: the source's records of that file): a byte-for-byte copy keeps every record as it is; a
    re-encoded file keeps every field but the encoding, and the items in the source's order
    (:func:`~dcp_tiered.tiers.promote.fragments.reencode_file`)."""
    olds = {i: record_view(r) for i, r in old.items()}
    news = {i: _untrusted_view(new.get(i)) for i in olds}
    unreadable = [i for i, v in news.items() if v is None]
    if unreadable:
        return unreadable
    if all(news[i].codec == o.codec and news[i].filter_name == o.filter_name for i, o in olds.items()):
        return [i for i in olds if new[i] != old[i]]  # copied byte for byte
    # same item, and no field written as null (to_builtin leaves unset fields out)
    bad = [i for i, o in olds.items() if not o.same_item_as(news[i]) or news[i].to_builtin() != new[i]]
    sized = [i for i, o in olds.items() if o.length]  # empty items hold no bytes: their place does not matter
    by_old = sorted(sized, key=lambda i: olds[i].offset)
    by_new = sorted(sized, key=lambda i: news[i].offset if isinstance(news[i].offset, int) else -1)
    return bad or [a for a, b in zip(by_old, by_new) if a != b]


def copy_with_fragment(src: Storage, dst: Storage, data_file: str, records: list, target: Tier,
                       save_id: str | None = None, cpu: "threading.Semaphore | None" = None) -> int:
    """Copy this rank's ``data_file`` from ``src`` to ``dst`` (re-encoded when the codecs differ), then commit
    its fragment; a target committed with another save id is un-committed first.  Returns the bytes copied."""
    committed_id = committed_save_id(dst)
    if committed_id is not None:
        if save_id and committed_id == save_id:
            return 0  # another process (e.g. one that resumed this intent) promoted this save already
        # an older checkpoint of the same step is being replaced: un-commit it before its
        # data files change, so no .metadata ever describes files that are being rewritten
        uncommit(dst)
    if all(record_view(r).codec == target.codec for _, r in records):
        n = copy_file(src, dst, data_file)
        new_records = records
    else:
        n, new_records = reencode_file(src, dst, data_file, records, target.codec, cpu)
    dst.commit_bytes(fragment_name(data_file), fragment_bytes(save_id, new_records, records))
    return n


def fragment_bytes(save_id: str | None, new_records: list, records: list) -> bytes:
    """A fragment: the promoted records of one data file, the source records its copy used, the save id."""
    return json.dumps({"save_id": save_id, "records": [[index_to_json(i), r] for i, r in new_records],
                       "source": [[index_to_json(i), r] for i, r in records]}).encode()


def in_pool(fn: Callable[[T], R], items: Sequence[T], workers: int = FRAGMENT_READERS) -> list[R]:
    """``[fn(i) for i in items]`` on at most ``workers`` threads (here when there is one item or none)."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="dcp_tiered-fragments") as pool:
        return list(pool.map(fn, items))


#: What a listing says of a file: its size and modification time (None where the backend does not say).
Listed = tuple[int, "float | None"]
_CHANGED = object()  # a fragment that is not what the listing said any more: read it after the next listing


def read_listed_fragment(dst: Storage, name: str, size: int) -> object:
    """The fragment ``name`` of ``dst`` that a listing gave as ``size`` bytes, read in one bounded request.

    None when it is no fragment (empty, over :data:`FRAGMENT_MAX_BYTES`, not JSON, no records, locally
    not a regular file); :data:`_CHANGED` when it is not ``size`` bytes any more (rewritten or removed
    since the listing).  Storage failures raise, as every read."""
    if not 0 < size <= FRAGMENT_MAX_BYTES:
        return None
    try:
        data = dst.read_range(name, 0, size + 1)  # one byte more: a file that grew shows
    except MissingFileError:
        return _CHANGED
    except CorruptCheckpointError:  # locally a link or no regular file: never read through
        return None
    if len(data) != size:
        return _CHANGED
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("records"), list) else None


@dataclass
class FragmentReads:
    """The fragments one promotion's coordinator has read, by name, with what the listing said of each then.

    :meth:`update` reads, on at most :data:`FRAGMENT_READERS` threads, only the fragments a listing
    shows for the first time or changed (another size or time), and forgets those no longer listed: a
    fragment is read once per promotion unless it is rewritten.  A fragment of another save (an older
    attempt) that a rank replaces counts once the listing shows the change; where the backend reports
    no times, such a fragment is read again at each update."""

    docs: dict[str, tuple[Listed, dict | None]] = field(default_factory=dict)

    def doc(self, data_file: str, save_id: str | None) -> dict | None:
        """The fragment of ``data_file`` of save ``save_id`` as read, or None (not read, unreadable, another save)."""
        held = self.docs.get(fragment_name(data_file))
        doc = held[1] if held is not None else None
        return doc if doc is not None and doc.get("save_id") == save_id else None

    def missing(self, files: list[str], save_id: str | None) -> list[str]:
        """Data files whose fragment of this save has not been read (an older attempt's does not count)."""
        return [f for f in files if self.doc(f, save_id) is None]

    def update(self, dst: Storage, listed: dict[str, Listed], files: list[str], save_id: str | None) -> list[DcpTieredError]:
        """Read the fragments of ``files`` that ``listed`` (one listing of ``dst``) shows new or changed;
        returns the storage failures (those fragments are read again next time)."""
        for name in [n for n in self.docs if n not in listed]:
            del self.docs[name]
        todo = [n for n in map(fragment_name, files) if n in listed and self._stale(n, listed[n], save_id)]

        def read(name: str) -> object:
            try:
                return read_listed_fragment(dst, name, listed[name][0])
            except DcpTieredError as exc:
                return exc

        errors = []
        for name, got in zip(todo, in_pool(read, todo)):
            if isinstance(got, DcpTieredError) or got is _CHANGED:
                self.docs.pop(name, None)
                if got is not _CHANGED:
                    errors.append(got)
            else:
                self.docs[name] = (listed[name], got)  # type: ignore[assignment]
        return errors

    def _stale(self, name: str, listed: Listed, save_id: str | None) -> bool:
        held = self.docs.get(name)
        if held is None or held[0] != listed:
            return True
        return listed[1] is None and (held[1] is None or held[1].get("save_id") != save_id)


def commit_from_fragments(src: Storage, dst: Storage, save_id: str | None = None,
                          on_commit: Callable[[Any], None] | None = None, *, source: SourceMetadata | None = None,
                          reads: FragmentReads | None = None) -> int:
    """Commit ``dst``'s ``.metadata`` from the fragments of every data file of ``src`` (of save ``save_id``).

    Raises :class:`~dcp_tiered.errors.PromotionError` when a fragment is malformed or does not describe
    the source's items, and :class:`~dcp_tiered.errors.PromotionIOError` (retried like any storage
    failure) when a fragment is missing or a file has the wrong size: another process promoting the
    same save may not have finished its copy yet.  Returns the bytes of ``.metadata``; ``on_commit``
    receives the committed ``Metadata`` (not called when another process committed this save).

    ``source``: the source's ``.metadata`` as read just before (else read and decoded here); ``reads``:
    the fragments a :class:`FragmentWait` read (only those a listing shows changed since are read
    again).  The target is listed once; its fragments are removed on at most :data:`FRAGMENT_READERS` threads."""
    source = source if source is not None else read_source(src)
    md = source.md
    files = native_files(md.storage_data)
    listed = dst.file_stats()
    present = {name: size for name, (size, _mtime) in listed.items()}
    if save_id and METADATA_FILE in listed and committed_save_id(dst) == save_id:
        return 0  # another process committed this very save (and removed the fragments)
    if save_id and source.save_id != save_id:
        raise PromotionError(f"{src.url} was saved again while being promoted; not committing {dst.url}")
    reads = reads if reads is not None else FragmentReads()
    errors = reads.update(dst, listed, files, save_id)
    if errors:
        raise errors[0]  # a StorageError: retried
    fragments = {f: reads.doc(f, save_id) for f in files}
    missing = [f for f, doc in fragments.items() if doc is None]
    if missing:
        # transient when another process promotes the same save right now: retried (a StorageError)
        raise PromotionIOError(f"{dst.url}: promoted files {missing[:3]} vanished before the commit")
    new_data = {}
    try:
        for f in files:
            for i, r in fragments[f]["records"]:  # type: ignore[index]
                new_data[index_from_json(i)] = builtin_from_json(r)
    except (TypeError, ValueError) as exc:
        raise PromotionError(f"{dst.url}: a promotion fragment is malformed ({exc}); not committing") from None
    if set(new_data) != set(md.storage_data):
        raise PromotionError(f"{dst.url}: promoted records do not match the source checkpoint's items")
    by_file = source.records_by_file()
    # a fragment may re-encode (offsets, sizes, frames, codec) but never change what an item is
    changed = [i.fqn for f in files for i in changed_items(new_data, by_file[f])]
    try:  # the records each copy read (its intent's): exactly the source's records of that file
        for f in files:
            used = {index_from_json(i): builtin_from_json(r) for i, r in fragments[f].get("source", ())}  # type: ignore[union-attr]
            want = by_file[f]
            if "source" in fragments[f] and used != want:  # type: ignore[operator]
                changed += sorted({i.fqn for i in set(used) ^ set(want)} | {i.fqn for i in want if used.get(i) != want[i]})
    except (TypeError, ValueError) as exc:
        raise PromotionError(f"{dst.url}: a promotion fragment is malformed ({exc}); not committing") from None
    if changed:
        raise PromotionError(f"{dst.url}: promoted records of {changed[:3]} do not describe the source checkpoint's "
                             "items (a damaged or crafted promotion fragment); not committing")
    for f, size in expected_sizes(new_data.values()).items():
        if present.get(f, -1) != size:
            # transient when another process is still copying the same file: retried (a StorageError)
            raise PromotionIOError(f"{dst.url_of(f)} has {present.get(f)} bytes, expected {size}")
    out = copy.copy(md)  # the source's, shared with the promotions to other tiers: left as it is
    out.storage_data = new_data
    if md.storage_meta is not None:
        out.storage_meta = copy.copy(md.storage_meta)
        out.storage_meta.checkpoint_id = dst.url
    dst.commit_bytes(METADATA_FILE, encode_metadata(out))
    if on_commit is not None:
        on_commit(out)

    def remove(f: str) -> None:
        try:
            dst.remove(fragment_name(f))
        except DcpTieredError as exc:  # cleanup only: the target is committed
            log.warning("could not remove promotion fragment %s: %s", dst.url_of(fragment_name(f)), exc)

    in_pool(remove, files)
    return source.size


def fragment_wait_bound(source: Tier, target: Tier, own_copy_s: float = 0.0) -> float:
    """How long a promotion's commit waits, without progress, for the other ranks' promoted files.

    Of the order of the save interval: the target tier's ``every`` (else the source's, else
    :data:`FRAGMENT_WAIT_DEFAULT`), and at least three times as long as this rank's own copy of
    its data file took (ranks copy files of similar sizes at the same time); clamped to
    [:data:`FRAGMENT_WAIT_FLOOR`, :data:`FRAGMENT_WAIT_CAP`] (1 to 30 minutes).  Any new or
    growing file in the target directory counts as progress and restarts the wait.
    """
    interval = target.every or source.every or FRAGMENT_WAIT_DEFAULT
    return min(FRAGMENT_WAIT_CAP, max(FRAGMENT_WAIT_FLOOR, interval, 3.0 * own_copy_s))


@dataclass
class FragmentWait:
    """The coordinator's wait for the fragments of every data file (``files``) of one save in one target.

    :meth:`poll` lists the target; a new or growing file there counts as progress (the other
    ranks are getting there), and the wait gives up only after ``bound`` seconds without any."""

    files: list[str]
    save_id: str | None
    start: float
    progress: float = 0.0
    seen: dict[str, int] | None = None
    missing: list[str] = field(default_factory=list)
    reads: FragmentReads = field(default_factory=FragmentReads)
    #: The last listing showed a ``.metadata`` in the target (another process may have committed).
    listed_metadata: bool = False

    def poll(self, dst: Storage, now: float, what: str) -> list[str]:
        """The data files whose fragment of this save is still missing in ``dst`` (listing trouble: as before).

        One listing of ``dst``; the fragments it shows new or changed are read (:class:`FragmentReads`)."""
        try:
            listed = dst.file_stats()
        except DcpTieredError as exc:  # storage trouble: keep polling within the bound
            log.warning("%s: cannot list the target (%s); trying again", what, exc)
            return self.missing
        errors = self.reads.update(dst, listed, self.files, self.save_id)
        if errors:
            log.warning("%s: cannot read %d promotion fragment(s) (%s); trying again", what, len(errors), errors[0])
        self.missing = self.reads.missing(self.files, self.save_id)
        self.listed_metadata = METADATA_FILE in listed
        present = {name: size for name, (size, _mtime) in listed.items()}
        if present != self.seen:
            self.seen, self.progress = present, now
        return self.missing

    def ranks(self) -> list[str]:
        """The ranks whose files are missing (from the data file names ``__{rank}_*``)."""
        return sorted({m.group(1) if (m := _DATA_RANK.match(f)) else "?" for f in self.missing})

    def stalled(self, now: float, bound: float) -> bool:
        return now - self.progress >= bound

    def describe(self, now: float, bound: float) -> str:
        return (f"waiting {now - self.start:.0f}s (bound {bound:.0f}s without progress) for {len(self.missing)} "
                f"file(s) of rank(s) {', '.join(self.ranks())}: {self.missing[:4]}")


COPY_CHUNK = 8 << 20


def copy_file(src: Storage, dst: Storage, name: str) -> int:
    """Stream ``name`` from ``src`` to ``dst`` in bounded chunks; return the bytes copied."""
    size = src.size(name)
    buf = bytearray(min(COPY_CHUNK, max(size, 1)))
    done = 0
    with dst.open_write(name) as f:
        while done < size:
            n = src.read_range_into(name, done, memoryview(buf)[: min(len(buf), size - done)])
            if n == 0:
                raise CorruptCheckpointError(f"{src.url_of(name)} shrank while being copied ({done} of {size} bytes)")
            f.write(memoryview(buf)[:n])
            done += n
    return done


def reencode_file(src: Storage, dst: Storage, name: str, records: list[tuple[object, dict]], codec: str,
                  cpu: "threading.Semaphore | None" = None) -> tuple[int, list[tuple[object, dict]]]:
    """Decode every item of ``name`` (verifying checksums) and write it re-encoded with ``codec``.

    ``cpu`` (the background CPU budget) is held around each frame's decode and encode only, so
    that re-encodes for several tiers never run more coders at once than it allows, while reads
    and writes of a stalled tier hold no slot.

    ``records`` are validated native records (plain builtins) of ``name``.  Returns the bytes
    written and the new records (same keys, new offsets/lengths/frames), as plain builtins.
    """
    out_records = []
    offset = 0
    target = get_codec(codec)
    with dst.open_write(name) as f:
        for key, rec in sorted(((k, record_view(r)) for k, r in records), key=lambda kr: kr[1].offset):
            old = FrameCodec(rec.codec, rec.filter_name, rec.itemsize)
            new_filter = rec.filter_name if target.compresses else FILTER_NONE
            new = FrameCodec(target, new_filter, rec.itemsize)
            frames, sums = [], []
            for i, at, stored_len, s, e in rec.frame_slices():
                stored = src.read_range(rec.file, at, at + stored_len)
                if len(stored) != stored_len or not verify_frame(stored, rec.frame_sums[i]):
                    raise CorruptCheckpointError(f"frame {i} of {key!r} in {src.url_of(name)} fails its checksum; not promoting it")
                raw = np.empty(e - s, dtype=np.uint8)
                with cpu or contextlib.nullcontext():
                    old.decode(stored, raw)
                    enc = new.encode(raw)
                write_pieces(f, enc.pieces)
                frames.append(enc.stored_len)
                sums.append(enc.digest)
            moved = rec.reencoded(target.spec, new_filter, offset, frames, sums)
            out_records.append((key, moved.to_builtin()))
            offset += moved.length
    return offset, out_records
