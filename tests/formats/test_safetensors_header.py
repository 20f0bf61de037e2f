"""safetensors_header against the safetensors library: same verdict, same metadata."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import safe_open

from cachedoctor.formats import native, read_bytes, read_path, safetensors_header
from cachedoctor.formats.meta import SAFETENSORS
from cachedoctor.formats.source import BytesSource


@pytest.fixture(autouse=True, params=["native", "python"])
def checks(request, monkeypatch):
    """Every test here twice: with the compiled value test (native.py), where it was built, and
    with numpy's, which every install has (--deep's zeros and NaN/Inf proofs)."""
    if request.param == "python":
        monkeypatch.setattr(native, "NATIVE", None)
    elif native.NATIVE is None:
        pytest.skip("the C checks were not built here")


# torch dtype -> safetensors dtype, for every dtype safetensors.torch can write and the
# installed torch has (float8_e8m0fnu and float4_e2m1fn_x2 are recent: torch 2.4 has neither)
TORCH_DTYPES = {
    getattr(torch, name): code for name, code in [
        ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
        ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"),
        ("uint8", "U8"), ("bool", "BOOL"), ("complex64", "C64"),
        ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("float8_e8m0fnu", "F8_E8M0"), ("float4_e2m1fn_x2", "F4"),
    ] if hasattr(torch, name)
}
FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)
# ...those safetensors.torch can load with the installed torch (2.1 has no uint16/32/64)
NUMPY_DTYPES = [d for d in (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
                            np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64)
                if hasattr(torch, np.dtype(d).name)]


def library_verdict(path: Path) -> tuple[bool, str]:
    """What safe_open (the numpy framework: no torch) says about the header."""
    try:
        with safe_open(str(path), "np"):
            return True, ""
    except Exception as exc:  # SafetensorError, and OSError for files mmap refuses
        return False, str(exc)


def random_shape(rng: random.Random) -> list[int]:
    kind = rng.random()
    if kind < 0.15:
        return []  # 0-dim
    if kind < 0.3:
        return [rng.randint(0, 3) for _ in range(rng.randint(1, 3))] + [0]  # empty
    return [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]


def random_torch_tensor(rng: random.Random, gen: torch.Generator, dtype: torch.dtype):
    shape = random_shape(rng)
    if dtype == FLOAT4:
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        return raw.view(FLOAT4)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=gen) * 4).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def header_file(header: object, data: bytes = b"", raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def u8(name: str = "x", n: int = 1, begin: int = 0) -> dict:
    return {name: {"dtype": "U8", "shape": [n], "data_offsets": [begin, begin + n]}}


# The research note's crafted cases and the corners of serde's JSON decoding. Each is
# (name, file bytes, a phrase of the library's own message or None when the file is fine).
CRAFTED = [
    ("empty file", b"", "header too small"),
    ("shorter than the length", b"\x01\x00\x00", "header too small"),
    ("header too large", struct.pack("<Q", 100_000_001) + b"{}", "header too large"),
    ("length at the limit, past the end", struct.pack("<Q", 100_000_000) + b"{}",
     "invalid header length"),
    ("length past the end", struct.pack("<Q", 50) + b"{}", "invalid header length"),
    ("100 GB length", struct.pack("<Q", 100 * 10**9) + b"{}", "header too large"),
    ("not UTF-8", header_file(None, raw=b'{"a\xff":1}'), "invalid UTF-8"),
    ("bad JSON", header_file(None, raw=b'{"a":'), "invalid JSON"),
    ("empty header", header_file(None, raw=b""), "invalid JSON"),
    ("array root", header_file([1]), "invalid JSON"),
    ("unknown dtype", header_file({"x": {"dtype": "C128", "shape": [1], "data_offsets": [0, 16]}},
                                  b"\0" * 16), "invalid JSON"),
    ("negative shape", header_file({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
     "invalid JSON"),
    ("float shape", header_file({"x": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}},
                                b"\0"), "invalid JSON"),
    ("bool shape", header_file({"x": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}},
                               b"\0"), "invalid JSON"),
    ("-0 in shape", header_file(None, raw=b'{"x":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
     "invalid JSON"),
    ("2**64 in shape", header_file({"x": {"dtype": "U8", "shape": [2**64], "data_offsets": [0, 0]}}),
     "invalid JSON"),
    ("three offsets", header_file({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}},
                                  b"\0"), "invalid JSON"),
    ("missing field", header_file({"x": {"dtype": "U8", "shape": [1]}}, b"\0"), "invalid JSON"),
    ("null tensor", header_file({"x": None}), "invalid JSON"),
    ("non-string metadata", header_file({"__metadata__": {"a": 1}}), "invalid JSON"),
    ("metadata as a list", header_file({"__metadata__": [["a", "b"]]}), "invalid JSON"),
    ("NaN literal", header_file(None, raw=b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],'
                                          b'"z":NaN}}', data=b"\0"), "invalid JSON"),
    ("number out of range", header_file(None, raw=b'{"x":{"dtype":"U8","shape":[1],'
                                                  b'"data_offsets":[0,1],"z":1e999}}', data=b"\0"),
     "invalid JSON"),
    ("lone surrogate", header_file(None, raw=b'{"__metadata__":{"a":"\\ud800"}}'), "invalid JSON"),
    ("surrogate pair", header_file(None, raw=b'{"__metadata__":{"a":"\\ud83d\\ude00"}}'), None),
    ("duplicate __metadata__", header_file(None, raw=b'{"__metadata__":{},"__metadata__":{}}'),
     "invalid JSON"),
    ("duplicate field", header_file(None, raw=b'{"x":{"dtype":"U8","dtype":"U8","shape":[1],'
                                              b'"data_offsets":[0,1]}}', data=b"\0"),
     "invalid JSON"),
    ("trailing characters", header_file(None, raw=b"{}\0"), "invalid JSON"),
    ("BOM", header_file(None, raw=b"\xef\xbb\xbf{}"), "invalid JSON"),
    ("nesting 128 deep", header_file(None, raw=b'{"x":{"dtype":"U8","shape":[1],"data_offsets":'
                                               b'[0,1],"z":' + b"[" * 126 + b"]" * 126 + b"}}",
                                     data=b"\0"), "invalid JSON"),
    ("nesting 127 deep", header_file(None, raw=b'{"x":{"dtype":"U8","shape":[1],"data_offsets":'
                                               b'[0,1],"z":' + b"[" * 125 + b"]" * 125 + b"}}",
                                     data=b"\0"), None),
    ("gap before the first tensor", header_file(u8(begin=1), b"\0\0"), "invalid offset for tensor `x`"),
    ("overlapping tensors", header_file(
        {**u8("x", 2), "y": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3),
     "invalid offset for tensor `y`"),
    ("end before begin", header_file(
        {**u8("x"), "y": {"dtype": "U8", "shape": [0], "data_offsets": [1, 0]}}, b"\0"),
     "invalid offset for tensor `y`"),
    ("numel overflow", header_file(
        {"x": {"dtype": "U8", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}), "overflow"),
    ("bits overflow", header_file(
        {"x": {"dtype": "F64", "shape": [2**62], "data_offsets": [0, 0]}}), "overflow"),
    ("misaligned F4", header_file({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}},
                                  b"\0"), "byte boundary"),
    ("size != numel x bits", header_file(
        {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
     "invalid shape, data type, or offset for tensor"),
    ("truncated data", header_file(
        {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
     "incomplete metadata, file not fully covered"),
    ("trailing bytes", header_file(
        {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 9),
     "incomplete metadata, file not fully covered"),
    ("duplicate tensor, the last covers the file", header_file(None, raw=(
        b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'), data=b"\0\0"), None),
    ("duplicate tensor, the first covers the file", header_file(None, raw=(
        b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'), data=b"\0"),
     "incomplete metadata"),
    ("tensor as a 3-element array", header_file(None, raw=b'{"x":["U8",[1],[0,1]]}', data=b"\0"),
     None),
    ("tensor as a 4-element array", header_file(None, raw=b'{"x":["U8",[1],[0,1],5]}', data=b"\0"),
     "invalid JSON"),
    ("dtype as a unit-variant map", header_file(
        None, raw=b'{"x":{"dtype":{"U8":null},"shape":[1],"data_offsets":[0,1]}}', data=b"\0"),
     None),
    ("unknown field", header_file(None, raw=b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],'
                                            b'"q":[1,{"a":2}]}}', data=b"\0"), None),
    ("tensors out of order", header_file({**u8("y", 1, 1), **u8("x")}, b"\0\0"), None),
    ("u64 max times zero", header_file(
        {"x": {"dtype": "U8", "shape": [2**64 - 1, 0], "data_offsets": [0, 0]}}), None),
    ("null metadata", header_file({"__metadata__": None}), None),
    ("whitespace padding", header_file(None, raw=b"\t{}\r\n    "), None),
    ("F4 and F6", header_file({"a": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]},
                               "b": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [3, 6]}},
                              b"\0" * 6), None),
]


@pytest.mark.parametrize(("name", "blob", "phrase"), CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_headers_get_the_library_verdict(tmp_path, name, blob, phrase):
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    library_ok, library_message = library_verdict(path)
    meta = safetensors_header.read(BytesSource(blob), str(path), False)
    assert meta.ok == library_ok, (meta.errors, library_message)
    assert (phrase is None) == library_ok
    if phrase is not None:
        assert phrase in library_message  # the case fails for the reason it was made for
        assert meta.errors[0].startswith("safetensors header: ")
        assert phrase in meta.errors[0]


def test_coverage_error_says_where_the_data_ends():
    blob = header_file({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 10)
    meta = read_bytes(blob, "x.safetensors")
    end = len(blob) + 6
    assert meta.errors == (
        "safetensors header: incomplete metadata, file not fully covered "
        f"(data ends at {end}, file is {len(blob)} bytes: truncated)",
    )
    assert [t.shape for t in meta.tensors] == [(4,)]  # the header itself is fine


def test_random_tensors_match_what_the_library_loads(tmp_path):
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    files = 0
    for round_ in range(40):
        tensors = {
            f"t{i}_{rng.randint(0, 999)}": random_torch_tensor(rng, gen, rng.choice(list(TORCH_DTYPES)))
            for i in range(rng.randint(1, 6))
        }
        metadata = {"format": "pt", "round": str(round_), "resolution": "[512, 768]"}
        path = tmp_path / f"t{round_}.safetensors"
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
        _assert_matches_library(path, metadata)
        files += 1
    for round_ in range(40):
        arrays = {}
        for i in range(rng.randint(1, 6)):
            dtype = rng.choice(NUMPY_DTYPES)
            values = np.random.default_rng(round_ * 10 + i).standard_normal(random_shape(rng))
            arrays[f"a{i}"] = np.asarray(values * 50).astype(dtype)
        path = tmp_path / f"n{round_}.safetensors"
        safetensors.numpy.save_file(arrays, str(path))
        _assert_matches_library(path, None)
        files += 1
    assert files == 80


def _assert_matches_library(path: Path, metadata: dict | None) -> None:
    meta = read_path(str(path))
    assert meta.format == SAFETENSORS and meta.ok, meta.errors
    loaded = safetensors.torch.load_file(str(path))
    with safe_open(str(path), "np") as f:
        assert dict(meta.metadata) == (f.metadata() or {})
        assert len(meta.tensors) == len(f.keys())
        for t in meta.tensors:
            (name,) = t.path
            sliced = f.get_slice(name)
            torch_tensor = loaded[name]
            assert t.dtype == str(torch_tensor.dtype).removeprefix("torch.")
            assert t.shape == tuple(torch_tensor.shape)
            assert t.storage_bytes == torch_tensor.untyped_storage().nbytes() == t.nbytes
            assert t.stride == torch_tensor.stride()
            assert t.itemsize == torch_tensor.element_size()
            assert (t.storage_key, t.storage_offset, t.location) == (name, 0, "cpu")
            assert sliced.get_dtype() == TORCH_DTYPES[torch_tensor.dtype]
            if sliced.get_dtype() != "F4":  # the header counts 4-bit values, torch pairs them
                assert list(t.shape) == sliced.get_shape()
    if metadata is not None:
        assert dict(meta.metadata) == metadata


def test_every_truncation_and_every_trailing_length_is_an_error(tmp_path):
    path = tmp_path / "x.safetensors"
    safetensors.torch.save_file({"latent": torch.randn(4, 8, 8).half(), "ids": torch.arange(3)},
                                str(path), metadata={"format": "pt"})
    blob = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    for size in [*range(len(blob)), len(blob) + 1, len(blob) + 8]:
        data = (blob + b"\0" * 8)[:size]
        cut.write_bytes(data)
        meta = safetensors_header.read(BytesSource(data), str(cut), False)
        assert not meta.ok
        assert meta.ok == library_verdict(cut)[0], size


def test_mutated_headers_agree_with_the_library(tmp_path):
    """Flip, drop and insert header bytes: whatever the library says, we say."""
    path = tmp_path / "x.safetensors"
    safetensors.torch.save_file({"a": torch.ones(2, 3), "b": torch.zeros(5, dtype=torch.int64),
                                 "c": torch.ones(0, 2).bfloat16()}, str(path),
                                metadata={"format": "pt", "k": "v"})
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    rng = random.Random(7)
    alphabet = b'{}[]",:0123456789-.eE ntrufalsFUIB\\x'
    mutated = tmp_path / "m.safetensors"
    agree = oks = 0
    for _ in range(600):
        data = bytearray(blob)
        at = rng.randrange(8, 8 + n)
        op = rng.random()
        if op < 0.5:
            data[at] = rng.choice(alphabet)
        elif op < 0.75:
            data[at] = rng.randrange(256)
        else:  # keep the header length consistent with the text it frames
            del data[at]
            data[:8] = struct.pack("<Q", n - 1)
        mutated.write_bytes(bytes(data))
        meta = safetensors_header.read(BytesSource(bytes(data)), str(mutated), False)
        library_ok = library_verdict(mutated)[0]
        assert meta.ok == library_ok, (bytes(data[8 : 8 + n]), meta.errors)
        agree += 1
        oks += library_ok
    assert agree == 600 and 0 < oks < 600


def test_garbage_never_raises():
    rng = random.Random(3)
    for i in range(500):
        size = rng.choice([0, 1, 7, 8, 9, 16, 100, 5000])
        blob = bytes(rng.randrange(256) for _ in range(size))
        if i % 2:  # a plausible length, so the JSON parser sees the garbage
            blob = struct.pack("<Q", max(0, size - 8)) + b"{" + blob[9:]
        meta = safetensors_header.read(BytesSource(blob), "g.safetensors", False)
        assert meta.format == SAFETENSORS and meta.errors


def test_duplicate_keys_are_noted_and_the_last_counts():
    blob = header_file(None, raw=(b'{"__metadata__":{"k":"1","k":"2"},'
                                  b'"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},'
                                  b'"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'),
                       data=b"\0\0")
    meta = read_bytes(blob, "d.safetensors")
    assert meta.ok
    assert dict(meta.metadata) == {"k": "2"}
    assert [t.shape for t in meta.tensors] == [(2,)]
    assert any("duplicate tensor name `x`" in n for n in meta.notes)
    assert any("duplicate `__metadata__` key `k`" in n for n in meta.notes)


def test_ai_toolkit_latent_parameters_are_kept(tmp_path):
    path = tmp_path / "img_7f3a.safetensors"
    metadata = {"format": "pt", "resolution": "1024", "scale_factor": "0.13025",
                "vae_hash": "ae3c", "flip_x": "False"}
    safetensors.torch.save_file({"latent": torch.randn(4, 128, 96)}, str(path), metadata=metadata)
    meta = read_path(str(path))
    assert dict(meta.metadata) == metadata
    assert meta.tensors[0].path == ("latent",)
    assert meta.tensors[0].shape == (4, 128, 96)


def test_float4_is_described_as_torch_holds_it():
    blob = header_file({"a": {"dtype": "F4", "shape": [3, 4], "data_offsets": [0, 6]},
                        "b": {"dtype": "F4", "shape": [2, 3], "data_offsets": [6, 9]}}, b"\0" * 9)
    meta = read_bytes(blob, "f4.safetensors")
    a, b = meta.tensors
    assert (a.dtype, a.shape, a.stride, a.nbytes) == ("float4_e2m1fn_x2", (3, 2), (2, 1), 6)
    assert (b.shape, b.nbytes) == ((3,), 3)  # an odd last dim: torch refuses, bytes it is
    assert any("tensor `b` is F4 [2, 3]" in n for n in meta.notes)


def test_deep_counts_nonfinite_values_per_dtype(tmp_path):
    special = torch.tensor([0.0, float("nan"), float("inf"), -float("inf"), 1.5, float("nan")])
    tensors = {name: special.to(dtype) for name, dtype in [
        ("f16", torch.float16), ("f32", torch.float32), ("f64", torch.float64),
        ("bf16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
        ("c64", torch.complex64)]}
    if hasattr(torch, "float8_e4m3fnuz"):  # torch >= 2.2
        tensors["e4m3fnuz"] = special.to(torch.float8_e4m3fnuz)
    # e4m3fn has no Inf: how a cast treats Inf differs between torch releases (NaN, or the
    # largest finite value), so the bits are also given outright: 0x7f and 0xff are its NaNs,
    # 0x7e (448) and 0xfe (-448) its largest finite values
    tensors["e4m3_bits"] = torch.tensor([0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x38], dtype=torch.uint8).view(
        torch.float8_e4m3fn)
    tensors["clean"] = torch.ones(3, 3)
    tensors["ints"] = torch.arange(6)
    path = tmp_path / "nan.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    meta = read_path(str(path), deep=True)
    assert meta.deep and meta.ok
    expected = {name: _nonfinite(t) for name, t in tensors.items()}
    expected = {(name,): count for name, count in expected.items() if count}
    assert dict(meta.nonfinite) == expected
    assert expected[("e5m2",)] == expected[("bf16",)] == 4
    assert expected[("e4m3_bits",)] == 2
    assert not read_path(str(path)).nonfinite  # the default scan reads no values


def _nonfinite(t: torch.Tensor) -> int:
    if t.is_complex():
        return int((~torch.isfinite(torch.view_as_real(t))).any(-1).sum())
    return int((~torch.isfinite(t.to(torch.float64))).sum())  # float8 has no isfinite


def test_files_of_one_header_read_alike_with_a_scans_memo(tmp_path):
    """A scan parses a header once (Templates.headers): every later file of that size and
    header has the same facts, and with --deep still its own NaN/Inf and zero counts, on
    either sign, exactly as a read without the memo finds them. The clean ones are twins
    (same_as), whose verdict the scan may reuse; a truncated one is no twin."""
    from cachedoctor.formats.zip_templates import Templates

    gen = torch.Generator().manual_seed(3)
    planted = [None, None, {5: float("nan")}, {70: -float("inf")}, {9: 0.0}, {300: -0.0},
               {11: float("inf"), 12: 0.0}, None]
    paths = []
    for i, plant in enumerate(planted):
        latent = torch.randn(4, 32, 32, generator=gen).abs_().add_(0.5)  # no zero by chance
        latent = latent.to(torch.bfloat16 if i % 2 else torch.float16).to(torch.float16)
        for at, value in (plant or {}).items():
            latent.view(-1)[at] = value
        path = tmp_path / f"{i}.safetensors"
        safetensors.torch.save_file({"latents": latent}, str(path))
        paths.append(path)
    paths[-1].write_bytes(paths[-1].read_bytes()[:-2])  # truncated: another size
    for deep in (False, True):
        templates = Templates()
        for i, path in enumerate(paths):
            alone = read_path(str(path), deep=deep)
            shared = read_path(str(path), deep=deep, templates=templates)
            assert shared == alone
            twin = i in (1,) or (not deep and 0 < i < len(paths) - 1)
            assert (shared.same_as is not None) == twin, (deep, i)
    deep = [read_path(str(p), deep=True) for p in paths]
    assert [bool(m.nonfinite) for m in deep] == [False, False, True, True, False, False, True,
                                                 False]
    assert [bool(m.zeros) for m in deep] == [False, False, False, False, True, True, True, False]
    assert deep[-1].errors


def test_a_header_too_long_to_hold_is_parsed_every_time(tmp_path, monkeypatch):
    from cachedoctor.formats.zip_templates import Templates

    monkeypatch.setattr(safetensors_header, "MAX_KNOWN_HEADER", 16)
    path = tmp_path / "a.safetensors"
    safetensors.torch.save_file({"latents": torch.ones(4, 8, 8)}, str(path))
    templates = Templates()
    for _ in range(2):
        assert read_path(str(path), templates=templates).ok
    assert not templates.headers


def test_an_empty_tensor_beside_a_full_one_reads_alike_with_the_memo(tmp_path):
    from cachedoctor.formats.zip_templates import Templates

    templates = Templates()
    for i in range(3):
        path = tmp_path / f"{i}.safetensors"
        safetensors.torch.save_file({"empty": torch.zeros(0, 4), "latents": torch.ones(4, 8) + i},
                                    str(path))
        meta = read_path(str(path), deep=True, templates=templates)
        assert meta == read_path(str(path), deep=True) and meta.ok and not meta.zeros
