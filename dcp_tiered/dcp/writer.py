"""``CompressedWriter``: a DCP ``StorageWriter`` that compresses every item frame by frame.

Each rank writes one data file ``__{rank}_0.distcp``.  Frames are compressed on a thread
pool (zstd and lz4 release the GIL) while the calling thread writes finished frames in
order, so compression and I/O overlap.  ``.metadata`` is committed last, atomically.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_tiered.dcp.protocol import UrlCheckpointId, completed
from dcp_tiered.thread_priority import lower_thread_priority, run_lowered, yield_to_caller
from dcp_tiered.codecs import CHECKSUM_ALGORITHM, DEFAULT_FRAME_SIZE, FrameCodec, filter_for, get_codec
from dcp_tiered.codecs.frames import MAX_FRAME_SIZE, MIN_FRAME_SIZE, record_frame_size  # noqa: F401  (importable from here)
from dcp_tiered.dcp.frame_pipeline import GatedPool, ItemSource, encode_error, write_items
from dcp_tiered.dcp.dropin import check_stock_writer_args, refuse_positional, storage_options_with, writer_threads
from dcp_tiered.dcp.format import (
    DATA_SUFFIX, FORMAT_VERSION, KIND_BYTES, KIND_TENSOR, MAX_DIM, MAX_DIMS, MAX_OBJECT_BYTES, METADATA_FILE, OBJECT_FIELD,
    ItemRecord, dtype_name,
    expected_sizes,
)
from dcp_tiered.dcp.gc_pause import gc_paused
from dcp_tiered.dcp.item_table import BroadcastItems
from dcp_tiered.dcp.metadata_io import encode_metadata
from dcp_tiered.dcp.record_table import PackedRecords
from dcp_tiered.dcp.objects import SafeGlobals, encode_object, normalize_safe_globals
from dcp_tiered.dcp.save_stats import SaveStats
from dcp_tiered.dcp.tensors import tensor_bytes
from dcp_tiered.checks import check_count, check_frame_size  # noqa: F401  (importable from here, as before)
from dcp_tiered.errors import (CheckpointExistsError, ConfigError, DcpTieredError, SaveError, StorageError,
                               UnsupportedFormatError)
from dcp_tiered.names import LOCK_FILE, data_file, rank_prefix
from dcp_tiered.ranks import default_threads
from dcp_tiered.storage import FileLock, Storage

_FILTER_BYTES = filter_for(False, 1)



def exists_error(url: str, busy: bool = False) -> CheckpointExistsError:
    """The refusal of a save whose target is committed (or being written by another save)."""
    if busy:
        return CheckpointExistsError(
            f"Checkpoint already exists or is being written at {url}: another save holds {url}/{LOCK_FILE}; "
            "save to a new path, or wait for it and pass overwrite=True to replace it"
        )
    return CheckpointExistsError(
        f"Checkpoint already exists at {url} (overwrite=False); pass overwrite=True to replace it or save to a new "
        "path (unlike stock FileSystemWriter, CompressedWriter refuses by default)"
    )


@dataclasses.dataclass(frozen=True)
class RankFilePrefix:
    """The ``storage_data`` of a rank's ``SavePlan``: its data file is ``{prefix}0.distcp``.

    ``CompressedWriter.prepare_global_plan`` gives rank ``i`` the prefix ``__{i}_``.  A writer
    that wraps ``CompressedWriter`` and plans the save itself (``TieredWriter``) sets it on the
    plan before calling ``prepare_local_plan``, which then keeps it, to choose the rank's data
    file name.  Plain builtins only: the plan travels between ranks.
    """

    prefix: str


def claim_checkpoint(storage: Storage, overwrite: bool) -> "tuple[FileLock, bool]":
    """Claim ``storage`` for one save (coordinator, before any data is written).

    Locally an exclusive lock on ``LOCK_FILE`` (held until the commit; the kernel drops it if
    the process dies) makes a second concurrent save fail here.  Returns the lock and whether a
    committed checkpoint is being replaced; raises :class:`CheckpointExistsError` when one is
    committed and ``overwrite`` is off, or when another save holds the lock.
    """
    if not overwrite and storage.exists(METADATA_FILE):
        raise exists_error(storage.url)  # refused before a lock file is made: a committed checkpoint keeps none
    lock = storage.try_lock(LOCK_FILE)
    if lock is None:
        raise exists_error(storage.url, busy=True)
    try:
        replacing = storage.exists(METADATA_FILE)
        if replacing and not overwrite:
            raise exists_error(storage.url)
    except BaseException:
        lock.release()
        raise
    return lock, replacing


def unique_tag(storage: Storage) -> str:
    """Part of the data file names unique to one save, where two saves could race on one name.

    Object stores have no locks: each save writes its own data files and only the exclusive
    commit of ``.metadata`` decides which one wins, so the loser never overwrites the winner's
    data.  Local directories are locked instead and keep the plain names.
    """
    return f"{uuid.uuid4().hex[:12]}_" if storage.is_object_store else ""


def uncommit(storage: Storage) -> bool:
    """Un-commit the checkpoint in ``storage``: remove its ``.metadata``, before any of its files changes
    or goes, so that a ``.metadata`` never describes files being rewritten or deleted.  Whether one was there."""
    if not storage.exists(METADATA_FILE):
        return False
    storage.remove(METADATA_FILE)
    return True


def commit_metadata(storage: Storage, data: bytes, overwrite: bool, own_files: "collections.abc.Iterable[str]") -> None:
    """Commit ``.metadata``; without ``overwrite`` only if none exists (atomically), else
    remove this save's own uniquely named data files and raise :class:`CheckpointExistsError`."""
    if storage.commit_bytes(METADATA_FILE, data, exclusive=not overwrite):
        return
    if storage.is_object_store:
        for name in own_files:
            storage.remove(name)
    raise exists_error(storage.url)


#: CompressedWriter's own keywords: a near miss among the fsspec keywords is a typo (TypeError).
_WRITER_ARGS = ("codec", "storage_options", "byte_group", "frame_size", "threads", "overwrite", "sync_files",
                "check_sizes", "nice", "cpu_slots", "safe_globals", "save_id", "thread_count", "single_file_per_rank",
                "per_thread_copy_ahead", "cache_staged_state_dict")


def _check_readable_shape(item: WriteItem, data: torch.Tensor) -> None:
    """Refuse a tensor whose record readers would refuse: too many dimensions, a dimension past their limit,
    or (a planner's doing) a shape other than its chunk's."""
    fqn, shape = item.index.fqn, tuple(data.shape)
    if len(shape) > MAX_DIMS:
        raise SaveError(f"tensor {fqn!r} has {len(shape)} dimensions, over the {MAX_DIMS} readers accept; nothing "
                        "was committed. Reshape it (for instance flatten it) before the save")
    if any(d >= MAX_DIM for d in shape):
        raise SaveError(f"tensor {fqn!r} has a dimension of {max(shape)}, at or over the {MAX_DIM} readers accept; "
                        "nothing was committed. Reshape it before the save")
    chunk = item.tensor_data.chunk.sizes if item.tensor_data is not None else None
    if chunk is not None and tuple(chunk) != shape:
        raise SaveError(f"the save planner resolved {fqn!r} to a tensor of shape {shape} for its chunk of shape "
                        f"{tuple(chunk)}; nothing was committed. resolve_data must return each chunk in its own shape")


class CompressedWriter(UrlCheckpointId, StorageWriter):
    """Write a DCP checkpoint with per-frame compression to any fsspec URL or local path.

    Args:
        path: checkpoint directory: a local path or any fsspec URL (``s3://bucket/run/step_100``).
        codec: ``"none"``, ``"lz4"``, ``"zstd"``, ``"zstd:N"``, or the spec of a codec registered
            with :func:`~dcp_tiered.codecs.register_codec` (see docs/architecture.md).
        storage_options: passed to fsspec (``endpoint_url``, credentials, ...).
        byte_group: regroup float bytes into planes before compressing (on by default).
        frame_size: raw bytes per frame; frames are compressed in parallel and read independently.
        threads: compression threads (default: cores of this node divided by its ranks).
        overwrite: replace a committed checkpoint at ``path`` instead of refusing.
        sync_files: fsync data files on local filesystems before committing.
        check_sizes: each rank checks that its data file, once written, has the size its records
            need, as the storage reports it (a failure fails the save before anything is committed).
        nice: encode and write on threads of their own at this lower CPU priority, relative to
            the process's main thread; the calling thread keeps its priority
            (``TieredCheckpointer`` uses it for background saves, so training keeps the cores).
        cpu_slots: a semaphore of coder slots shared with other background work: each frame's
            encode holds one (``TieredCheckpointer`` shares its ``background_threads`` budget
            between async saves and promotion re-encodes this way).
        safe_globals: classes/functions that non-tensor values need beyond ``torch.load``'s
            ``weights_only`` allow-list (numpy values: :func:`~dcp_tiered.dcp.objects.numpy_safe_globals`),
            as for ``torch.serialization.add_safe_globals``.  Every non-tensor item is loaded back
            at save time under them: one that a reader would refuse raises
            :class:`~dcp_tiered.errors.UnsafeObjectError`, naming the key and the missing globals.
            Readers need the same list.  ``io.BytesIO`` values are stored as raw bytes.
        save_id: the id the commit carries (``.metadata``'s ``storage_meta.save_id``), which
            tells two saves of one path apart.  Default: a new random id per save.  A wrapper
            that coordinates several writers for one save passes them one id; a fixed id is
            kept by every save of this writer.

    Stock ``FileSystemWriter``/``FsspecWriter`` keywords, for drop-in swaps (everything after
    ``path`` is keyword-only; a positional argument is a TypeError naming the keyword form):

        thread_count: stock's name for ``threads`` (both, with different values: ConfigError).
        single_file_per_rank: ``True`` only (one data file per rank is what this writer
            writes); ``False`` is a ConfigError.
        per_thread_copy_ahead: accepted and ignored: each frame is copied to host memory
            just before it is encoded, so the copy is bounded without it.
        cache_staged_state_dict: accepted and ignored: for cached staging with
            ``dcp.async_save`` pass it an ``async_stager``.
        **fsspec_options: fsspec storage options given as keywords, as ``FsspecWriter`` takes
            them (merged with ``storage_options``; URLs only).

    Unlike stock, ``overwrite`` defaults to False: saving over a committed checkpoint raises
    :class:`CheckpointExistsError` (also a ``RuntimeError``, "Checkpoint already exists").
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *args: Any,
        codec: str = "zstd",
        storage_options: dict[str, Any] | None = None,
        byte_group: bool = True,
        frame_size: int = DEFAULT_FRAME_SIZE,
        threads: int | None = None,
        overwrite: bool = False,
        sync_files: bool = True,
        check_sizes: bool = True,
        nice: int | None = None,
        cpu_slots: threading.Semaphore | None = None,
        safe_globals: SafeGlobals | None = None,
        save_id: str | None = None,
        thread_count: int | None = None,
        single_file_per_rank: bool = True,
        per_thread_copy_ahead: int | None = None,
        cache_staged_state_dict: bool = False,
        **fsspec_options: Any,
    ) -> None:
        super().__init__()
        refuse_positional("CompressedWriter", args, "CompressedWriter(path, codec='zstd', threads=4)")
        storage_options = storage_options_with("CompressedWriter", path, storage_options, fsspec_options, _WRITER_ARGS)
        threads = writer_threads(threads, thread_count)
        check_stock_writer_args(single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict)
        if save_id is not None and (not isinstance(save_id, str) or not save_id):
            raise ConfigError(f"save_id must be a non-empty string or None, got {save_id!r}")
        self._fixed_save_id = save_id
        self.codec = str(get_codec(codec))
        check_frame_size(frame_size)
        check_count(nice, "nice", 0, 19, optional=True)
        if cpu_slots is not None and not (hasattr(cpu_slots, "acquire") and hasattr(cpu_slots, "release")):
            raise ConfigError(f"cpu_slots must be a threading.Semaphore or None, got {cpu_slots!r}")
        for flag, value in (("byte_group", byte_group), ("overwrite", overwrite), ("sync_files", sync_files),
                            ("check_sizes", check_sizes)):
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} must be True or False, got {value!r}")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"path must be a local path or fsspec URL, got {path!r}")
        self.storage_options = dict(storage_options or {})
        self.byte_group = byte_group
        self.frame_size = frame_size
        self.threads = threads
        self.overwrite = overwrite
        self.sync_files = sync_files
        self.check_sizes = check_sizes
        self.nice = nice
        self.cpu_slots = cpu_slots
        self.safe_globals = normalize_safe_globals(safe_globals, "CompressedWriter")
        self.storage = Storage(path, self.storage_options)
        self.storage.check_reachable()
        if self.storage.is_local and os.path.exists(self.storage.root) and not os.path.isdir(self.storage.root):
            raise ConfigError(f"path {self.storage.url} exists and is not a directory")
        self._lock: FileLock | None = None
        self.is_coordinator = False
        self.rank: int | None = None
        self.save_id = save_id or uuid.uuid4().hex
        self._replacing = False
        #: Sizes and ratio of the last checkpoint this writer committed (coordinator only).
        self.last_stats: SaveStats | None = None

    # -- DCP protocol ---------------------------------------------------------------

    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        if checkpoint_id:
            self.storage = Storage(checkpoint_id, self.storage_options)
        self.save_id = self._fixed_save_id or uuid.uuid4().hex
        self._replacing = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            # Every rank would then run finish() and commit a .metadata of its own items only.
            raise ConfigError(
                "CompressedWriter needs DCP's collectives (use_collectives=True): without them each rank "
                "would commit a .metadata describing only its own items"
            )
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self._release()

    def _release(self, committed: bool = False) -> None:
        if self._lock is not None:
            self._lock.release(unlink=committed)
            self._lock = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.storage.makedirs()
        if self.storage.exists(METADATA_FILE):
            if not self.overwrite:
                raise exists_error(self.storage.url)
            self._replacing = True
        if self.rank is not None and plan.storage_data is None:
            plan = dataclasses.replace(plan, storage_data=RankFilePrefix(rank_prefix(self.rank)))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes data: a refusal here fails every rank.
        self._lock, self._replacing = claim_checkpoint(self.storage, self.overwrite)
        if self._replacing:
            # Un-commit before any rank writes data, so the old .metadata can never describe
            # files that are being replaced.
            uncommit(self.storage)
        tag = unique_tag(self.storage)
        prefixes = [p.storage_data.prefix if isinstance(p.storage_data, RankFilePrefix) else rank_prefix(i) for i, p in enumerate(plans)]
        return [dataclasses.replace(p, storage_data=RankFilePrefix(prefix + tag)) for p, prefix in zip(plans, prefixes)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix if plan.storage_data is not None else rank_prefix(0)
        file_name = data_file(prefix)
        def write() -> list[WriteResult]:
            try:
                results = self._write_file(file_name, plan.items, planner)
                if self.check_sizes:
                    self._check_written(results)
                return results
            except BaseException:
                # This save fails everywhere (DCP gathers the failure): let a retry claim the path.
                # A failure on another rank leaves the coordinator's lock until this writer is
                # reset, set up again or collected.
                self._release()
                raise

        return completed(write)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with gc_paused():
            storage_md = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
            # what DCP broadcasts to every rank: the items and the records as their tables
            metadata.state_dict_metadata = BroadcastItems.of(metadata.state_dict_metadata)
            records = metadata.storage_data = PackedRecords.of(metadata.state_dict_metadata, storage_md)
            missing = records.missing()
            if missing is not None:
                raise UnsupportedFormatError(
                    f"{self.storage.url}/{METADATA_FILE}: {missing}; readers would refuse this checkpoint, nothing "
                    "was committed. Every chunk the save planner names must be written by some rank, once")
            inconsistent = records.inconsistent(self.storage.url)
            if inconsistent is not None:
                raise UnsupportedFormatError(
                    f"{inconsistent}; readers would refuse this checkpoint, nothing was committed. The save "
                    "planner's metadata must give each tensor the dtype and chunk shapes its ranks wrote")
            # each rank checked its own files (write_data); sizes and stats over the table's columns
            expected, stats = records.totals()
            records.stats = stats
            metadata.storage_meta = self._storage_meta()
            encoded = encode_metadata(metadata)
        committed = False
        try:
            commit_metadata(self.storage, encoded, self.overwrite, expected)
            committed = True
        finally:
            # The lock file goes only after a commit: a save that failed leaves it (unlocked) so
            # that a save which opened it meanwhile and one that would create it again never both run.
            self._release(committed=committed)
        self.last_stats = stats
        if self._replacing:
            for name in self.storage.listdir():
                if name.endswith(DATA_SUFFIX) and name not in expected:
                    self.storage.remove(name)

    def storage_meta(self) -> StorageMeta | None:
        yield_to_caller()  # DCP's first call of every save: a caller waiting for the GIL gets it now
        return self._storage_meta()

    def _storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.storage.url, save_id=self.save_id)

    def _check_written(self, results: list[WriteResult]) -> None:
        """This rank's data file, once written, has the size its records need, as the storage sees it: a
        check of every rank's own file (the coordinator stat-ing each in turn would keep every rank waiting)."""
        for name, size in expected_sizes(r.storage_data for r in results).items():
            actual = self.storage.size(name)
            if actual != size:
                raise StorageError(
                    f"data file {self.storage.url_of(name)} has {actual} bytes once written, expected {size}; "
                    "the save did not complete, nothing was committed"
                )

    # -- encoding -------------------------------------------------------------------

    def _checked_source(self, item: WriteItem, planner: SavePlanner, group: bool, where: str) -> ItemSource:
        """:meth:`_item_source`, whose failures (a device copy, an allocation) name the item, not the file's write."""
        try:
            return self._item_source(item, planner, group)
        except DcpTieredError:
            raise
        except Exception as exc:
            raise encode_error(item.index.fqn, where, exc) from exc

    def _item_source(self, item: WriteItem, planner: SavePlanner, group: bool) -> ItemSource:
        """Resolve one item to its raw bytes and its :class:`ItemRecord` fields (``group``: byte-group floats)."""
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw, extra = encode_object(item, data, planner, self.safe_globals, self.storage.url)
            if len(raw) > MAX_OBJECT_BYTES:
                raise SaveError(f"non-tensor item {item.index.fqn!r} is {len(raw)} bytes, over the {MAX_OBJECT_BYTES} "
                                "readers accept by default; nothing was committed. Save large data as a tensor "
                                "(torch.frombuffer(bytearray(data), dtype=torch.uint8)) or in pieces")
            return ItemSource(item, np.frombuffer(raw, dtype=np.uint8), raw, {
                "kind": KIND_BYTES, "itemsize": 1, "filter_name": _FILTER_BYTES, "object_kind": extra.get(OBJECT_FIELD)})
        if not isinstance(data, torch.Tensor):
            raise ConfigError(f"planner resolved tensor item {item.index.fqn!r} to {type(data).__name__}, not a tensor")
        _check_readable_shape(item, data)
        arr, keep = tensor_bytes(data, self.frame_size)
        dtype = keep.dtype
        name = dtype_name(dtype)
        orig = item.tensor_data.properties.dtype if item.tensor_data is not None else dtype
        size = keep.element_size()
        return ItemSource(item, arr, keep, {
            "kind": KIND_TENSOR,
            "itemsize": size,
            "filter_name": filter_for(dtype.is_floating_point, size, group),
            "dtype": name,
            "orig_dtype": name if orig is dtype else dtype_name(orig),
            "shape": tuple(keep.shape),
        })

    def _write_file(self, file_name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        # with ``nice``, on a lowered thread of its own: the caller may be the training loop
        return run_lowered(self.nice, lambda: self._encode_and_write(file_name, items, planner))

    def _encode_and_write(self, file_name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        threads = self.threads or default_threads()
        codecs: dict[tuple[str, int], FrameCodec] = {}
        group = self.byte_group and get_codec(self.codec).compresses
        # Bytes items first: they are small and let tensor frames stream without gaps.
        ordered = sorted(items, key=lambda it: 0 if it.type == WriteItemType.BYTE_IO else 1)
        results: list[WriteResult] = []

        def codec_for(fields: dict) -> FrameCodec:
            key = (fields["filter_name"], fields["itemsize"])
            fc = codecs.get(key)
            return fc if fc is not None else codecs.setdefault(key, FrameCodec(self.codec, *key))

        def on_item(src: ItemSource, start: int, lengths: list, sums: list) -> None:
            results.append(self._result(file_name, src, start, lengths, sums))

        with self.storage.open_write(file_name, durable=self.sync_files) as f, ThreadPoolExecutor(
            threads, thread_name_prefix="dcp_tiered-encode", initializer=lower_thread_priority, initargs=(self.nice,)
        ) as pool:
            where = self.storage.url_of(file_name)
            sources = (self._checked_source(item, planner, group, where) for item in ordered)
            coders = GatedPool(pool, self.cpu_slots) if self.cpu_slots is not None else pool
            # threads + 2 frames submitted and not written: each encoding one holds its planes and their
            # compressed copy, so the save's extra memory is (2 x threads + 2) frames
            write_items(f, sources, codec_for, self.frame_size, coders, (threads + 2) * self.frame_size, on_item, where)
        return results

    def _result(self, file_name: str, src: ItemSource, start: int, lengths: list, sums: list) -> WriteResult:
        record = ItemRecord(
            version=FORMAT_VERSION, file=file_name, offset=start, length=sum(lengths), raw_length=src.arr.nbytes,
            codec=self.codec, frame_lengths=tuple(lengths), frame_sums=tuple(sums),
            checksum=CHECKSUM_ALGORITHM, **src.fields,
        )
        return WriteResult(index=src.item.index, size_in_bytes=record.length, storage_data=record.to_builtin())
