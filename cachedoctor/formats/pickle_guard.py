"""Checks a pickle stream before the C unpickler sees it, for what the C unpickler survives badly.

The C unpickler is fast, but a hostile stream can make it
- zero-fill gigabytes: PUT / LONG_BINPUT to memo slot N grows its memo array to 2N entries;
- crash with a C stack overflow: a dict key or set member that is a tuple nested ~10^5 deep
  is hashed recursively, with no recursion check (CPython 3.11);
- allocate for a counted length (BINBYTES8, BYTEARRAY8) before finding the data is not there;
- build gigabytes from megabytes: each opcode byte can make an object (a set is 224 bytes).
`check_stream` tokenizes the stream with one regex, handing to Python only what a regex cannot
check (a large memo index, a length over 255), and so also finds where the pickle ends, and
whether it is cut off, before anything is built. A large stream's opcodes are then counted, at
C speed, for what they would build (MAX_BUILD_BYTES) and how many tuples they make.
"""

from __future__ import annotations

import functools
import pickletools
import re
import struct

MAX_TUPLE_DEPTH = 10_000  # a 3.11 main thread crashes past ~140,000 levels (8 MiB stack)
MAX_MEASURED_BYTES = 4 * 1024 * 1024  # nesting is measured op by op (~1 µs each) up to this
_MEMO_SLACK = 1 << 20  # a memo index below this costs at most 16 MiB, whatever the stream
# What unpickling may build, estimated from the opcodes before anything is built: the objects,
# stack entries and memo slots they create, and the stream's own bytes (strings are copies). A
# latent's data.pkl builds a few KiB; a dict of 200,000 file names (a big dataset's aggregate)
# about 30 MiB. Without a cap one opcode byte can build a 224-byte set: 15 GiB from 64 MiB.
MAX_BUILD_BYTES = 256 * 1024 * 1024

OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_STOP, _PUT, _LONG_BINPUT = ord("."), ord("p"), ord("r")
_SIGNED_LENGTHS = {ord("T"), 0x8B}  # BINSTRING, LONG4: a negative length is an error
_TUPLE_BYTES = (b"t", b"\x85", b"\x86", b"\x87")  # TUPLE, TUPLE1, TUPLE2, TUPLE3
_LENGTH_WIDTHS = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                  pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}


# Estimated bytes each opcode builds (measured with tracemalloc on CPython 3.11, rounded up).
_BUILDS = {
    # a set, or a call to a factory (a Stub with its args, items and mapping): 224-265 bytes
    240: ("EMPTY_SET", "FROZENSET", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"),
    # a dict, list or tuple: 56-73 bytes, and the stack entry it takes
    80: ("EMPTY_DICT", "DICT", "EMPTY_LIST", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"),
    # a number, string, bytes or global, and its stack entry (the characters count apart)
    48: ("INT", "BININT", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING",
         "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
         "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "GLOBAL",
         "STACK_GLOBAL", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"),
    # a stack entry for a shared object, a mark, or a memo slot (the memo doubles as it grows)
    16: ("NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "BININT1", "DUP", "MARK", "GET", "BINGET",
         "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"),
}  # every other opcode pops, stores into what exists, or reads a header: 0
_WEIGHT = [0] * 256  # by opcode byte
for _bytes, _names in _BUILDS.items():
    for _op in pickletools.opcodes:
        if _op.name in _names:
            _WEIGHT[ord(_op.code)] = _bytes
_MAX_WEIGHT = max(_BUILDS)
# For counting at C speed: bytes.translate maps each opcode to a class byte, tuples apart.
_CLASS_WEIGHTS = [(bytes([65 + i]), w) for i, w in enumerate(_BUILDS)] + [(b"t", 80)]
_CLASS = bytes(ord("t") if bytes([c]) in _TUPLE_BYTES else
               next((k[0] for k, w in _CLASS_WEIGHTS if w == _WEIGHT[c]), ord("0"))
               for c in range(256))
_SLOT_BYTES = 16  # a memo slot: the C unpickler's memo is an array, doubled to fit an index


class StreamError(ValueError):
    """The stream is no pickle the C unpickler may be given; str() says why."""

    def __init__(self, message: str, truncated: bool = False) -> None:
        super().__init__(message)
        self.truncated = truncated


def _truncated() -> StreamError:
    return StreamError("pickle data was truncated", truncated=True)


def _cls(codes: list[int]) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"


def token_patterns(leave: frozenset[int]) -> tuple[bytes, list[bytes]]:
    """(class of the opcodes without argument, a pattern per kind of opcode with one) for every
    opcode but those in `leave`; counted lengths over 255 are left to Python too."""

    def counted(pad: bytes) -> bytes:  # one branch per length: a regex cannot read a count
        return b"(?:" + b"|".join(re.escape(bytes([n])) + pad + b".{%d}" % n
                                  for n in range(256)) + b")"

    plain, lines, pairs, short, long4 = [], [], [], [], []
    fixed: dict[int, list[int]] = {}
    for code, op in OPS.items():
        if code in leave:
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
    args = [_cls(fixed.pop(n)) + b"." * n for n in (1, 2) if n in fixed]
    if long4:
        args.append(_cls(long4) + counted(b"\x00\x00\x00"))
    if pairs:
        args.append(_cls(pairs) + b"[^\n]*\n[^\n]*\n")
    if short:
        args.append(_cls(short) + counted(b""))
    args += [_cls(codes) + b".{%d}" % n for n, codes in sorted(fixed.items())]
    if lines:
        args.append(_cls(lines) + b"[^\n]*\n")
    return _cls(plain), args


def _build_tokenizer() -> re.Pattern[bytes]:
    """A regex that consumes a run of well-formed opcodes; it stops at STOP, at PUT and
    LONG_BINPUT with a large index, and at counted lengths over 255, which Python checks."""
    return re.compile(b"(?:" + b"|".join([_ARGS[0], _PLAIN + b"+", *_ARGS[1:]]) + b")*+",
                      re.DOTALL)


_PLAIN, _ARGS = token_patterns(frozenset({_STOP, _PUT, _LONG_BINPUT}))
_ARGS += [
    b"r..[\x00-\x0f]\x00",  # LONG_BINPUT below _MEMO_SLACK
    b"p[0-9]{1,6}\n",  # PUT below _MEMO_SLACK
]
_RUN = _build_tokenizer()


@functools.cache
def _counters() -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """For counting opcodes (compiled on first use: most streams are too small to need it): a
    stretch of up to 4096 tokens, and a token with its opcode bytes captured. A token is an
    opcode with its argument, or a run of up to 1024 opcodes without one (so a stretch, and
    what is built to count it, stays within a few MiB)."""
    token = b"(?:" + b"|".join([_PLAIN + b"{1,1024}+", *_ARGS]) + b")"
    return (re.compile(token + b"{1,4096}+", re.DOTALL),
            re.compile(b"(?=(" + _PLAIN + b"{1,1024}+|.))" + token, re.DOTALL))


_PIECE = 4 * 1024 * 1024  # bytes translated at a time for the quick bound


def check_stream(data: bytes, start: int = 0, limit: int | None = None) -> int:
    """Offset just past the STOP of the pickle at `start`. Raises StreamError if the stream
    is cut off (before `limit` bytes, if given), holds a byte that is no opcode, or asks for
    a memo slot or a tuple nesting the C unpickler cannot survive."""
    end = len(data) if limit is None else min(len(data), start + limit)
    pos = start
    if pos >= end:
        raise StreamError("there is no pickle data", truncated=True)
    match = _RUN.match
    memo = 0  # the highest memo slot past _MEMO_SLACK the stream stores into
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
        after = _skip(data, pos, end, op)
        if code in (_PUT, _LONG_BINPUT):
            memo = max(memo, _memo_index(data, pos, after))
        pos = after
    tuples = _check_build(data, start, pos + 1, memo)
    _check_tuple_depth(data, start, pos + 1, tuples)
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


def _check_build(data: bytes, start: int, stop: int, memo: int) -> int | None:
    """Raise StreamError if unpickling data[start:stop] (well-formed, STOP included) would build
    more than MAX_BUILD_BYTES; return how many tuple opcodes it holds when they were counted.

    Counting every byte as if it were an opcode bounds both at C speed; only when that bound
    is too high are the opcodes themselves counted (about 0.1 µs each, or 4 MiB of opcodes
    without argument at a time), stopping as soon as the cap is passed.
    """
    size = stop - start
    fixed = size + memo * _SLOT_BYTES
    if fixed + size * _MAX_WEIGHT <= MAX_BUILD_BYTES:
        return None
    builds, tuples = fixed, 0
    for at in range(start, stop, _PIECE):
        counts = data[at:min(stop, at + _PIECE)].translate(_CLASS)
        builds += sum(w * counts.count(c) for c, w in _CLASS_WEIGHTS)
        tuples += counts.count(b"t")
    if builds <= MAX_BUILD_BYTES and tuples <= MAX_TUPLE_DEPTH:
        return tuples
    builds, tuples, objects, pos = fixed, 0, 0, start
    chunk, opcodes = _counters()
    while pos < stop:
        found = chunk.match(data, pos, stop)
        if found is None:  # an opcode the regex leaves to Python
            code = data[pos]
            builds += _WEIGHT[code]
            objects += _WEIGHT[code] > 0
            pos = _skip(data, pos, stop, OPS[code])
        else:
            counts = b"".join(opcodes.findall(data, pos, found.end())).translate(_CLASS)
            for c, w in _CLASS_WEIGHTS:
                n = counts.count(c)
                builds += w * n
                objects += n
            tuples += counts.count(b"t")
            pos = found.end()
        if builds > MAX_BUILD_BYTES:
            raise StreamError(
                f"the pickle would build more than {MAX_BUILD_BYTES // 2**20} MiB of objects, "
                f"stack entries and memo slots ({objects:,} of them in its first "
                f"{pos - start:,} bytes, counted before anything is built): no cache holds "
                "that much, and cachedoctor does not unpickle it")
    return tuples


def _check_tuple_depth(data: bytes, start: int, stop: int, tuples: int | None = None) -> None:
    # How many tuple opcodes there are (or, when not counted, how many bytes could be one)
    # bounds how deep tuples nest: only when there are many is the nesting measured.
    if stop - start <= MAX_TUPLE_DEPTH:
        return
    if tuples is None:
        tuples = sum(data.count(op, start, stop) for op in _TUPLE_BYTES)
    if tuples <= MAX_TUPLE_DEPTH:
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
