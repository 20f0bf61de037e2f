"""safetensors: the header checks of the library, in the library's order, without the library.

A file is `u64 n` (little-endian), `n` bytes of UTF-8 JSON, then the data. This re-implements
`SafeTensors::read_metadata` and `Metadata::validate` (huggingface/safetensors tensor.rs, 0.8):
the first failure is the error, worded as the library words it. The JSON is decoded the way
serde decodes `HashMetadata` (duplicate `__metadata__` or tensor fields fail, duplicate tensor
names keep the last, NaN and lone surrogates fail, nesting stops at depth 128), so the verdict
matches `safe_open` on what Python's json would otherwise accept. Only the header is read,
except with `deep`, which counts NaN/Inf in every float tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import NamedTuple

from cachedoctor.formats.meta import SAFETENSORS, FileMeta, TensorMeta, contiguous_stride
from cachedoctor.formats.nonfinite import (
    FLOAT_DTYPES,
    count_values_at,
    holds_none,
    itemsize,
    none_test,
)
from cachedoctor.formats.source import Source
from cachedoctor.formats.torch_tensors import clip

N_LEN = 8
MAX_HEADER_SIZE = 100_000_000
FIRST_READ = 4096
U64_MAX = 2**64 - 1
MAX_DEPTH = 127  # serde_json's recursion limit: 128 nested arrays/objects fail

# safetensors dtype -> (torch name, bits per element)
DTYPES = {
    "BOOL": ("bool", 8),
    "F4": ("float4_e2m1fn_x2", 4),
    "F6_E2M3": ("float6_e2m3fn", 6),
    "F6_E3M2": ("float6_e3m2fn", 6),
    "U8": ("uint8", 8),
    "I8": ("int8", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),
    "I16": ("int16", 16),
    "U16": ("uint16", 16),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I32": ("int32", 32),
    "U32": ("uint32", 32),
    "F32": ("float32", 32),
    "C64": ("complex64", 64),
    "F64": ("float64", 64),
    "I64": ("int64", 64),
    "U64": ("uint64", 64),
}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_MISSING = object()
_NEG_ZERO = -0.0  # serde_json reads `-0` as a float, which no size field accepts


class _Object(list):
    """A JSON object as its (key, value) pairs: duplicates stay visible, as serde sees them."""

    __slots__ = ()


class _Invalid(Exception):
    """A header the library rejects: the message is the library's words plus our details."""


class _Tensor:
    __slots__ = ("begin", "dtype", "end", "name", "shape")

    def __init__(self, name: str, dtype: str, shape: list[int], offsets: list[int]) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape
        self.begin, self.end = offsets


def _reject_constant(name: str) -> float:
    raise ValueError(f"expected value, found {name}")


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number out of range: {text}")
    return value


def _parse_int_neg_zero(text: str) -> int | float:
    return _NEG_ZERO if text == "-0" else int(text)


_decode = json.JSONDecoder(
    object_pairs_hook=_Object, parse_constant=_reject_constant, parse_float=_parse_float
).decode
_decode_neg_zero = json.JSONDecoder(
    object_pairs_hook=_Object,
    parse_constant=_reject_constant,
    parse_float=_parse_float,
    parse_int=_parse_int_neg_zero,
).decode


# Files of one cache mostly share their header byte for byte (same names, shapes, dtypes):
# a scan keeps the verdict of one per header (Templates.headers), at most this many
MAX_KNOWN = 64
MAX_KNOWN_HEADER = 64 * 1024  # (a longer header is parsed every time: not held as a key)


class Known(NamedTuple):
    """A sound file's FileMeta, and for --deep the float tensors to count: (name, offset of
    its bytes in the file, their length, torch dtype, nonfinite.none_test or None)."""

    meta: FileMeta
    values: tuple[tuple[str, int, int, str, tuple | None], ...]


def read(src: Source, path: str, deep: bool,
         known: dict[tuple[int, bytes], Known] | None = None) -> FileMeta:
    """Validate the header of the safetensors file in `src`; never raises for bad input.
    `known` (a scan's, by size and header bytes) holds sound files read before: a file of the
    same size and header has the same facts, and with `deep` only its values are counted."""
    notes: list[str] = []
    tensors: list[_Tensor] = []
    metadata: dict[str, str] = {}
    try:
        n, raw = _read_header(src)
        seen = known.get((src.size, raw)) if known else None
        if seen is not None and seen.meta.deep == deep:
            return _again(src, path, seen) if deep else seen.meta.renamed(path)
        tensors, metadata = _deserialize(_text(raw), notes)
        data_end = _validate(tensors)
        if data_end + N_LEN + n != src.size:
            end = data_end + N_LEN + n
            why = "truncated" if end > src.size else f"{src.size - end:,} bytes past the data"
            return _meta(src, path, tensors, metadata, notes, error=(
                "incomplete metadata, file not fully covered "
                f"(data ends at {end:,}, file is {src.size:,} bytes: {why})"
            ))
    except _Invalid as exc:
        return _meta(src, path, [], metadata, notes, error=str(exc))
    nonfinite, zeros, values = [], [], []
    for t in tensors if deep else ():
        dtype = DTYPES[t.dtype][0]
        if dtype in FLOAT_DTYPES:
            values.append((t.name, N_LEN + n + t.begin, t.end - t.begin, dtype, none_test(dtype)))
            count, zero = count_values_at(src, N_LEN + n + t.begin, t.end - t.begin, dtype)
            if count:
                nonfinite.append(((t.name,), count))
            if zero:
                zeros.append(((t.name,), zero, (t.end - t.begin) // itemsize(dtype)))
    meta = _meta(src, path, tensors, metadata, notes, nonfinite=tuple(nonfinite), deep=deep,
                 zeros=tuple(zeros))
    if known is not None and meta.ok and not (nonfinite or zeros) and len(known) < MAX_KNOWN \
            and n <= MAX_KNOWN_HEADER:
        known[(src.size, raw)] = Known(meta, tuple(values))
    return meta


def _again(src: Source, path: str, seen: Known) -> FileMeta:
    """--deep of a file whose size and header are those of `seen`'s: its facts are seen's,
    and only its values are counted. A float tensor in memory is proven clean by four
    reductions (no NaN/Inf: nonfinite.none_test; no zero: neither +0, the smallest unsigned
    view, nor -0, the smallest signed one); any other is counted as read() counts it."""
    nonfinite, zeros = [], []
    whole = src.buffer if src.buffer is not None and len(src.buffer) == src.size else None
    for name, offset, nbytes, dtype, test in seen.values:
        if test is not None and whole is not None and nbytes and holds_none(  # (empty: no reduce)
                whole, offset, nbytes // test[0].itemsize, test, zeros=True):
            continue
        count, zero = count_values_at(src, offset, nbytes, dtype)
        if count:
            nonfinite.append(((name,), count))
        if zero:
            zeros.append(((name,), zero, nbytes // itemsize(dtype)))
    if not (nonfinite or zeros):
        return seen.meta.renamed(path)  # the same facts: whoever judges it may reuse the verdict
    return dataclasses.replace(seen.meta, path=path, nonfinite=tuple(nonfinite),
                               zeros=tuple(zeros), mtime=0.0, same_as=None)


def _meta(src: Source, path: str, tensors: list[_Tensor], metadata: dict[str, str],
          notes: list[str], error: str | None = None, nonfinite: tuple = (), deep: bool = False,
          zeros: tuple = ()) -> FileMeta:
    return FileMeta(
        path,
        src.size,
        SAFETENSORS,
        root="dict",
        tensors=tuple(_tensor_meta(t, notes) for t in tensors),
        errors=(f"safetensors header: {error}",) if error else (),
        nonfinite=nonfinite,
        zeros=zeros,
        notes=tuple(notes),
        metadata=metadata,
        deep=deep,
    )


def _read_header(src: Source) -> tuple[int, bytes]:
    """(n, header bytes): read_metadata's checks up to the UTF-8 one (_text)."""
    head = src.pread(0, FIRST_READ)
    if len(head) < N_LEN:
        raise _Invalid(f"header too small (the file has {src.size} bytes, fewer than 8)")
    n = int.from_bytes(head[:N_LEN], "little")
    if n > MAX_HEADER_SIZE:
        raise _Invalid(f"header too large (the first 8 bytes claim {n:,} bytes of header; "
                       f"the limit is {MAX_HEADER_SIZE:,})")
    if N_LEN + n > src.size:
        raise _Invalid(f"invalid header length ({n:,} bytes of header claimed, the file has "
                       f"{src.size - N_LEN:,} after the length)")
    raw = head[N_LEN : N_LEN + n] if N_LEN + n <= len(head) else src.pread(N_LEN, n)
    if len(raw) != n:
        raise _Invalid(f"invalid header length (read {len(raw):,} of {n:,} header bytes)")
    return n, raw


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid(f"invalid UTF-8 in header ({exc.reason} at byte "
                       f"{N_LEN + exc.start:,})") from None


def _deserialize(text: str, notes: list[str]) -> tuple[list[_Tensor], dict[str, str]]:
    """serde's HashMetadata from the header text: (tensors, __metadata__)."""
    try:
        doc = (_decode_neg_zero if "-0" in text else _decode)(text)
    except RecursionError:
        raise _json_error("recursion limit exceeded") from None
    except ValueError as exc:  # JSONDecodeError, and our hooks' rejections
        raise _json_error(str(exc)) from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _json_error("lone surrogate in a \\u escape") from None
    if type(doc) is not _Object:
        raise _json_error(f"invalid type: {_kind(doc)}, expected struct HashMetadata")
    metadata: dict[str, str] | None = None
    seen_metadata = False
    tensors: dict[str, _Tensor] = {}
    for key, value in doc:
        if key == "__metadata__":
            if seen_metadata:
                raise _json_error("duplicate field `__metadata__`")
            seen_metadata = True
            metadata = _metadata(value, notes)
        else:
            if key in tensors:
                notes.append(f"duplicate tensor name `{key}` in the header: the last one counts")
                del tensors[key]  # serde's HashMap keeps the last
            tensors[key] = _tensor(key, value)
    return list(tensors.values()), metadata or {}


def _metadata(value: object, notes: list[str]) -> dict[str, str] | None:
    if value is None:
        return None
    if type(value) is not _Object:
        raise _json_error(f"invalid type: {_kind(value)}, expected a map (`__metadata__`)")
    result: dict[str, str] = {}
    for key, item in value:
        if type(item) is not str:
            raise _json_error(
                f"invalid type: {_kind(item)}, expected a string (`__metadata__` key `{key}`)"
            )
        if key in result:
            notes.append(f"duplicate `__metadata__` key `{key}`: the last one counts")
        result[key] = item
    return result


def _tensor(name: str, value: object) -> _Tensor:
    """serde's TensorInfo: an object {dtype, shape, data_offsets}, or a 3-element array."""
    if type(value) is list:
        if len(value) != 3:
            raise _json_error(
                f"invalid length {len(value)}, expected struct TensorInfo with 3 elements "
                f"(tensor `{clip(name)}`)"
            )
        dtype, shape, offsets = value
    elif type(value) is _Object:
        dtype = shape = offsets = _MISSING
        for field, item in value:
            if field == "dtype":
                dtype = _field(name, field, dtype, item)
            elif field == "shape":
                shape = _field(name, field, shape, item)
            elif field == "data_offsets":
                offsets = _field(name, field, offsets, item)
            else:
                _check_depth(item, 3)  # unknown fields are ignored, but still parsed
        for field, item in (("dtype", dtype), ("shape", shape), ("data_offsets", offsets)):
            if item is _MISSING:
                raise _json_error(f"missing field `{field}` (tensor `{clip(name)}`)")
    else:
        raise _json_error(f"invalid type: {_kind(value)}, expected struct TensorInfo "
                          f"(tensor `{clip(name)}`)")
    return _Tensor(name, _dtype(name, dtype), _sizes(name, "shape", shape, None),
                   _sizes(name, "data_offsets", offsets, 2))


def _field(name: str, field: str, current: object, item: object) -> object:
    if current is not _MISSING:
        raise _json_error(f"duplicate field `{field}` (tensor `{clip(name)}`)")
    return item


def _dtype(name: str, value: object) -> str:
    if type(value) is _Object and len(value) == 1 and value[0][1] is None:
        value = value[0][0]  # serde also reads a unit variant from {"F32": null}
    if type(value) is not str:
        raise _json_error(f"invalid type: {_kind(value)}, expected a dtype (tensor `{clip(name)}`)")
    if value not in DTYPES:
        raise _json_error(f"unknown variant `{value}` (tensor `{clip(name)}`)")
    return value


def _sizes(name: str, field: str, value: object, length: int | None) -> list[int]:
    """A list of usize: non-negative ints that fit in 64 bits (bools and floats do not)."""
    if type(value) is not list:
        raise _json_error(f"invalid type: {_kind(value)}, expected a sequence "
                          f"(tensor `{clip(name)}` {field})")
    if length is not None and len(value) != length:
        raise _json_error(f"invalid length {len(value)}, expected {length} elements in sequence "
                          f"(tensor `{clip(name)}` {field})")
    for item in value:
        if type(item) is not int or not 0 <= item <= U64_MAX:
            raise _json_error(f"invalid value: {_kind(item)}, expected usize "
                              f"(tensor `{clip(name)}` {field})")
    return value


def _check_depth(value: object, depth: int) -> None:
    """Fail like serde_json where an ignored field nests deeper than its recursion limit."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if type(item) is _Object:
            children = [v for _, v in item]
        elif type(item) is list:
            children = item
        else:
            continue
        if level > MAX_DEPTH:
            raise _json_error("recursion limit exceeded")
        stack.extend((child, level + 1) for child in children)


def _validate(tensors: list[_Tensor]) -> int:
    """Metadata::validate: offsets contiguous from 0 in offset order, sizes = numel × bits / 8.

    Returns where the data ends (relative to the data start).
    """
    tensors.sort(key=lambda t: (t.begin, t.end))
    start = 0
    for t in tensors:
        if t.begin != start or t.end < t.begin:
            raise _Invalid(f"invalid offset for tensor `{clip(t.name)}` (data_offsets "
                           f"[{t.begin}, {t.end}], expected to begin at {start:,})")
        start = t.end
        numel = 1
        for n in t.shape:
            numel *= n
            if numel > U64_MAX:
                raise _overflow(t)
        nbits = numel * DTYPES[t.dtype][1]
        if nbits > U64_MAX:
            raise _overflow(t)
        if nbits % 8:
            raise _Invalid(f"the slice does not end up at a byte boundary, this is invalid "
                           f"(tensor `{clip(t.name)}`: {numel:,} × {t.dtype} is {nbits:,} bits)")
        if t.end - t.begin != nbits // 8:
            raise _Invalid(f"invalid shape, data type, or offset for tensor `{clip(t.name)}` "
                           f"({t.dtype} {_shape(t.shape)} needs {nbits // 8:,} bytes, data_offsets "
                           f"[{t.begin}, {t.end}] hold {t.end - t.begin:,})")
    return start


def _shape(shape: list[int]) -> str:
    """A shape from the header, bounded: a hostile one has thousands of 20-digit dims."""
    text = ", ".join(f"{n:,}" for n in shape[:8])
    return f"[{text}{f', … ({len(shape):,} dims)' if len(shape) > 8 else ''}]"


def _overflow(t: _Tensor) -> _Invalid:
    return _Invalid("overflow computing buffer size from shape and/or element type "
                    f"(tensor `{clip(t.name)}`: {t.dtype} {_shape(t.shape)})")


def _json_error(detail: str) -> _Invalid:
    return _Invalid(f"invalid JSON in header: {detail}")


def _kind(value: object) -> str:
    if type(value) is _Object:
        return "map"
    if type(value) is list:
        return "sequence"
    if value is None:
        return "null"
    shown = json.dumps(value)
    return f"{type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def _tensor_meta(t: _Tensor, notes: list[str]) -> TensorMeta:
    dtype, bits = DTYPES[t.dtype]
    nbytes = t.end - t.begin
    shape = tuple(t.shape)
    if bits == 4 and shape and shape[-1] % 2 == 0:
        shape = (*shape[:-1], shape[-1] // 2)  # torch's float4_e2m1fn_x2 holds two per byte
    elif bits < 8:
        notes.append(f"tensor `{clip(t.name)}` is {t.dtype} {list(t.shape)}, which torch cannot "
                     f"hold: described as {nbytes:,} packed bytes")
        shape = (nbytes,)
    return TensorMeta(
        path=(t.name,),
        dtype=dtype,
        shape=shape,
        stride=contiguous_stride(shape),
        storage_offset=0,
        storage_key=t.name,
        storage_bytes=nbytes,
        itemsize=max(1, bits // 8),
    )
