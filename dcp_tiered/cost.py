"""Storage cost model: stored bytes x price per GB-month x checkpoints kept, per tier.

Pure functions over plain values (no I/O, no torch), so the numbers are tested exactly.

A tier's retention costs the real size of each checkpoint it keeps (:func:`kept_bytes`): with
``optimizer_every`` the kept checkpoints differ in size several fold, so ``keep`` times the newest
one would be off by as much.  :func:`cost_from_listing` prices a tier listing that way.

Default prices, in USD per GB-month (GB = 2**30 bytes, as cloud bills count):

=============== ======= ==========================================================
kind            price   what it stands for
=============== ======= ==========================================================
``object``      0.023   object storage, standard class (S3, GCS, Azure Blob hot)
``shared``      0.14    shared parallel/network filesystem (FSx for Lustre, Filestore)
``local``       0.08    node-local block storage (provisioned SSD, e.g. gp3)
=============== ======= ==========================================================

A tier's kind comes from its URL (an object-store scheme is ``object``) and otherwise
from its name (a tier named ``durable``, ``object``, ``archive`` or ``cold`` is
``object``; ``shared``/``fsx``/``nfs``/``lustre`` in the name or URL is ``shared``;
anything else ``local``).  Every price is configurable per tier name or per kind.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

GB = 1 << 30
HOURS_PER_MONTH = 730.0

DEFAULT_PRICES: dict[str, float] = {"object": 0.023, "shared": 0.14, "local": 0.08}
OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2", "oss")
_SHARED_WORDS = ("shared", "fsx", "nfs", "lustre", "gpfs", "filestore", "efs")
_OBJECT_NAMES = ("durable", "object", "archive", "cold", "s3", "gcs", "blob")


def tier_kind(name: str, url: str = "") -> str:
    """``"object"``, ``"shared"`` or ``"local"`` for a tier, from its URL scheme and name."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in OBJECT_SCHEMES:
        return "object"
    if name.lower() in _OBJECT_NAMES:
        return "object"
    low = f"{name} {url}".lower()
    if any(w in low for w in _SHARED_WORDS):
        return "shared"
    return "local"


def price_for(name: str, url: str = "", prices: Mapping[str, float] | None = None) -> float:
    """USD per GB-month for a tier: ``prices[name]``, else ``prices[kind]``, else the default for its kind."""
    prices = dict(prices or {})
    if name in prices:
        return float(prices[name])
    kind = tier_kind(name, url)
    return float(prices.get(kind, DEFAULT_PRICES[kind]))


def monthly_cost(stored_bytes: float, price_gb_month: float, kept: int = 1) -> float:
    """USD per month to keep ``kept`` checkpoints of ``stored_bytes`` each at ``price_gb_month``."""
    if stored_bytes < 0 or price_gb_month < 0 or kept < 0:
        raise ValueError("stored_bytes, price and kept must not be negative")
    return stored_bytes / GB * price_gb_month * kept


def kept_bytes(sizes: Iterable[int], keep: int, full: Iterable[bool] | None = None) -> int:
    """Bytes that ``keep`` kept checkpoints take, from the sizes of the checkpoints a tier holds, newest first.

    The newest ``keep`` sizes are summed as they are; while the tier holds fewer than ``keep``, each
    missing one is projected at the mean of those it holds (0 when it holds none).  ``full`` (one flag
    per size: the checkpoint holds the optimizer state) applies retention's other rule: when none of
    the newest ``keep`` is full, the newest full one beyond them is kept too, and counted."""
    if keep < 0:
        raise ValueError("keep must not be negative")
    held = list(sizes)
    kept = held[:keep]
    if any(s < 0 for s in held):
        raise ValueError("checkpoint sizes must not be negative")
    if not kept:
        return 0
    extra = 0
    flags = list(full) if full is not None else []
    if flags and not any(flags[:keep]):
        extra = next((s for s, f in zip(held[keep:], flags[keep:]) if f), 0)
    return sum(kept) + round((keep - len(kept)) * sum(kept) / len(kept)) + extra


@dataclass(frozen=True)
class TierUsage:
    """What one tier holds: per-checkpoint stored bytes, the fp32 uncompressed size, how many are kept.

    With ``sizes`` (stored bytes of each checkpoint the tier holds, newest first) the cost sums
    those real sizes (:func:`kept_bytes`, with ``full``: which of them hold the optimizer state)
    instead of ``keep`` x ``stored_bytes``; ``fp32_sizes`` does the same for the fp32 comparison.
    ``fp32_bytes`` None: unknown (no torch to read the metadata), and so are the fp32 cost and saving."""

    name: str
    stored_bytes: int  # of one checkpoint, as stored (compressed, maybe downcast)
    fp32_bytes: int | None  # the same state uncompressed with every float tensor in fp32
    keep: int = 1
    url: str = ""
    sizes: tuple[int, ...] = ()
    fp32_sizes: tuple[int, ...] = ()
    full: tuple[bool, ...] | None = None

    def kept_stored_bytes(self) -> int:
        """Stored bytes of the retention: the real sizes when known, else ``keep`` x ``stored_bytes``."""
        return kept_bytes(self.sizes, self.keep, self.full) if self.sizes else self.stored_bytes * self.keep

    def kept_fp32_bytes(self) -> int | None:
        if self.fp32_bytes is None:
            return None
        return kept_bytes(self.fp32_sizes, self.keep) if self.fp32_sizes else self.fp32_bytes * self.keep


@dataclass(frozen=True)
class TierCost:
    """Monthly cost of one tier, and the cost the same retention would have uncompressed in fp32."""

    tier: str
    kind: str
    price_gb_month: float
    keep: int
    stored_bytes: int
    fp32_bytes: int | None  # None: unknown (so are the fp32 cost and the saving)
    monthly_usd: float
    fp32_monthly_usd: float | None
    kept_bytes: int = 0  # stored bytes priced: every kept checkpoint at its real size
    fp32_kept_bytes: int | None = 0

    @property
    def saving_usd(self) -> float | None:
        return None if self.fp32_monthly_usd is None else self.fp32_monthly_usd - self.monthly_usd

    @property
    def saving_fraction(self) -> float | None:
        if self.fp32_monthly_usd is None or self.saving_usd is None:
            return None
        return self.saving_usd / self.fp32_monthly_usd if self.fp32_monthly_usd else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["saving_usd"] = self.saving_usd
        d["saving_fraction"] = None if self.saving_fraction is None else round(self.saving_fraction, 4)
        return d


@dataclass(frozen=True)
class CostReport:
    tiers: tuple[TierCost, ...]

    @property
    def monthly_usd(self) -> float:
        return sum(t.monthly_usd for t in self.tiers)

    @property
    def fp32_monthly_usd(self) -> float | None:
        known = [t.fp32_monthly_usd for t in self.tiers]
        return None if None in known else sum(known)  # type: ignore[arg-type]

    @property
    def saving_usd(self) -> float | None:
        fp32 = self.fp32_monthly_usd
        return None if fp32 is None else fp32 - self.monthly_usd

    def as_dict(self) -> dict[str, Any]:
        return {
            "tiers": [t.as_dict() for t in self.tiers],
            "monthly_usd": self.monthly_usd,
            "fp32_monthly_usd": self.fp32_monthly_usd,
            "saving_usd": self.saving_usd,
        }


def tier_cost(usage: TierUsage, prices: Mapping[str, float] | None = None) -> TierCost:
    price = price_for(usage.name, usage.url, prices)
    kept, fp32_kept = usage.kept_stored_bytes(), usage.kept_fp32_bytes()
    return TierCost(
        tier=usage.name,
        kind=tier_kind(usage.name, usage.url),
        price_gb_month=price,
        keep=usage.keep,
        stored_bytes=usage.stored_bytes,
        fp32_bytes=usage.fp32_bytes,
        monthly_usd=monthly_cost(kept, price),
        fp32_monthly_usd=None if fp32_kept is None else monthly_cost(fp32_kept, price),
        kept_bytes=kept,
        fp32_kept_bytes=fp32_kept,
    )


def estimate(usages: Iterable[TierUsage], prices: Mapping[str, float] | None = None) -> CostReport:
    """Cost of every tier (see :func:`tier_cost`)."""
    return CostReport(tuple(tier_cost(u, prices) for u in usages))


def _field(entry: Any, name: str) -> Any:
    return entry[name] if isinstance(entry, Mapping) else getattr(entry, name)


def usage_from_listing(tiers: Iterable[Any], listing: Iterable[Any], fp32: Mapping[tuple[str, int], int] | None = None,
                       partial: Collection[tuple[str, int]] = (), fp32_known: bool = True) -> list[TierUsage]:
    """One :class:`TierUsage` per tier from a tier listing, each committed checkpoint at its real size.

    ``tiers``: objects with ``name``, ``keep`` and ``url`` (:class:`~dcp_tiered.tiers.Tier`).
    ``listing``: entries with ``tier``, ``step``, ``committed`` and ``size_bytes`` (the catalog's
    ``CheckpointInfo``, or the dicts of ``dcp-tiered ls --json``).  ``partial``: the ``(tier, step)``
    checkpoints without the optimizer state (``optimizer_every``): retention also keeps the newest
    full one, so it is priced too.  ``fp32[(tier, step)]``: that checkpoint's size uncompressed in fp32
    where known (else its stored size); the per-checkpoint fp32 baseline is the newest full
    checkpoint's (an uncompressed save would hold everything).  ``fp32_known=False``: fp32 unknown."""
    entries = [e for e in listing if _field(e, "committed") and _field(e, "step") >= 0]
    usages = []
    for t in tiers:
        held = sorted((e for e in entries if _field(e, "tier") == t.name), key=lambda e: _field(e, "step"), reverse=True)
        sizes = tuple(int(_field(e, "size_bytes")) for e in held)
        full = tuple((t.name, _field(e, "step")) not in partial for e in held)
        fp = [int((fp32 or {}).get((t.name, _field(e, "step")), s)) for e, s in zip(held, sizes)]
        base = next((f for f, is_full in zip(fp, full) if is_full), fp[0] if fp else 0)
        usages.append(TierUsage(t.name, sizes[0] if sizes else 0, base if fp32_known else None, t.keep,
                                getattr(t, "url", ""), sizes=sizes, full=full if partial else None))
    return usages


def cost_from_listing(tiers: Iterable[Any], listing: Iterable[Any], prices: Mapping[str, float] | None = None,
                      fp32: Mapping[tuple[str, int], int] | None = None) -> CostReport:
    """The monthly cost of what the tiers hold: :func:`usage_from_listing`, then :func:`estimate`."""
    return estimate(usage_from_listing(tiers, list(listing), fp32), prices)


def format_usd(x: float) -> str:
    """``$12.35``, ``$0.0421``, ``$0.000279``: cents for large sums, three significant digits for small ones."""
    if x == 0:
        return "$0"
    if abs(x) >= 1:
        return f"${x:,.2f}"
    return f"${x:.3g}" if abs(x) >= 1e-4 else f"${x:.2e}"


def parse_prices(items: Iterable[str]) -> dict[str, float]:
    """``["durable=0.02", "object=0.021"]`` -> ``{"durable": 0.02, "object": 0.021}``."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not key or price < 0:
            raise ValueError(f"price {item!r}: expected TIER=USD_PER_GB_MONTH, e.g. durable=0.023")
        out[key.strip()] = price
    return out
