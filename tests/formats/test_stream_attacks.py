"""Hostile streams, each built by its real mechanism: first a child process proves the unsafe
load runs the payload (it creates a marker file), then the scan must call the file an error
and `fix --yes` must never run it.

The payload is harmless: `builtins.open(marker, "w")`, in a protocol-0 pickle.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import pickletools
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cachedoctor.formats import read_path, torch_legacy
from cachedoctor.formats.source import BytesSource
from tests.conftest import by_code, run_cli, scan_paths


def payload(marker: Path) -> bytes:
    """A protocol-0 pickle that creates `marker` when a real unpickler runs it."""
    return b"cbuiltins\nopen\n(S" + repr(str(marker)).encode() + b"\nS'w'\ntR."


def runs_payload(code: str, marker: Path) -> bool:
    """Run `code` (an unsafe load) in a child process; whether the payload ran."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    ran = marker.exists()
    if ran:
        marker.unlink()
    else:
        print("the unsafe load did not run the payload here:", result.stderr[-300:])
    return ran


def torch_load(path: Path) -> str:
    return f"import torch; torch.load({str(path)!r}, weights_only=False)"


# A torch without its legacy (non-zip) loader refuses these files before unpickling anything:
# the proof is then skipped, the scan still judged.
LEGACY_TORCH = hasattr(torch.serialization, "_legacy_load")


def proves_torch_load(path: Path, marker: Path) -> None:
    if LEGACY_TORCH:
        assert runs_payload(torch_load(path), marker)


def assert_hostile_and_never_run(cache: Path, bad: Path, marker: Path) -> None:
    report = scan_paths(cache)
    errors = {f.code for f in report.findings if f.path == str(bad)}
    assert "CD105" in errors, report.findings
    assert "CD107" not in errors  # an image-looking pickle is no foreign file
    result = run_cli("fix", "--yes", str(cache), timeout=600)  # a loaded CI box is slow
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not bad.exists()  # quarantined, never loaded


def gif_polyglot(marker: Path) -> bytes:
    # BINFLOAT ('G') takes "IF89a" and the 3 bytes of width and height after it as a float;
    # the pickle follows, and STOP returns what it built
    return b"GIF89a" + b"\x01\x00\x01" + payload(marker)


def bmp_polyglot(marker: Path) -> bytes:
    # BINBYTES ('B') takes "M" and 3 bytes of the file size as its length (77): 77 bytes skipped
    return b"BM" + b"\0\0\0" + b"\0" * 77 + payload(marker)


@pytest.mark.parametrize("build", [gif_polyglot, bmp_polyglot], ids=["gif", "bmp"])
def test_image_header_then_pickle_is_cd105(tmp_path, build):
    cache = tmp_path / "cache"
    cache.mkdir()
    marker = tmp_path / "marker"
    bad = cache / "latent.pt"
    bad.write_bytes(build(marker))
    assert bad.read_bytes()[:2] in (b"GI", b"BM")
    proves_torch_load(bad, marker)
    assert runs_payload(f"import pickle; pickle.load(open({str(bad)!r}, 'rb'))", marker)
    assert_hostile_and_never_run(cache, bad, marker)


@pytest.mark.parametrize("name", ["a.pt", "a.npy", "a.npz", "a.safetensors", "a.pkl"])
def test_protocol_0_pickle_under_any_cache_name_is_cd105(tmp_path, name):
    cache = tmp_path / "cache"
    cache.mkdir()
    marker = tmp_path / "marker"
    bad = cache / name
    bad.write_bytes(payload(marker))
    if name.endswith((".npy", ".npz")):  # np.load unpickles what is neither npy nor zip
        assert runs_payload(f"import numpy; numpy.load({str(bad)!r}, allow_pickle=True)", marker)
    elif name.endswith(".pt"):
        proves_torch_load(bad, marker)
    assert_hostile_and_never_run(cache, bad, marker)


def _pickle_ends(data: bytes) -> list[int]:
    """Where each pickle of a stream ends."""
    ends, pos = [], 0
    while pos < len(data) and len(ends) < 4:
        stream = io.BytesIO(data[pos:])
        for op, _, at in pickletools.genops(stream):
            if op.name == "STOP":
                pos += at + 1
                ends.append(pos)
                break
    return ends


def tar_polyglot(marker: Path) -> bytes:
    """A legacy torch.save stream whose first 512 bytes are also a tar header.

    The system-info pickle is padded with a BINBYTES that holds a real tarfile archive (then
    POP): read as pickles it is a clean legacy file; tarfile opens it, and torch.load's tar
    loader unpickles the archive's 'storages' member first.
    """
    saved = io.BytesIO()
    torch.save(torch.arange(4.0), saved, _use_new_zipfile_serialization=False)
    data = saved.getvalue()
    _, version_end, info_end = _pickle_ends(data)[:3]
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        members = {"pad": b"", "storages": payload(marker) + pickle.dumps([], protocol=0),
                   "tensors": pickle.dumps(0, protocol=0), "pickle": pickle.dumps("ok", 0)}
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    tar_bytes = archive.getvalue()
    head = data[:version_end] + b"\x80\x02B"
    padding = tar_bytes[len(head) + 4:]
    info_pickle = head[version_end:] + len(padding).to_bytes(4, "little") + padding + b"0" + (
        data[version_end + 2:info_end])
    out = bytearray(data[:version_end] + info_pickle + data[info_end:])
    # the first header's name field now starts with the pickles: put its checksum right
    block = out[:512]
    block[148:156] = b" " * 8
    out[148:156] = b"%06o\0 " % sum(block)
    return bytes(out)


def test_legacy_stream_that_is_also_a_tar_is_cd105(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    marker = tmp_path / "marker"
    bad = cache / "embed.pt"
    bad.write_bytes(tar_polyglot(marker))
    with tarfile.open(bad) as tar:  # both readings hold
        assert "storages" in tar.getnames()
    as_stream = torch_legacy.read(BytesSource(bad.read_bytes()), str(bad), False)
    assert as_stream.format == "torch-legacy" and not as_stream.unsafe_globals
    proves_torch_load(bad, marker)
    meta = read_path(str(bad))
    assert "builtins.open" in meta.unsafe_globals
    assert_hostile_and_never_run(cache, bad, marker)


def test_clean_legacy_stream_and_clean_image_stay_clean(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    torch.save({"latent": torch.zeros(4, 8, 8)}, cache / "a.pt",
               _use_new_zipfile_serialization=False)
    (cache / "b.pt").write_bytes(b"GIF89a" + bytes(200))  # an image under a cache name
    report = scan_paths(cache)
    assert not by_code(report, "CD105")
    assert not by_code(report, "CD101")
    assert [f.path for f in by_code(report, "CD107")] == [str(cache / "b.pt")]


def npy_with_shape(shape: str) -> bytes:
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + shape + ",), }"
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()


@pytest.mark.parametrize("digits", [20, 400, 4000])
def test_npy_shape_past_int64_is_a_bounded_cd101(tmp_path, digits):
    cache = tmp_path / "cache"
    cache.mkdir()
    big = cache / "big.npy"
    big.write_bytes(npy_with_shape("9" * digits))
    with pytest.raises((OverflowError, ValueError)):  # numpy cannot load it either
        np.load(big)
    marker = tmp_path / "marker"
    evil = cache / "evil.pkl"
    evil.write_bytes(payload(marker))
    report = scan_paths(cache)
    [finding] = [f for f in by_code(report, "CD101") if f.path == str(big)]
    assert f"{digits:,}-digit" in finding.message and len(finding.message) < 200
    assert [f.path for f in by_code(report, "CD105")] == [str(evil)]  # the other file is judged
    result = run_cli("fix", "--yes", str(cache), timeout=600)  # a loaded CI box is slow
    assert "Traceback" not in result.stderr and not evil.exists() and not marker.exists()


def test_npy_shape_whose_bytes_overflow_int64(tmp_path):
    path = tmp_path / "big.npy"
    path.write_bytes(npy_with_shape(f"{2**62}, 4"))
    meta = read_path(str(path))
    assert "more than int64 holds" in meta.errors[0] and not meta.tensors


def test_pickled_tensor_size_past_int64_is_a_bounded_cd101(tmp_path):
    saved = io.BytesIO()
    torch.save(torch.zeros(7), saved, _use_new_zipfile_serialization=False)
    data = saved.getvalue()
    huge = int("9" * 400)
    as_long = pickle.dumps(huge, protocol=2)[2:-1]  # LONG1 + bytes
    assert data.count(b"K\x07\x85") == 1  # the size tuple (7,)
    path = tmp_path / "huge.pt"
    path.write_bytes(data.replace(b"K\x07\x85", as_long + b"\x85"))
    meta = read_path(str(path))
    assert meta.errors and "400-digit" in meta.errors[0] and len(meta.errors[0]) < 200
    assert not meta.tensors


def gzip_bomb(inflated_gib: int) -> bytes:
    """gzip of zeros: concatenated members (legal; gzip.decompress reads them all)."""
    member = gzip.compress(bytes(64 * 2**20), compresslevel=9)
    return member * (inflated_gib * 16)


@pytest.mark.parametrize("deep", [False, True])
def test_gzip_bomb_is_cd101_within_budget(tmp_path, monkeypatch, deep):
    bomb = tmp_path / "cache" / "latent.pt"
    bomb.parent.mkdir()
    bomb.write_bytes(gzip_bomb(8))  # 8 MB on disk, 8 GiB inflated

    def no_spool(*args, **kwargs):
        raise AssertionError("a scan spooled to a temp file")

    for name in ("TemporaryFile", "NamedTemporaryFile", "SpooledTemporaryFile", "mkstemp"):
        monkeypatch.setattr(tempfile, name, no_spool)
    started = time.perf_counter()
    report = scan_paths(bomb.parent, deep=deep)
    assert time.perf_counter() - started < 10  # generous: without --deep about 0.1 s idle
    [finding] = by_code(report, "CD101")
    assert "inflates past" in finding.message and len(finding.message) < 200


def test_healthy_gzip_cache_stays_clean(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    for i in range(3):
        saved = io.BytesIO()
        torch.save({"latents": torch.randn(16, 64, 64)}, saved)
        (cache / f"{i}.pt").write_bytes(gzip.compress(saved.getvalue()))
    report = scan_paths(cache, deep=True)
    assert not [f for f in report.findings if f.severity.name == "ERROR"], report.findings


@pytest.mark.parametrize("tensor", [
    {"dtype": "F32", "shape": [2**64 - 1] * 3000, "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0, int("9" * 400)]},
], ids=["huge-shape", "400-digit-offset"])
def test_safetensors_numbers_past_u64_are_bounded_cd101(tmp_path, tensor):
    header = json.dumps({"t" * 5000: tensor}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    report = scan_paths(path)
    [finding] = by_code(report, "CD101")
    assert len(finding.message) < 500


def test_tar_without_torch_members_is_cd101(tmp_path):
    # torch.load opens it with tarfile and fails (KeyError: storages): no pickle fallback
    path = tmp_path / "cache" / "a.pt"
    path.parent.mkdir()
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("caption.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    if LEGACY_TORCH:
        result = subprocess.run([sys.executable, "-c", torch_load(path)], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode != 0
    [finding] = by_code(scan_paths(path.parent), "CD101")
    assert "no 'storages' member" in finding.message


def test_a_sound_protocol_0_pickle_under_a_pickle_name_is_a_pickle(tmp_path):
    """picklescan's benign0_v0.pkl: pickle.load reads it, it names no global: no error."""
    path = tmp_path / "list.pkl"
    path.write_bytes(pickle.dumps(["a", "b", "c"], protocol=0))
    meta = read_path(str(path))
    assert meta.format == "pickle" and meta.ok and not meta.unsafe_globals, meta.errors
    # under a torch name the same bytes are no torch file (torch.load wants its magic first)
    (tmp_path / "list.pt").write_bytes(path.read_bytes())
    assert read_path(str(tmp_path / "list.pt")).errors


def test_a_reading_with_globals_of_its_own_takes_no_twins_verdict():
    """A file whose facts are another's (a twin: same_as) but whose bytes also read as a pickle
    naming globals is judged on its own: the merged FileMeta holds no same_as, so a scan
    cannot hand it the clean twin's verdict."""
    from cachedoctor.formats import _with_pickle
    from cachedoctor.formats.meta import SAFETENSORS, FileMeta

    first = FileMeta("a.pt", 100, SAFETENSORS, root="dict")
    twin = first.renamed("b.pt")
    pickled = torch_legacy.read(BytesSource(payload(Path("m"))), "b.pt", False)
    assert pickled.globals and twin.same_as is first
    merged = _with_pickle(twin, pickled)
    assert merged.same_as is None and merged.unsafe_globals


def _legacy_tar(members: list[tuple[str, bytes, dict]]) -> bytes:
    """A pre-1.0 torch tar: an empty `storages` and `tensors`, then `members` (name, bytes,
    TarInfo fields)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, body, fields in [("storages", pickle.dumps(0, 2) + pickle.dumps([], 2), {}),
                                   ("tensors", pickle.dumps(0, 2), {}), *members]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            for key, value in fields.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


@pytest.mark.parametrize("attack", ["second pickle", "hard link"])
def test_a_tar_pickle_torch_reads_but_the_scan_did_not(tmp_path, attack):
    """torch's tar loader asks tarfile for 'pickle': the last member of that name, and a link's
    target. The scan read the first, and a link's own (empty) bytes: clean."""
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    cache.mkdir()
    benign = pickle.dumps({"a": 1}, 2)
    if attack == "second pickle":
        members = [("pickle", benign, {}), ("pickle", payload(marker), {})]
    else:
        members = [("evil", payload(marker), {}),
                   ("pickle", b"", {"type": tarfile.LNKTYPE, "linkname": "evil"})]
    bad = cache / "a.pt"
    bad.write_bytes(_legacy_tar(members))
    proves_torch_load(bad, marker)
    assert read_path(str(bad)).errors
    report = scan_paths(cache)
    assert "CD101" in {f.code for f in report.findings if f.path == str(bad)}
    if attack == "second pickle":  # (a link's target is not followed: no CD105 for it)
        assert_hostile_and_never_run(cache, bad, marker)
    # the plain archive reads clean
    clean = tmp_path / "clean.pt"
    clean.write_bytes(_legacy_tar([("pickle", benign, {})]))
    assert read_path(str(clean)).errors == ()


@pytest.mark.parametrize("spelt", [b"0o%05o\0", b"+%06o\0", b"%03o_%03o\0"])
def test_a_tar_checksum_spelt_as_tarfile_still_reads_it(tmp_path, spelt):
    """tarfile parses a header's checksum with Python's int(text, 8), which takes a "0o"
    prefix, a sign or an underscore; the sniff took only octal digits, so the tar polyglot
    with such a checksum was judged as a pickle stream alone: clean, while torch.load ran the
    tar's pickles."""
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    cache.mkdir()
    data = bytearray(tar_polyglot(marker))
    block = data[:512]
    block[148:156] = b" " * 8
    total = sum(block)
    data[148:156] = (spelt % (total // 512, total % 512) if b"_" in spelt else spelt % total)
    bad = cache / "embed.pt"
    bad.write_bytes(bytes(data))
    with tarfile.open(bad) as tar:
        assert "storages" in tar.getnames()
    proves_torch_load(bad, marker)
    assert "builtins.open" in read_path(str(bad)).unsafe_globals
    assert_hostile_and_never_run(cache, bad, marker)


@pytest.mark.parametrize("depth", [2, 3000])
def test_a_gzip_inside_the_gzip_is_cd101_however_deep(tmp_path, depth):
    """SimpleTuner gunzips a cache file once (LocalDataBackend._decompress_torch) and hands the
    rest to torch.load, which reads no gzip: a nested stream is a broken entry, judged without
    walking down the nesting (it used to be CD002, a RecursionError, at depth 3000)."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(4, 8, 8), buffer)
    data = buffer.getvalue()
    for _ in range(depth):
        data = gzip.compress(data, compresslevel=1)
    path = tmp_path / "cache" / "latent.pt"
    path.parent.mkdir()
    path.write_bytes(data)
    with pytest.raises(Exception):  # noqa: B017 (pickle's or torch's error, by version)
        torch.load(io.BytesIO(gzip.decompress(data)), weights_only=True)
    findings = scan_paths(path.parent).findings
    assert [(f.code, f.path) for f in findings] == [("CD101", str(path))]
    assert "inside the gzip" in findings[0].message
