"""numpy `.npy`: the array header (shared with numpy_npz.py) and a bare `.npy` file.

A header is `\\x93NUMPY`, a version (1.0, 2.0 or 3.0), a u16 (v1) or u32 length, then a Python
literal dict `{'descr': ..., 'fortran_order': ..., 'shape': ...}` padded with spaces and a
newline. numpy writes one exact form of that dict, which a regex reads in a microsecond;
anything else goes through `ast.literal_eval` (never eval), as numpy's own `safe_eval` does.
The checks are the ones `np.load` makes, plus header size + numel × itemsize == data size.
An object array (`|O`) is a pickle that np.load runs only with allow_pickle=True: its globals
are listed by the restricted unpickler and it is never executed. The globals numpy itself writes
for one (its array reconstruction) are not unsafe; every other one outside torch's weights-only
set is. Either way a trainer's `np.load` (allow_pickle=False) refuses the array: an error.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from math import prod

from cachedoctor.formats.meta import (
    INT64_MAX,
    NPY,
    FileMeta,
    TensorMeta,
    contiguous_stride,
    number_text,
)
from cachedoctor.formats.nonfinite import FLOAT_DTYPES, count_nonfinite_at
from cachedoctor.formats.source import Source
from cachedoctor.formats.unpickler import MAX_PICKLE_BYTES, UnpickleError, load_restricted

MAGIC = b"\x93NUMPY"
HEAD_READ = 256  # a numpy 2 header is 128 bytes unless the dtype is structured
MAX_HEADER_CHARS = 10_000  # np.load's max_header_size unless allow_pickle=True
MAX_REMEMBERED = 4096  # distinct headers kept parsed
PICKLE_READ = MAX_PICKLE_BYTES + 1  # an object array's pickle bytes read: one past what is unpickled

_NUMPY_FORM = re.compile(
    r"\{'descr': '([^'\\]+)', 'fortran_order': (True|False), 'shape': \(((?:\d+, )*\d+,?)?\), \}"
    r"[ \n]*\Z"
)
_TYPESTR = re.compile(r"([<>|=]?)([biufcmMOSUVa])(\d*)(\[\w+\])?\Z")
_PY2_LONG = re.compile(r"\b(\d+)L\b")  # numpy < 1.x wrote 64L: numpy still reads those headers
_KEYS = frozenset(("descr", "fortran_order", "shape"))
_LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)

# (kind, itemsize) -> torch's dtype name
_TORCH = {
    ("b", 1): "bool",
    ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32", ("i", 8): "int64",
    ("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32", ("u", 8): "uint64",
    ("f", 2): "float16", ("f", 4): "float32", ("f", 8): "float64",
    ("c", 8): "complex64", ("c", 16): "complex128",
}
_NUMPY_KIND = {"f": "float", "c": "complex", "S": "bytes", "a": "bytes", "U": "str", "V": "void"}


class NpyError(ValueError):
    """The bytes are no loadable .npy header; the message says why."""


@dataclass(frozen=True, slots=True)
class Dtype:
    """A numpy dtype as cachedoctor reports it."""

    name: str  # torch's name, or numpy's (str160, void64, datetime64[ns]) where torch has none
    itemsize: int
    big_endian: bool = False
    has_object: bool = False
    torch: bool = True  # whether torch has this dtype


@dataclass(frozen=True, slots=True)
class NpyHeader:
    """The parsed header of one .npy array."""

    descr: str  # as written: '<f4', or the repr of a structured descr
    dtype: Dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int  # bytes from the magic to the first data byte
    stride: tuple[int, ...]  # in elements: C order, or column-major for fortran_order

    @property
    def nbytes(self) -> int:
        """Data bytes np.save writes for this header (object arrays: unknown, a pickle)."""
        return prod(self.shape) * self.dtype.itemsize


def header_size(prefix: bytes) -> int:
    """Bytes from the magic to the data, from the first 12 bytes; NpyError if no npy."""
    if not prefix:
        raise NpyError("empty: no .npy header")
    if prefix[:6] != MAGIC[: len(prefix)]:
        raise NpyError(f"not an .npy array: it starts with {prefix[:8].hex(' ')}, not \\x93NUMPY")
    if len(prefix) < 10:
        raise NpyError(f"truncated: it ends after {len(prefix)} bytes, inside the npy preamble")
    major, minor = prefix[6], prefix[7]
    if (major, minor) == (1, 0):
        start, length = 10, int.from_bytes(prefix[8:10], "little")
    elif (major, minor) in ((2, 0), (3, 0)):
        if len(prefix) < 12:
            raise NpyError("header ends inside its length field")
        start, length = 12, int.from_bytes(prefix[8:12], "little")
    else:
        raise NpyError(f"npy format version {major}.{minor}: numpy reads only 1.0, 2.0 and 3.0")
    if length > MAX_HEADER_CHARS * (4 if major == 3 else 1):  # checked before reading it
        raise _too_large(length)
    return start + length


def _too_large(length: int) -> NpyError:
    return NpyError(
        f"Header info length ({length:,}) is large and may not be safe to load securely "
        "(np.load refuses it unless allow_pickle=True)"
    )


def parse_header(data: bytes) -> NpyHeader:
    """The header at the start of `data`, which must hold header_size(data) bytes."""
    end = header_size(data)
    if len(data) < end:
        raise NpyError(f"header needs {end:,} bytes, only {len(data):,} are there")
    raw = data[:end]
    header = _parsed.get(raw)
    if header is None:
        header = _parse(raw)
        if end <= HEAD_READ:
            if len(_parsed) >= MAX_REMEMBERED:
                _parsed.clear()
            _parsed[raw] = header
    return header


# The files of one cache repeat a handful of headers: parse each (small) one once per worker.
_parsed: dict[bytes, NpyHeader] = {}


def _parse(raw: bytes) -> NpyHeader:
    start, end = (10 if raw[6] == 1 else 12), len(raw)
    try:
        text = raw[start:].decode("utf-8" if raw[6] == 3 else "latin1")
    except UnicodeDecodeError as exc:
        raise NpyError(f"header is not UTF-8 ({exc.reason} at byte {start + exc.start})") from None
    if len(text) > MAX_HEADER_CHARS:
        raise _too_large(len(text))
    m = _NUMPY_FORM.match(text)
    if m is not None:
        descr, fortran = m[1], m[2] == "True"
        digits = (m[3] or "").replace(",", " ").split()
        for n in digits:
            if len(n) > 19:  # past int64 for sure; int() refuses past 4,300 digits anyway
                raise NpyError(f"shape holds a {len(n):,}-digit number: np.load cannot size "
                               "that array (OverflowError: Python int too large to convert)")
        shape = tuple(map(int, digits))
        return _header(descr, _typestr(descr), shape, fortran, end)
    return _parse_literal(text, raw[6], end)


def _header(descr: str, dtype: Dtype, shape: tuple[int, ...], fortran: bool, end: int
            ) -> NpyHeader:
    # np.load sizes the array as an int64 product: a number past that is no loadable array
    numel = 1
    for n in shape:
        if n > INT64_MAX:
            raise NpyError(f"shape holds {number_text(n)}, more than int64 holds: np.load "
                           "cannot size that array (OverflowError)")
        numel *= n
    if numel * dtype.itemsize > INT64_MAX:
        raise NpyError(f"shape {_shape_text(shape)} of {descr[:40]} needs "
                       f"{number_text(numel * dtype.itemsize)} bytes, more than int64 holds: "
                       "np.load cannot size that array (ValueError: array is too big)")
    return NpyHeader(descr, dtype, shape, fortran, end, contiguous_stride(shape, fortran))


def _shape_text(shape: tuple[int, ...]) -> str:
    text = ", ".join(number_text(n) for n in shape[:8])
    return f"({text}{', …' if len(shape) > 8 else ''})"


def _parse_literal(text: str, major: int, end: int) -> NpyHeader:
    try:
        d = _literal(text)
    except _LITERAL_ERRORS as exc:
        if major > 2 or not _PY2_LONG.search(text):
            raise NpyError(f"header is no Python literal: {_clip(str(exc))}") from None
        try:
            d = _literal(_PY2_LONG.sub(r"\1", text))
        except _LITERAL_ERRORS as exc2:
            raise NpyError(f"header is no Python literal: {_clip(str(exc2))}") from None
    if not isinstance(d, dict):
        raise NpyError(f"Header is not a dictionary: {text.strip()[:80]!r}")
    if d.keys() != _KEYS:
        raise NpyError(f"Header does not contain the correct keys: {sorted(map(str, d))}")
    shape = d["shape"]
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise NpyError(f"shape is not a valid shape: {_clip(repr(shape))}")
    if not isinstance(d["fortran_order"], bool):
        raise NpyError(f"fortran_order is not a valid bool: {_clip(repr(d['fortran_order']))}")
    descr = d["descr"]
    descr_text = descr if isinstance(descr, str) else repr(descr)
    return _header(descr_text, _resolve(descr), shape, d["fortran_order"], end)


def _clip(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def _literal(text: str) -> object:
    with warnings.catch_warnings():  # a damaged header's "\ " would warn on the scan's stderr
        warnings.simplefilter("ignore")
        import ast  # most headers never get here (start-up: ~2 ms)

        return ast.literal_eval(text.lstrip(" \t"))


def _resolve(descr: object) -> Dtype:
    """numpy's descr_to_dtype, computed: itemsize and name without building a numpy dtype."""
    if isinstance(descr, str):
        return _typestr(descr)
    if isinstance(descr, tuple) and len(descr) == 2:  # (base descr, subarray shape)
        base = _resolve(descr[0])
        size = base.itemsize * _count(descr[1])
        return Dtype(f"void{size * 8}", size, has_object=base.has_object, torch=False)
    if isinstance(descr, list):
        size, has_object = 0, False
        for field in descr:
            if not isinstance(field, tuple) or len(field) not in (2, 3):
                raise NpyError(f"structured descr field {_clip(repr(field))} is not (name, descr[, shape])")
            dtype = _resolve(field[1])
            size += dtype.itemsize * (_count(field[2]) if len(field) == 3 else 1)
            has_object = has_object or dtype.has_object
        return Dtype(f"void{size * 8}", size, has_object=has_object, torch=False)
    raise NpyError(f"descr {_clip(repr(descr))} is not a numpy dtype")


def _count(shape: object) -> int:
    n = None
    if type(shape) is int and shape >= 0:
        n = shape
    elif isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape):
        n = prod(shape)
    if n is not None:
        if n > INT64_MAX:
            raise NpyError(f"a subarray shape counts {number_text(n)} elements, more than "
                           "int64 holds: numpy cannot build that dtype")
        return n
    raise NpyError(f"subarray shape {_clip(repr(shape))} is not a shape")


def _typestr(descr: str) -> Dtype:
    m = _TYPESTR.match(descr)
    if m is None:
        return _numpy_alias(descr)
    order, kind, digits, unit = m.groups()
    if len(digits) > 18:
        raise NpyError(f"descr {_clip(descr)} names a {len(digits):,}-digit item size: "
                       "numpy refuses it")
    size = int(digits) if digits else None
    big = order == ">"
    if kind == "O" and size in (None, 8):
        return Dtype("object", 8, has_object=True, torch=False)
    if size is None:
        return _numpy_alias(descr)
    torch_name = _TORCH.get((kind, size))
    if torch_name is not None and unit is None:
        return Dtype(torch_name, size, big and size > 1)
    if kind in "mM" and size == 8:
        name = ("timedelta64" if kind == "m" else "datetime64") + (unit or "")
        return Dtype(name, 8, big, torch=False)
    if kind in "fcSaV" and unit is None:
        return Dtype(f"{_NUMPY_KIND[kind]}{size * 8}", size, big and kind in "fc", torch=False)
    if kind == "U" and unit is None:
        return Dtype(f"str{size * 32}", size * 4, big, torch=False)
    return _numpy_alias(descr)


def _numpy_alias(descr: str) -> Dtype:
    """A descr np.save never writes ('float32', '<f'): numpy decides, imported only here."""
    import numpy as np

    try:
        dtype = np.dtype(descr)
    except Exception as exc:  # numpy's dtype parser raises several types for odd strings
        raise NpyError(f"descr {_clip(repr(descr))} is not a numpy dtype ({_clip(str(exc))})") from None
    if dtype.str != descr and _TYPESTR.match(dtype.str) and dtype.subdtype is None:
        return _typestr(dtype.str)
    return Dtype(dtype.name, dtype.itemsize, has_object=dtype.hasobject, torch=False)


def tensor_meta(
    header: NpyHeader, path: tuple[str, ...], storage_key: str, storage_bytes: int | None
) -> TensorMeta:
    """The array as a tensor: C strides, or column-major for fortran_order."""
    return TensorMeta(
        path=path,
        dtype=header.dtype.name,
        shape=header.shape,
        stride=header.stride,
        storage_offset=0,
        storage_key=storage_key,
        storage_bytes=storage_bytes,
        itemsize=header.dtype.itemsize,
    )


def size_error(header: NpyHeader, data_bytes: int) -> str | None:
    """Why `data_bytes` after the header cannot be this array (None when they can)."""
    need = header.nbytes
    if data_bytes == need or header.dtype.has_object:
        return None
    what = f"{header.descr} {list(header.shape)}"
    if data_bytes < need:
        return (
            f"truncated: the header promises {need:,} bytes of {what} data, "
            f"only {data_bytes:,} follow it"
        )
    return f"{data_bytes - need:,} bytes after the {need:,} bytes of {what} data"


def dtype_notes(header: NpyHeader, what: str) -> list[str]:
    """Facts about the dtype worth a line: `what` names the array ("the array", "'latents'")."""
    dtype = header.dtype
    if dtype.has_object:
        return [f"{what} is an object array: np.load runs its pickle only with allow_pickle=True"]
    if dtype.big_endian:
        return [f"{what} is big-endian ({header.descr}): torch.from_numpy refuses it unswapped"]
    if not dtype.torch:
        return [f"{what} has numpy dtype {header.descr} ({dtype.name}), which torch lacks"]
    return []


# What np.save writes into an object array's pickle itself (numpy 1.x and 2.x module names)
NUMPY_OWN_GLOBALS = frozenset({
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar", "numpy.ndarray", "numpy.dtype",
})


def pickle_globals(data: bytes, offset: int) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    """Globals the object array's pickle at `offset` names, the unsafe ones among them, and why
    it is broken if it is.

    `data` need not hold more than PICKLE_READ bytes past `offset`: the unpickler stops there.
    """
    try:
        found = load_restricted(data, offset)
        named, unsafe, error = found.globals, found.unsafe_globals, None
    except UnpickleError as exc:  # still report what a pickle named before it broke
        named, unsafe, error = exc.globals, exc.unsafe_globals, f"object array pickle: {exc}"
    unsafe = tuple(dict.fromkeys(g for g in unsafe if g not in NUMPY_OWN_GLOBALS))
    return tuple(dict.fromkeys((*named, *unsafe))), unsafe, error


def object_array_error(what: str) -> str:
    return (f"{what} is an object array: np.load refuses it unless allow_pickle=True, as trainers "
            "load their caches")


def read(src: Source, path: str, deep: bool) -> FileMeta:
    """A bare .npy file: its header, its data size, and with `deep` its NaN/Inf count."""
    try:
        head = src.pread(0, HEAD_READ)
        end = header_size(head)
        if end > src.size:
            raise NpyError(f"truncated: the header needs {end:,} bytes, the file has {src.size:,}")
        header = parse_header(head if end <= len(head) else src.pread(0, end))
    except NpyError as exc:
        return FileMeta(path, src.size, NPY, errors=(f"npy header: {exc}",))
    data_bytes = src.size - header.data_offset
    if header.dtype.has_object:
        globals_, unsafe, error = pickle_globals(src.pread(header.data_offset, PICKLE_READ), 0)
        error = error or object_array_error("the array")
    else:
        globals_, unsafe, error = (), (), size_error(header, data_bytes)
    nonfinite = ()
    if deep and not error and header.dtype.name in FLOAT_DTYPES:
        count = count_nonfinite_at(
            src, header.data_offset, header.nbytes, header.dtype.name, header.dtype.big_endian
        )
        nonfinite = (((), count),) if count else ()
    storage = None if header.dtype.has_object else data_bytes
    return FileMeta(
        path,
        src.size,
        NPY,
        root="tensor",
        tensors=(tensor_meta(header, (), os.path.basename(path), storage),),
        globals=globals_,
        unsafe_globals=unsafe,
        errors=(error,) if error else (),
        nonfinite=nonfinite,
        notes=tuple(dtype_notes(header, "the array")),
        deep=deep,
    )
