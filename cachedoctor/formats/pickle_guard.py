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
C speed, for what they would build (MAX_BUILD_BYTES) and how many tuples they make. When there
are more than MAX_TUPLE_DEPTH, their nesting is bounded from the shape of the opcodes, at C
speed too (a big dataset's aggregate holds millions of shallow tuples), and only what that
cannot bound is measured op by op, following the C unpickler's stack.
"""

from __future__ import annotations

import functools
import operator
import pickletools
import re
import struct
from collections.abc import Iterator

MAX_TUPLE_DEPTH = 10_000  # a 3.11 main thread crashes past ~140,000 levels (8 MiB stack)
# Nesting that _shallow cannot bound is measured op by op (~0.2 µs each) in up to this many
# opcodes (a few seconds at worst); past it the pickle is refused.
MAX_MEASURED_OPS = 4_000_000
_MEMO_SLACK = 1 << 20  # a memo index below this costs at most 16 MiB, whatever the stream
# What unpickling may build, estimated from the opcodes before anything is built: the objects,
# stack entries and memo slots they create, and the stream's own bytes (strings are copies). A
# latent's data.pkl builds a few KiB; a dict of 200,000 file names (a big dataset's aggregate)
# about 30 MiB. Without a cap one opcode byte can build a 224-byte set: 15 GiB from 64 MiB.
MAX_BUILD_BYTES = 256 * 1024 * 1024

OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
OPS_BY_NAME = {op.name: op for op in pickletools.opcodes}
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
    tuples, ops = _check_build(data, start, pos + 1, memo)
    _check_tuple_depth(data, start, pos + 1, tuples, ops)
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


def _opcode_pieces(data: bytes, start: int, stop: int, memo_tokens: list[bytes] | None = None,
                   ) -> Iterator[tuple[bytes, int]]:
    """The opcodes of data[start:stop] (well-formed), one byte each, arguments dropped, in
    pieces of up to 4096 tokens, with the offset each piece ends at; at C speed but for the
    opcodes the regex leaves to Python. Given `memo_tokens`, the GET and PUT tokens (opcode and
    argument) are appended to it in order."""
    chunk, opcodes = _counters()
    if memo_tokens is not None:
        opcodes, take = _memo_counter(), memo_tokens.extend
    pos = start
    while pos < stop:
        found = chunk.match(data, pos, stop)
        if found is None:  # an opcode the regex leaves to Python
            code = data[pos]
            after = _skip(data, pos, stop, OPS[code])
            if memo_tokens is not None and code in (_PUT, _LONG_BINPUT):
                memo_tokens.append(data[pos:after])
            yield data[pos:pos + 1], after
            pos = after
        elif memo_tokens is None:
            pos = found.end()
            yield b"".join(opcodes.findall(data, found.start(), pos)), pos
        else:
            pos = found.end()
            pairs = opcodes.findall(data, found.start(), pos)
            take(filter(None, map(_SECOND, pairs)))
            yield b"".join(map(_FIRST, pairs)), pos


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


@functools.cache
def _memo_counter() -> re.Pattern[bytes]:
    """_counters()'s token regex that also captures each GET and PUT token whole."""
    token = b"(?:" + b"|".join([_PLAIN + b"{1,1024}+", *_ARGS]) + b")"
    memo = b"(h.|j.{4}|q.|r..[\x00-\x0f]\x00|p[0-9]{1,6}\n|g[^\n]*\n)"  # as _ARGS has them
    return re.compile(b"(?=(" + _PLAIN + b"{1,1024}+|.))(?:" + memo + b"|" + token + b")",
                      re.DOTALL)


def _check_build(data: bytes, start: int, stop: int, memo: int,
                 ) -> tuple[int | None, bytes | None]:
    """Raise StreamError if unpickling data[start:stop] (well-formed, STOP included) would build
    more than MAX_BUILD_BYTES; return how many tuple opcodes it holds, and its opcodes one byte
    each, when they were counted.

    Counting every byte as if it were an opcode bounds both at C speed; only when that bound
    is too high are the opcodes themselves counted (about 0.1 µs each, or 4 MiB of opcodes
    without argument at a time), stopping as soon as the cap is passed.
    """
    size = stop - start
    fixed = size + memo * _SLOT_BYTES
    if fixed + size * _MAX_WEIGHT <= MAX_BUILD_BYTES:
        return None, None
    builds, tuples = fixed, 0
    for at in range(start, stop, _PIECE):
        counts = data[at:min(stop, at + _PIECE)].translate(_CLASS)
        builds += sum(w * counts.count(c) for c, w in _CLASS_WEIGHTS)
        tuples += counts.count(b"t")
    if builds <= MAX_BUILD_BYTES and tuples <= MAX_TUPLE_DEPTH:
        return tuples, None
    builds, tuples, objects, pieces = fixed, 0, 0, []
    for ops, pos in _opcode_pieces(data, start, stop):
        pieces.append(ops)
        counts = ops.translate(_CLASS)
        for c, w in _CLASS_WEIGHTS:
            n = counts.count(c)
            builds += w * n
            objects += n
        tuples += counts.count(b"t")
        if builds > MAX_BUILD_BYTES:
            raise StreamError(
                f"the pickle would build more than {MAX_BUILD_BYTES // 2**20} MiB of objects, "
                f"stack entries and memo slots ({objects:,} of them in its first "
                f"{pos - start:,} bytes, counted before anything is built): no latent or "
                "embedding holds that much (a OneTrainer aggregate.pt of ~500,000 samples "
                "does), and cachedoctor does not unpickle it: not checked")
    return tuples, b"".join(pieces)


def _check_tuple_depth(data: bytes, start: int, stop: int, tuples: int | None = None,
                       ops: bytes | None = None) -> None:
    """Raise StreamError if data[start:stop] (well-formed, STOP included) nests tuples more
    than MAX_TUPLE_DEPTH deep. `tuples` and `ops` are what _check_build counted, if it did.

    How many tuple opcodes there are (or, when not counted, how many bytes could be one) bounds
    how deep tuples nest; when there are many, _shallow bounds the nesting from the opcodes'
    shape at C speed, which suffices for what picklers write; only what it cannot bound is
    measured op by op, up to MAX_MEASURED_OPS opcodes.
    """
    if stop - start <= MAX_TUPLE_DEPTH:
        return
    if tuples is None:
        tuples = sum(data.count(op, start, stop) for op in _TUPLE_BYTES)
    if tuples <= MAX_TUPLE_DEPTH:
        return
    if ops is None:
        ops = b"".join(ops for ops, _ in _opcode_pieces(data, start, stop))
    if _shallow(ops):
        return
    if len(ops) > MAX_MEASURED_OPS:
        raise StreamError(f"the pickle has too many tuple operations to check in its "
                          f"{stop - start:,} bytes")
    if _tuple_depth(data, start, stop) > MAX_TUPLE_DEPTH:
        raise StreamError(f"the pickle nests tuples more than {MAX_TUPLE_DEPTH:,} deep")


# ---- the nesting, bounded from the shape of the opcodes ----------------------------------------
#
# Each opcode becomes a letter: a pushes a new value that is no tuple (a string, a number, an
# empty container, a global), ( is MARK, 1 2 3 t make tuples of the top 1, 2, 3 values or of
# those above the mark, and the other capitals say how they use the stack (below). The memo
# stores are dropped: they move nothing. Anything else (a GET, DUP, POP) is kept as it is: the
# value it pushes or leaves on top is unknown.
_SHAPES = {
    b"a": ("NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1",
           "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE",
           "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
           "BINBYTES8", "BYTEARRAY8", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE",
           "GLOBAL", "PERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER"),
    b"(": ("MARK",), b"1": ("TUPLE1",), b"2": ("TUPLE2",), b"3": ("TUPLE3",), b"t": ("TUPLE",),
    # pop 1, 2 or 3 values and push a new one (our factories return no tuple but torch.Size's)
    b"Q": ("BINPERSID", "READONLY_BUFFER"), b"R": ("REDUCE", "NEWOBJ", "STACK_GLOBAL"),
    b"W": ("NEWOBJ_EX",),
    b"L": ("LIST", "DICT", "FROZENSET", "OBJ", "INST"),  # pop to the mark, push a new value
    b"U": ("APPENDS", "SETITEMS", "ADDITEMS"),  # pop to the mark, keep the container below it
    b"A": ("APPEND", "BUILD"),  # pop 1 value, keep the object below it
    b"S": ("SETITEM",),  # pop 2, keep the dict below them
}
_DROPPED = ("PROTO", "FRAME", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
_SHAPE = bytearray(b"?" * 256)
for _letter, _names in _SHAPES.items():
    for _name in _names:
        _SHAPE[ord(OPS_BY_NAME[_name].code)] = _letter[0]
_SHAPE = bytes(_SHAPE)
_DROP = bytes(ord(OPS_BY_NAME[name].code) for name in _DROPPED)
# One step of a pass: an opcode that only uses new values made just before it, with those
# values, becomes one new value. Fixed strings are replaced at memchr speed, the rest by regexes
# that start with a literal (which re finds fast).
_STEPS = [*(operator.methodcaller("replace", fixed, b"a")
            for fixed in (b"aa2", b"a1", b"aaa3", b"aaR", b"aQ", b"aaaW", b"aaA", b"aaaS")),
          *(functools.partial(re.compile(pattern).sub, b"a")
            for pattern in (b"\\(a*+[tL]", b"a\\(a*+U"))]
_PASSES = 4


def _shallow(ops: bytes) -> bool:
    """True if the opcodes, one byte each, provably nest tuples at most MAX_TUPLE_DEPTH deep.

    Each step that changes the shape makes the values it replaces at most one level deeper than
    any new value was before it (torch.Size's tuples of integers are 1 deep): after n of them,
    at most n + 1 deep. A tuple that contains a tuple d levels down its nesting, d > n + 1, is
    one of the tuple opcodes left: so if n + 1 + (tuple opcodes left) is at most
    MAX_TUPLE_DEPTH, so is the nesting. What picklers write is settled in a pass or two, each
    at C speed (about 0.01 µs an opcode).
    """
    shape = ops.translate(_SHAPE, _DROP)
    steps = 0
    for _ in range(_PASSES):
        left = sum(shape.count(c) for c in (b"1", b"2", b"3", b"t"))
        if steps + 1 + left <= MAX_TUPLE_DEPTH:
            return True
        size = len(shape)
        for step in _STEPS:
            before = len(shape)
            shape = step(shape)
            steps += len(shape) < before
        if len(shape) == size:
            break
    return steps + 1 + sum(shape.count(c) for c in (b"1", b"2", b"3", b"t")) <= MAX_TUPLE_DEPTH


# ---- the nesting, measured op by op ------------------------------------------------------------
#
# How the C unpickler (CPython 3.11 Modules/_pickle.c) moves its stack, by opcode. Its marks
# are a stack of their own: the topmost is a fence no opcode but those that pop to it may pop
# below, and POP pops that mark rather than a value when nothing was pushed above it.
(_DO_PUSH, _DO_GETS, _DO_PUTS, _DO_MEMOIZE, _DO_MARK, _DO_TUPLEN, _DO_TUPLE, _DO_POP,
 _DO_POP_MARK, _DO_DUP, _DO_KEEP, _DO_NEW, _DO_MARK_KEEP, _DO_MARK_NEW, _DO_NOTHING,
 _DO_STOP) = range(16)
_TRACK_KINDS = {
    _DO_PUSH: _SHAPES[b"a"], _DO_GETS: ("GET", "BINGET", "LONG_BINGET"),
    _DO_PUTS: ("PUT", "BINPUT", "LONG_BINPUT"), _DO_MEMOIZE: ("MEMOIZE",), _DO_MARK: ("MARK",),
    _DO_TUPLEN: ("TUPLE1", "TUPLE2", "TUPLE3"), _DO_TUPLE: ("TUPLE",), _DO_POP: ("POP",),
    _DO_POP_MARK: ("POP_MARK",), _DO_DUP: ("DUP",), _DO_KEEP: ("APPEND", "BUILD", "SETITEM"),
    _DO_NEW: ("BINPERSID", "READONLY_BUFFER", "REDUCE", "NEWOBJ", "STACK_GLOBAL", "NEWOBJ_EX"),
    _DO_MARK_KEEP: _SHAPES[b"U"], _DO_MARK_NEW: _SHAPES[b"L"], _DO_NOTHING: ("PROTO", "FRAME"),
    _DO_STOP: ("STOP",),
}
_TRACK = [_DO_STOP] * 256  # a byte that is no opcode never gets here
_POPS = [0] * 256  # how many values _DO_TUPLEN, _DO_KEEP and _DO_NEW pop
for _kind, _names in _TRACK_KINDS.items():
    for _name in _names:
        _TRACK[ord(OPS_BY_NAME[_name].code)] = _kind
for _name, _n in (("TUPLE1", 1), ("TUPLE2", 2), ("TUPLE3", 3), ("APPEND", 1), ("BUILD", 1),
                  ("SETITEM", 2), ("BINPERSID", 1), ("READONLY_BUFFER", 1), ("REDUCE", 2),
                  ("NEWOBJ", 2), ("STACK_GLOBAL", 2), ("NEWOBJ_EX", 3)):
    _POPS[ord(OPS_BY_NAME[_name].code)] = _n
_UNCOVERED = set(OPS_BY_NAME) - {n for names in _TRACK_KINDS.values() for n in names}
assert not _UNCOVERED, f"pickle_guard does not know how {_UNCOVERED} moves the stack"
_UNCOVERED = set(OPS_BY_NAME) - {n for names in _SHAPES.values() for n in names} - set(_DROPPED)
_UNKNOWN = (_DO_GETS, _DO_POP, _DO_POP_MARK, _DO_DUP, _DO_STOP)  # what _shallow keeps
assert {n for kind in _UNKNOWN for n in _TRACK_KINDS[kind]} == _UNCOVERED


def _tuple_depth(data: bytes, start: int, stop: int) -> int:
    """How deep tuples nest in data[start:stop] (well-formed), following the C unpickler's
    stack op by op (about 0.2 µs each) without building anything; returns as soon as the depth
    passes MAX_TUPLE_DEPTH.

    Only chains of tuples matter: hashing stops at a list or dict (unhashable), at a frozenset
    (it keeps its members' hashes), and our factories return no nested tuples.
    """
    memo_tokens: list[bytes] = []
    ops = b"".join(ops for ops, _ in _opcode_pieces(data, start, stop, memo_tokens))
    tokens = iter(memo_tokens)
    track, pops = _TRACK, _POPS
    stack: list[int] = []
    push = stack.append
    marks: list[int] = []
    memo: dict[int, int] = {}
    fence = deepest = 0
    try:
        for code in ops:
            kind = track[code]
            if kind == _DO_PUSH:
                push(0)
            elif kind == _DO_GETS:
                push(memo.get(_token_index(next(tokens)), 0))
            elif kind in (_DO_PUTS, _DO_MEMOIZE):
                index = _token_index(next(tokens)) if kind == _DO_PUTS else len(memo)
                if len(stack) <= fence:
                    raise IndexError
                memo[index] = stack[-1]
            elif kind in (_DO_TUPLEN, _DO_TUPLE):
                if kind == _DO_TUPLE:
                    at = marks.pop()
                    fence = marks[-1] if marks else 0
                else:
                    at = len(stack) - pops[code]
                    if at < fence:
                        raise IndexError
                depth = 1 + max(stack[at:], default=0)
                del stack[at:]
                if depth > deepest:
                    if depth > MAX_TUPLE_DEPTH:
                        return depth
                    deepest = depth
                push(depth)
            elif kind == _DO_MARK:
                fence = len(stack)
                marks.append(fence)
            elif kind in (_DO_KEEP, _DO_NEW):
                at = len(stack) - pops[code]
                if at - (kind == _DO_KEEP) < fence:
                    raise IndexError
                del stack[at:]
                if kind == _DO_NEW:
                    push(0)
            elif kind in (_DO_MARK_KEEP, _DO_MARK_NEW, _DO_POP_MARK):
                at = marks.pop()
                fence = marks[-1] if marks else 0
                if kind == _DO_MARK_KEEP and at <= fence:
                    raise IndexError
                del stack[at:]
                if kind == _DO_MARK_NEW:
                    push(0)
            elif kind == _DO_POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                    fence = marks[-1] if marks else 0
                elif len(stack) <= fence:
                    raise IndexError
                else:
                    stack.pop()
            elif kind == _DO_DUP:
                if len(stack) <= fence:
                    raise IndexError
                push(stack[-1])
            elif kind == _DO_STOP:
                break
    except IndexError:
        raise StreamError("the pickle pops more than it pushed (stack underflow)") from None
    return deepest


def _token_index(token: bytes) -> int:
    """The memo index of a GET or PUT token (opcode and argument)."""
    if token[0] in (ord("g"), _PUT):
        try:
            return int(token[1:-1])
        except ValueError:
            raise StreamError("a GET in the pickle has a malformed index") from None
    return int.from_bytes(token[1:], "little")


def _memo_index(data: bytes, pos: int, after: int) -> int:
    return _token_index(data[pos:after])
