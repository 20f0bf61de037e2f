"""--deep value checks: count NaN and Inf in raw tensor bytes, without torch.

Keyed by torch dtype names so every reader can use it. Every format is tested on its bits, as
unsigned integers: an element is NaN or Inf when its exponent bits are all set, that is when
its bits less the sign are at least the exponent mask. Two read-only reductions find that
nothing is bad (nearly always), at memory speed for every dtype and with no temporary array (so
nothing shared between threads either): numpy's own isfinite on float16 converts each element
and was 30x slower, and bfloat16 and the float8 formats have no numpy dtype at all. numpy is
imported on first use, so a default (metadata-only) scan never pays for its import.
"""

from __future__ import annotations

import sys

from cachedoctor.formats import native
from cachedoctor.formats.source import Source, view

CHUNK = 16 * 1024 * 1024  # bytes per read: bounds a worker's memory on a multi-GB tensor

# torch name -> (unsigned code, values per element, mask, threshold): a value whose
# `bits & mask >= threshold` is NaN or Inf (the mask drops the sign, the threshold is the
# exponent all ones, with the mantissa bits of the float8 formats whose only NaN is S.1111.111)
_TESTS = {
    "float16": ("u2", 1, 0x7FFF, 0x7C00),
    "bfloat16": ("u2", 1, 0x7FFF, 0x7F80),
    "float32": ("u4", 1, 0x7FFF_FFFF, 0x7F80_0000),
    "float64": ("u8", 1, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "complex64": ("u4", 2, 0x7FFF_FFFF, 0x7F80_0000),
    "complex128": ("u8", 2, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "float8_e5m2": ("u1", 1, 0x7F, 0x7C),  # exponent all ones
    "float8_e4m3fn": ("u1", 1, 0x7F, 0x7F),  # no Inf; NaN is S.1111.111
    "float8_e8m0fnu": ("u1", 1, 0xFF, 0xFF),  # no sign, no Inf; NaN is all ones
}
# no Inf, and NaN is one pattern: the negative zero's
_ONE_NAN = {"float8_e4m3fnuz": 0x80, "float8_e5m2fnuz": 0x80}
FLOAT_DTYPES = frozenset(_TESTS) | frozenset(_ONE_NAN)


def itemsize(dtype: str) -> int:
    code, parts = _TESTS[dtype][:2] if dtype in _TESTS else ("u1", 1)
    return int(code[1:]) * parts


def _bits(data: bytes | memoryview, dtype: str, big_endian: bool):
    """`data`'s whole elements as unsigned integers, one per value (two per complex): a view,
    no copy."""
    import numpy as np

    code, parts = _TESTS[dtype][:2] if dtype in _TESTS else ("u1", 1)
    count = len(data) // (int(code[1:]) * parts) * parts
    return np.frombuffer(data, (">" if big_endian else "<") + code, count=count)


def _count_bad(bits, dtype: str) -> int:
    """NaN/Inf elements among `bits` (from _bits). Two reductions that read and write nothing
    else find that there are none (nearly always): a value is bad when its bits less the sign
    reach the threshold, so a bad positive one has the largest signed view of all, at least
    the threshold, and a bad negative one the largest unsigned view, at least sign | threshold.
    Only then are they counted."""
    import numpy as np

    if dtype in _ONE_NAN:  # (rare formats: plainly)
        return int(np.count_nonzero(bits == _ONE_NAN[dtype]))
    _, parts, mask, threshold = _TESTS[dtype]
    if not bits.size:
        return 0
    sign = mask + 1 if mask + 1 < 1 << (8 * bits.dtype.itemsize) else 0  # (e8m0: no sign)
    if not sign:
        if bits.max() < threshold:
            return 0
    elif bits.max() < sign | threshold and bits.view(bits.dtype.str.replace("u", "i")).max() \
            < threshold:
        return 0
    return _whole((bits & mask) >= threshold, parts, any)


def none_test(dtype: str, big_endian: bool = False) -> tuple | None:
    """_count_bad's proof that a block holds no NaN/Inf, prepared once for a plan that tests
    many blocks of one dtype: (unsigned dtype, signed dtype, unsigned top, signed top, native
    sign bit). A block `bits` (of the unsigned dtype) holds none when `bits.max() < unsigned
    top` and `bits.view(signed dtype).max() < signed top`: no element's bits but its sign
    reach the signed top (what the compiled test, native.py, checks in one pass; the sign bit
    is 0 where the bytes are big-endian, which it leaves to numpy). None for the formats
    without a sign bit or with a single NaN pattern, which _count_bad tests otherwise."""
    import numpy as np

    if dtype not in _TESTS:
        return None
    code, _, mask, threshold = _TESTS[dtype]
    sign = mask + 1
    if sign >= 1 << (8 * int(code[1:])):
        return None  # (e8m0: no sign)
    order = ">" if big_endian else "<"
    little = not big_endian or code == "u1"
    return (np.dtype(order + code), np.dtype(order + code.replace("u", "i")), sign | threshold,
            threshold, sign if little and sys.byteorder == "little" else 0)


def holds_none(data: bytes | memoryview, offset: int, count: int, test: tuple,
               zeros: bool = False) -> bool:
    """Whether the `count` elements at byte `offset` of `data` are proven free of NaN/Inf by
    `test` (none_test's), in two reductions; with `zeros`, of exact zeros too (two more: +0 is
    the smallest unsigned view, -0 the smallest signed one). False says only: count them."""
    unsigned, signed, top, signed_top, sign = test
    compiled = native.NATIVE
    if compiled is not None and sign:  # (one pass, in C)
        return compiled.finite(data, offset, count, unsigned.itemsize, sign, signed_top, zeros)
    frombuffer, largest, smallest = _REDUCTIONS or _reductions()
    bits = frombuffer(data, unsigned, count, offset)
    ints = bits.view(signed)
    if largest(bits) >= top or largest(ints) >= signed_top:
        return False
    return not zeros or (smallest(bits) != 0 and
                         smallest(ints) != -(1 << (8 * signed.itemsize - 1)))


# (numpy.frombuffer, maximum.reduce, minimum.reduce), bound on first use: holds_none runs once
# per storage of every file, where a `from numpy import` per call and ndarray.max's Python
# frame cost as much as a reduction
_REDUCTIONS: tuple | None = None


def preload() -> None:
    """Import numpy now (a parent process about to fork --deep workers)."""
    _REDUCTIONS or _reductions()


def _reductions() -> tuple:
    global _REDUCTIONS
    from numpy import frombuffer, maximum, minimum

    _REDUCTIONS = (frombuffer, maximum.reduce, minimum.reduce)
    return _REDUCTIONS


def _whole(flags, parts: int, combine) -> int:
    """How many elements `flags` (one per value) marks: for complex elements, by `combine`
    (any, all) of their two parts."""
    import numpy as np

    if parts == 2:
        flags = flags.reshape(-1, 2)
        flags = flags.any(axis=1) if combine is any else flags.all(axis=1)
    return int(np.count_nonzero(flags))


def count_nonfinite(data: bytes | memoryview, dtype: str, big_endian: bool = False) -> int:
    """NaN/Inf elements in `data` (whole elements only); 0 for dtypes that have neither."""
    if dtype not in FLOAT_DTYPES:
        return 0
    return _count_bad(_bits(data, dtype, big_endian), dtype)


def nonfinite_offsets(data: bytes | memoryview, dtype: str, big_endian: bool = False):
    """Byte offsets in `data` of its NaN/Inf elements (whole elements only), ascending, as a
    numpy int64 array; None when there are none (the usual case: nothing is allocated)."""
    if dtype not in FLOAT_DTYPES:
        return None
    import numpy as np

    bits = _bits(data, dtype, big_endian)
    if not _count_bad(bits, dtype):
        return None
    if dtype in _ONE_NAN:
        bad = bits == _ONE_NAN[dtype]
    else:  # some are bad (rare): the whole mask at once
        _, parts, mask, threshold = _TESTS[dtype]
        bad = (bits & mask) >= threshold
        if parts == 2:
            bad = bad.reshape(-1, 2).any(axis=1)
    return np.flatnonzero(bad).astype(np.int64) * itemsize(dtype)


class Counter:
    """count_nonfinite over bytes that come in pieces cut anywhere (a deflated member read in
    chunks): an element cut between two pieces is counted once, whole."""

    __slots__ = ("_big", "_dtype", "_rest", "_size", "total")

    def __init__(self, dtype: str, big_endian: bool = False) -> None:
        self._dtype, self._big = dtype, big_endian
        self._size = itemsize(dtype) if dtype in FLOAT_DTYPES else 1
        self._rest = b""  # the start of an element the last piece cut
        self.total = 0

    def feed(self, data: bytes | memoryview) -> None:
        if self._dtype not in FLOAT_DTYPES or not data:
            return
        if self._rest:
            data = self._rest + bytes(data)
        whole = len(data) - len(data) % self._size
        piece = memoryview(data)
        self.total += count_nonfinite(piece[:whole], self._dtype, self._big)
        self._rest = bytes(piece[whole:])


def count_nonfinite_at(
    src: Source, offset: int, nbytes: int, dtype: str, big_endian: bool = False
) -> int:
    """count_nonfinite over `nbytes` of `src` at `offset`, read in bounded chunks."""
    if dtype not in FLOAT_DTYPES:
        return 0
    step = CHUNK - CHUNK % itemsize(dtype)
    total, pos, end = 0, offset, offset + nbytes
    while pos < end:
        chunk = view(src, pos, min(step, end - pos))
        if not chunk:
            break
        total += count_nonfinite(chunk, dtype, big_endian)
        pos += len(chunk)
    return total


def count_values_at(src: Source, offset: int, nbytes: int, dtype: str) -> tuple[int, int]:
    """(NaN/Inf elements, exactly zero elements) in `nbytes` of `src` at `offset`, read once
    in bounded chunks; (0, 0) for dtypes that are no float. Zeros are counted because some
    writers (musubi-tuner's cache_io.py) replace NaN with 0 before they save."""
    if dtype not in FLOAT_DTYPES:
        return 0, 0
    size = itemsize(dtype)
    step = CHUNK - CHUNK % size
    # an element is zero when every bit but the sign is clear; for the fnuz float8 formats
    # the sign-only pattern is NaN, so only the all-clear one
    code, parts = _TESTS[dtype][:2] if dtype in _TESTS else ("u1", 1)
    width = 8 * int(code[1:])
    zero_mask = 0xFF if dtype.endswith("fnuz") else (1 << (width - 1)) - 1
    bad = zeros = 0
    pos, end = offset, offset + nbytes
    while pos < end:
        chunk = view(src, pos, min(step, end - pos))
        if not chunk:
            break
        bits = _bits(chunk, dtype, False)
        bad += _count_bad(bits, dtype)
        # any zero at all (rare, but for NaNs a writer replaced with 0): +0 is the smallest
        # unsigned view, -0 (the sign bit alone) the smallest signed one; read-only reductions
        if bits.size and (bits.min() == 0 or (zero_mask != 0xFF and bits.view(
                bits.dtype.str.replace("u", "i")).min() == -(1 << (width - 1)))):
            zeros += _whole((bits & zero_mask) == 0, parts, all)
        pos += len(chunk)
    return bad, zeros
