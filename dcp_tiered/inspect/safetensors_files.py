"""The Hugging Face safetensors layout: file names, the shard plan, and the checks on untrusted files.

One ``model.safetensors`` when one shard suffices, else ``model-0000N-of-0000M.safetensors`` files
and a ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {key:
file}}``), as ``transformers`` writes them.  Headers and indexes read from storage are untrusted:
their sizes are bounded before anything is parsed, and every file an index names stays inside its
directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dcp_tiered.checks import parse_bytes
from dcp_tiered.errors import CorruptCheckpointError, UnsafeCheckpointError

if TYPE_CHECKING:
    from dcp_tiered.storage import Storage

#: The single-file name and the index name ``transformers`` reads.
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: ``transformers``' default ``max_shard_size`` (decimal gigabytes, as it counts).
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: The header-size limit of the ``safetensors`` library itself: a larger length prefix is no safetensors file.
MAX_HEADER_BYTES = 100_000_000
#: The largest index read (an index of a million tensors is about 100 MB; real ones are well under 1 MB).
MAX_INDEX_BYTES = 64 << 20
#: The longest tensor name accepted from a file (names are module paths, a few hundred characters at most).
MAX_NAME_CHARS = 4096
#: The ``metadata`` ``transformers`` writes into each shard's header (its loader checks ``format``).
SHARD_METADATA = {"format": "pt"}


def shard_name(index: int, count: int) -> str:
    """The file name of shard ``index`` (1-based) of ``count``, as ``transformers`` names them."""
    return WEIGHTS_NAME if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def max_shard_bytes(value: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"``, ``"500MB"``, ``"2GiB"`` (as :func:`~dcp_tiered.checks.parse_bytes`)."""
    n = parse_bytes(value, "max_shard_size")
    assert n is not None
    return n


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Keys grouped into shards in their order: a new shard starts when the next tensor would take the current
    one past ``max_bytes``; a tensor larger than ``max_bytes`` gets a shard of its own (``transformers``' rule)."""
    shards: list[list[str]] = []
    used = max_bytes + 1  # no shard yet
    for key, size in sizes:
        if shards and used + size <= max_bytes:
            shards[-1].append(key)
            used += size
        else:
            shards.append([key])
            used = size
    return shards


def index_document(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """The ``model.safetensors.index.json`` bytes: ``transformers``' keys, sorted, indented."""
    return (json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)},
                       indent=2, sort_keys=True) + "\n").encode()


#: The key of a safetensors header that holds its metadata, never a tensor's name.
HEADER_METADATA_KEY = "__metadata__"


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a tensor of a safetensors file, or None: the one rule of export and import
    (a printable, non-empty string of at most :data:`MAX_NAME_CHARS`, not :data:`HEADER_METADATA_KEY`)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        return f"is not a printable name of 1 to {MAX_NAME_CHARS} characters"
    if name == HEADER_METADATA_KEY:
        return f"is the header's own {HEADER_METADATA_KEY} key"
    return None


def check_name(name: object, where: str) -> str:
    """A tensor name read from a file (untrusted): :func:`name_problem` says it is one."""
    problem = name_problem(name)
    if problem:
        raise UnsafeCheckpointError(f"{where}: tensor name {repr(name)[:200]} {problem}; the file is damaged or "
                                    "crafted, re-export it")
    assert isinstance(name, str)
    return name


def check_header(storage: Storage, name: str) -> int:
    """The header length of the safetensors file ``name``, checked against the file's size and
    :data:`MAX_HEADER_BYTES` before the ``safetensors`` library parses it; returns the file's size."""
    url = storage.url_of(name)
    size = storage.size(name)
    prefix = storage.read_range(name, 0, 8) if size >= 8 else b""
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"{url} has {size} bytes, too short for a safetensors file; re-download it")
    length = int.from_bytes(prefix, "little")
    if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
        raise CorruptCheckpointError(
            f"{url}: its safetensors header claims {length} bytes (the file has {size}, headers are limited to "
            f"{MAX_HEADER_BYTES}); it is not a safetensors file or it is damaged: re-download or re-export it")
    return size


def read_index(storage: Storage, name: str) -> dict[str, str]:
    """The ``weight_map`` of the index ``name`` (untrusted): tensor name -> file name inside the same directory.

    Raises :class:`CorruptCheckpointError` (a bounded read, not JSON, no ``weight_map`` object, a name
    that is no string) or :class:`UnsafeCheckpointError` (a file outside the directory).
    """
    from dcp_tiered.storage.paths import safe_relative_name

    url = storage.url_of(name)
    data = storage.read_bytes(name, MAX_INDEX_BYTES)
    try:
        doc: Any = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{url} is not a JSON index ({type(exc).__name__}: {str(exc)[:200]}); "
                                     "re-download it or give the .safetensors file itself") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpointError(f"{url} has no 'weight_map' object naming the tensors' files; "
                                     "it is not a transformers index (model.safetensors.index.json)")
    out: dict[str, str] = {}
    for key, file in weight_map.items():
        check_name(key, url)
        if not isinstance(file, str):
            raise CorruptCheckpointError(f"{url}: the file of tensor {key!r} is {type(file).__name__}, not a file name")
        out[key] = safe_relative_name(file, f"{url} (tensor {key!r})")
    return out
