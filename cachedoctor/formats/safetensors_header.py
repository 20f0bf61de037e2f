"""safetensors: the header checks of the library, in the library's order, without the library.

A file is `u64 n` (little-endian), `n` bytes of UTF-8 JSON, then the data. This re-implements
`SafeTensors::read_metadata` and `Metadata::validate` (huggingface/safetensors tensor.rs, 0.8):
the first failure is the error, worded as the library words it. The JSON is decoded the way
serde decodes `HashMetadata` (duplicate `__metadata__` or tensor fields fail, duplicate tensor
names keep the last, NaN and lone surrogates fail, nesting stops at depth 128), so the verdict
matches `safe_open` on what Python's json would otherwise accept. Only the header is read,
except with `deep`, which counts NaN/Inf in every float tensor.

A header may hold 100 MB (the library's MAX_HEADER_SIZE) of 1.4 million tensors or 7 million
metadata keys: it is walked entry by entry (json's C scanner decodes one tensor's value at a
time), every tensor is checked, but only the first MAX_KEPT become TensorMeta and the first
MAX_METADATA metadata pairs are kept (a note says so). Reading such a header costs about what
safe_open's own read_metadata does (benchmarks/hostile_safetensors.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from array import array
from itertools import islice
from json.decoder import scanstring as _scanstring
from json.scanner import make_scanner
from math import isinf, prod
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
# A header within the library's limit can declare 1.4 million tensors, or 7 million metadata
# keys: every one is checked, but only these many are kept as Python objects (a real model
# checkpoint has a few thousand tensors and a hundred metadata keys, a cache entry a handful)
MAX_KEPT = 16_384
MAX_METADATA = 4_096
MAX_NOTES = 8  # notes of one kind (duplicate names); then one note counts the rest
MAX_DIMS = 64  # numpy's NPY_MAXDIMS: a kept tensor with more dims is described as its bytes
NUMEL_SLICE = 1024

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
_MISSING = object()
_SPACE = " \t\n\r"
_skip_space = re.compile(r"[ \t\n\r]*").match
# A JSON string of no control character, no lone surrogate (pairs only), then whitespace
_STRING = (r'"(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4}'
           r'|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})*+"[ \t\n\r]*+')
# Any run of `"key": "value",` pairs that Python's json and serde both accept, matched without
# making an object: how the metadata pairs past MAX_METADATA are checked
_PLAIN_PAIRS = re.compile(rf"(?:{_STRING}:[ \t\n\r]*+{_STRING},[ \t\n\r]*+)*+").match
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE]([-+]?)([0-9]+))?")
I32_MAX = 2**31 - 1
INT_DIGITS = 4300  # Python's default int_max_str_digits
_NEG_ZERO = -0.0  # serde_json reads `-0` as a float, which no size field accepts


class _Object(list):
    """A JSON object as its (key, value) pairs: duplicates stay visible, as serde sees them."""

    __slots__ = ()


class _Invalid(Exception):
    """A header the library rejects: the message is the library's words plus our details."""


class _Tensor:
    __slots__ = ("bad", "begin", "dtype", "end", "name", "shape")

    def __init__(self, name: str, dtype: str, shape: list[int], offsets: list[int]) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape
        self.begin, self.end = offsets
        self.bad: bool | None = None  # whether _size_error finds a fault; None: not asked yet


def _reject_constant(name: str) -> float:
    raise ValueError(f"expected value, found {name}")


def _parse_float(text: str) -> float:
    if _out_of_range(text):
        raise ValueError(f"number out of range ({_number_text(text)})")
    return float(text)  # linear in the digits (0.3 ms a MB)


def _out_of_range(text: str) -> bool:
    """Whether serde_json, as safetensors builds it (no float_roundtrip feature), refuses the
    JSON number `text` as out of range: de.rs parse_integer / parse_long_integer /
    parse_decimal / parse_exponent / f64_from_parts. Its digits go into a u64 until one would
    overflow it; later integer digits each add one to the exponent, later fraction digits are
    dropped; the u64 as f64 times POW10[exponent] must be finite, and an exponent past the
    table (308) fails unless the digits are all 0. An exponent past i32 fails unless the
    digits are 0 or it is negative. Not Python's float(), which rounds correctly: serde's
    product does not (2e308 and the integer 17976931348623157081...[309 digits] both fail)."""
    whole, fraction, sign, exponent = _NUMBER.fullmatch(text).groups()
    if len(whole) <= 19:
        significand, scale = int(whole), 0
    else:
        taken = 20 if int(whole[:20]) <= U64_MAX else 19
        significand, scale = int(whole[:taken]), len(whole) - taken
    fraction = fraction or ""
    if significand == 0:  # leading zeros of the fraction each lower the exponent
        zeros = len(fraction) - len(fraction.lstrip("0"))
        scale -= zeros
        fraction = fraction[zeros:]
    for digit in fraction[:21]:  # a nonzero u64 overflows within 20 more digits
        grown = significand * 10 + ord(digit) - 48
        if grown > U64_MAX:
            break
        significand, scale = grown, scale - 1
    if exponent is not None:
        exponent = exponent.lstrip("0") or "0"
        if len(exponent) > 10 or int(exponent) > I32_MAX:
            return significand != 0 and sign != "-"
        scale = scale - int(exponent) if sign == "-" else scale + int(exponent)
        scale = max(-I32_MAX - 1, min(I32_MAX, scale))  # serde's saturating_add/sub
    if scale < 0:
        return False  # divisions: never infinite
    if scale > 308:
        return significand != 0
    return isinf(float(significand) * float(f"1e{scale}"))


def _number_text(text: str) -> str:
    return text if len(text) <= 40 else f"a number of {len(text):,} characters"


def _number_message(message: str) -> str:
    """Python's own words for an integer too long for int() (over 4,300 digits) are about
    sys.set_int_max_str_digits; serde refuses it as out of range (no f64 holds it)."""
    if message.startswith("Exceeds the limit"):
        digits = re.search(r"value has (\d+) digits", message)
        return f"number out of range (an integer of {int(digits[1]):,} digits)" if digits \
            else "number out of range"
    return message


def _parse_int_neg_zero(text: str) -> int | float:
    return _NEG_ZERO if text == "-0" else int(text)


def _parse_int_bounded(text: str) -> int | float:
    """int() where PYTHONINTMAXSTRDIGITS lifts Python's limit: then a 100 MB integer would
    take hours (its conversion is quadratic in 3.11); serde refuses it as out of range."""
    if len(text) > INT_DIGITS + text.startswith("-"):
        raise ValueError(f"number out of range (an integer of {len(text):,} digits)")
    return _parse_int_neg_zero(text)


def _scanner(**hooks) -> object:
    return make_scanner(json.JSONDecoder(object_pairs_hook=_Object,
                                         parse_constant=_reject_constant,
                                         parse_float=_parse_float, **hooks))


# scan(text, i) -> (value, end): one JSON value at i, as json.loads would decode it
_scan = _scanner()
_scan_neg_zero = _scanner(parse_int=_parse_int_neg_zero)
_scan_bounded = _scanner(parse_int=_parse_int_bounded)


def _scan_for(text: str):
    if not 0 < sys.get_int_max_str_digits() <= INT_DIGITS:
        return _scan_bounded
    return _scan_neg_zero if "-0" in text else _scan


def _skip(text: str, i: int) -> int:
    return _skip_space(text, i).end()


def _kind_at(text: str, i: int) -> str:
    """The kind of the JSON value at `i`, by its first character (serde names it so without
    reading it: a hostile value may be 100 MB)."""
    first = text[i : i + 1]
    if first in ("[", "{", '"', "t", "f", "n"):
        return {"[": "sequence", "{": "map", '"': "string", "n": "null"}.get(first, "boolean")
    if first and first in "-0123456789":
        return "number"
    raise _json_error(f"expected value at character {i:,}")


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
        text = _text(raw)
        if n > MAX_KNOWN_HEADER:
            raw = b""  # never a key of `known`: its bytes need not outlive the text
        header = _deserialize(text, notes)
        data_end = _validate(header, text)
        del text
        tensors, metadata = header.kept, header.metadata or {}
        tensors.sort(key=_offsets)
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
    packed = _Capped(notes, "{} more tensors described as their packed bytes")
    return FileMeta(
        path,
        src.size,
        SAFETENSORS,
        root="dict",
        tensors=_tensor_metas(tensors, packed),
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


class _Header:
    """What the walk keeps of a header. Every tensor costs a few bytes here, whatever their
    number (a 100 MB header can declare 1.4 million): its data_offsets, whether its size is
    wrong, and where its entry starts in the text (to name it in an error). Only the first
    MAX_KEPT are kept whole, for the FileMeta."""

    __slots__ = ("begins", "ends", "kept", "metadata", "problems", "starts")

    def __init__(self) -> None:
        self.begins, self.ends, self.starts = array("Q"), array("Q"), array("Q")
        self.problems = bytearray()  # 1 where _size_error finds the tensor's bytes wrong
        self.kept: list[_Tensor] = []
        self.metadata: dict[str, str] | None = None

    @property
    def count(self) -> int:
        return len(self.begins)


class _Capped:
    """Notes of one kind: room() says whether one more may be written (MAX_NOTES of them);
    close() adds one note that counts those left out."""

    def __init__(self, notes: list[str], more: str) -> None:
        self.notes, self.more, self.told, self.left_out = notes, more, 0, 0

    def room(self) -> bool:
        if self.told < MAX_NOTES:
            self.told += 1
            return True
        self.left_out += 1
        return False

    def close(self) -> None:
        if self.left_out:
            self.notes.append(self.more.format(f"{self.left_out:,}"))


def _deserialize(text: str, notes: list[str]) -> _Header:
    """serde's HashMetadata from the header text, walked entry by entry: each tensor's value
    is decoded alone and folded into _Header, never the whole document at once."""
    scan = _scan_for(text)
    header = _Header()
    slots: dict[str, int] = {}
    duplicates = _Capped(notes, "{} more duplicate tensor names in the header: the last of "
                                "each counts")
    seen_metadata = False
    try:
        i = _skip(text, 0)
        if text[i] != "{":
            raise _json_error(f"invalid type: {_kind_at(text, i)}, expected struct HashMetadata")
        i = _skip(text, i + 1)
        if text[i] == "}":
            i += 1
        else:
            # the loop runs once per tensor (1.4 million times for a hostile 100 MB header):
            # _key and _add inlined for a new name, as most are
            begins, ends, starts, problems = (header.begins.append, header.ends.append,
                                              header.starts.append, header.problems.append)
            kept = header.kept.append
            while True:
                start = i
                if text[i] != '"':
                    raise _json_error(f"key must be a string at character {i:,}")
                key, i = _scanstring(text, i + 1, True)
                if text[i] == ":" and text[i + 1] not in _SPACE and key.isascii():
                    i += 1
                else:
                    key, i = _key(text, start)
                if key == "__metadata__":
                    if seen_metadata:
                        raise _json_error("duplicate field `__metadata__`")
                    seen_metadata = True
                    header.metadata, i = _metadata(text, i, scan, notes)
                else:
                    value, i = scan(text, i)
                    t = _canonical(key, value) or _tensor(key, value)
                    slot = slots.setdefault(key, len(slots))
                    if slot == len(header.begins):
                        begins(t.begin)
                        ends(t.end)
                        starts(start)
                        problems(t.bad if t.bad is not None else _size_error(t) is not None)
                        if slot < MAX_KEPT:
                            kept(t)
                    else:
                        _again_named(header, slot, t, start, duplicates)
                if text[i] in _SPACE:
                    i = _skip(text, i)
                if text[i] == ",":
                    i += 1
                    if text[i] in _SPACE:
                        i = _skip(text, i)
                elif text[i] == "}":
                    i += 1
                    break
                else:
                    raise _json_error(f"expected `,` or `}}` at character {i:,}")
        if _skip(text, i) != len(text):
            raise _json_error(f"trailing characters at character {i:,}")
    except IndexError:
        raise _json_error("EOF while parsing the header") from None
    except StopIteration as exc:
        raise _json_error(f"expected value at character {exc.value:,}") from None
    except RecursionError:
        raise _json_error("recursion limit exceeded") from None
    except ValueError as exc:  # JSONDecodeError, and our hooks' rejections
        raise _json_error(_number_message(str(exc))) from None
    duplicates.close()
    if header.count > MAX_KEPT:
        notes.append(f"the header declares {header.count:,} tensors: all are checked, the "
                     f"first {MAX_KEPT:,} described (and only theirs counted by --deep)")
    return header


def _key(text: str, i: int) -> tuple[str, int]:
    """An object's key at `i` and the colon after it: (key, where its value starts)."""
    if text[i] != '"':
        raise _json_error(f"key must be a string at character {i:,}")
    key, i = _scanstring(text, i + 1, True)
    if not key.isascii():
        _utf8(key)
    if text[i] in _SPACE:
        i = _skip(text, i)
    if text[i] != ":":
        raise _json_error(f"expected `:` at character {i:,}")
    i += 1
    return key, _skip(text, i) if text[i] in _SPACE else i


def _canonical(name: str, value: object) -> _Tensor | None:
    """The tensor of an entry as safetensors writes it ({dtype, shape, data_offsets} in that
    order, a short shape), checked in a few steps; None for any other, which _tensor reads."""
    if type(value) is not _Object or len(value) != 3:
        return None
    (f0, dtype), (f1, shape), (f2, offsets) = value
    if f0 != "dtype" or f1 != "shape" or f2 != "data_offsets" or type(dtype) is not str \
            or type(shape) is not list or type(offsets) is not list or len(offsets) != 2 \
            or len(shape) > 8 or dtype not in DTYPES:
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= U64_MAX \
            or not 0 <= end <= U64_MAX:
        return None
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= U64_MAX:
            return None
    t = _Tensor(name, dtype, shape, offsets)
    if 0 not in shape:  # (a 0 dim can hide an overflow before it: _size_error tells)
        nbits = prod(shape) * DTYPES[dtype][1]  # no 0: the running product only grows
        t.bad = nbits > U64_MAX or nbits % 8 != 0 or end - begin != nbits >> 3
    return t


def _again_named(header: _Header, slot: int, t: _Tensor, start: int,
                 duplicates: _Capped) -> None:
    """A tensor named as one before it: serde's HashMap keeps the last."""
    problem = t.bad if t.bad is not None else _size_error(t) is not None
    if duplicates.room():
        duplicates.notes.append(f"duplicate tensor name `{clip(t.name)}` in the header: the "
                                "last one counts")
    header.begins[slot], header.ends[slot], header.starts[slot] = t.begin, t.end, start
    header.problems[slot] = problem
    if slot < MAX_KEPT:
        header.kept[slot] = t


def _metadata(text: str, i: int, scan, notes: list[str]) -> tuple[dict[str, str] | None, int]:
    """`__metadata__` at `i`: null or a map of strings, and where it ends. Its first
    MAX_METADATA pairs are kept; the rest are only checked, runs of them by one regex."""
    if text[i] == "n":
        value, i = scan(text, i)
        if value is None:
            return None, i
    if text[i] != "{":
        raise _json_error(f"invalid type: {_kind_at(text, i)}, expected a map (`__metadata__`)")
    i = _skip(text, i + 1)
    result: dict[str, str] = {}
    if text[i] == "}":
        return result, i + 1
    duplicates = _Capped(notes, "{} more duplicate `__metadata__` keys: the last of each counts")
    pairs = 0
    while True:
        if pairs >= MAX_METADATA:
            i = _PLAIN_PAIRS(text, i).end()
        key, i = _key(text, i)
        if text[i] != '"':
            raise _json_error(f"invalid type: {_kind_at(text, i)}, expected a string "
                              f"(`__metadata__` key `{clip(key)}`)")
        value, i = _scanstring(text, i + 1, True)
        if not value.isascii():
            _utf8(value)
        if pairs < MAX_METADATA:
            if key in result and duplicates.room():
                notes.append(f"duplicate `__metadata__` key `{clip(key)}`: the last one counts")
            result[key] = value
        pairs += 1
        i = _skip(text, i)
        if text[i] == "}":
            break
        if text[i] != ",":
            raise _json_error(f"expected `,` or `}}` at character {i:,}")
        i = _skip(text, i + 1)
    duplicates.close()
    if pairs > MAX_METADATA:
        notes.append(f"`__metadata__` holds more than {MAX_METADATA:,} entries: the first "
                     f"{MAX_METADATA:,} are kept (a later value of one of their keys is not seen)")
    return result, i + 1


def _utf8(text: str) -> None:
    """serde refuses a \\u escape that leaves a lone surrogate, which Python's json keeps."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _json_error("lone surrogate in a \\u escape") from None


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
                if not field.isascii():
                    _utf8(field)
                _check_ignored(item, 3)  # unknown fields are ignored, but still parsed
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
        raise _json_error(f"unknown variant `{clip(value)}` (tensor `{clip(name)}`)")
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


def _check_ignored(value: object, depth: int) -> None:
    """Fail like serde_json where an ignored field does: nesting deeper than its recursion
    limit, a lone surrogate, or an integer no f64 holds (serde buffers the field, reading an
    integer past u64 as an f64: `parse_long_integer` in serde_json's de.rs)."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        kind = type(item)
        if kind is int:
            if item > U64_MAX and _out_of_range(str(item)):
                raise _json_error("number out of range")
            if item < -U64_MAX and _out_of_range(str(-item)):
                raise _json_error("number out of range")
            continue
        if kind is str:
            if not item.isascii():
                _utf8(item)
            continue
        if kind is _Object:
            children = []
            for key, child in item:
                if not key.isascii():
                    _utf8(key)
                children.append(child)
        elif kind is list:
            children = item
        else:
            continue
        if level > MAX_DEPTH:
            raise _json_error("recursion limit exceeded")
        stack.extend((child, level + 1) for child in children)


def _validate(header: _Header, text: str) -> int:
    """Metadata::validate: offsets contiguous from 0 in offset order, sizes = numel × bits / 8.

    Returns where the data ends (relative to the data start). Tensors listed in offset order
    (as safetensors writes them) pass in one sweep; otherwise, or on any failure, they are
    sorted as the library sorts them, to name the tensor it would name.
    """
    start = 0
    for begin, end in zip(header.begins, header.ends, strict=True):
        if begin != start or end < begin:
            break
        start = end
    else:
        if not any(header.problems):
            return start
    begins, ends = header.begins, header.ends
    start = 0
    for slot in sorted(range(header.count), key=lambda s: (begins[s], ends[s])):
        begin, end = begins[slot], ends[slot]
        if begin != start or end < begin:
            name = _entry(header, slot, text).name
            raise _Invalid(f"invalid offset for tensor `{clip(name)}` (data_offsets "
                           f"[{begin}, {end}], expected to begin at {start:,})")
        start = end
        if header.problems[slot]:
            raise _size_error(_entry(header, slot, text))
    return start


def _entry(header: _Header, slot: int, text: str) -> _Tensor:
    """The tensor of `slot`: kept, or decoded again from its entry (only to word an error)."""
    if slot < MAX_KEPT:
        return header.kept[slot]
    key, i = _key(text, header.starts[slot])
    return _tensor(key, _scan_for(text)(text, i)[0])


def _numel(shape: list[int]) -> int | None:
    """The library's checked product of `shape`; None where it overflows u64. The dims before
    the first 0 are all at least 1, so the running product only grows until there: it
    overflows iff their product does; from the first 0 on it is 0. Taken in slices, so a
    hostile shape of millions of huge dims stops at the first slice past u64."""
    cut = shape.index(0) if 0 in shape else len(shape)
    dims = islice(shape, cut)
    numel = 1
    for _ in range(0, cut, NUMEL_SLICE):
        numel *= prod(islice(dims, NUMEL_SLICE))
        if numel > U64_MAX:
            return None
    return numel if cut == len(shape) else 0


def _size_error(t: _Tensor) -> _Invalid | None:
    """Metadata::validate's checks of one tensor's size, or None when its bytes are right."""
    numel = _numel(t.shape)
    nbits = None if numel is None else numel * DTYPES[t.dtype][1]
    if nbits is None or nbits > U64_MAX:
        return _overflow(t)
    if nbits % 8:
        return _Invalid(f"the slice does not end up at a byte boundary, this is invalid "
                        f"(tensor `{clip(t.name)}`: {numel:,} × {t.dtype} is {nbits:,} bits)")
    if t.end - t.begin != nbits // 8:
        return _Invalid(f"invalid shape, data type, or offset for tensor `{clip(t.name)}` "
                        f"({t.dtype} {_shape(t.shape)} needs {nbits // 8:,} bytes, data_offsets "
                        f"[{t.begin}, {t.end}] hold {t.end - t.begin:,})")
    return None


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


def _offsets(t: _Tensor) -> tuple[int, int]:
    return t.begin, t.end


def _tensor_metas(tensors: list[_Tensor], packed: _Capped) -> tuple[TensorMeta, ...]:
    metas = tuple(_tensor_meta(t, packed) for t in tensors)
    packed.close()
    return metas


def _tensor_meta(t: _Tensor, packed: _Capped) -> TensorMeta:
    dtype, bits = DTYPES[t.dtype]
    nbytes = t.end - t.begin
    if len(t.shape) > MAX_DIMS:  # a hostile shape of millions of dims: no tuple of them
        if packed.room():
            packed.notes.append(f"tensor `{clip(t.name)}` is {t.dtype} of {len(t.shape):,} "
                                f"dims, more than {MAX_DIMS}: described as {nbytes:,} packed bytes")
        shape: tuple[int, ...] = (nbytes,)
    elif bits == 4 and t.shape and t.shape[-1] % 2 == 0:
        shape = (*t.shape[:-1], t.shape[-1] // 2)  # torch's float4_e2m1fn_x2 holds two per byte
    elif bits < 8:
        if packed.room():
            packed.notes.append(f"tensor `{clip(t.name)}` is {t.dtype} {_shape(t.shape)}, which "
                                f"torch cannot hold: described as {nbytes:,} packed bytes")
        shape = (nbytes,)
    else:
        shape = tuple(t.shape)
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
