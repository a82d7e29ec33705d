"""Non-tensor values of a state dict: ``io.BytesIO`` items and ``weights_only`` objects.

DCP stores every non-tensor value as a BYTE_IO item holding ``torch.save(value)``.  This
module is the one place that decides how such an item is written and read back:

* An ``io.BytesIO`` value is stored as its raw bytes, and its record carries
  ``"object": "bytesio"``, so reading it needs no unpickling at all.  (Stock DCP pickles
  the ``BytesIO`` object; such stock items load too, ``io.BytesIO`` is always allowed.)
* Any other object is loaded with ``torch.load(weights_only=True)``.  Types outside
  torch's allow-list (numpy arrays and random states, user classes) need an explicit
  opt-in, ``safe_globals=[...]``, given to the writer and the reader; it is applied with
  ``torch.serialization.safe_globals`` only around this package's own loads, never
  process-wide.
* The writer loads every object item back under its ``safe_globals`` before writing it,
  so a checkpoint that every restore would refuse fails at save time
  (:class:`~dcp_tiered.errors.UnsafeObjectError`), naming the key and the missing globals.

``Stateful`` objects are expanded by :func:`dcp_tiered.dcp.statedict.expand_stateful`.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem, SavePlanner, WriteItem

from dcp_tiered.dcp.pickle_scan import check_torch_payload
from dcp_tiered.errors import ConfigError, UnsafeCheckpointError, UnsafeObjectError, UnsupportedFormatError

#: Record field telling how a bytes item's raw bytes encode its value (absent: ``torch.save``).
OBJECT_FIELD = "object"
#: ``OBJECT_FIELD`` value: the raw bytes are the content of an ``io.BytesIO`` value.
OBJECT_BYTESIO = "bytesio"

#: What ``safe_globals`` accepts, as ``torch.serialization.add_safe_globals`` does.
SafeGlobals = Sequence[Union[Callable[..., Any], "tuple[Callable[..., Any], str]"]]

def _bytes(*args: Any) -> bytes:
    """``bytes`` as pickle uses it (``bytes()`` for ``b""``, ``bytes(str, encoding)``), never ``bytes(n)``."""
    if not args:
        return b""
    if isinstance(args[0], (bytes, bytearray)) and len(args) == 1:
        return bytes(args[0])
    if isinstance(args[0], str) and 2 <= len(args) <= 3 and all(isinstance(a, str) for a in args[1:]):
        return bytes(*args)
    raise UnsafeCheckpointError(f"refusing bytes() of {type(args[0]).__name__} while unpickling a non-tensor item")


# DCP's own BYTE_IO type: stock writers pickle io.BytesIO values (an empty one as BytesIO(bytes()));
# building either runs no code, and this bytes() cannot be made to allocate a size of its choosing.
_ALWAYS: tuple[Any, ...] = (io.BytesIO, (_bytes, "builtins.bytes"))
# torch.serialization.safe_globals edits one process-wide set and removes its entries on exit:
# one lock keeps two of our loads (the training thread and a background save) from removing
# each other's entries.
_LOCK = threading.RLock()
_GLOBAL_RE = (
    re.compile(r"GLOBAL (\S+) was not an allowed global"),
    re.compile(r"but got <class '([^']+)'>"),
    re.compile(r"Unsupported global: GLOBAL (\S+)"),
)


def normalize_safe_globals(safe_globals: SafeGlobals | None, owner: str) -> tuple[Any, ...]:
    """Check a ``safe_globals`` argument the way torch would use it; raise :class:`ConfigError` early."""
    if safe_globals is None:
        return ()
    if isinstance(safe_globals, (str, bytes)) or not isinstance(safe_globals, Sequence):
        raise ConfigError(f"{owner}: safe_globals must be a list of classes/functions, got {type(safe_globals).__name__}")
    out = []
    for g in safe_globals:
        ok = callable(g) or (isinstance(g, tuple) and len(g) == 2 and callable(g[0]) and isinstance(g[1], str))
        if not ok:
            raise ConfigError(
                f"{owner}: safe_globals entries must be classes/functions or (object, 'module.name') pairs, "
                f"as for torch.serialization.add_safe_globals; got {g!r}"
            )
        out.append(g)
    return tuple(out)


def numpy_safe_globals() -> list[Any]:
    """The globals numpy arrays and ``np.random.get_state()`` tuples need (numpy dtypes included).

    ``CompressedWriter(path, safe_globals=numpy_safe_globals())`` and the same for the reader.
    """
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")] if hasattr(np, "dtypes") else []
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def _name(g: Any) -> str:
    if isinstance(g, tuple):
        return g[1]
    return f"{getattr(g, '__module__', '?')}.{getattr(g, '__qualname__', getattr(g, '__name__', '?'))}"


@contextlib.contextmanager
def allowing(safe_globals: Sequence[Any] = ()) -> Iterator[None]:
    """``torch.serialization.safe_globals`` with ``safe_globals`` (plus ``io.BytesIO``) for this block.

    Entries the process already allows are left out, so leaving the block never removes a
    global the user added with ``add_safe_globals``.
    """
    with _LOCK:
        present = torch.serialization.get_safe_globals()
        extra = [g for g in (*_ALWAYS, *safe_globals) if g not in present]
        with torch.serialization.safe_globals(extra):
            yield


def _torch_load(data: "bytes | memoryview") -> Any:
    # torch's weights_only unpickler caps no depth: scan the pickle's shape first
    check_torch_payload(data, "a non-tensor item")
    return torch.load(io.BytesIO(data), weights_only=True)


def missing_globals(data: "bytes | memoryview", safe_globals: Sequence[Any] = (), error: BaseException | None = None,
                    *, explore: bool = False) -> list[str]:
    """The ``module.name`` globals ``data`` (a ``torch.save`` payload) needs beyond ``safe_globals``.

    The pickle's own GLOBALs (read statically, nothing runs) plus the one ``error`` (torch's
    refusal) names.  With ``explore`` (the writer only: the objects are the caller's own),
    classes that torch refuses to build only once the rest is allowed (numpy's
    ``dtypes.UInt32DType``) are found too: named globals that are non-stdlib classes or numpy
    functions are taken from ``sys.modules`` (never imported) and the load retried.
    """
    names: list[str] = []

    def add(exc: BaseException) -> bool:
        text = str(exc)
        found = next((m.group(1) for r in _GLOBAL_RE if (m := r.search(text))), None)
        if found is None or found in names:
            return False
        names.append(found)
        return True

    with allowing(safe_globals):
        try:
            names += sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # noqa: BLE001 - not a torch.save zip: only the error can tell
            pass
    if error is not None:
        add(error)
    for _ in range(32 if explore else 0):
        extra = [g for g in map(_from_loaded_modules, names) if _explorable(g)]
        if len(extra) < len(names):
            break  # something we will not run is needed first
        try:
            with allowing((*safe_globals, *extra)):
                _torch_load(data)
            break
        except Exception as exc:  # noqa: BLE001 - any refusal: find the global it names
            if not add(exc):
                break
    return names


def _explorable(obj: Any) -> bool:
    """A global that the save-time diagnosis may allow on the caller's own objects."""
    module = (getattr(obj, "__module__", None) or "").partition(".")[0]
    if not module or module in sys.stdlib_module_names or module in ("builtins", "torch"):
        return False
    return isinstance(obj, type) or module == "numpy"


def _from_loaded_modules(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    obj = sys.modules.get(module)
    for part in attr.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


def _refusal(data: "bytes | memoryview", safe_globals: Sequence[Any], exc: BaseException, explore: bool = False) -> str:
    names = missing_globals(data, safe_globals, exc, explore=explore)
    risky = [n for n in names if n.partition(".")[0] in sys.stdlib_module_names or n.startswith("builtins.")]
    if risky:
        return (
            f"torch.load(weights_only=True) refuses the global(s) {', '.join(names)}; do not allow "
            f"{', '.join(risky)}: such functions can run arbitrary code (store plain data instead)"
        )
    if names:
        return (
            f"torch.load(weights_only=True) refuses the global(s) {', '.join(names)}. If you trust these types, "
            f"opt in with safe_globals=[{', '.join(names)}] on the writer and on every reader "
            "(numpy values: dcp_tiered.numpy_safe_globals())"
        )
    return f"torch.load(weights_only=True) fails: {type(exc).__name__}: {str(exc)[:300]}"


def load_object(data: "bytes | memoryview", safe_globals: Sequence[Any], key: str, where: str) -> Any:
    """Load one ``torch.save`` payload with ``weights_only=True`` under ``safe_globals``.

    Raises :class:`UnsafeCheckpointError` naming ``key``, ``where`` and the missing globals,
    or the shape (depth, size) that makes the pickle unsafe to unpickle at all.
    """
    check_torch_payload(data, f"non-tensor item {key!r} in {where}")
    try:
        with allowing(safe_globals):
            return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every refusal or decode failure is reported alike
        raise UnsafeCheckpointError(
            f"non-tensor item {key!r} in {where} does not load safely: {_refusal(data, safe_globals, exc)}; "
            "refusing to unpickle it"
        ) from exc


# -- writer side -------------------------------------------------------------------------------


def _state_value(planner: SavePlanner, item: WriteItem) -> Any:
    """The state dict's value behind a BYTE_IO item, when the planner exposes it (else None)."""
    lookup = getattr(planner, "lookup_object", None)
    try:
        if lookup is not None:
            return lookup(item.index)
        sd = getattr(planner, "state_dict", None)
        return sd.get(item.index.fqn) if isinstance(sd, Mapping) else None
    except Exception:  # noqa: BLE001 - a custom planner: fall back to the payload alone
        return None


def encode_object(item: WriteItem, data: Any, planner: SavePlanner, safe_globals: Sequence[Any], where: str
                  ) -> tuple["bytes | memoryview", dict[str, Any]]:
    """The raw bytes to store for one BYTE_IO item, and the record fields to add.

    ``data`` is what the planner resolved (``torch.save(value)`` for DCP's planners).  An
    ``io.BytesIO`` value is stored raw (flagged :data:`OBJECT_BYTESIO`); anything else is the
    planner's payload, after checking that it loads with ``weights_only=True`` under
    ``safe_globals``.  Raises :class:`UnsafeObjectError` otherwise.
    """
    key = item.index.fqn
    value = _state_value(planner, item)
    payload = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
    if isinstance(value, io.BytesIO) and data is value:  # a planner passing the BytesIO through
        return bytes(value.getbuffer()), {OBJECT_FIELD: OBJECT_BYTESIO}
    try:
        with allowing(safe_globals):
            loaded = _torch_load(payload)
    except Exception as exc:  # noqa: BLE001 - whatever the reader would refuse
        raise UnsafeObjectError(
            f"cannot save non-tensor item {key!r} to {where}: a restore would refuse it, "
            f"{_refusal(payload, safe_globals, exc, explore=True)}. Nothing was committed"
        ) from exc
    if isinstance(value, io.BytesIO) and isinstance(loaded, io.BytesIO):
        return loaded.getvalue(), {OBJECT_FIELD: OBJECT_BYTESIO}
    return payload, {}


# -- reader side -------------------------------------------------------------------------------


def _places_itself(planner: LoadPlanner) -> bool:
    """Whether ``planner.load_bytes`` is DCP's default one, whose effect we can apply without pickle."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return (
        isinstance(planner, DefaultLoadPlanner)
        and type(planner).load_bytes is DefaultLoadPlanner.load_bytes
        and hasattr(planner, "state_dict")
    )


def _place(planner: LoadPlanner, req: ReadItem, value: Any) -> None:
    """What ``DefaultLoadPlanner.load_bytes`` does with an already loaded value."""
    from torch.distributed.checkpoint._traverse import set_element

    fqn = req.dest_index.fqn
    if getattr(planner, "flatten_state_dict", False):
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def deliver(planner: LoadPlanner, req: ReadItem, data: bytes, record: Any, safe_globals: Sequence[Any], where: str) -> None:
    """Hand one bytes item (its decoded raw bytes) to ``planner``, loading it safely.

    ``record`` is the item's storage record (a native dict, or a stock ``_StorageInfo``).
    DCP's default planners get the value placed directly (no second unpickle); a custom
    ``load_bytes`` gets the ``torch.save`` payload DCP's contract promises, after the same
    ``weights_only`` check, and runs under ``safe_globals`` too.
    """
    key = req.storage_index.fqn
    kind = record.get(OBJECT_FIELD) if isinstance(record, dict) else None
    if kind is None:
        value = load_object(data, safe_globals, key, where)
        payload = data
    elif kind == OBJECT_BYTESIO:
        value = io.BytesIO(data)
        payload = None
    else:
        raise UnsupportedFormatError(
            f"non-tensor item {key!r} in {where} is stored as {kind!r}, which this version cannot read: upgrade dcp_tiered"
        )
    if _places_itself(planner):
        _place(planner, req, value)
        return
    if payload is None:
        buf = io.BytesIO()
        torch.save(value, buf)
        payload = buf.getvalue()
    with allowing(safe_globals):
        planner.load_bytes(req, io.BytesIO(payload))
