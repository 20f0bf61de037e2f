"""Checks a pickle stream before the C unpickler sees it, for what the C unpickler survives badly.

The C unpickler is fast, but a hostile stream can make it
- zero-fill gigabytes: PUT / LONG_BINPUT to memo slot N grows its memo array to 2N entries;
- crash with a C stack overflow: a dict key or set member that is a tuple nested ~10^5 deep
  is hashed recursively, with no recursion check (CPython 3.11);
- allocate for a counted length (BINBYTES8, BYTEARRAY8) before finding the data is not there.
`check_stream` tokenizes the stream with one regex, handing to Python only what a regex cannot
check (a large memo index, a length over 255), and so also finds where the pickle ends, and
whether it is cut off, before anything is built.
"""

from __future__ import annotations

import pickletools
import re
import struct

MAX_TUPLE_DEPTH = 10_000  # a 3.11 main thread crashes past ~140,000 levels (8 MiB stack)
MAX_MEASURED_BYTES = 4 * 1024 * 1024  # nesting is measured op by op (~1 µs each) up to this
_MEMO_SLACK = 1 << 20  # a memo index below this costs at most 16 MiB, whatever the stream

OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_STOP, _PUT, _LONG_BINPUT = ord("."), ord("p"), ord("r")
_SIGNED_LENGTHS = {ord("T"), 0x8B}  # BINSTRING, LONG4: a negative length is an error
_TUPLE_BYTES = (b"t", b"\x85", b"\x86", b"\x87")  # TUPLE, TUPLE1, TUPLE2, TUPLE3
_LENGTH_WIDTHS = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                  pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}


class StreamError(ValueError):
    """The stream is no pickle the C unpickler may be given; str() says why."""

    def __init__(self, message: str, truncated: bool = False) -> None:
        super().__init__(message)
        self.truncated = truncated


def _truncated() -> StreamError:
    return StreamError("pickle data was truncated", truncated=True)


def _build_tokenizer() -> re.Pattern[bytes]:
    """A regex that consumes a run of well-formed opcodes; it stops at STOP, at PUT and
    LONG_BINPUT with a large index, and at counted lengths over 255, which Python checks."""

    def cls(codes: list[int]) -> bytes:
        return b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"

    def counted(pad: bytes) -> bytes:  # one branch per length: a regex cannot read a count
        return b"|".join(re.escape(bytes([n])) + pad + b".{%d}" % n for n in range(256))

    plain, lines, pairs, short, long4 = [], [], [], [], []
    fixed: dict[int, list[int]] = {}
    for code, op in OPS.items():
        if code in (_STOP, _PUT, _LONG_BINPUT):
            continue
        n = op.arg.n if op.arg is not None else 0
        if op.arg is None:
            plain.append(code)
        elif op.arg.name == "stringnl_noescape_pair":  # GLOBAL, INST
            pairs.append(code)
        elif n == pickletools.UP_TO_NEWLINE:
            lines.append(code)
        elif n == pickletools.TAKEN_FROM_ARGUMENT1:
            short.append(code)
        elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            long4.append(code)
        elif n >= 0:
            fixed.setdefault(n, []).append(code)
    # Branches are tried in order: the opcodes torch writes most come first.
    token = [cls(fixed.pop(1)) + b".", cls(plain) + b"+", cls(fixed.pop(2)) + b"..",
             cls(long4) + b"(?:" + counted(b"\x00\x00\x00") + b")",
             cls(pairs) + b"[^\n]*\n[^\n]*\n",
             cls(short) + b"(?:" + counted(b"") + b")"]
    token += [cls(codes) + b".{%d}" % n for n, codes in sorted(fixed.items())]
    token += [
        b"r..[\x00-\x0f]\x00",  # LONG_BINPUT below _MEMO_SLACK
        b"p[0-9]{1,6}\n",  # PUT below _MEMO_SLACK
        cls(lines) + b"[^\n]*\n",
    ]
    return re.compile(b"(?:" + b"|".join(token) + b")*+", re.DOTALL)


_RUN = _build_tokenizer()


def check_stream(data: bytes, start: int = 0, limit: int | None = None) -> int:
    """Offset just past the STOP of the pickle at `start`. Raises StreamError if the stream
    is cut off (before `limit` bytes, if given), holds a byte that is no opcode, or asks for
    a memo slot or a tuple nesting the C unpickler cannot survive."""
    end = len(data) if limit is None else min(len(data), start + limit)
    pos = start
    if pos >= end:
        raise StreamError("there is no pickle data", truncated=True)
    match = _RUN.match
    while True:
        pos = match(data, pos, end).end()
        if pos >= end:
            raise _truncated()
        code = data[pos]
        op = OPS.get(code)
        if op is None:
            raise StreamError(f"byte {code:#04x} at offset {pos:,} is not a pickle opcode")
        if code == _STOP:
            break
        pos = _skip(data, pos, end, op)
    _check_tuple_depth(data, start, pos + 1)
    return pos + 1


def _skip(data: bytes, pos: int, end: int, op: pickletools.OpcodeInfo) -> int:
    """Step over the one opcode at `pos`, checking what the tokenizer regex left to Python."""
    code, arg = data[pos], op.arg
    pos += 1
    if arg is None:
        return pos
    n = arg.n
    if n == pickletools.UP_TO_NEWLINE:
        newline = data.find(b"\n", pos, end)
        if arg.name == "stringnl_noescape_pair" and newline >= 0:
            newline = data.find(b"\n", newline + 1, end)
        if newline < 0:
            raise _truncated()
        if code == _PUT:
            try:
                index = int(data[pos:newline])
            except ValueError:
                raise StreamError(f"PUT at offset {pos - 1:,} has a malformed index") from None
            _check_memo_index(index, end)
        return newline + 1
    if n >= 0:
        if pos + n > end:
            raise _truncated()
        if code == _LONG_BINPUT:
            _check_memo_index(struct.unpack_from("<I", data, pos)[0], end)
        return pos + n
    width = _LENGTH_WIDTHS[n]
    if pos + width > end:
        raise _truncated()
    length = int.from_bytes(data[pos:pos + width], "little", signed=code in _SIGNED_LENGTHS)
    if length < 0:
        raise StreamError(f"{op.name} at offset {pos - 1:,} has a negative length")
    if pos + width + length > end:
        raise _truncated()  # found here, the C unpickler never allocates for a lying length
    return pos + width + length


def _check_memo_index(index: int, size: int) -> None:
    # A pickler numbers memo slots from 0, one per object: a stream never needs more.
    if index > max(size, _MEMO_SLACK):
        raise StreamError(
            f"the pickle stores into memo slot {index:,}, far past what its {size:,} bytes need")


def _check_tuple_depth(data: bytes, start: int, stop: int) -> None:
    # Each byte that could be a tuple opcode bounds how deep tuples nest: only when there
    # are many is the nesting measured.
    if stop - start <= MAX_TUPLE_DEPTH:
        return
    if sum(data.count(op, start, stop) for op in _TUPLE_BYTES) <= MAX_TUPLE_DEPTH:
        return
    if stop - start > MAX_MEASURED_BYTES:
        raise StreamError(f"the pickle has too many tuple operations to check in its "
                          f"{stop - start:,} bytes")
    if _tuple_depth(data, start, stop) > MAX_TUPLE_DEPTH:
        raise StreamError(f"the pickle nests tuples more than {MAX_TUPLE_DEPTH:,} deep")


# How each opcode moves the stack, for _tuple_depth: (kind, pops to a mark?, items popped
# below the mark or in all, items pushed, argument size or None when it varies)
_MARK, _TUPLE, _GET, _PUTS, _MEMOIZE, _DUP, _KEEP, _OTHER = range(8)
_KINDS = {"MARK": _MARK, "TUPLE": _TUPLE, "TUPLE1": _TUPLE, "TUPLE2": _TUPLE, "TUPLE3": _TUPLE,
          "GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET, "PUT": _PUTS, "BINPUT": _PUTS,
          "LONG_BINPUT": _PUTS, "MEMOIZE": _MEMOIZE, "DUP": _DUP, "BUILD": _KEEP}


def _effect(op: pickletools.OpcodeInfo) -> tuple[int, bool, int, int, int | None]:
    before = op.stack_before
    to_mark = pickletools.markobject in before
    below = before.index(pickletools.markobject) if to_mark else len(before)
    size = op.arg.n if op.arg is not None else 0  # None below: the argument's length varies
    return (_KINDS.get(op.name, _OTHER), to_mark, below, len(op.stack_after),
            size if size >= 0 else None)


_EFFECTS = {code: _effect(op) for code, op in OPS.items()}


def _tuple_depth(data: bytes, start: int, stop: int) -> int:
    """How deep tuples nest, following the stack op by op without building anything; returns
    as soon as the depth passes MAX_TUPLE_DEPTH.

    Only chains of tuples matter: hashing stops at a list or dict (unhashable), at a frozenset
    (it keeps its members' hashes), and our factories return no nested tuples.
    """
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    deepest, pos = 0, start
    try:
        while pos < stop:
            code = data[pos]
            kind, to_mark, below, pushes, n = _EFFECTS[code]
            after = pos + 1 + n if n is not None else _skip(data, pos, stop, OPS[code])
            if kind == _OTHER and not to_mark:
                if below:
                    if len(stack) < below:
                        raise IndexError
                    del stack[-below:]
                stack.extend([0] * pushes)
            elif kind == _MARK:
                marks.append(len(stack))
            elif kind == _GET:
                stack.append(memo.get(_memo_index(data, pos, after), 0))
            elif kind == _PUTS:
                memo[_memo_index(data, pos, after)] = stack[-1]
            elif kind == _MEMOIZE:
                memo[len(memo)] = stack[-1]
            elif kind == _DUP:
                stack.append(stack[-1])
            else:
                popped: list[int] = []
                if to_mark:
                    at = marks.pop()
                    popped, stack[at:] = stack[at:], []
                if below:
                    if len(stack) < below:
                        raise IndexError
                    popped += stack[-below:]
                    del stack[-below:]
                if kind == _TUPLE:
                    depth = 1 + max(popped, default=0)
                    if depth > MAX_TUPLE_DEPTH:
                        return depth
                    deepest = max(deepest, depth)
                    stack.append(depth)
                elif kind == _KEEP:  # BUILD returns the object it was given
                    stack.append(popped[-2])
                else:
                    stack.extend([0] * pushes)
            pos = after
    except IndexError:
        raise StreamError("the pickle pops more than it pushed (stack underflow)") from None
    return deepest


def _memo_index(data: bytes, pos: int, after: int) -> int:
    if data[pos] in (ord("g"), _PUT):
        return int(data[pos + 1:after - 1])
    return int.from_bytes(data[pos + 1:after], "little")
