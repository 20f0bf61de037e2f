"""numpy_npy against numpy: same dtype, shape, strides and data size; np.load's refusals."""

from __future__ import annotations

import io
import os
import random
from math import prod
from pathlib import Path

import numpy as np
import pytest
import torch

from cachedoctor.formats import numpy_npy, read_bytes, read_path
from cachedoctor.formats.meta import NPY
from cachedoctor.formats.source import BytesSource

TORCH_LIKE = ["<f2", "<f4", "<f8", "|u1", "|i1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8",
              "|b1", "<c8", "<c16"]
NUMPY_ONLY = [">f4", ">i8", "<U7", "|S5", "|V12", "<M8[ns]", "<m8[s]", "<f16",
              [("a", "<f4"), ("b", "<i8", (2,))],
              {"names": ["x", "y"], "formats": ["<f4", "<f2"], "offsets": [0, 8], "itemsize": 12}]


def npy_bytes(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version, allow_pickle=True)
    return buf.getvalue()


def random_array(rng: random.Random, dtype: object) -> np.ndarray:
    kind = rng.random()
    if kind < 0.15:
        shape: tuple[int, ...] = ()
    elif kind < 0.3:
        shape = (*[rng.randint(0, 3) for _ in range(rng.randint(0, 2))], 0)
    else:
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
    dtype = np.dtype(dtype)
    size = prod(shape) * dtype.itemsize
    raw = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, size, np.uint8)
    array = np.frombuffer(raw.tobytes(), dtype).reshape(shape)
    return np.asfortranarray(array) if rng.random() < 0.3 else array


def test_random_arrays_match_np_load(tmp_path):
    rng = random.Random(99)
    checked = 0
    for i in range(200):
        dtype = rng.choice(TORCH_LIKE + NUMPY_ONLY)
        array = random_array(rng, dtype)
        version = rng.choice([None, (1, 0), (2, 0), (3, 0)])
        path = tmp_path / f"a{i}.npy"
        path.write_bytes(npy_bytes(array, version))
        meta = read_path(str(path))
        loaded = np.load(path)
        assert meta.format == NPY and meta.ok, (dtype, meta.errors)
        (t,) = meta.tensors
        assert t.path == () and meta.root == "tensor"
        assert t.shape == loaded.shape
        assert t.itemsize == loaded.itemsize
        assert t.storage_bytes == loaded.nbytes == t.nbytes
        if loaded.size > 1:
            assert t.stride == tuple(s // loaded.itemsize for s in loaded.strides)
        if isinstance(dtype, str) and dtype in TORCH_LIKE:
            # torch 2.1 has no uint16/32/64 to compare with: the name is numpy's, as torch's is
            torch_name = (str(torch.from_numpy(loaded).dtype).removeprefix("torch.")
                          if hasattr(torch, loaded.dtype.name) else loaded.dtype.name)
            assert t.dtype == torch_name
            assert not meta.notes
        else:
            assert t.dtype == loaded.dtype.name
            assert meta.notes  # big-endian, or no torch dtype
        checked += 1
    assert checked == 200


def test_fortran_order_gives_column_major_strides():
    meta = read_bytes(npy_bytes(np.asfortranarray(np.zeros((2, 3, 4), np.float32))), "f.npy")
    assert meta.tensors[0].stride == (1, 2, 6)


@pytest.mark.filterwarnings("ignore:Reading `.npy`")  # numpy on the Python 2 header
@pytest.mark.parametrize("header", [
    "{'shape': (3, 4), 'fortran_order': False, 'descr': '<f4'}",  # another key order
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3L, 4L), }",  # numpy < 1.x longs
    "{'descr':'<f4','fortran_order':False,'shape':(3,4)}",
    "{'descr': 'float32', 'fortran_order': False, 'shape': (3, 4), }",  # a dtype alias
])
def test_non_canonical_headers_are_read_as_numpy_reads_them(tmp_path, header):
    text = header.encode("latin1") + b" " * 10 + b"\n"
    blob = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + b"\0" * 48
    (tmp_path / "h.npy").write_bytes(blob)
    assert np.load(tmp_path / "h.npy").shape == (3, 4)
    meta = read_bytes(blob, "h.npy")
    assert meta.ok, meta.errors
    assert (meta.tensors[0].dtype, meta.tensors[0].shape) == ("float32", (3, 4))


@pytest.mark.parametrize(("header", "phrase"), [
    ("[1, 2]", "not a dictionary"),
    ("{'descr': '<f4', 'shape': (3,)}", "correct keys"),
    ("{'descr': '<f4', 'fortran_order': 1, 'shape': (3,)}", "fortran_order"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': [3]}", "shape"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (-3,)}", "shape"),
    ("{'descr': '<q7', 'fortran_order': False, 'shape': (3,)}", "not a numpy dtype"),
    ("{'descr': __import__('os').system('true'), 'fortran_order': False, 'shape': (3,)}",
     "no Python literal"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (3,)", "no Python literal"),
])
def test_bad_headers_are_errors(header, phrase):
    text = header.encode() + b"\n"
    blob = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + b"\0" * 12
    # numpy refuses each (from a stream: from a real file numpy < 2 reads a negative count as
    # "all of it" through fromfile and loads the (-3,) one)
    with pytest.raises(Exception):  # noqa: B017 (ValueError, SyntaxError or tokenize's error)
        np.load(io.BytesIO(blob))
    meta = read_bytes(blob, "h.npy")
    assert meta.errors and phrase in meta.errors[0], meta.errors


def test_header_numpy_refuses_to_parse_by_default(tmp_path):
    array = np.zeros(3, dtype=[(f"field_{i}", "<f4") for i in range(600)])
    blob = npy_bytes(array)
    (tmp_path / "big.npy").write_bytes(blob)
    with pytest.raises(ValueError, match="Header info length"):
        np.load(tmp_path / "big.npy")
    meta = read_bytes(blob, "big.npy")
    assert "Header info length" in meta.errors[0]


def test_a_huge_header_length_is_refused_before_reading():
    blob = b"\x93NUMPY\x02\x00" + (2**32 - 1).to_bytes(4, "little") + b"{'descr'"
    assert "Header info length (4,294,967,295)" in read_bytes(blob, "h.npy").errors[0]


def test_unknown_format_version_is_an_error():
    blob = bytearray(npy_bytes(np.zeros(3)))
    blob[6] = 4
    assert "version 4.0" in read_bytes(bytes(blob), "v.npy").errors[0]


def test_every_truncation_and_trailing_bytes_are_errors(tmp_path):
    blob = npy_bytes(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    for size in range(6, len(blob)):
        meta = read_bytes(blob[:size], "cut.npy")
        assert meta.format == NPY and meta.errors, size
    assert "truncated" in read_bytes(blob[:-5], "cut.npy").errors[0]
    meta = read_bytes(blob + b"\0" * 3, "long.npy")
    assert meta.errors == ("3 bytes after the 96 bytes of <f4 [2, 3, 4] data",)
    assert read_bytes(blob, "ok.npy").ok


def test_garbage_after_the_magic_never_raises():
    rng = random.Random(5)
    for _ in range(400):
        body = bytes(rng.randrange(256) for _ in range(rng.choice([0, 3, 10, 200])))
        version = bytes([rng.choice([1, 2, 3, 9]), 0])
        meta = numpy_npy.read(BytesSource(b"\x93NUMPY" + version + body), "g.npy", True)
        assert meta.format == NPY and meta.errors


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_hostile_object_array_is_listed_never_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.npy"
    np.save(path, np.array([Evil(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        np.load(path)
    meta = read_path(str(path), deep=True)
    assert [g for g in meta.unsafe_globals if g.endswith(".system")], meta.unsafe_globals
    # numpy's own reconstruction is named, not unsafe; everything else the pickle names is
    assert set(meta.globals) - set(meta.unsafe_globals) <= numpy_npy.NUMPY_OWN_GLOBALS
    assert meta.tensors[0].dtype == "object" and meta.tensors[0].storage_bytes is None
    assert any("allow_pickle=True" in note for note in meta.notes)
    assert not marker.exists()


def test_plain_object_array_is_an_error_but_not_hostile(tmp_path):
    """numpy's own reconstruction globals are no attack (no CD105), but a trainer's np.load
    refuses any object array: an error all the same (CD101)."""
    path = tmp_path / "obj.npy"
    np.save(path, np.array([1, "a", None], dtype=object), allow_pickle=True)
    meta = read_path(str(path))
    assert meta.globals and all(g.startswith("numpy") for g in meta.globals)
    assert meta.unsafe_globals == ()
    assert any("object array" in e and "allow_pickle" in e for e in meta.errors)
    with pytest.raises(ValueError, match="allow_pickle"):
        np.load(path)


def test_deep_counts_nan_and_inf():
    values = np.array([0.0, np.nan, np.inf, -np.inf, 2.0])
    for dtype in ["<f2", "<f4", "<f8", ">f4", "<c8"]:
        meta = read_bytes(npy_bytes(values.astype(dtype)), "n.npy", deep=True)
        assert meta.deep and meta.nonfinite == (((), 3),), dtype
    assert read_bytes(npy_bytes(np.arange(5)), "i.npy", deep=True).nonfinite == ()
    assert read_bytes(npy_bytes(values), "n.npy").nonfinite == ()
