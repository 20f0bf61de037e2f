"""--deep value checks: count NaN and Inf in raw tensor bytes, without torch.

Keyed by torch dtype names so every reader can use it. bfloat16 and the float8 formats have no
numpy dtype: they are counted by bit pattern. numpy is imported on first use, so a default
(metadata-only) scan never pays for its import.
"""

from __future__ import annotations

from cachedoctor.formats.source import Source

CHUNK = 16 * 1024 * 1024  # bytes per read: bounds a worker's memory on a multi-GB tensor

# IEEE formats numpy knows: torch name -> (numpy code, values per element)
_IEEE = {
    "float16": ("f2", 1),
    "float32": ("f4", 1),
    "float64": ("f8", 1),
    "complex64": ("f4", 2),
    "complex128": ("f8", 2),
}
# The rest: torch name -> (unsigned view, mask, value); `bits & mask == value` is NaN or Inf
_BIT_PATTERNS = {
    "bfloat16": ("u2", 0x7F80, 0x7F80),  # exponent all ones
    "float8_e5m2": ("u1", 0x7C, 0x7C),  # exponent all ones
    "float8_e4m3fn": ("u1", 0x7F, 0x7F),  # no Inf; NaN is S.1111.111
    "float8_e4m3fnuz": ("u1", 0xFF, 0x80),  # no Inf; NaN is the negative zero pattern
    "float8_e5m2fnuz": ("u1", 0xFF, 0x80),
    "float8_e8m0fnu": ("u1", 0xFF, 0xFF),
}
FLOAT_DTYPES = frozenset(_IEEE) | frozenset(_BIT_PATTERNS)


def itemsize(dtype: str) -> int:
    code, parts = _IEEE.get(dtype) or (_BIT_PATTERNS[dtype][0], 1)
    return int(code[1:]) * parts


def _bad(data: bytes | memoryview, dtype: str, big_endian: bool):
    """A bool array, True for each NaN/Inf element of `data` (whole elements only)."""
    import numpy as np

    order = ">" if big_endian else "<"
    count = len(data) // itemsize(dtype)
    if dtype in _IEEE:
        code, parts = _IEEE[dtype]
        bad = ~np.isfinite(np.frombuffer(data, order + code, count=count * parts))
        if parts == 2:  # a complex element is bad when either part is
            bad = bad.reshape(-1, 2).any(axis=1)
        return bad
    code, mask, value = _BIT_PATTERNS[dtype]
    bits = np.frombuffer(data, order + code, count=count)
    return (bits & mask) == value


def count_nonfinite(data: bytes | memoryview, dtype: str, big_endian: bool = False) -> int:
    """NaN/Inf elements in `data` (whole elements only); 0 for dtypes that have neither."""
    if dtype not in FLOAT_DTYPES:
        return 0
    import numpy as np

    return int(np.count_nonzero(_bad(data, dtype, big_endian)))


def nonfinite_offsets(data: bytes | memoryview, dtype: str, big_endian: bool = False):
    """Byte offsets in `data` of its NaN/Inf elements (whole elements only), ascending, as a
    numpy int64 array; None when there are none (the usual case: nothing is allocated)."""
    if dtype not in FLOAT_DTYPES:
        return None
    import numpy as np

    bad = _bad(data, dtype, big_endian)
    if not bad.any():
        return None
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
        view = memoryview(data)
        self.total += count_nonfinite(view[:whole], self._dtype, self._big)
        self._rest = bytes(view[whole:])


def count_nonfinite_at(
    src: Source, offset: int, nbytes: int, dtype: str, big_endian: bool = False
) -> int:
    """count_nonfinite over `nbytes` of `src` at `offset`, read in bounded chunks."""
    if dtype not in FLOAT_DTYPES:
        return 0
    step = CHUNK - CHUNK % itemsize(dtype)
    total, pos, end = 0, offset, offset + nbytes
    while pos < end:
        chunk = src.pread(pos, min(step, end - pos))
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
    import numpy as np

    size = itemsize(dtype)
    step = CHUNK - CHUNK % size
    # an element is zero when every bit but the sign is clear; for the fnuz float8 formats the
    # sign-only pattern is NaN, so only the all-clear one
    parts = _IEEE.get(dtype, ("", 1))[1]
    width = size // parts
    mask = 0xFF if dtype.endswith("fnuz") else (1 << (8 * width - 1)) - 1
    bad = zeros = 0
    pos, end = offset, offset + nbytes
    while pos < end:
        chunk = src.pread(pos, min(step, end - pos))
        if not chunk:
            break
        whole = len(chunk) - len(chunk) % size
        view = memoryview(chunk)[:whole]
        bad += count_nonfinite(view, dtype)
        bits = np.frombuffer(view, f"<u{width}")
        clear = (bits & mask) == 0
        if parts == 2:  # a complex element is zero when both parts are
            clear = clear.reshape(-1, 2).all(axis=1)
        zeros += int(np.count_nonzero(clear))
        pos += len(chunk)
    return bad, zeros
