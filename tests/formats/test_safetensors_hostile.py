"""Hostile safetensors headers (within the library's 100 MB limit) cost a bounded amount and
get the library's verdict: millions of tensors or metadata keys, duplicates, deep nesting,
huge numbers, huge shapes and offsets. Each runs here at a size that reads in about a second
(the caps are made small where a case needs more than that to reach them);
benchmarks/hostile_safetensors.py measures them at the full 100 MB."""

from __future__ import annotations

import json
import struct
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from safetensors import safe_open

from cachedoctor.formats import read_path, safetensors_header
from cachedoctor.formats.meta import SAFETENSORS

U64_MAX = 2**64 - 1


def write(tmp_path: Path, header: bytes, data: bytes = b"", name: str = "x") -> Path:
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def library_ok(path: Path) -> bool:
    try:
        with safe_open(str(path), "np"):
            return True
    except Exception:  # SafetensorError
        return False


def tiny_tensors(n: int, order: range | list[int] | None = None) -> bytes:
    """n 1-byte U8 tensors `t<i>`, listed in `order` (offset order by default)."""
    entries = (f'"t{i:07d}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}'
               for i in (order if order is not None else range(n)))
    return ("{" + ",".join(entries) + "}").encode()


def judged(path: Path):
    """read_path's FileMeta, checked against the library's verdict."""
    meta = read_path(str(path))
    assert meta.format == SAFETENSORS
    assert meta.ok == library_ok(path), meta.errors
    return meta


@pytest.fixture
def small_caps(monkeypatch):
    monkeypatch.setattr(safetensors_header, "MAX_KEPT", 50)
    monkeypatch.setattr(safetensors_header, "MAX_METADATA", 10)


def test_many_tensors_are_all_checked_and_the_first_kept(tmp_path, small_caps):
    meta = judged(write(tmp_path, tiny_tensors(3000), b"\0" * 3000))
    assert meta.ok
    assert [t.storage_key for t in meta.tensors] == [f"t{i:07d}" for i in range(50)]
    assert "the header declares 3,000 tensors: all are checked, the first 50 described (and " \
        "only theirs counted by --deep)" in meta.notes


def test_a_fault_past_the_cap_is_still_an_error(tmp_path, small_caps):
    header = tiny_tensors(3000).replace(b'"shape":[1],"data_offsets":[2999,3000]',
                                        b'"shape":[2],"data_offsets":[2999,3000]')
    meta = judged(write(tmp_path, header, b"\0" * 3000))
    assert meta.errors == ("safetensors header: invalid shape, data type, or offset for tensor "
                           "`t0002999` (U8 [2] needs 2 bytes, data_offsets [2999, 3000] hold 1)",)
    gap = tiny_tensors(3000).replace(b"[2999,3000]", b"[3000,3001]")
    meta = judged(write(tmp_path, gap, b"\0" * 3001, "gap"))
    assert "invalid offset for tensor `t0002999`" in meta.errors[0]


def test_tensors_out_of_offset_order_past_the_cap_are_sorted_as_the_library_sorts(
        tmp_path, small_caps):
    order = list(range(3000))[::-1]
    meta = judged(write(tmp_path, tiny_tensors(3000, order), b"\0" * 3000))
    assert meta.ok
    # the kept tensors are the first 50 listed, described in offset order
    assert [t.storage_key for t in meta.tensors] == [f"t{i:07d}" for i in range(2950, 3000)]


def test_huge_offsets_are_an_invalid_offset(tmp_path):
    header = json.dumps({"a": {"dtype": "U8", "shape": [0], "data_offsets": [U64_MAX, U64_MAX]},
                         "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    meta = judged(write(tmp_path, header, b"\0"))
    assert "invalid offset for tensor `a`" in meta.errors[0]


def test_a_million_duplicate_names_make_a_few_notes(tmp_path):
    entry = b'"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    meta = judged(write(tmp_path, b"{" + b",".join([entry] * 20_000) + b"}", b"\0"))
    assert meta.ok and len(meta.tensors) == 1
    assert len(meta.notes) == safetensors_header.MAX_NOTES + 1
    assert meta.notes[-1] == ("19,991 more duplicate tensor names in the header: the last of "
                              "each counts")


def test_deep_nesting_is_the_recursion_error(tmp_path):
    head = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"z":'
    meta = judged(write(tmp_path, head + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}}", b"\0"))
    assert meta.errors == ("safetensors header: invalid JSON in header: recursion limit exceeded",)
    meta = judged(write(tmp_path, b'{"x":' + b"[" * 1_000_000, name="open"))
    assert not meta.ok


@pytest.mark.parametrize(("number", "phrase"), [
    (b"1e999999", "number out of range (1e999999)"),
    (b"1." + b"1" * 1_000_000 + b"e999", "number out of range (a number of 1,000,006 characters)"),
    (b"1" * 5000, "number out of range (an integer of 5,000 digits)"),
    (b"9" * 400, "number out of range"),  # Python's int holds it; no f64 does
    (b"[" + b",".join([b"9" * 4000] * 200) + b"]", "number out of range"),
    (b"1" + b"0" * 308, None),  # 1e308: an f64
    (b"2" + b"0" * 308, "number out of range"),
    (b"-2" + b"0" * 308, "number out of range"),
    (b"17976931348623157" + b"0" * 292, "number out of range"),  # serde's product is not exact
    (b"1.8e308", "number out of range"),
    (b"1e308", None),
    (b"1e-99999", None),
    (b"0." + b"0" * 100_000 + b"1e100000", None),
    (b"1e" + b"0" * 100_000 + b"1", None),
    (b"1e9999999999", "number out of range"),
    (b"0e9999999999", None),
    (b"1e-9999999999", None),
    (b"18446744073709551615.5e288", None),
    (b"18446744073709551615.5e289", "number out of range"),  # the .5 is dropped, not rounded
    (b"184467440737095516150e288", "number out of range"),
])
def test_huge_numbers_in_an_ignored_field_get_the_library_verdict(tmp_path, number, phrase):
    head = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"z":'
    meta = judged(write(tmp_path, head + number + b"}}", b"\0"))
    if phrase is None:
        assert meta.ok, meta.errors
    else:
        assert meta.errors[0].startswith("safetensors header: invalid JSON in header: " + phrase)


@pytest.mark.parametrize("shape", [[2**64], ["1" * 5000], [1.5], [True], [-1]])
def test_a_bad_dim_is_an_error(tmp_path, shape):
    dims = json.dumps(shape).replace('"', "").encode()
    meta = judged(write(tmp_path, b'{"x":{"dtype":"U8","shape":' + dims
                        + b',"data_offsets":[0,1]}}', b"\0"))
    assert meta.errors[0].startswith("safetensors header: invalid JSON in header")


def test_a_huge_metadata_value_is_kept(tmp_path):
    big = "a" * 5_000_000
    meta = judged(write(tmp_path, json.dumps({"__metadata__": {"big": big, "k": "v"}}).encode()))
    assert meta.ok and dict(meta.metadata) == {"big": big, "k": "v"}


def test_many_metadata_keys_are_all_checked_and_the_first_kept(tmp_path, small_caps):
    pairs = [f'"k{i}":"v{i}"' for i in range(50_000)]
    # past the cap: whitespace, escapes and surrogate pairs, as the library accepts them
    pairs[5000] = '"k\\u00e9\\n" :\t"\\ud83d\\ude00 \\"x\\""'
    text = '{"__metadata__":{' + ",".join(pairs) + "}}"
    meta = judged(write(tmp_path, text.encode()))
    assert meta.ok
    assert dict(meta.metadata) == {f"k{i}": f"v{i}" for i in range(10)}
    assert any("more than 10 entries" in note for note in meta.notes)
    for bad in ('"k":1', '"k":"\\ud800"', '"k\\udc00":""', '"k":"\x01"', '"k":"\\x"', '"k" "v"'):
        broken = text.replace('"k40000":"v40000"', bad).encode()
        meta = judged(write(tmp_path, broken, name="bad"))
        assert meta.errors[0].startswith("safetensors header: invalid JSON in header"), bad


def test_duplicate_metadata_keys_make_a_few_notes(tmp_path):
    text = '{"__metadata__":{' + ",".join(['"k":"1"'] * 100_000) + ',"k":"2"}}'
    meta = judged(write(tmp_path, text.encode()))
    assert meta.ok
    assert meta.notes[-2:] == (
        "4,087 more duplicate `__metadata__` keys: the last of each counts",
        "`__metadata__` holds more than 4,096 entries: the first 4,096 are kept (a later value "
        "of one of their keys is not seen)")
    assert len(meta.notes) == safetensors_header.MAX_NOTES + 2
    assert dict(meta.metadata) == {"k": "1"}  # the last "2" is past the first 4,096 pairs


def test_a_shape_of_many_dims_is_described_as_bytes(tmp_path):
    dims = b",".join([b"1"] * 1_000_000)
    meta = judged(write(tmp_path, b'{"x":{"dtype":"F16","shape":[' + dims + b',2],'
                                  b'"data_offsets":[0,4]}}', b"\0" * 4))
    assert meta.ok
    (t,) = meta.tensors
    assert (t.shape, t.dtype, t.storage_bytes) == ((4,), "float16", 4)
    assert "is F16 of 1,000,001 dims, more than 64: described as 4 packed bytes" in meta.notes[0]


@pytest.mark.parametrize(("dims", "ok"), [
    ([U64_MAX] * 200_000, False),  # overflows at the second dim
    ([1] * 200_000 + [U64_MAX, 0] + [U64_MAX] * 1000, True),  # 0 after u64::MAX: no overflow
    ([2**40] * 2 + [0], False),  # overflows before the 0
    ([2] * 63 + [1] * 100_000 + [0], True),  # 2**63 at most
    ([2] * 64 + [1] * 100_000 + [0], False),
])
def test_the_product_of_many_dims_overflows_where_the_library_says(tmp_path, dims, ok):
    text = b'{"x":{"dtype":"U8","shape":' + json.dumps(dims).encode() + b',"data_offsets":[0,0]}}'
    meta = judged(write(tmp_path, text))
    assert meta.ok == ok
    if not ok:
        assert "overflow computing buffer size" in meta.errors[0]


def test_reading_many_tensors_holds_little_memory(tmp_path, monkeypatch):
    """20,000 tensors in a 1.3 MB header: 4 MB at the peak, where decoding the whole document
    at once (and a TensorMeta each) held 17 MB."""
    monkeypatch.setattr(safetensors_header, "MAX_KEPT", 1000)
    path = write(tmp_path, tiny_tensors(20_000), b"\0" * 20_000)
    tracemalloc.start()
    try:
        meta = read_path(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert meta.ok and len(meta.tensors) == 1000
    assert peak < 8 * 2**20, peak


@pytest.mark.parametrize(("header", "ok"), [
    (b' { "a\\u00e9" :\n{"dtype":"U8","shape":[1],"data_offsets":[0,1]} ,\t"b" :["U8",[1],'
     b'[1,2]] , "__metadata__" : { "k" : "v" } } ', True),
    (b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,2]}}', False),
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,2]},}', False),
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,2]}', False),
    (b'{"a" {"dtype":"U8","shape":[1],"data_offsets":[0,2]}}', False),
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,2]} "b":1}', False),
    (b'{1:2}', False),
    (b'{"__metadata__":5}', False),
    (b'{"__metadata__":{"a":"b",}}', False),
    (b'{"__metadata__":{"a":"b"} x', False),
])
def test_the_walk_reads_json_as_the_library_does(tmp_path, header, ok):
    meta = judged(write(tmp_path, header, b"\0\0"))
    assert meta.ok == ok, meta.errors


def test_an_integer_of_a_million_digits_is_refused_quickly_without_pythons_limit(tmp_path):
    """With PYTHONINTMAXSTRDIGITS=0, int() would take its digits in quadratic time (minutes
    for a million in Python 3.11, hours for 100 MB): the reader refuses them unread."""
    head = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"z":'
    path = write(tmp_path, head + b"7" * 1_000_000 + b"}}", b"\0")
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        started = time.perf_counter()
        meta = read_path(str(path))
        took = time.perf_counter() - started
    finally:
        sys.set_int_max_str_digits(old)
    assert meta.errors == ("safetensors header: invalid JSON in header: number out of range (an "
                           "integer of 1,000,000 digits)",)
    assert took < 5, took
