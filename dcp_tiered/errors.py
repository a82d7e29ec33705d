"""The error hierarchy of dcp_tiered.

Every error raised on purpose by this package derives from :class:`DcpTieredError` and
also from the builtin that fits, so ``except FileNotFoundError`` keeps working.  Messages
name the file, tier and tensor key where known, and say what to do.
"""

from __future__ import annotations


class DcpTieredError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(DcpTieredError, ValueError):
    """An argument or configuration value is invalid (raised at construction)."""


class CodecError(ConfigError):
    """Unknown codec name or level in a codec spec string."""


class StorageError(DcpTieredError, OSError):
    """A storage operation failed (unreachable URL, missing bucket, I/O error, full disk)."""


class CheckpointNotFoundError(DcpTieredError, FileNotFoundError):
    """The path holds no committed checkpoint (no ``.metadata``) or a file it names is missing."""


class CheckpointExistsError(DcpTieredError, FileExistsError, RuntimeError):
    """A committed checkpoint already exists where a save was asked, and ``overwrite`` is off.

    Also a ``RuntimeError``, as stock DCP's refusal ("Checkpoint already exists"), so code written
    for ``FileSystemWriter(overwrite=False)`` catches it unchanged."""


class CorruptCheckpointError(DcpTieredError, ValueError):
    """Stored bytes fail verification: checksum mismatch, truncation, or an undecodable frame."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint tried to run code, reference a disallowed class, or escape its directory."""


class UnsupportedFormatError(DcpTieredError, ValueError):
    """The checkpoint was written in a format version or transform this version cannot read."""


class PromotionError(DcpTieredError, RuntimeError):
    """A background promotion to a slower tier failed (after the retries of its storage steps), or work
    was still pending when a ``wait``/``close`` timeout ran out; raised at ``wait()``/``close()``.

    Not an ``OSError``: a failed check of the promotion protocol is not retried as I/O.  When every
    failure it reports is a storage failure it is a :class:`PromotionIOError`, which is one."""


class SaveError(DcpTieredError, RuntimeError):
    """A checkpoint save (possibly in the background) failed; raised at the next call that can report it."""


class SaveMemoryError(SaveError, MemoryError):
    """A save ran out of host or device memory while it read or encoded a tensor (a :class:`SaveError`
    that is also a ``MemoryError``)."""


class UnsafeObjectError(ConfigError):
    """A non-tensor value would be refused on restore (``weights_only``); raised at save, naming the opt-in."""


class RestoreError(DcpTieredError, RuntimeError):
    """Committed checkpoints exist but none could be restored; ``candidates`` lists each
    ``(tier, step, reason)`` that was rejected, in the order they were considered."""

    def __init__(self, message: str, candidates: "list[tuple[str, int, str]] | None" = None) -> None:
        super().__init__(message)
        self.candidates = list(candidates or [])

    def __reduce__(self):  # picklable across processes with its candidates
        return (type(self), (str(self), self.candidates))


class MissingFileError(StorageError, FileNotFoundError):
    """A file that should exist in storage does not."""


class PromotionIOError(PromotionError, StorageError):
    """A :class:`PromotionError` whose every failure is a storage failure (unreachable URL, I/O error, full
    disk) that outlasted its retries; also an ``OSError``, with the first failure as ``__cause__``."""


class LeaderLoadError(DcpTieredError, RuntimeError):
    """Raised on the receivers of a ``load_and_broadcast`` group whose leader failed to load
    (its error is in the message)."""


class MemoryBudgetError(StorageError):
    """A save to a memory tier (``/dev/shm``, tmpfs) would not fit its ``memory_budget`` or the free RAM;
    raised before anything is written.  ``tier``, ``needed`` (bytes with what the tier holds) and ``budget``."""

    def __init__(self, message: str, tier: str = "", needed: int = 0, budget: "int | None" = None) -> None:
        super().__init__(message)
        self.tier, self.needed, self.budget = tier, needed, budget

    def __str__(self) -> str:  # OSError's str of one argument is the argument
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # picklable across processes (DCP gathers a rank's failure) with its fields
        return (type(self), (str(self), self.tier, self.needed, self.budget))


class MetadataTooLargeError(DcpTieredError, ValueError):
    """A save whose ``.metadata`` would hold more records or bytes than readers accept
    (``MAX_METADATA_RECORDS``, ``MAX_METADATA_BYTES``): refused before the commit, so no save ever
    commits a checkpoint that no reader could open."""


class ReplicationError(DcpTieredError, RuntimeError):
    """Background replication of a node-local tier to peer ranks failed (a peer died, a timeout, a
    digest mismatch); raised at ``wait()``/``close()``, never into training.  The step stays usable
    from its own node's files; a lost node then falls back to another step or tier."""
