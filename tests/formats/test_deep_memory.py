"""--deep on deflated entries: each storage or member is inflated once, in bounded chunks.

A torch file re-zipped with ZIP_DEFLATED (torch writes stored entries; a user's zip tool may
not, and torch.load still reads the result) whose many small views share one big storage used
to be inflated whole once per view, and an np.savez_compressed member was copied three times
whole: gigabytes and minutes for a 1 MB file. These tests build both by the real mechanism,
at 64 MiB instead of 1 GiB, and hold read_path's Python peak (tracemalloc: numpy's buffers
count too) under a quarter of the inflated size; what --deep reports must not change.
"""

from __future__ import annotations

import io
import struct
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from cachedoctor.formats import read_bytes, read_path, zipdir
from cachedoctor.formats.source import BytesSource
from cachedoctor.formats.zipdir import entry_chunks, read_directory

MIB = 1 << 20
INFLATED = 64 * MIB  # bytes of zeros in each big storage or member
PEAK_LIMIT = INFLATED // 4
N_VIEWS = 200


def rezip_deflated(src: Path, dst: Path, change: dict[str, int] | None = None) -> None:
    """Copy the zip at `src` to `dst` with every entry deflated, streaming each entry as a
    user's tool does; `change` flips the byte at the given offset of the named entries."""
    change = change or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            with zin.open(info) as fin, zout.open(info.filename, "w", force_zip64=True) as fout:
                done = 0
                while chunk := fin.read(4 * MIB):
                    at = change.get(info.filename, -1) - done
                    if 0 <= at < len(chunk):
                        chunk = bytearray(chunk)
                        chunk[at] ^= 0x10
                    fout.write(chunk)
                    done += len(chunk)


def set_recorded(path: Path, name: str, *, crc: int | None = None, size: int | None = None) -> None:
    """Rewrite the CRC32 or the uncompressed size the zip records for entry `name`, in its
    local header and its central directory entry (32-bit fields, as zipfile writes them
    for entries under 4 GiB)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = z.getinfo(name)
        cd_at = z.start_dir
    fields = [(info.header_offset, 14, 22)]  # local header: crc at +14, size at +22
    at = cd_at
    while data[at : at + 4] == b"PK\x01\x02":
        nlen, xlen, clen = struct.unpack_from("<HHH", data, at + 28)
        if data[at + 46 : at + 46 + nlen].decode() == name:
            fields.append((at, 16, 24))  # central directory: crc at +16, size at +24
        at += 46 + nlen + xlen + clen
    assert len(fields) == 2
    for base, crc_at, size_at in fields:
        if crc is not None:
            struct.pack_into("<I", data, base + crc_at, crc)
        if size is not None:
            struct.pack_into("<I", data, base + size_at, size)
    path.write_bytes(bytes(data))


def measured(path: Path):
    """read_path(path, deep=True), its Python peak (bytes) and its wall time."""
    tracemalloc.start()
    try:
        start = time.perf_counter()
        meta = read_path(str(path), deep=True)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return meta, peak, elapsed


@pytest.fixture
def count_inflations(monkeypatch):
    """How many times each entry's deflate stream is started."""
    started: dict[str, int] = {}
    real = zipdir._inflate_chunks

    def spy(src, entry, *args):
        started[entry.name] = started.get(entry.name, 0) + 1
        return real(src, entry, *args)

    monkeypatch.setattr(zipdir, "_inflate_chunks", spy)
    return started


def views_file(tmp_path: Path, nonfinite: dict[int, float] | None = None,
               flip: int | None = None) -> tuple[Path, torch.Tensor]:
    """N_VIEWS one-element views of one INFLATED-byte float32 storage, saved by torch.save
    and re-zipped deflated; `flip` flips a byte of the storage without updating its CRC."""
    big = torch.zeros(INFLATED // 4)
    for i, value in (nonfinite or {}).items():
        big[i] = value
    views = [big[i : i + 1] for i in range(N_VIEWS)]
    views.append(big[-3:])  # the storage's last chunk
    views.append(big[1_000_000 : 1_000_010])
    saved = tmp_path / "torch" / "views.pt"  # torch names the archive's folder after the file
    saved.parent.mkdir()
    torch.save(views, saved)
    path = tmp_path / "views.pt"
    change = {} if flip is None else {"views/data/0": flip}
    rezip_deflated(saved, path, change)
    if flip is not None:
        with zipfile.ZipFile(saved) as z:
            set_recorded(path, "views/data/0", crc=z.getinfo("views/data/0").CRC)
    saved.unlink()
    return path, big


def test_deflated_views_of_one_storage_inflate_it_once_in_bounded_memory(tmp_path,
                                                                          count_inflations):
    path, _ = views_file(tmp_path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("views/data/0")
        assert info.compress_type == zipfile.ZIP_DEFLATED and info.file_size == INFLATED
        assert info.compress_size < INFLATED // 100
    loaded = torch.load(path)  # torch.load reads a deflated archive
    assert len(loaded) == N_VIEWS + 2 and loaded[0].untyped_storage().nbytes() == INFLATED
    meta, peak, elapsed = measured(path)
    assert meta.ok and meta.deep, meta.errors
    assert meta.crc_errors == () and meta.nonfinite == () and meta.notes == ()
    assert len(meta.tensors) == N_VIEWS + 2
    assert {t.storage_bytes for t in meta.tensors} == {INFLATED}
    assert count_inflations["views/data/0"] == 1  # not once per view
    assert peak < PEAK_LIMIT, f"peak {peak / MIB:.1f} MiB"
    assert elapsed < 60


def test_deflated_storage_nonfinite_counted_and_flipped_byte_found(tmp_path, count_inflations):
    last = INFLATED // 4 - 1
    planted = {5: float("nan"), 1_000_003: float("inf"), 1_000_004: float("nan"),
               last: float("-inf"), 12_345_678: float("nan")}  # the last: in no view
    path, _ = views_file(tmp_path, planted, flip=40 * MIB + 1)
    meta, peak, _ = measured(path)
    assert meta.ok, meta.errors
    assert dict(meta.nonfinite) == {(5,): 1, (N_VIEWS,): 1, (N_VIEWS + 1,): 2}
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("views/data/0")
    big = torch.zeros(INFLATED // 4)
    for i, value in planted.items():
        big[i] = value
    raw = bytearray(big.numpy().tobytes())
    recorded = zlib.crc32(raw)
    raw[40 * MIB + 1] ^= 0x10
    actual = zlib.crc32(raw)
    assert info.CRC == recorded != actual
    assert meta.crc_errors == (
        f"CRC32 mismatch in 'views/data/0' (recorded 0x{recorded:08x}, actual 0x{actual:08x})",)
    assert count_inflations["views/data/0"] == 1
    assert peak < PEAK_LIMIT, f"peak {peak / MIB:.1f} MiB"


def test_entry_inflating_past_its_size_is_an_error_not_a_hang(tmp_path):
    """A zip bomb: the directory records 4 KiB, the stream inflates to 96 MiB."""
    saved = tmp_path / "torch" / "bomb.pt"
    saved.parent.mkdir()
    torch.save(torch.zeros(96 * MIB // 4), saved)
    path = tmp_path / "bomb.pt"
    rezip_deflated(saved, path)
    set_recorded(path, "bomb/data/0", size=4096)
    meta, peak, elapsed = measured(path)
    bomb = [e for e in meta.errors if "inflates to more than" in e]
    assert bomb == [f"entry 'bomb/data/0' inflates to more than {4096 + zipdir.MAX_OVERFLOW:,} "
                    "bytes, where the zip directory records 4,096 (a zip bomb, or a damaged "
                    "directory): its CRC32 and values are not checked"], meta.errors
    assert any("holds 4,096 bytes where data.pkl expects" in e for e in meta.errors)
    assert meta.crc_errors == ()
    assert peak < PEAK_LIMIT and elapsed < 30


def test_entry_past_the_inflate_cap_is_an_error(tmp_path, monkeypatch):
    path, _ = views_file(tmp_path, {7: float("nan")})
    monkeypatch.setattr(zipdir, "MAX_INFLATE", 8 * MIB)
    meta = read_path(str(path), deep=True)
    assert meta.errors == (f"entry 'views/data/0' inflates to {INFLATED:,} bytes, more than the "
                           "8,388,608 --deep inflates: its CRC32 and values are not checked",)
    assert meta.nonfinite == () and meta.crc_errors == ()
    npz = tmp_path / "big.npz"
    np.savez_compressed(npz, latents=np.zeros(INFLATED // 4, np.float32))
    meta = read_path(str(npz), deep=True)
    assert len(meta.errors) == 1 and meta.errors[0].startswith(
        "member 'latents.npy': entry 'latents.npy' inflates to 67,108,992 bytes, more than")
    assert len(meta.tensors) == 1 and meta.crc_errors == ()


def test_savez_compressed_member_checked_in_bounded_memory(tmp_path, count_inflations):
    path = tmp_path / "zeros.npz"
    np.savez_compressed(path, latents=np.zeros(INFLATED // 4, np.float32),
                        original_size=np.array([1024, 1024]))
    meta, peak, elapsed = measured(path)
    assert meta.ok and meta.deep and meta.crc_errors == () and meta.nonfinite == ()
    assert [t.path for t in meta.tensors] == [("latents",), ("original_size",)]
    assert meta.tensors[0].storage_bytes == INFLATED
    assert peak < PEAK_LIMIT, f"peak {peak / MIB:.1f} MiB"
    assert elapsed < 60
    # once for the whole member, once for its header's first bytes (a few KB inflated)
    assert count_inflations["latents.npy"] == 2


def test_savez_compressed_nonfinite_and_flipped_byte(tmp_path):
    values = np.zeros(INFLATED // 4, np.float32)
    values[[0, 3, 4_000_000, 9_999_999, INFLATED // 4 - 1]] = [np.nan, np.inf, -np.inf, np.nan,
                                                                 np.nan]
    path = tmp_path / "bad.npz"
    np.savez_compressed(path, latents=values)
    meta, peak, _ = measured(path)
    assert meta.ok and meta.crc_errors == ()
    assert meta.nonfinite == ((("latents",), 5),)
    assert peak < PEAK_LIMIT, f"peak {peak / MIB:.1f} MiB"

    flipped = tmp_path / "flipped.npz"
    with zipfile.ZipFile(path) as z:
        member = z.read("latents.npy")
    damaged = bytearray(member)
    damaged[len(member) // 2] ^= 0x01
    with zipfile.ZipFile(flipped, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("latents.npy", bytes(damaged))
    set_recorded(flipped, "latents.npy", crc=zlib.crc32(member))
    with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        np.load(flipped)["latents"]
    meta = read_path(str(flipped), deep=True)
    assert meta.ok
    assert meta.crc_errors == (
        f"CRC32 mismatch in 'latents.npy' (recorded 0x{zlib.crc32(member):08x}, "
        f"actual 0x{zlib.crc32(damaged):08x})",)
    assert meta.nonfinite == ((("latents",), 5),)


def test_stream_that_ends_on_a_chunk_boundary_is_inflated_whole():
    """zlib may hold a match's tail when its output limit is reached just as the input runs
    out: those bytes were dropped, and a valid member 'inflated to 1,048,576 bytes'. With the
    zlib numpy uses here this array is such a member."""
    values = np.zeros(524291, np.float16)
    values[[65213, 348689, 446830]] = np.nan
    buf = io.BytesIO()
    np.savez_compressed(buf, x=values)
    assert np.isnan(np.load(io.BytesIO(buf.getvalue()))["x"]).sum() == 3
    meta = read_bytes(buf.getvalue(), "x.npz", deep=True)
    assert meta.ok and meta.crc_errors == () and meta.nonfinite == ((("x",), 3),)


@pytest.mark.parametrize("size", [0, 1, 1000, MIB - 1, MIB, MIB + 1, MIB + 134, 3 * MIB + 7])
@pytest.mark.parametrize("kind", ["zeros", "random", "mixed"])
def test_entry_chunks_are_the_entry(size, kind):
    rng = np.random.default_rng(size)
    if kind == "zeros":
        data = bytes(size)
    elif kind == "random":
        data = rng.integers(0, 256, size, np.uint8).tobytes()
    else:
        data = bytes(rng.integers(0, 4, size, np.uint8) * (rng.random(size) < 0.01))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("d", data, zipfile.ZIP_DEFLATED)
        z.writestr("s", data, zipfile.ZIP_STORED)
    src = BytesSource(buf.getvalue())
    for entry in read_directory(src).entries:
        chunks = list(entry_chunks(src, entry))
        assert b"".join(chunks) == data
        assert all(len(c) == zipdir.CHUNK for c in chunks[:-1])
        assert zipdir.entry_crc(src, entry) == entry.crc
        assert zipdir.read_entry(src, entry) == data
        assert zipdir.read_entry(src, entry, 777) == data[:777]
        assert b"".join(entry_chunks(src, entry, MIB + 5)) == data[: MIB + 5]
