"""Structure scan of a pickle from a checkpoint, run before anything unpickles it.

Before any pickle from a checkpoint is unpickled (``.metadata`` by the allow-list unpickler
of :mod:`dcp_tiered.dcp.safe_pickle`, non-tensor items and stock tensor items by
``torch.load(weights_only=True)``, which has no depth cap), its opcodes are walked once (read
as pickle reads them) and the unpickler's stack is simulated symbolically: a depth per
entry, the memo, and counts.  Nothing is built, so the scan cannot itself recurse, crash or
allocate more than a few words per opcode.

:func:`check_pickle_structure` scans one pickle; :func:`check_torch_payload` scans the
pickles ``torch.load`` would unpickle from a ``torch.save`` payload (zip or legacy).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from typing import Any, BinaryIO

from dcp_tiered.errors import CorruptCheckpointError, DcpTieredError, UnsafeCheckpointError

#: Deepest nesting accepted in a non-tensor object (``hash()``/``repr()`` of ~10^5 nested
#: tuples overflows the C stack; real optimizer/scheduler/trainer states nest < 15).
MAX_OBJECT_DEPTH = 100
#: Most entries on the unpickler's stack at once (pickle batches APPENDS/SETITEMS by 1000;
#: a tuple is pushed whole: a frame table of the largest record has 2^20 items).
MAX_STACK = (1 << 20) + (1 << 16)
# Objects and memo entries a pickle may create: a constant plus a share of its size. Real
# pickles spend several bytes per object; 1-byte EMPTY_DICT/MEMOIZE spam cannot reach more
# than a few times the size of a real pickle's objects.
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
# or one/two newline-terminated lines.  None and fixed come first: ``layout <= _ARG_FIXED``
# means the argument is ``width`` bytes (0 for none).
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
for _opcode in pickletools.opcodes:
    _OPS[ord(_opcode.code)] = (_CLASS_OF[_opcode.name], _opcode.name in _MEMOIZABLE, _TAKES.get(_opcode.name, 0),
                               *_ARGS.get(_opcode.name, (_ARG_NONE, 0)), _opcode.name)
del _opcode


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
    try:
        return _Scan(data if isinstance(data, bytes) else bytes(data), source, max_depth, start).run(start)
    except DcpTieredError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed or truncated opcodes
        raise CorruptCheckpointError(f"{source} is not a readable pickle: {type(exc).__name__}: {str(exc)[:300]}") from exc


class _Scan:
    """The simulated unpickler of one :func:`check_pickle_structure` call.

    A stack entry is 0 (a scalar or immutable leaf) or the number k of a node: a container or
    instance, ``depths[k]`` deep, ``was_placed[k]`` once it was put inside another object.
    Plain ints and arrays, so the scan allocates no objects the garbage collector has to walk.
    :meth:`run` handles the commonest opcodes inline (a call per opcode would slow the scan
    down); the other opcode families have one method each (``_on_*``, found through
    ``_HANDLERS``), returning the number of objects they create.  ``fresh`` in :meth:`run`: the
    top of the stack was just pushed by an opcode that creates a memoizable object.
    """

    def __init__(self, data: bytes, source: str, max_depth: int, start: int) -> None:
        self.data = data
        self.source = source
        self.max_depth = max_depth
        self.size = len(data) - start
        self.max_objects = self.size // _OBJECTS_PER_BYTE + _FREE_OBJECTS
        self.stack: list[int] = []
        self.marks: list[int] = []  # stack lengths at each MARK
        self.memo: dict[int, int] = {}
        self.depths = [0]
        self.was_placed = bytearray(1)

    def run(self, start: int) -> int:
        """Scan the pickle at ``start``; the offset just past its STOP."""
        data, end, ops, handlers = self.data, len(self.data), _OPS, _HANDLERS
        stack, memo, marks, depths, was_placed = self.stack, self.memo, self.marks, self.depths, self.was_placed
        append, max_depth, max_objects = stack.append, self.max_depth, self.max_objects
        objects, fresh, i = 0, False, start
        while True:  # read one opcode, skip its argument exactly as pickle reads it, apply its effect
            if i >= end:
                raise pickle.UnpicklingError("the pickle ends without STOP")
            code = data[i]
            if code == 0x94:  # MEMOIZE and the GETs, half the opcodes of DCP metadata: fast paths
                if not fresh:
                    raise self.refuse("memoizes a value twice or one it did not just create (MEMOIZE)")
                fresh = False
                memo[len(memo)] = stack[-1]
                if len(memo) > max_objects:
                    raise self.too_many("memoizes", "values")
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
                    raise self.too_deep_stack()
                continue
            entry = ops[code]
            if entry is None:
                raise pickle.UnpicklingError(f"unknown opcode {code:#04x} at offset {i}")
            kind, makes_fresh, n, layout, width, name = entry
            at = i + 1
            i = at + width if layout <= _ARG_FIXED else _arg_end(data, at, layout, width, name)
            if i > end:
                raise pickle.UnpicklingError(f"{name} at offset {at - 1} runs past the end of the data")
            if kind == _NOP:
                continue
            was_fresh, fresh = fresh, makes_fresh  # effects, commonest first
            if kind == _PUSH:
                append(0)
                if len(stack) > MAX_STACK:
                    raise self.too_deep_stack()
                continue
            if kind == _TUPLEN:  # TUPLE1-3, REDUCE, NEWOBJ, STACK_GLOBAL, NEWOBJ_EX: n entries -> 1 new one
                if len(stack) - (marks[-1] if marks else 0) < n:
                    raise pickle.UnpicklingError(f"{name} on a stack of fewer than {n} items")
                deepest = 0
                for k in stack[-n:]:  # self.placed, inline: the commonest opcodes with an effect
                    if k:
                        was_placed[k] = 1
                        if depths[k] > deepest:
                            deepest = depths[k]
                if deepest >= max_depth:
                    raise self.refuse(f"nests objects more than {max_depth} deep")
                depths.append(deepest + 1)
                was_placed.append(0)
                stack[-n:] = [len(depths) - 1]
                objects += 1
            elif kind == _NEW:  # EMPTY_LIST, EMPTY_DICT, EMPTY_SET
                depths.append(1)
                was_placed.append(0)
                append(len(depths) - 1)
                objects += 1
                if objects > max_objects or len(stack) > MAX_STACK:  # in this order
                    raise self.too_many("creates", "objects") if objects > max_objects else self.too_deep_stack()
            elif kind == _MARK:
                marks.append(len(stack))
                if len(stack) + len(marks) > MAX_STACK:
                    raise self.too_deep_stack()
            elif kind == _STOP:
                return self._on_stop(i)
            else:
                objects += handlers[kind](self, entry, at, i, was_fresh)
            if objects > max_objects:
                raise self.too_many("creates", "objects")

    # -- helpers ------------------------------------------------------------------------------------

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.source} {what}, which a checkpoint written by torch/DCP never does; the file is damaged "
            "or malicious: refusing to unpickle it"
        )

    def too_deep_stack(self) -> UnsafeCheckpointError:
        return self.refuse(f"holds more than {MAX_STACK} values on the unpickler's stack")

    def too_many(self, verb: str, what: str) -> UnsafeCheckpointError:
        return self.refuse(f"{verb} more than {self.max_objects} {what} for {self.size} bytes")

    def placed(self, items: Any) -> int:
        """Mark ``items`` as placed into a parent; their deepest depth."""
        depths, was_placed = self.depths, self.was_placed
        deepest = 0
        for k in items:
            if k:
                was_placed[k] = 1
                if depths[k] > deepest:
                    deepest = depths[k]
        return deepest

    def node(self, depth: int) -> int:
        """A new container or instance ``depth`` deep: its number."""
        if depth > self.max_depth:
            raise self.refuse(f"nests objects more than {self.max_depth} deep")
        self.depths.append(depth)
        self.was_placed.append(0)
        return len(self.depths) - 1

    def pop_mark(self) -> list:
        if not self.marks:
            raise pickle.UnpicklingError("no MARK on the stack")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def mutate(self, target: Any, deepest: int) -> None:
        """``target`` (an entry of the stack) gets items as deep as ``deepest``."""
        if not target:
            raise self.refuse("modifies a value that is not a container")
        if self.was_placed[target]:
            raise self.refuse("modifies a container after placing it inside another object")
        if deepest + 1 > self.depths[target]:
            if deepest + 1 > self.max_depth:
                raise self.refuse(f"nests objects more than {self.max_depth} deep")
            self.depths[target] = deepest + 1

    def _empty_above_mark(self) -> bool:
        return len(self.stack) <= (self.marks[-1] if self.marks else 0)

    # -- the other opcode families: ``handler(entry, at, stop, was_fresh)`` -> objects created ------
    # ``entry`` is the opcode's row of _OPS, ``data[at:stop]`` its argument, ``was_fresh`` whether
    # the opcode before it created a memoizable object.

    def _on_stop(self, stop: int) -> int:
        if len(self.stack) != 1 or self.marks:
            raise pickle.UnpicklingError("STOP with a stack that does not hold exactly the result")
        return stop

    def _on_put(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        """PUT, BINPUT, LONG_BINPUT (MEMOIZE takes the fast path in :meth:`run`)."""
        if not was_fresh:
            raise self.refuse(f"memoizes a value twice or one it did not just create ({entry[5]})")
        self.memo[_memo_key(self.data, at, stop, entry[3])] = self.stack[-1]
        if len(self.memo) > self.max_objects:
            raise self.too_many("memoizes", "values")
        return 0

    def _on_get(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        """GET (BINGET and LONG_BINGET take the fast path in :meth:`run`)."""
        self.stack.append(self.memo[_memo_key(self.data, at, stop, entry[3])])  # KeyError: never stored
        if len(self.stack) > MAX_STACK:
            raise self.too_deep_stack()
        return 0

    def _on_mutate_mark(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        """APPENDS, SETITEMS, ADDITEMS: the items above the MARK go into the object below it."""
        items = self.pop_mark()
        if self._empty_above_mark():
            raise pickle.UnpicklingError(f"{entry[5]} on an empty stack")
        self.mutate(self.stack[-1], self.placed(items))
        return 0

    def _on_from_mark(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        """TUPLE, LIST, DICT, FROZENSET, INST, OBJ: the items above the MARK -> one new object."""
        self.stack.append(self.node(self.placed(self.pop_mark()) + 1))
        return 1

    def _on_mutate(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        """APPEND, BUILD (n=1), SETITEM (n=2): n items go into the object below them."""
        stack, n = self.stack, entry[2]
        if len(stack) - (self.marks[-1] if self.marks else 0) < n + 1:
            raise pickle.UnpicklingError(f"{entry[5]} on a stack of fewer than {n + 1} items")
        items = stack[-n:]
        del stack[-n:]
        self.mutate(stack[-1], self.placed(items))
        return 0

    def _on_pop(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        if self.marks and self.marks[-1] == len(self.stack):
            self.marks.pop()  # pickle's POP discards a MARK on top
        else:
            self.stack.pop()  # IndexError: empty
        return 0

    def _on_pop_mark(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        self.pop_mark()
        return 0

    def _on_dup(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        if self._empty_above_mark():
            raise pickle.UnpicklingError("DUP on an empty stack")
        self.stack.append(self.stack[-1])
        if len(self.stack) > MAX_STACK:
            raise self.too_deep_stack()
        return 0

    def _on_persid(self, entry: tuple, at: int, stop: int, was_fresh: bool) -> int:
        """BINPERSID: the persistent id on top becomes an object."""
        if self._empty_above_mark():
            raise pickle.UnpicklingError(f"{entry[5]} on an empty stack")
        self.stack[-1] = self.node(self.placed(self.stack[-1:]) + 1)
        return 0


# opcode class -> the _Scan method applying it (the classes run() does not handle inline)
_HANDLERS: list[Any] = [None] * 15
for _kind, _handler in (
    (_FROM_MARK, _Scan._on_from_mark), (_MUTATE, _Scan._on_mutate), (_MUTATE_MARK, _Scan._on_mutate_mark),
    (_POP, _Scan._on_pop), (_POP_MARK, _Scan._on_pop_mark), (_DUP, _Scan._on_dup), (_POP1_PUSH, _Scan._on_persid),
    (_MEMOIZE, _Scan._on_put), (_GET, _Scan._on_get),
):
    _HANDLERS[_kind] = _handler
del _kind, _handler


def _arg_end(data: bytes, at: int, layout: int, width: int, name: str) -> int:
    """Where a variable-length argument starting at ``at`` ends, read as pickle reads it."""
    if layout == _ARG_LEN or layout == _ARG_SLEN:
        length = int.from_bytes(data[at:at + width], "little", signed=layout == _ARG_SLEN)
        if length < 0:
            raise pickle.UnpicklingError(f"{name} with a negative length")
        return at + width + length
    i = data.find(b"\n", at) + 1
    if i and width == 2:
        i = data.find(b"\n", i) + 1
    if not i:
        raise pickle.UnpicklingError(f"{name} without its newline")
    return i


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
            _check_payload_file(data, source, max_depth)
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


def _check_payload_file(file: BinaryIO, source: str, max_depth: int) -> None:
    """:func:`check_torch_payload` of a seekable file, left at its position."""
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


def _check_archive(archive: zipfile.ZipFile, source: str, max_depth: int, size: "int | None") -> None:
    for info in archive.infolist():
        if not info.filename.endswith("data.pkl"):
            continue
        if info.file_size > max(info.compress_size * 64, size or 0) + (1 << 20):
            raise UnsafeCheckpointError(f"{source} has a data.pkl that inflates to {info.file_size} bytes")
        check_pickle_structure(archive.read(info), source, max_depth=max_depth)
