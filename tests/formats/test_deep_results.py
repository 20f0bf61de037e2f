"""--deep's results on planted defects, against references that share no code with the readers:
torch for NaN/Inf (every bit pattern of the 8- and 16-bit float formats), zlib for CRC32.

The fast path (a file read whole into one buffer, checked through memoryview slices) and the
bounded path (a big file read in chunks) must report the same thing, so every planted file is
also read with the bounded path forced.
"""

from __future__ import annotations

import sys
import zipfile
import zlib

import numpy as np
import pytest
import safetensors.torch
import torch

from cachedoctor.formats import crc, native, nonfinite, read_path, source, zipdir
from cachedoctor.formats.nonfinite import FLOAT_DTYPES, Counter, count_nonfinite, count_values_at
from cachedoctor.formats.source import BytesSource
from cachedoctor.formats.zip_templates import Templates

EIGHT_BIT = {name: getattr(torch, name) for name in (
    "float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)}


def reference_bad(t: torch.Tensor) -> torch.Tensor:
    """True for each NaN/Inf element, as torch sees it (float8 has no isfinite: widened)."""
    if t.is_complex():
        return (~torch.isfinite(torch.view_as_real(t))).any(-1)
    return ~torch.isfinite(t.to(torch.float64))


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)  # wraps: all bits


def special_values(dtype: torch.dtype, n: int = 10_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(n, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
    for i, v in enumerate((float("nan"), float("inf"), -float("inf"), 0.0, -0.0)):
        t[i * 997] = v
    return t


DTYPES = [torch.float16, torch.bfloat16, *EIGHT_BIT.values()]


@pytest.fixture(autouse=True, params=["native", "python"])
def checks(request, monkeypatch):
    """Every test here twice: with the compiled checks (native.py), where they were built, and
    with the Python ones every install has."""
    if request.param == "python":
        monkeypatch.setattr(native, "NATIVE", None)
    elif native.NATIVE is None:
        pytest.skip("the C checks were not built here")


@pytest.fixture(params=[None, 1000], ids=["chunks", "small-chunks"])
def block(request, monkeypatch):
    """The values are read a chunk at a time: also in many small chunks."""
    if request.param:
        monkeypatch.setattr(nonfinite, "CHUNK", request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bit_pattern_counts_as_torch_says(dtype):
    t = every_pattern(dtype)
    name = str(dtype).removeprefix("torch.")
    assert name in FLOAT_DTYPES
    data = t.view(torch.uint8).numpy().tobytes()
    bad = reference_bad(t)
    assert count_nonfinite(data, name) == int(bad.sum())
    offsets = nonfinite.nonfinite_offsets(data, name)
    assert offsets.tolist() == (bad.nonzero().flatten() * dtype.itemsize).tolist()
    # the same values stored big-endian
    swapped = t.view(torch.uint8).numpy().reshape(-1, dtype.itemsize)[:, ::-1].tobytes()
    assert count_nonfinite(swapped, name, big_endian=True) == int(bad.sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.complex64, torch.complex128], ids=str)
def test_values_and_zeros_count_as_torch_says(dtype, block):
    t = special_values(dtype)
    if dtype.is_complex:
        t[5] = complex(0.0, float("nan"))
        t[6] = complex(0.0, 0.0)
    name = str(dtype).removeprefix("torch.")
    data = t.view(torch.uint8).numpy().tobytes()
    bad = int(reference_bad(t).sum())
    zeros = int((t == 0).sum())
    assert bad >= 3 and zeros >= 2
    assert count_nonfinite(data, name) == bad
    assert count_values_at(BytesSource(data), 0, len(data), name) == (bad, zeros)
    # pieces cut anywhere (a deflated member's chunks): each element counted once, whole
    counter = Counter(name)
    for at in range(0, len(data), 4099):
        counter.feed(memoryview(data)[at : at + 4099])
    assert counter.total == bad


def test_clean_values_count_nothing():
    for name in ("float16", "bfloat16", "float32", "float64"):
        data = torch.randn(4096, dtype=getattr(torch, name)).view(torch.uint8).numpy().tobytes()
        assert count_nonfinite(data, name) == 0
        assert nonfinite.nonfinite_offsets(data, name) is None
    assert count_nonfinite(b"\xff" * 64, "int16") == 0  # no float: nothing to count


# ---- planted defects in cache files --------------------------------------------------------


def latent(dtype: torch.dtype, planted: dict[int, float] | None = None) -> torch.Tensor:
    t = torch.randn(4, 96, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    flat = t.view(-1)
    for i, v in (planted or {}).items():
        flat[i] = v
    return t


PLANTED = {7: float("nan"), 100: float("inf"), 2000: -float("inf"), 4095: float("nan")}


def both_paths(path, monkeypatch):
    """read_path(deep=True) as it runs, and with every file read in small bounded chunks."""
    fast = read_path(str(path), deep=True)
    with monkeypatch.context() as m:
        m.setattr(source, "DEEP_WHOLE_LIMIT", 0, raising=False)
        m.setattr(zipdir, "CHUNK", 4096)
        m.setattr(nonfinite, "CHUNK", 4096)
        bounded = read_path(str(path), deep=True)
    assert fast == bounded
    return fast


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float8_e5m2], ids=str)
def test_nan_and_inf_in_a_saved_latent(tmp_path, monkeypatch, dtype):
    planted = latent(dtype, PLANTED)
    expected = int(reference_bad(planted).sum())
    assert expected == 4
    pt, st = tmp_path / "bad.pt", tmp_path / "bad.safetensors"
    torch.save({"latent": planted, "clean": latent(dtype)}, pt)
    safetensors.torch.save_file({"latent": planted, "clean": latent(dtype)}, str(st))
    for path in (pt, st):
        meta = both_paths(path, monkeypatch)
        assert meta.deep and meta.errors == () and meta.crc_errors == ()
        assert dict(meta.nonfinite) == {("latent",): expected}
    clean = tmp_path / "clean.pt"
    torch.save(latent(dtype), clean)
    meta = both_paths(clean, monkeypatch)
    assert meta.nonfinite == () and meta.crc_errors == () and meta.errors == ()


def flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_storage_is_a_crc_error(tmp_path, monkeypatch):
    path = tmp_path / "flip.pt"
    torch.save(latent(torch.float16), path)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        stored = z.read(info)
    at = path.read_bytes().index(stored)  # a stored entry: its bytes as they are
    flip(path, at + 1234)
    changed = bytearray(stored)
    changed[1234] ^= 0x01
    meta = both_paths(path, monkeypatch)
    assert meta.errors == () and meta.nonfinite == ()
    assert meta.crc_errors == (
        f"CRC32 mismatch in '{info.filename}' (recorded 0x{info.CRC:08x}, "
        f"actual 0x{zlib.crc32(bytes(changed)):08x})",)
    assert not read_path(str(path)).crc_errors  # only --deep reads every byte


def test_a_flipped_byte_in_a_deflated_member(tmp_path, monkeypatch):
    path = tmp_path / "deflated.pt"
    torch.save(latent(torch.bfloat16, PLANTED), tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as zin, \
            zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = bytearray(zin.read(info))
            zout.writestr(info.filename, bytes(data))
            if info.filename.endswith("/data/0"):
                name, crc = info.filename, zlib.crc32(data)
    meta = both_paths(path, monkeypatch)
    assert meta.crc_errors == () and dict(meta.nonfinite) == {(): 4}
    # the recorded CRC changed in the central directory and the local header alike
    data = path.read_bytes()
    recorded = crc.to_bytes(4, "little")
    assert data.count(recorded) == 2
    path.write_bytes(data.replace(recorded, (crc ^ 1).to_bytes(4, "little")))
    meta = both_paths(path, monkeypatch)
    assert meta.crc_errors == (
        f"CRC32 mismatch in '{name}' (recorded 0x{crc ^ 1:08x}, actual 0x{crc:08x})",)
    assert dict(meta.nonfinite) == {(): 4}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_truncated_file_is_an_error_not_a_count(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"cut{suffix}"
    if suffix == ".pt":
        torch.save(latent(torch.float16, PLANTED), path)
    else:
        safetensors.torch.save_file({"latent": latent(torch.float16, PLANTED)}, str(path))
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) * 2 // 3])
    meta = both_paths(path, monkeypatch)
    assert meta.errors and "truncated" in meta.errors[0]
    assert meta.nonfinite == () and meta.crc_errors == ()


def test_a_planted_cache_scans_alike_on_both_paths(tmp_path, monkeypatch):
    """Many files of every kind at once: the fast path changes no result."""
    kinds = [torch.float16, torch.bfloat16, torch.float32]
    for i in range(12):
        dtype = kinds[i % 3]
        planted = {j: float("nan") for j in range(i)}
        if i % 2:
            torch.save(latent(dtype, planted), tmp_path / f"{i}.pt")
        else:
            safetensors.torch.save_file({"latent": latent(dtype, planted)},
                                        str(tmp_path / f"{i}.safetensors"))
    for path in sorted(tmp_path.iterdir()):
        meta = both_paths(path, monkeypatch)
        i = int(path.stem)
        where = ("latent",) if path.suffix == ".safetensors" else ()
        assert dict(meta.nonfinite) == ({where: i} if i else {})


@pytest.mark.parametrize("fast", [True, False], ids=["zlib-ng", "zlib-fallback"])
def test_crc32_is_zlibs(monkeypatch, fast):
    if fast:
        pytest.importorskip("zlib_ng.zlib_ng")
    else:  # where zlib-ng is not installed
        monkeypatch.setitem(sys.modules, "zlib_ng.zlib_ng", None)
    crc.fast.cache_clear()
    try:
        data = np.random.default_rng(0).bytes(300_001)
        assert crc.crc32(data) == zlib.crc32(data)
        assert crc.crc32(memoryview(data)[7:], 12345) == zlib.crc32(data[7:], 12345)
        assert crc.crc32(b"") == 0
        assert (crc.fast() is zlib.crc32) is not fast
    finally:
        crc.fast.cache_clear()


@pytest.mark.parametrize("whole", [True, False], ids=["in-memory", "windows"])
def test_files_of_one_layout_read_alike_with_templates(tmp_path, monkeypatch, whole):
    """A scan's zip templates let --deep skip what a file shares with one read before (its
    directory, its data.pkl): every file still reports its own CRC errors and NaN/Inf, whether
    the file is all in memory (checked from slices of it) or only its head and tail are."""
    if not whole:
        monkeypatch.setattr(source, "DEEP_WHOLE_LIMIT", 0)
    paths = []
    for i in range(8):
        path = tmp_path / f"{i:02d}.pt"
        torch.save(latent(torch.bfloat16, {i * 11: float("nan")} if i in (3, 6) else None), path)
        paths.append(path)
    data = paths[4].read_bytes()
    with zipfile.ZipFile(paths[4]) as z:
        stored = z.read(next(n for n in z.namelist() if n.endswith("/data/0")))
    flip(paths[4], data.index(stored) + 99)  # a flipped payload byte: CD103
    data = paths[5].read_bytes()
    with zipfile.ZipFile(paths[5]) as z:
        recorded = next(i for i in z.infolist() if i.filename.endswith("/data/0")).CRC
    paths[5].write_bytes(data.replace(recorded.to_bytes(4, "little"),
                                      (recorded ^ 0x100).to_bytes(4, "little")))  # a flipped CRC
    templates = Templates()
    for path in paths:
        alone = read_path(str(path), deep=True)
        shared = read_path(str(path), deep=True, templates=templates)
        assert shared == alone
        # the clean ones after the first are twins: the same facts, reusable verdicts
        assert (shared.same_as is not None) == (path.stem in ("01", "02", "07"))
    assert [bool(read_path(str(p), deep=True).crc_errors) for p in paths] == [
        False, False, False, False, True, True, False, False]
    assert dict(read_path(str(paths[6]), deep=True).nonfinite) == {(): 1}


def test_twins_report_a_wrong_crc_in_any_entry(tmp_path):
    """A twin proven clean in one pass (torch_zip.clean: the records' recorded CRC32s compared
    with theirs, worked out once; two reductions per storage) still reports a recorded CRC32
    of data.pkl that is wrong, a flipped byte in an entry only it holds (serialization_id),
    and a negative or a positive NaN/Inf, as a full read does."""
    paths = []
    for i, planted in enumerate((None, None, None, None, {500: -float("inf")},
                                 {900: float("nan")})):
        path = tmp_path / f"{i:02d}.pt"
        torch.save(latent(torch.float16, planted), path)
        paths.append(path)
    with zipfile.ZipFile(paths[2]) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
        own = [i for i in z.infolist() if i.filename.endswith("/.data/serialization_id")]
    data = paths[2].read_bytes()
    paths[2].write_bytes(data.replace(pkl.CRC.to_bytes(4, "little"),
                                      (pkl.CRC ^ 0x10).to_bytes(4, "little")))
    if own:  # (torch writes one since 2.4)
        local = paths[3].read_bytes()[own[0].header_offset:]
        names, extra = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
        flip(paths[3], own[0].header_offset + 30 + names + extra + 5)
    templates = Templates()
    for path in paths:
        alone = read_path(str(path), deep=True)
        assert read_path(str(path), deep=True, templates=templates) == alone
    errors = [read_path(str(p), deep=True, templates=templates).crc_errors for p in paths]
    assert "data.pkl" in errors[2][0] and len(errors[2]) == 1
    assert bool(errors[3]) == bool(own) and not errors[0] and not errors[1]
    assert [dict(read_path(str(p), deep=True, templates=templates).nonfinite)
            for p in paths[4:]] == [{(): 1}, {(): 1}]


def test_twins_report_a_wrong_crc_or_other_digits_in_small_members(tmp_path):
    """A template spells out .format_version and .storage_alignment (digits, but the same in
    every file one torch writes), so their CRC32s are worked out once per twin: a twin whose
    directory records a wrong CRC32 for one is still a CRC error, and a file holding other
    digits there is read in full, as alone."""
    paths = []
    for i in range(4):
        path = tmp_path / f"{i:02d}.pt"
        torch.save(latent(torch.float16, None), path)
        paths.append(path)
    with zipfile.ZipFile(paths[0]) as z:
        small = [i for i in z.infolist() if i.filename.endswith("/.format_version")]
    if not small:
        pytest.skip("this torch writes no .format_version")
    member = small[0]
    data = paths[2].read_bytes()
    wrong = (member.CRC ^ 0x4).to_bytes(4, "little")
    assert data.count(member.CRC.to_bytes(4, "little")) == 2  # (local header and directory)
    paths[2].write_bytes(data.replace(member.CRC.to_bytes(4, "little"), wrong))
    local = paths[3].read_bytes()[member.header_offset:]
    names, extra = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
    at = member.header_offset + 30 + names + extra
    data = bytearray(paths[3].read_bytes())
    data[at:at + member.file_size] = b"7" * member.file_size  # other digits, its own CRC32
    fixed = zlib.crc32(bytes(data[at:at + member.file_size])).to_bytes(4, "little")
    paths[3].write_bytes(bytes(data).replace(member.CRC.to_bytes(4, "little"), fixed))
    templates = Templates()
    metas = [read_path(str(p), deep=True, templates=templates) for p in paths]
    assert metas == [read_path(str(p), deep=True) for p in paths]
    assert not metas[0].crc_errors and not metas[1].crc_errors
    assert len(metas[2].crc_errors) == 1 and ".format_version" in metas[2].crc_errors[0]
    assert not metas[3].crc_errors and metas[3].same_as is None


@pytest.mark.parametrize("record,garbage", [("byteorder", b"elttil"), ("version", b"x\n")])
@pytest.mark.parametrize("deep", [False, True])
def test_twins_read_records_named_in_another_case(tmp_path, record, garbage, deep):
    """torch.load finds a record with its name's A-Z folded (archive/BYTEORDER is the byteorder
    record), and so does the reader: a template keys its twins by those records' bytes however
    their names are cased, so a later file of that layout with a broken record in it is read,
    not taken for the clean file's twin."""
    paths = [tmp_path / "00.pt", tmp_path / "01.pt"]
    for path in paths:
        torch.save({"latent": torch.arange(1.0, 513.0)}, path)
        data = path.read_bytes().replace(f"/{record}".encode(), f"/{record.upper()}".encode())
        path.write_bytes(data)
    with zipfile.ZipFile(paths[1]) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(f"/{record.upper()}"))
        assert len(z.read(info)) == len(garbage)
    data = bytearray(paths[1].read_bytes())
    local = info.header_offset
    at = local + 30 + int.from_bytes(data[local + 26 : local + 28], "little") + \
        int.from_bytes(data[local + 28 : local + 30], "little")
    data[at : at + len(garbage)] = garbage
    crc = zlib.crc32(garbage).to_bytes(4, "little")
    data = bytes(data).replace(info.CRC.to_bytes(4, "little"), crc)  # local header and directory
    paths[1].write_bytes(data)
    alone = read_path(str(paths[1]), deep=deep)
    assert alone.errors and not alone.crc_errors
    templates = Templates()
    assert read_path(str(paths[0]), deep=deep, templates=templates).ok
    assert read_path(str(paths[1]), deep=deep, templates=templates) == alone
