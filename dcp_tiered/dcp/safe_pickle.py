"""Load DCP ``.metadata`` pickles through an allow-list, so a crafted checkpoint runs no code.

Only the exact classes DCP metadata is made of may be referenced: the metadata
dataclasses, torch dtypes, ``torch.Size``, layouts and memory formats, path classes, and
the stock ``_StorageInfo`` record (to read checkpoints written by stock DCP writers).
Anything else raises :class:`UnsafeCheckpointError` before it is called.

Beyond names, only the *shapes* DCP metadata has are accepted, so a crafted pickle can
neither poison the process nor crash or stall it:

* ``BUILD`` only on a fresh instance (made by ``NEWOBJ`` in this pickle) of an allowed
  dataclass, once, with a ``dict`` state of identifier keys (``TensorProperties``: its
  5-tuple).  Never on a class, a function or a module, never slot state: a crafted
  ``BUILD`` cannot monkeypatch a class for the whole process.
* ``NEWOBJ`` only on those dataclasses, without arguments; ``REDUCE`` only on the
  constructors DCP's pickles call, with arguments of the right types.  ``INST``, ``OBJ``
  and the extension registry are refused.
* The nesting depth of every built object is tracked (not only ``MARK`` depth) and capped,
  so ``hash()`` of a million nested tuples can never overflow the C stack.
* Dict keys are ``str`` or a validated ``MetadataIndex``; set members are ``str``.  ``str``
  hashes are randomized, and ``MetadataIndex`` keys sharing one hash value are capped, so
  keys that all collide (quadratic dict insertion) are refused after a handful.
* Item counts per container and in total, and integer sizes, are capped.

Before this unpickler (or ``torch.load(weights_only=True)``, for non-tensor and stock tensor
items) runs, :func:`check_pickle_structure` scans the opcodes without building anything:
nesting depth (also when built top-down through the memo), stack size, memo writes and the
number of objects per byte are capped, so the depth tracking above is not the only defence.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import pickletools
import struct
import sys
import zipfile
from collections import OrderedDict
from itertools import repeat
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.serialization import _get_layout

from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError, UnsafeCheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "slice", "complex"}),
}
_TORCH_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
_TORCH_MISC = frozenset({"strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"})

#: Deepest nesting of built objects accepted (DCP metadata nests about 10 deep).
MAX_DEPTH = 64
#: Most items in one container (a frame table of the largest record fits).
MAX_CONTAINER_ITEMS = 1 << 22
#: Most items in all containers of one pickle together.
MAX_TOTAL_ITEMS = 1 << 26
#: Most dict keys sharing one hash value (colliding keys make dict insertion quadratic).
MAX_SAME_HASH = 16
# Largest integer (bytes of LONG4 / digits of LONG) accepted; DCP's are 64-bit.
_MAX_INT_BYTES = 16
_MAX_DIMS = 64
_MAX_PATH_PARTS = 4096

# Dataclasses DCP pickles as NEWOBJ + BUILD.
_BUILDABLE = frozenset(
    {
        _md.Metadata,
        _md.MetadataIndex,
        _md.TensorStorageMetadata,
        _md.BytesStorageMetadata,
        _md.ChunkStorageMetadata,
        _md.TensorProperties,
        _md.StorageMeta,
        _StorageInfo,
    }
)
_MEM_FORMATS = frozenset(_md._MEM_FORMAT_ENCODING)
_STR = frozenset({str})
_SIZE = torch.Size
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _BUILDABLE}


def _op(code: bytes) -> int:
    return code[0]


# The pure-Python unpickler keeps its memo in a dict; the C one preallocates a memo array
# as large as any index a PUT opcode names, so 9 crafted bytes could make it zero-fill GBs.
class _AllowListUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: bytes, source: str) -> None:
        self._source_stream = io.BytesIO(data)
        super().__init__(self._source_stream)
        self._source = source
        self._size = len(data)
        self._depth: dict[int, int] = {}  # id -> nesting depth of containers and instances built here
        self._keep: list[Any] = []  # keeps those objects alive, so their ids stay unique
        self._fresh: set[int] = set()  # ids of NEWOBJ instances not yet BUILT
        self._hashes: dict[int, int] = {}  # hash value -> number of non-str keys having it
        self._items = 0

    def load(self) -> Any:
        """Run the opcodes straight from the in-memory buffer.

        The whole pickle is in memory, so FRAME opcodes (read-ahead hints) are skipped
        instead of going through pickle's unframer: a third of the pure-Python cost.
        """
        stream = self._source_stream
        self.read, self.readinto, self.readline = stream.read, stream.readinto, stream.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read = stream.read
        dispatch = self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("pickle data was truncated")
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def load_frame(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._size - self._source_stream.tell():
            raise pickle.UnpicklingError("FRAME runs past the end of the data")

    dispatch[_op(pickle.FRAME)] = load_frame

    # -- helpers ------------------------------------------------------------------

    def _refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self._source} {what}, which DCP checkpoint metadata never does; "
            "the file is damaged or malicious: do not load it with plain pickle"
        )

    # Depth bookkeeping: every container and instance built here is recorded by id (scalars
    # are not: they count 0).  Ids of freed objects may be reused; a stale entry can only
    # overstate a depth, and legitimate metadata nests far below the cap.
    def _depth_of(self, items: Any) -> int:
        """Depth of the deepest of ``items`` (0 for scalars and no items)."""
        return max(map(self._depth.get, map(id, items), repeat(0)), default=0)

    def _register(self, obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self._refuse(f"nests objects more than {MAX_DEPTH} deep")
        self._depth[id(obj)] = depth
        return obj

    def _count(self, n: int) -> None:
        if n > MAX_CONTAINER_ITEMS:
            raise self._refuse(f"has a container of {n} items (limit {MAX_CONTAINER_ITEMS})")
        self._items += n
        if self._items > MAX_TOTAL_ITEMS:
            raise self._refuse(f"holds more than {MAX_TOTAL_ITEMS} items")

    def _grow(self, container: Any, items: Any) -> None:
        """``items`` were added to ``container``: update its depth."""
        new = self._depth_of(items) + 1
        if new > self._depth.get(id(container), 1):
            self._register(container, new)

    def _check_keys(self, keys: Any, what: str = "dict key") -> None:
        """Keys must be str (randomized hash) or a valid MetadataIndex (same-hash keys capped)."""
        types = set(map(type, keys))
        if types <= {str}:
            return
        if what != "dict key" or not types <= {str, _md.MetadataIndex}:
            bad = next(t for t in types if t is not str and (what != "dict key" or t is not _md.MetadataIndex))
            raise self._refuse(f"has a {what} of type {bad.__name__}")
        for key in keys:
            if type(key) is str:
                continue
            fqn, offset, index = (getattr(key, f, None) for f in ("fqn", "offset", "index"))
            if (
                type(fqn) is not str
                or not (offset is None or (type(offset) is torch.Size and len(offset) <= _MAX_DIMS))
                or not (index is None or type(index) is int)
            ):
                raise self._refuse("has a MetadataIndex key with invalid fields")
            h = hash(key)
            n = self._hashes.get(h, 0) + 1
            if n > MAX_SAME_HASH:
                raise self._refuse(f"has more than {MAX_SAME_HASH} keys with one hash value (a hash-collision attack)")
            self._hashes[h] = n

    # -- names --------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name in _TORCH_DTYPES or name in _TORCH_MISC):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._source} references {module}.{name}, which is not allowed in checkpoint metadata; "
            "the file may be malicious: do not load it with plain pickle"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source} uses persistent ids, which checkpoint metadata never does")

    # -- containers ---------------------------------------------------------------

    def load_mark(self) -> None:
        metastack = self.metastack
        if len(metastack) >= MAX_DEPTH:
            raise self._refuse(f"nests MARKs more than {MAX_DEPTH} deep")
        metastack.append(self.stack)
        self.stack = []
        self.append = self.stack.append

    dispatch[_op(pickle.MARK)] = load_mark

    def load_tuple(self) -> None:
        items = self.pop_mark()
        self._count(len(items))
        self.append(self._register(tuple(items), self._depth_of(items) + 1))

    dispatch[_op(pickle.TUPLE)] = load_tuple

    def load_empty_tuple(self) -> None:
        self.append(())  # a singleton: depth 0 is as good as 1

    def load_tuple1(self) -> None:
        stack = self.stack
        t = (stack[-1],)
        stack[-1] = t
        d = self._depth.get(id(t[0]), 0) + 1
        if d > MAX_DEPTH:
            raise self._refuse(f"nests objects more than {MAX_DEPTH} deep")
        self._depth[id(t)] = d

    def load_tuple2(self) -> None:
        stack = self.stack
        t = (stack[-2], stack[-1])
        stack[-2:] = [t]
        get = self._depth.get
        d = max(get(id(t[0]), 0), get(id(t[1]), 0)) + 1
        if d > MAX_DEPTH:
            raise self._refuse(f"nests objects more than {MAX_DEPTH} deep")
        self._depth[id(t)] = d

    def load_tuple3(self) -> None:
        stack = self.stack
        t = (stack[-3], stack[-2], stack[-1])
        stack[-3:] = [t]
        self._register(t, self._depth_of(t) + 1)

    def load_empty_list(self) -> None:
        lst: list = []
        self._depth[id(lst)] = 1
        self.append(lst)

    def load_empty_dictionary(self) -> None:
        d: dict = {}
        self._depth[id(d)] = 1
        self.append(d)

    def load_empty_set(self) -> None:
        st: set = set()
        self._depth[id(st)] = 1
        self.append(st)

    dispatch[_op(pickle.EMPTY_TUPLE)] = load_empty_tuple
    dispatch[_op(pickle.TUPLE1)] = load_tuple1
    dispatch[_op(pickle.TUPLE2)] = load_tuple2
    dispatch[_op(pickle.TUPLE3)] = load_tuple3
    dispatch[_op(pickle.EMPTY_LIST)] = load_empty_list
    dispatch[_op(pickle.EMPTY_DICT)] = load_empty_dictionary
    dispatch[_op(pickle.EMPTY_SET)] = load_empty_set

    def load_list(self) -> None:
        items = self.pop_mark()
        self._count(len(items))
        self.append(self._register(items, self._depth_of(items) + 1))

    dispatch[_op(pickle.LIST)] = load_list

    def load_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise pickle.UnpicklingError("odd number of items for DICT")
        self._count(len(items) // 2)
        self._check_keys(items[0::2])
        d = dict(zip(items[0::2], items[1::2]))
        self.append(self._register(d, self._depth_of(items) + 1))

    dispatch[_op(pickle.DICT)] = load_dict

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self._count(len(items))
        self._check_keys(items, "set member")  # str only
        self.append(self._register(frozenset(items), 1))

    dispatch[_op(pickle.FROZENSET)] = load_frozenset

    def _target(self, types: tuple[type, ...], op: str) -> Any:
        if not self.stack:
            raise pickle.UnpicklingError(f"{op} on an empty stack")
        target = self.stack[-1]
        if type(target) not in types:
            raise self._refuse(f"applies {op} to a {type(target).__name__}")
        return target

    def load_append(self) -> None:
        value = self.stack.pop()
        target = self._target((list,), "APPEND")
        target.append(value)
        self._grow(target, (value,))

    def load_appends(self) -> None:
        items = self.pop_mark()
        target = self._target((list,), "APPENDS")
        self._count(len(items))
        target.extend(items)
        self._grow(target, items)

    dispatch[_op(pickle.APPEND)] = load_append
    dispatch[_op(pickle.APPENDS)] = load_appends

    def load_setitem(self) -> None:
        stack = self.stack
        value = stack.pop()
        key = stack.pop()
        target = self._target((dict, OrderedDict), "SETITEM")
        self._check_keys((key,))
        target[key] = value
        self._grow(target, (key, value))

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not dict and type(target) is not OrderedDict:
            raise self._refuse(f"applies SETITEMS to a {type(target).__name__}")
        if len(items) & 1:
            raise pickle.UnpicklingError("odd number of items for SETITEMS")
        keys = items[0::2]
        if not set(map(type, keys)) <= _STR:
            self._check_keys(keys)
        self._count(len(keys))
        target.update(zip(keys, items[1::2]))
        depth = self._depth
        d = max(map(depth.get, map(id, items), repeat(0)), default=0) + 1
        if d > depth.get(id(target), 1):
            self._register(target, d)

    dispatch[_op(pickle.SETITEM)] = load_setitem
    dispatch[_op(pickle.SETITEMS)] = load_setitems

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self._target((set,), "ADDITEMS")
        self._check_keys(items, "set member")
        self._count(len(items))
        target.update(items)  # str only: depth 0

    dispatch[_op(pickle.ADDITEMS)] = load_additems

    # -- objects ------------------------------------------------------------------

    def _new(self, cls: Any, args: Any, kwargs: Any = None) -> None:
        if not isinstance(cls, type) or cls not in _BUILDABLE:
            raise self._refuse(f"creates a {getattr(cls, '__name__', type(cls).__name__)} with NEWOBJ")
        if args != () or kwargs:
            raise self._refuse(f"passes arguments to {cls.__name__}.__new__")
        obj = cls.__new__(cls)
        self._fresh.add(id(obj))
        self._keep.append(obj)  # its id stays in _fresh: keep it unique
        self._depth[id(obj)] = 1
        self.append(obj)

    def load_newobj(self) -> None:
        stack = self.stack
        args = stack.pop()
        cls = stack.pop()
        self._new(cls, args)

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls, args, kwargs)

    dispatch[_op(pickle.NEWOBJ)] = load_newobj
    dispatch[_op(pickle.NEWOBJ_EX)] = load_newobj_ex

    def _refuse_op(self) -> None:
        raise self._refuse("uses INST, OBJ or the copyreg extension registry")

    for _code in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op(_code)] = _refuse_op
    del _code

    def load_build(self) -> None:
        stack = self.stack
        state = stack.pop()
        inst = stack[-1]
        cls = type(inst)
        if id(inst) not in self._fresh:
            raise self._refuse(f"applies BUILD to a {cls.__name__} that is not a fresh DCP metadata instance")
        self._fresh.discard(id(inst))
        if cls is _md.TensorProperties:
            if not (
                type(state) is tuple
                and len(state) == 5
                and isinstance(state[0], torch.dtype)
                and isinstance(state[1], torch.layout)
                and type(state[2]) is bool
                and state[3] in _MEM_FORMATS
                and type(state[4]) is bool
            ):
                raise self._refuse("has TensorProperties state that is not (dtype, layout, bool, format, bool)")
            inst.__setstate__(state)
        else:
            if type(state) is not dict or not (
                state.keys() <= _FIELDS[cls]  # fast path; else any plain names (fields of other torch versions)
                or all(type(k) is str and k.isidentifier() and not k.startswith("__") for k in state)
            ):
                raise self._refuse(f"has {cls.__name__} state that is not a dict of field names")
            inst_dict = inst.__dict__
            intern = sys.intern
            for k, v in state.items():
                inst_dict[intern(k)] = v
        self._register(inst, self._depth.get(id(state), 0) + 1)

    dispatch[_op(pickle.BUILD)] = load_build

    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        if func is _SIZE:  # the common case, inline
            if type(args) is not tuple or len(args) != 1 or type(args[0]) not in (tuple, list) or len(args[0]) > _MAX_DIMS:
                raise self._refuse("calls torch.Size with arguments of the wrong shape")
            stack[-1] = value = _SIZE(args[0])
            self._depth[id(value)] = 1
            return
        check = _REDUCE_RULES.get(id(func))
        if check is None or check[0] is not func:
            raise self._refuse(f"calls {getattr(func, '__name__', type(func).__name__)} with REDUCE")
        if type(args) is not tuple or not check[1](self, args):
            raise self._refuse(f"calls {func.__name__} with arguments of the wrong shape")
        stack[-1] = self._register(func(*args), self._depth.get(id(args), 0) + 1)

    dispatch[_op(pickle.REDUCE)] = load_reduce

    # -- integers -----------------------------------------------------------------

    def load_long4(self) -> None:
        (n,) = struct.unpack("<i", self.read(4))
        if not 0 <= n <= _MAX_INT_BYTES:
            raise self._refuse(f"has a {n}-byte integer")
        self.append(pickle.decode_long(self.read(n)))

    dispatch[_op(pickle.LONG4)] = load_long4

    def load_long(self) -> None:
        line = self.readline()
        if len(line) > 3 * _MAX_INT_BYTES:
            raise self._refuse("has an integer of more than 128 bits")
        val = line[:-1]
        if val and val[-1] == b"L"[0]:
            val = val[:-1]
        self.append(int(val, 0))

    dispatch[_op(pickle.LONG)] = load_long


def _seq(args: tuple, item_types: tuple[type, ...] | None = None, limit: int = MAX_CONTAINER_ITEMS) -> bool:
    """``()`` or ``(list_or_tuple,)`` whose items have the given types."""
    if not args:
        return True
    if len(args) != 1 or type(args[0]) not in (list, tuple) or len(args[0]) > limit:
        return False
    return item_types is None or set(map(type, args[0])) <= set(item_types)


def _set_args(u: _AllowListUnpickler, args: tuple) -> bool:
    if not _seq(args):
        return False
    if args:
        u._count(len(args[0]))
        u._check_keys(args[0], "set member")
    return True


def _list_args(u: _AllowListUnpickler, args: tuple) -> bool:
    if not _seq(args):
        return False
    if args:
        u._count(len(args[0]))
    return True


_REDUCE_RULES: dict[int, tuple[Any, Any]] = {
    id(f): (f, check)
    for f, check in [
        (torch.Size, lambda u, a: len(a) == 1 and type(a[0]) in (tuple, list) and len(a[0]) <= _MAX_DIMS),
        (_get_layout, lambda u, a: len(a) == 1 and type(a[0]) is str and len(a[0]) <= 64),
        (_md._MEM_FORMAT_ENCODING, lambda u, a: len(a) == 1 and type(a[0]) is int),
        (pathlib.PosixPath, lambda u, a: len(a) <= _MAX_PATH_PARTS and all(type(x) is str for x in a)),
        (pathlib.PurePosixPath, lambda u, a: len(a) <= _MAX_PATH_PARTS and all(type(x) is str for x in a)),
        (pathlib.PureWindowsPath, lambda u, a: len(a) <= _MAX_PATH_PARTS and all(type(x) is str for x in a)),
        (OrderedDict, lambda u, a: a == ()),
        (dict, lambda u, a: a == ()),
        (set, _set_args),
        (frozenset, _set_args),
        (list, _list_args),
        (tuple, _list_args),
        (slice, lambda u, a: len(a) <= 3 and all(type(x) in (int, type(None)) for x in a)),
        (complex, lambda u, a: len(a) <= 2 and all(type(x) in (int, float) for x in a)),
    ]
}


def safe_loads(data: bytes, source: str = ".metadata", exact: bool = True) -> Any:
    """Unpickle ``data`` allowing only DCP metadata classes and shapes; raise a clear error otherwise.

    With ``exact``, bytes left over after the pickle's end mean the file was damaged.  The
    opcodes are first scanned by :func:`check_pickle_structure` (depth, stack, memo, counts).
    """
    end = check_pickle_structure(data, source, max_depth=MAX_DEPTH)
    try:
        unpickler = _AllowListUnpickler(data, source)
        value = unpickler.load()
    except DcpTieredError:
        raise
    except Exception as exc:  # any failure to decode hostile or damaged bytes is "not readable"
        raise CorruptCheckpointError(f"{source} is not a readable DCP metadata pickle: {type(exc).__name__}: {str(exc)[:300]}") from exc
    if unpickler._source_stream.tell() != end:
        raise CorruptCheckpointError(f"{source} is not a readable DCP metadata pickle: it ends where the scan did not")
    if exact and end != len(data):
        raise CorruptCheckpointError(f"{source} has {len(data) - end} stray bytes after its end: it is damaged")
    return value


# -- structure scan (both loaders) ----------------------------------------------------------------
#
# Before any pickle from a checkpoint is unpickled (``.metadata`` by the allow-list unpickler
# above, non-tensor items and stock tensor items by ``torch.load(weights_only=True)``, which
# has no depth cap), its opcodes are walked once (read as pickle reads them) and the
# unpickler's stack is simulated symbolically: a depth per entry, the memo, and counts.
# Nothing is built, so the scan cannot itself recurse, crash or allocate more than a few
# words per opcode.

#: Deepest nesting accepted in a non-tensor object (``hash()``/``repr()`` of ~10^5 nested
#: tuples overflows the C stack; real optimizer/scheduler/trainer states nest < 15).
MAX_OBJECT_DEPTH = 100
#: Most entries on the unpickler's stack at once (pickle batches APPENDS/SETITEMS by 1000;
#: a tuple is pushed whole: a frame table of the largest record has 2^20 items).
MAX_STACK = (1 << 20) + (1 << 16)
# Objects and memo entries a pickle may create: a constant plus a share of its size. Real
# pickles spend several bytes per object (see MEASUREMENTS); 1-byte EMPTY_DICT/MEMOIZE spam
# cannot reach more than a few times the size of a real pickle's objects.
_OBJECTS_PER_BYTE = 4  # at most len(data) // 4 objects (containers, instances, memoized str/bytes)
_FREE_OBJECTS = 10_000

# Opcode classes for the scan: op -> (class, whether it pushes a new memoizable object, entries it takes).
(_PUSH, _NEW, _TUPLEN, _MARK, _FROM_MARK, _MUTATE, _MUTATE_MARK, _POP, _POP_MARK, _DUP, _MEMOIZE, _GET, _NOP,
 _STOP, _POP1_PUSH) = range(15)
_CLASSES = {
    _PUSH: "INT BININT BININT1 BININT2 LONG LONG1 LONG4 NONE NEWTRUE NEWFALSE FLOAT BINFLOAT EMPTY_TUPLE GLOBAL "
           "EXT1 EXT2 EXT4 PERSID NEXT_BUFFER STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 "
           "BYTEARRAY8 UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8",
    _NEW: "EMPTY_LIST EMPTY_DICT EMPTY_SET",
    _TUPLEN: "TUPLE1 TUPLE2 TUPLE3 REDUCE NEWOBJ STACK_GLOBAL NEWOBJ_EX",
    _MARK: "MARK",
    _FROM_MARK: "TUPLE LIST DICT FROZENSET INST OBJ",
    _MUTATE: "APPEND BUILD SETITEM",
    _MUTATE_MARK: "APPENDS SETITEMS ADDITEMS",
    _POP: "POP", _POP_MARK: "POP_MARK", _DUP: "DUP", _MEMOIZE: "MEMOIZE PUT BINPUT LONG_BINPUT",
    _GET: "GET BINGET LONG_BINGET", _NOP: "PROTO FRAME READONLY_BUFFER", _STOP: "STOP", _POP1_PUSH: "BINPERSID",
}
# What pickle memoizes (once, right after creating it); never None, bools, numbers or ().
_MEMOIZABLE = frozenset(
    "STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 UNICODE SHORT_BINUNICODE "
    "BINUNICODE BINUNICODE8 GLOBAL STACK_GLOBAL EMPTY_LIST EMPTY_DICT EMPTY_SET TUPLE TUPLE1 TUPLE2 TUPLE3 LIST "
    "DICT FROZENSET REDUCE NEWOBJ NEWOBJ_EX OBJ INST EXT1 EXT2 EXT4 NEXT_BUFFER".split()
)
_TAKES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "STACK_GLOBAL": 2, "NEWOBJ_EX": 3,
          "APPEND": 1, "BUILD": 1, "SETITEM": 2}
_CLASS_OF = {name: cls for cls, names in _CLASSES.items() for name in names.split()}
# How each opcode's argument is laid out, exactly as pickle reads it: none, fixed width,
# a little-endian length of that width then the bytes (signed for LONG4 and BINSTRING),
# or one/two newline-terminated lines.
_ARG_NONE, _ARG_FIXED, _ARG_LEN, _ARG_SLEN, _ARG_LINES = range(5)
_ARGS = {
    "BININT1": (_ARG_FIXED, 1), "BININT2": (_ARG_FIXED, 2), "BININT": (_ARG_FIXED, 4), "BINFLOAT": (_ARG_FIXED, 8),
    "BINGET": (_ARG_FIXED, 1), "LONG_BINGET": (_ARG_FIXED, 4), "BINPUT": (_ARG_FIXED, 1), "LONG_BINPUT": (_ARG_FIXED, 4),
    "EXT1": (_ARG_FIXED, 1), "EXT2": (_ARG_FIXED, 2), "EXT4": (_ARG_FIXED, 4), "PROTO": (_ARG_FIXED, 1),
    "FRAME": (_ARG_FIXED, 8), "SHORT_BINUNICODE": (_ARG_LEN, 1), "SHORT_BINBYTES": (_ARG_LEN, 1),
    "SHORT_BINSTRING": (_ARG_LEN, 1), "LONG1": (_ARG_LEN, 1), "BINUNICODE": (_ARG_LEN, 4), "BINBYTES": (_ARG_LEN, 4),
    "BINUNICODE8": (_ARG_LEN, 8), "BINBYTES8": (_ARG_LEN, 8), "BYTEARRAY8": (_ARG_LEN, 8),
    "BINSTRING": (_ARG_SLEN, 4), "LONG4": (_ARG_SLEN, 4),
    "INT": (_ARG_LINES, 1), "LONG": (_ARG_LINES, 1), "FLOAT": (_ARG_LINES, 1), "STRING": (_ARG_LINES, 1),
    "UNICODE": (_ARG_LINES, 1), "GET": (_ARG_LINES, 1), "PUT": (_ARG_LINES, 1), "PERSID": (_ARG_LINES, 1),
    "GLOBAL": (_ARG_LINES, 2), "INST": (_ARG_LINES, 2),
}
# code byte -> (class, pushes a new memoizable object, entries taken, arg layout, arg width, name); None: unknown
_OPS: list[Any] = [None] * 256
for _op in pickletools.opcodes:
    _OPS[ord(_op.code)] = (_CLASS_OF[_op.name], _op.name in _MEMOIZABLE, _TAKES.get(_op.name, 0),
                           *_ARGS.get(_op.name, (_ARG_NONE, 0)), _op.name)
del _op


def check_pickle_structure(data: "bytes | memoryview", source: str, *, max_depth: int = MAX_OBJECT_DEPTH,
                           start: int = 0) -> int:
    """Refuse a pickle whose shape could crash or exhaust the process that unpickles it.

    A linear scan of the opcodes (nothing is unpickled) simulating the unpickler's stack with
    a nesting depth per entry.  Raises :class:`UnsafeCheckpointError` (naming ``source``) when
    objects nest deeper than ``max_depth`` (``hash()`` of 10^6 nested tuples overflows the C
    stack), when a container is modified after it was placed inside another one (how depth
    is built top-down through the memo; real pickles never do it, cyclic values aside), when
    the stack exceeds :data:`MAX_STACK` entries, when the memo is written other than once right
    after a new object, or when more objects are created than the size warrants.  Raises
    :class:`CorruptCheckpointError` when the opcodes do not parse.  Scans the pickle that
    starts at offset ``start``; returns the offset just past its STOP.
    """
    size = len(data) - start
    max_objects = size // _OBJECTS_PER_BYTE + _FREE_OBJECTS

    def refuse(what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{source} {what}, which a checkpoint written by torch/DCP never does; the file is damaged "
            "or malicious: refusing to unpickle it"
        )

    # A stack entry is 0 (a scalar or immutable leaf) or the number k of a node: a container or
    # instance, depths[k] deep, placed[k] once it was put inside another object.  Plain ints
    # and arrays, so the scan allocates no objects the garbage collector has to walk.
    stack: list[Any] = []
    marks: list[int] = []  # stack lengths at each MARK
    memo: dict[int, int] = {}
    depths = [0]
    was_placed = bytearray(1)
    objects = 0
    fresh = False  # the top of the stack was just pushed by an opcode creating a memoizable object

    def placed(items: Any) -> int:
        """Mark ``items`` as placed into a parent; their deepest depth."""
        deepest = 0
        for k in items:
            if k:
                was_placed[k] = 1
                if depths[k] > deepest:
                    deepest = depths[k]
        return deepest

    def node(depth: int) -> int:
        if depth > max_depth:
            raise refuse(f"nests objects more than {max_depth} deep")
        depths.append(depth)
        was_placed.append(0)
        return len(depths) - 1

    def pop_mark() -> list:
        if not marks:
            raise pickle.UnpicklingError("no MARK on the stack")
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def mutate(target: Any, deepest: int) -> None:
        if not target:
            raise refuse("modifies a value that is not a container")
        if was_placed[target]:
            raise refuse("modifies a container after placing it inside another object")
        if deepest + 1 > depths[target]:
            if deepest + 1 > max_depth:
                raise refuse(f"nests objects more than {max_depth} deep")
            depths[target] = deepest + 1

    append = stack.append
    ops = _OPS
    MEMOIZE, GET, PUSH, NOP, NONE, FIXED = _MEMOIZE, _GET, _PUSH, _NOP, _ARG_NONE, _ARG_FIXED  # noqa: N806 - locals: faster
    data = data if isinstance(data, bytes) else bytes(data)
    end = len(data)
    i = start
    try:
        while True:
            # -- read one opcode and skip its argument exactly as pickle reads it
            if i >= end:
                raise pickle.UnpicklingError("the pickle ends without STOP")
            code = data[i]
            if code == 0x94:  # MEMOIZE and the GETs, half the opcodes of DCP metadata: fast paths
                if not fresh:
                    raise refuse("memoizes a value twice or one it did not just create (MEMOIZE)")
                fresh = False
                memo[len(memo)] = stack[-1]
                if len(memo) > max_objects:
                    raise refuse(f"memoizes more than {max_objects} values for {size} bytes")
                i += 1
                continue
            if code == 0x68 or code == 0x6A:  # BINGET, LONG_BINGET
                if code == 0x68:
                    append(memo[data[i + 1]])  # KeyError: never stored; IndexError: truncated
                    i += 2
                else:
                    if i + 5 > end:
                        raise pickle.UnpicklingError("LONG_BINGET runs past the end of the data")
                    append(memo[int.from_bytes(data[i + 1:i + 5], "little")])
                    i += 5
                fresh = False
                if len(stack) > MAX_STACK:
                    raise refuse(f"holds more than {MAX_STACK} values on the unpickler's stack")
                continue
            entry = ops[code]
            if entry is None:
                raise pickle.UnpicklingError(f"unknown opcode {code:#04x} at offset {i}")
            kind, makes_fresh, n, layout, width, name = entry
            at = i + 1
            if layout == NONE:
                i = at
            elif layout == FIXED:
                i = at + width
            elif layout == _ARG_LEN or layout == _ARG_SLEN:
                length = int.from_bytes(data[at:at + width], "little", signed=layout == _ARG_SLEN)
                if length < 0:
                    raise pickle.UnpicklingError(f"{name} with a negative length")
                i = at + width + length
            else:
                i = data.find(b"\n", at) + 1
                if i and width == 2:
                    i = data.find(b"\n", i) + 1
                if not i:
                    raise pickle.UnpicklingError(f"{name} without its newline")
            if i > end:
                raise pickle.UnpicklingError(f"{name} at offset {at - 1} runs past the end of the data")
            if kind == NOP:
                continue
            # -- its effect on the simulated stack (commonest opcodes first)
            was_fresh, fresh = fresh, makes_fresh
            if kind == MEMOIZE:
                if not was_fresh:
                    raise refuse(f"memoizes a value twice or one it did not just create ({name})")
                memo[len(memo) if layout == NONE else _memo_key(data, at, i, layout)] = stack[-1]
                if len(memo) > max_objects:
                    raise refuse(f"memoizes more than {max_objects} values for {size} bytes")
            elif kind == GET:
                append(memo[data[at] if layout == FIXED and width == 1 else _memo_key(data, at, i, layout)])  # KeyError: never stored
                if len(stack) > MAX_STACK:
                    raise refuse(f"holds more than {MAX_STACK} values on the unpickler's stack")
            elif kind == PUSH:
                append(0)
                if len(stack) > MAX_STACK:
                    raise refuse(f"holds more than {MAX_STACK} values on the unpickler's stack")
            elif kind == _TUPLEN:  # TUPLE1-3, REDUCE, NEWOBJ, STACK_GLOBAL, NEWOBJ_EX: n entries -> 1 new one
                if len(stack) - (marks[-1] if marks else 0) < n:
                    raise pickle.UnpicklingError(f"{name} on a stack of fewer than {n} items")
                deepest = placed(stack[-n:])
                if deepest >= max_depth:
                    raise refuse(f"nests objects more than {max_depth} deep")
                depths.append(deepest + 1)
                was_placed.append(0)
                stack[-n:] = [len(depths) - 1]
                objects += 1
                if objects > max_objects:
                    raise refuse(f"creates more than {max_objects} objects for {size} bytes")
            elif kind == _NEW:
                depths.append(1)
                was_placed.append(0)
                append(len(depths) - 1)
                objects += 1
                if objects > max_objects:
                    raise refuse(f"creates more than {max_objects} objects for {size} bytes")
                if len(stack) > MAX_STACK:
                    raise refuse(f"holds more than {MAX_STACK} values on the unpickler's stack")
            elif kind == _MARK:
                marks.append(len(stack))
                if len(stack) + len(marks) > MAX_STACK:
                    raise refuse(f"holds more than {MAX_STACK} values on the unpickler's stack")
            elif kind == _MUTATE_MARK:  # APPENDS, SETITEMS, ADDITEMS
                items = pop_mark()
                if len(stack) <= (marks[-1] if marks else 0):
                    raise pickle.UnpicklingError(f"{name} on an empty stack")
                mutate(stack[-1], placed(items))
            elif kind == _FROM_MARK:  # TUPLE, LIST, DICT, FROZENSET, INST, OBJ
                stack.append(node(placed(pop_mark()) + 1))
                objects += 1
                if objects > max_objects:
                    raise refuse(f"creates more than {max_objects} objects for {size} bytes")
            elif kind == _MUTATE:  # APPEND, BUILD (n=1), SETITEM (n=2)
                if len(stack) - (marks[-1] if marks else 0) < n + 1:
                    raise pickle.UnpicklingError(f"{name} on a stack of fewer than {n + 1} items")
                items = stack[-n:]
                del stack[-n:]
                mutate(stack[-1], placed(items))
            elif kind == _POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()  # pickle's POP discards a MARK on top
                else:
                    stack.pop()  # IndexError: empty
            elif kind == _POP_MARK:
                pop_mark()
            elif kind == _DUP:
                if len(stack) <= (marks[-1] if marks else 0):
                    raise pickle.UnpicklingError("DUP on an empty stack")
                append(stack[-1])
                if len(stack) > MAX_STACK:
                    raise refuse(f"holds more than {MAX_STACK} values on the unpickler's stack")
            elif kind == _POP1_PUSH:  # BINPERSID
                if len(stack) <= (marks[-1] if marks else 0):
                    raise pickle.UnpicklingError(f"{name} on an empty stack")
                stack[-1] = node(placed(stack[-1:]) + 1)
            elif kind == _STOP:
                if len(stack) != 1 or marks:
                    raise pickle.UnpicklingError("STOP with a stack that does not hold exactly the result")
                return i
    except DcpTieredError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed or truncated opcodes
        raise CorruptCheckpointError(f"{source} is not a readable pickle: {type(exc).__name__}: {str(exc)[:300]}") from exc


def _memo_key(data: bytes, at: int, stop: int, layout: int) -> int:
    """The memo index a GET/PUT opcode names (its argument is ``data[at:stop]``), as pickle reads it."""
    if layout == _ARG_FIXED:  # BINGET/BINPUT, LONG_BINGET/LONG_BINPUT
        return int.from_bytes(data[at:stop], "little")
    text = data[at:stop - 1]  # GET/PUT: decimal digits then a newline (anything else: refused, never reinterpreted)
    if not text.isdigit():
        raise pickle.UnpicklingError(f"memo index {text[:20]!r} is not a plain decimal number")
    return int(text)


def check_torch_payload(data: "bytes | memoryview | BinaryIO", source: str, *, max_depth: int = MAX_OBJECT_DEPTH) -> None:
    """:func:`check_pickle_structure` on the pickles ``torch.load`` would unpickle from ``data``.

    ``data`` is the payload, or a seekable binary file (left at its position; a zip archive
    is then read member by member, not whole).  A zip archive (``torch.save``'s format):
    every member named ``.../data.pkl``.  A legacy (non-zip) payload: its five pickles in
    sequence (magic, protocol, sys info, the value, the storage keys); the raw storage bytes
    that follow are not pickle.
    """
    try:
        if hasattr(data, "read"):
            file = data
            at = file.tell()
            try:
                if file.read(4) != b"PK\x03\x04":
                    file.seek(at)
                    check_torch_payload(file.read(), source, max_depth=max_depth)
                    return
                file.seek(at)
                with zipfile.ZipFile(file) as archive:
                    _check_archive(archive, source, max_depth, None)
            finally:
                file.seek(at)
            return
        if bytes(data[:4]) == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                _check_archive(archive, source, max_depth, len(data))
            return
        end = 0
        for _ in range(5):
            end = check_pickle_structure(data, source, max_depth=max_depth, start=end)
            if end >= len(data):
                return
    except DcpTieredError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged archive
        raise CorruptCheckpointError(f"{source} is not a readable torch.save payload: {type(exc).__name__}: {exc}") from exc


def _check_archive(archive: zipfile.ZipFile, source: str, max_depth: int, size: "int | None") -> None:
    for info in archive.infolist():
        if not info.filename.endswith("data.pkl"):
            continue
        if info.file_size > max(info.compress_size * 64, size or 0) + (1 << 20):
            raise UnsafeCheckpointError(f"{source} has a data.pkl that inflates to {info.file_size} bytes")
        check_pickle_structure(archive.read(info), source, max_depth=max_depth)


