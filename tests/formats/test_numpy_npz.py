"""numpy_npz against np.load on kohya-style caches, truncated, damaged and hostile archives."""

from __future__ import annotations

import io
import os
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from cachedoctor.formats import numpy_npy as npy
from cachedoctor.formats import numpy_npz, read_bytes, read_path
from cachedoctor.formats.meta import NPZ
from cachedoctor.formats.source import BytesSource
from cachedoctor.formats.zipdir import read_directory

EXTRA_DTYPES = [np.float16, np.float32, np.float64, np.int64, np.int32, np.uint8, np.bool_,
                np.complex64, np.dtype(">f4"), np.dtype("<U4")]


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array)
    return buf.getvalue()


def zip_of(members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def read_npz(blob: bytes, deep: bool = False):
    src = BytesSource(blob)
    return numpy_npz.read(src, "x.npz", deep, read_directory(src))


def kohya_arrays(rng: random.Random, nprng: np.random.Generator) -> dict[str, np.ndarray]:
    h, w = rng.choice([(64, 64), (128, 96), (96, 128), (1, 1)])
    latents = nprng.standard_normal((rng.choice([4, 16]), h, w)).astype(np.float32)
    arrays = {
        "latents": np.asfortranarray(latents) if rng.random() < 0.3 else latents,
        "original_size": np.array([w * 8, h * 8]),
        "crop_ltrb": np.array([0, 0, w * 8, h * 8]),
    }
    if rng.random() < 0.5:  # multi-resolution keys (FLUX, SD3): latents_<H>x<W>
        arrays[f"latents_{h}x{w}"] = latents
        arrays[f"original_size_{h}x{w}"] = np.array([w * 8, h * 8])
    if rng.random() < 0.3:
        arrays["alpha_mask"] = nprng.random((h * 8, w * 8)).astype(np.float32)
    for i in range(rng.randint(0, 3)):
        dtype = rng.choice(EXTRA_DTYPES)
        shape = rng.choice([(), (0,), (3, 0), (77, 8), (5,)])
        arrays[f"extra{i}"] = np.asarray(nprng.integers(0, 100, shape)).astype(dtype)
    return arrays


def test_kohya_caches_match_np_load(tmp_path):
    rng = random.Random(2024)
    nprng = np.random.default_rng(2024)
    members = 0
    for i in range(60):
        arrays = kohya_arrays(rng, nprng)
        path = tmp_path / f"img{i}_0512x0768_sdxl.npz"
        (np.savez_compressed if i % 2 else np.savez)(path, **arrays)
        meta = read_path(str(path))
        assert meta.format == NPZ and meta.ok and meta.root == "dict", meta.errors
        with np.load(path) as z:
            assert [t.path[0] for t in meta.tensors] == z.files
            for t in meta.tensors:
                loaded = z[t.path[0]]
                assert t.storage_key == t.path[0] + ".npy"
                assert t.shape == loaded.shape
                assert t.storage_bytes == loaded.nbytes == t.nbytes
                assert t.itemsize == loaded.itemsize
                if loaded.size > 1:
                    assert t.stride == tuple(s // loaded.itemsize for s in loaded.strides)
                if loaded.dtype.isnative and loaded.dtype.kind in "biufc":
                    expected = str(torch.from_numpy(loaded).dtype).removeprefix("torch.")
                else:
                    expected = loaded.dtype.name
                assert t.dtype == expected
                members += 1
    assert members > 200


def test_a_truncated_npz_is_an_error_at_every_offset():
    arrays = {"latents": np.ones((4, 16, 16), np.float32), "original_size": np.array([128, 128])}
    for save in (np.savez, np.savez_compressed):
        buf = io.BytesIO()
        save(buf, **arrays)
        blob = buf.getvalue()
        for size in range(1, len(blob)):
            meta = read_bytes(blob[:size], "cut.npz")
            assert meta.format == NPZ and meta.errors, size
        assert read_bytes(blob, "whole.npz").ok


def test_garbage_and_zeros_never_raise():
    rng = random.Random(11)
    for _ in range(300):
        blob = b"PK\x03\x04" + bytes(rng.randrange(256) for _ in range(rng.choice([0, 30, 500])))
        assert read_bytes(blob, "g.npz").errors
    assert read_bytes(b"\0" * 4096, "z.npz").errors
    assert read_bytes(b"", "e.npz").format == "empty"


def test_damaged_bytes_anywhere_never_raise_nor_warn(recwarn):
    rng = random.Random(13)
    blobs = []
    for save in (np.savez, np.savez_compressed):
        buf = io.BytesIO()
        save(buf, latents=np.linspace(0, 1, 256, dtype=np.float32).reshape(4, 8, 8),
             o=np.array([1, "a"], dtype=object), original_size=np.array([64, 64]))
        blobs.append(buf.getvalue())
    for i in range(2000):
        blob = bytearray(rng.choice(blobs))
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        meta = read_bytes(bytes(blob), "x.npz", deep=bool(i % 2))
        assert meta.format == NPZ
    assert not recwarn.list  # literal_eval of a damaged header warns about bad escapes


def test_garbage_members_are_errors_naming_the_member():
    rng = random.Random(12)
    for i in range(300):
        body = bytes(rng.randrange(256) for _ in range(rng.choice([0, 5, 12, 300])))
        if i % 3 == 0:  # a real preamble, so the header parser sees the garbage
            body = b"\x93NUMPY" + bytes([rng.choice([1, 2, 3]), 0]) + body
        method = zipfile.ZIP_DEFLATED if i % 2 else zipfile.ZIP_STORED
        meta = read_npz(zip_of({"ok.npy": npy_bytes(np.zeros(3)), "junk.npy": body}, method),
                        deep=bool(i % 4 == 0))
        assert meta.errors and all("'junk.npy'" in e for e in meta.errors), meta.errors
        assert [t.path for t in meta.tensors] == [("ok",)]


def test_member_sizes_must_match_their_headers():
    data = npy_bytes(np.arange(10, dtype=np.float32))
    meta = read_npz(zip_of({"latents.npy": data[:-8], "crop_ltrb.npy": npy_bytes(np.zeros(4))}))
    assert meta.errors == (
        "member 'latents.npy': truncated: the header promises 40 bytes of <f4 [10] data, "
        "only 32 follow it",
    )
    meta = read_npz(zip_of({"latents.npy": data + b"\0" * 4}, zipfile.ZIP_DEFLATED))
    assert meta.errors == ("member 'latents.npy': 4 bytes after the 40 bytes of <f4 [10] data",)


def test_a_member_that_is_no_npy_is_an_error():
    blob = zip_of({"latents.npy": npy_bytes(np.zeros(3)), "notes.txt": b"hello"})
    meta = read_bytes(blob, "mixed.npz")
    assert meta.format == NPZ
    assert meta.errors == ("member 'notes.txt' is not an .npy array (np.savez writes only those)",)


def _flip_in_member(blob: bytes, member: str, at_from_end: int) -> bytes:
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        info = z.getinfo(member)
    src = BytesSource(blob)
    entry = next((e for e in read_directory(src).entries if e.name == member), None)
    assert entry is not None and entry.header_offset == info.header_offset
    where = entry.data_offset + entry.compressed_size - at_from_end
    damaged = bytearray(blob)
    damaged[where] ^= 0x10
    return bytes(damaged)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_a_flipped_byte_is_found_by_deep_only(tmp_path, save):
    path = tmp_path / "x.npz"
    save(path, latents=np.linspace(0, 1, 4096, dtype=np.float32).reshape(4, 32, 32),
         original_size=np.array([256, 256]))
    damaged = _flip_in_member(path.read_bytes(), "latents.npy", at_from_end=40)
    path.write_bytes(damaged)
    with pytest.raises(Exception):  # noqa: B017 (BadZipFile, or zlib's error)
        np.load(path)["latents"]
    assert read_bytes(damaged, "x.npz").ok
    meta = read_bytes(damaged, "x.npz", deep=True)
    assert meta.deep and len(meta.crc_errors) == 1 and "'latents.npy'" in meta.crc_errors[0]
    if save is np.savez:
        assert meta.crc_errors[0].startswith("CRC32 mismatch in 'latents.npy' (recorded 0x")


def test_deep_counts_nan_and_inf_per_member(tmp_path):
    bad = np.ones((4, 8, 8), np.float16)
    bad[0, 0, :3] = [np.nan, np.inf, -np.inf]
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / "nan.npz"
        save(path, latents=bad, clean=np.ones(5, np.float32), ids=np.arange(3),
             be=np.array([np.nan, 1.0], ">f8"))
        meta = read_path(str(path), deep=True)
        assert meta.ok and not meta.crc_errors
        assert dict(meta.nonfinite) == {("latents",): 3, ("be",): 1}
        assert read_path(str(path)).nonfinite == ()


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
@pytest.mark.parametrize("deep", [False, True])
def test_hostile_object_array_is_listed_never_run(tmp_path, save, deep):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.npz"
    save(path, latents=np.zeros((4, 8, 8), np.float32), x=np.array([Evil(marker)], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        np.load(path)["x"]
    meta = read_path(str(path), deep=deep)
    # np.load refuses the member as a trainer loads it: an error, beside the unsafe global
    assert meta.errors == ("member 'x.npy': 'x' is an object array: np.load refuses it unless "
                           "allow_pickle=True, as trainers load their caches",) and not meta.crc_errors
    assert any(g.endswith(".system") for g in meta.unsafe_globals), meta.unsafe_globals
    assert set(meta.globals) - set(meta.unsafe_globals) <= npy.NUMPY_OWN_GLOBALS
    assert {t.path: t.dtype for t in meta.tensors} == {("latents",): "float32", ("x",): "object"}
    assert any("'x' is an object array" in note for note in meta.notes)
    assert not marker.exists()
