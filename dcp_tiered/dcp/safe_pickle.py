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

The opcodes are first scanned by :func:`~dcp_tiered.dcp.pickle_scan.check_pickle_structure`
(depth, stack, memo and object counts), so the depth tracking here is not the only defence.
The tables of allowed names, shapes and limits are in :mod:`dcp_tiered.dcp.pickle_allowlist`.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections import OrderedDict
from itertools import repeat
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md

from dcp_tiered.dcp.pickle_allowlist import (ALLOWED_GLOBALS, BUILDABLE, MAX_CONTAINER_ITEMS, MAX_DEPTH, MAX_DIMS,
                                             MAX_INT_BYTES, MAX_SAME_HASH, MAX_TOTAL_ITEMS, REDUCE_RULES,
                                             TORCH_DTYPE_NAMES, TORCH_MISC_NAMES, field_state_ok, index_key_ok,
                                             tensor_properties_state_ok)
from dcp_tiered.dcp.pickle_scan import check_pickle_structure
from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError, UnsafeCheckpointError
from dcp_tiered.names import METADATA_FILE

_STR = frozenset({str})
_SIZE = torch.Size


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
            if not index_key_ok(key):
                raise self._refuse("has a MetadataIndex key with invalid fields")
            h = hash(key)
            n = self._hashes.get(h, 0) + 1
            if n > MAX_SAME_HASH:
                raise self._refuse(f"has more than {MAX_SAME_HASH} keys with one hash value (a hash-collision attack)")
            self._hashes[h] = n

    # -- names --------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name in TORCH_DTYPE_NAMES or name in TORCH_MISC_NAMES):
            return getattr(torch, name)
        if name in ALLOWED_GLOBALS.get(module, ()):
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
        if not isinstance(cls, type) or cls not in BUILDABLE:
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
            if not tensor_properties_state_ok(state):
                raise self._refuse("has TensorProperties state that is not (dtype, layout, bool, format, bool)")
            inst.__setstate__(state)
        else:
            if not field_state_ok(cls, state):
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
            if type(args) is not tuple or len(args) != 1 or type(args[0]) not in (tuple, list) or len(args[0]) > MAX_DIMS:
                raise self._refuse("calls torch.Size with arguments of the wrong shape")
            stack[-1] = value = _SIZE(args[0])
            self._depth[id(value)] = 1
            return
        check = REDUCE_RULES.get(id(func))
        if check is None or check[0] is not func:
            raise self._refuse(f"calls {getattr(func, '__name__', type(func).__name__)} with REDUCE")
        if type(args) is not tuple or not check[1](self, args):
            raise self._refuse(f"calls {func.__name__} with arguments of the wrong shape")
        stack[-1] = self._register(func(*args), self._depth.get(id(args), 0) + 1)

    dispatch[_op(pickle.REDUCE)] = load_reduce

    # -- integers -----------------------------------------------------------------

    def load_long4(self) -> None:
        (n,) = struct.unpack("<i", self.read(4))
        if not 0 <= n <= MAX_INT_BYTES:
            raise self._refuse(f"has a {n}-byte integer")
        self.append(pickle.decode_long(self.read(n)))

    dispatch[_op(pickle.LONG4)] = load_long4

    def load_long(self) -> None:
        line = self.readline()
        if len(line) > 3 * MAX_INT_BYTES:
            raise self._refuse("has an integer of more than 128 bits")
        val = line[:-1]
        if val and val[-1] == b"L"[0]:
            val = val[:-1]
        self.append(int(val, 0))

    dispatch[_op(pickle.LONG)] = load_long


def safe_loads(data: bytes, source: str = METADATA_FILE, exact: bool = True) -> Any:
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
