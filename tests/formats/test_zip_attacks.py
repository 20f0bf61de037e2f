"""Zip archives crafted so that the scan and the loader read different bytes (issue #11).

Each attack is built by its real mechanism (torch.save or np.savez, then zipfile or byte
edits), first proven in a child process to run its payload when loaded unsafely, then scanned:
the scan must report an error (CD105 or CD101), and `cachedoctor fix --yes` must never run it.
The payload only creates a marker file.
"""

from __future__ import annotations

import gzip
import io
import pickle
import re
import struct
import subprocess
import sys
import time
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch_samples as samples

from cachedoctor.findings import Severity
from cachedoctor.formats import read_bytes, read_path, zip_templates
from cachedoctor.formats.source import BytesSource
from cachedoctor.formats.zipdir import read_directory

from conftest import codes, run_cli, scan_paths

ERRORS = {"CD101", "CD105"}
# The global a pickle of builtins.open names: io.open up to Python 3.11, _io.open from 3.12.
OPEN = f"{open.__module__}.open"


class Payload:
    """Creates `marker` when unpickled for real (builtins.open pickles as OPEN)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rezip(data: bytes, edit=lambda name, body: (name, body), extra=()) -> bytes:
    """`data` written again by zipfile: each entry through `edit`, then the `extra` entries."""
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about a duplicate name: the point here
        with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                changed = edit(info.filename, src.read(info))
                if changed is not None:
                    dst.writestr(*changed)
            for name, body in extra:
                dst.writestr(name, body)
    return out.getvalue()


def unsafe_load(path: Path, marker: Path, code: str) -> bool:
    """Run `code` (which loads `path`) in a child; True when the payload ran. A loader that
    refuses the file for another reason proves nothing, and the caller goes on."""
    subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                   text=True, timeout=120)
    ran = marker.exists()
    if ran:
        marker.unlink()
    return ran


TORCH_LOAD = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
NP_LOAD = ("import sys, numpy as np\nwith np.load(sys.argv[1], allow_pickle=True) as f:\n"
           "    [f[k] for k in f.files]")


def judged_hostile(path: Path, marker: Path, tmp_path: Path) -> None:
    """The scan reports an error, and fix --yes never runs the payload."""
    report = scan_paths(path.parent)
    found = {f.code for f in report.findings if f.path == str(path)}
    assert found & ERRORS, report.findings
    assert all(f.severity == Severity.ERROR for f in report.findings
               if f.path == str(path) and f.code in ERRORS)
    fixed = run_cli("fix", "--yes", str(path.parent),
                    env={"CACHEDOCTOR_STATE_DIR": str(tmp_path / "state")})
    assert "Traceback" not in fixed.stderr, fixed.stderr
    assert not marker.exists(), "fix ran the payload"


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path]:
    cache = tmp_path / "cache"
    cache.mkdir()
    return cache, tmp_path / "marker"


def test_a_case_twin_of_data_pkl_is_judged(paths, tmp_path):
    cache, marker = paths
    base = saved({"latent": torch.zeros(4, 8, 8)})
    evil = pickle.dumps(Payload(marker), protocol=2)
    path = cache / "a.pt"
    path.write_bytes(rezip(base, extra=[("archive/DATA.PKL", evil)]))
    child_ran = unsafe_load(path, marker, TORCH_LOAD)
    # miniz finds records case-insensitively by binary search over a sorted index: torch
    # takes DATA.PKL here, where zipfile (and the scan before) took data.pkl
    assert child_ran or torch.__version__ < "2"
    meta = read_path(str(path))
    assert OPEN in meta.unsafe_globals
    assert any("name one record" in e for e in meta.errors)
    judged_hostile(path, marker, tmp_path)


def test_a_case_twin_wrapped_in_gzip(paths, tmp_path):
    cache, marker = paths
    evil = pickle.dumps(Payload(marker), protocol=2)
    inner = rezip(saved(torch.ones(3)), extra=[("archive/Data.Pkl", evil)])
    path = cache / "a.pt"
    path.write_bytes(gzip.compress(inner))
    meta = read_path(str(path))
    assert OPEN in meta.unsafe_globals and meta.errors
    judged_hostile(path, marker, tmp_path)


def test_data_pkl_twice_under_one_name(paths, tmp_path):
    cache, marker = paths
    evil = pickle.dumps(Payload(marker), protocol=2)
    path = cache / "a.pt"
    path.write_bytes(rezip(saved(torch.ones(3)), extra=[("archive/data.pkl", evil)]))
    meta = read_path(str(path))
    assert OPEN in meta.unsafe_globals
    assert any("twice" in e for e in meta.errors)
    judged_hostile(path, marker, tmp_path)


def test_data_pkl_only_under_another_case(paths, tmp_path):
    """torch finds archive/DATA.PKL when asked for archive/data.pkl: it must be read."""
    cache, marker = paths
    evil = pickle.dumps(Payload(marker), protocol=2)
    data = rezip(saved(torch.ones(3)),
                 lambda name, body: ("archive/DATA.PKL", evil) if name.endswith("data.pkl")
                 else (name, body))
    path = cache / "a.pt"
    path.write_bytes(data)
    ran = unsafe_load(path, marker, TORCH_LOAD)
    meta = read_path(str(path))
    assert OPEN in meta.unsafe_globals, meta
    assert ran
    judged_hostile(path, marker, tmp_path)


@pytest.mark.parametrize("name", ["data.txt", "model/config.pkl", "weights.bin"])
def test_a_pickle_member_of_a_plain_zip_is_unpickled_restricted(paths, tmp_path, name):
    cache, marker = paths
    path = cache / "bundle.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("readme.md", "hello")
        zf.writestr(name, pickle.dumps(Payload(marker), protocol=4))
    code = f"import sys, zipfile, pickle; pickle.loads(zipfile.ZipFile(sys.argv[1]).read({name!r}))"
    assert unsafe_load(path, marker, code)
    meta = read_path(str(path))
    assert meta.unsafe_globals == (OPEN,)
    judged_hostile(path, marker, tmp_path)


def test_an_encrypted_flag_hides_nothing(paths, tmp_path):
    """The flag says the bytes are ciphertext; they are a plain pickle all the same."""
    cache, marker = paths
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("blob", pickle.dumps(Payload(marker), protocol=2))
    data = bytearray(out.getvalue())
    for sig, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # general purpose flags
        pos = data.find(sig)
        data[pos + at] |= 0x01
    path = cache / "blob.zip"
    path.write_bytes(bytes(data))
    assert zipfile.ZipFile(path).infolist()[0].flag_bits & 1
    assert read_path(str(path)).unsafe_globals == (OPEN,)
    judged_hostile(path, marker, tmp_path)


def test_a_benign_pickle_member_of_a_plain_zip_stays_a_warning(tmp_path):
    path = tmp_path / "bundle.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("meta.pkl", pickle.dumps({"a": [1, 2.5, "x"]}))
        zf.writestr("image.png", b"\x89PNG\r\n\x1a\n" + bytes(100))
    meta = read_path(str(path))
    assert meta.unsafe_globals == () and meta.errors == ()
    assert codes(scan_paths(tmp_path)) == {"CD107"}


def test_npz_duplicate_member_last_one_wins(paths, tmp_path):
    cache, marker = paths
    benign, evil = io.BytesIO(), io.BytesIO()
    np.savez(benign, latents=np.zeros((4, 8, 8), np.float16))
    np.save(evil, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    path = cache / "a_0512x0512_sd.npz"
    path.write_bytes(rezip(benign.getvalue(), extra=[("latents.npy", evil.getvalue())]))
    assert unsafe_load(path, marker, NP_LOAD)  # zipfile's NameToInfo: the last one wins
    assert OPEN in read_path(str(path)).unsafe_globals
    judged_hostile(path, marker, tmp_path)


def _pickle_with(shape, stride) -> bytes:
    """A data.pkl naming storage '0' (256 floats) for one tensor of this shape and stride,
    written by the pickler with torch's own globals."""
    import collections

    class Ref:
        pass

    class Tensor:
        pass

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", 256) if isinstance(obj, Ref) else None

        def reducer_override(self, obj):
            if isinstance(obj, Tensor):
                return (torch._utils._rebuild_tensor_v2,
                        (Ref(), 0, shape, stride, False, collections.OrderedDict()))
            return NotImplemented

    out = io.BytesIO()
    Pickler(out, protocol=2).dump({"latent": Tensor()})
    return out.getvalue()


@pytest.mark.parametrize("shape, stride, shown", [
    # the unpickler or torch_zip, whichever meets the number first, names it (merged readers)
    ((2,), (10**400,), r"stride (holds )?a 401-digit number"),
    ((10**30,), (1,), r"(size|shape holds) a 31-digit number"),
    ((2**40,) * 3, (1, 1, 1), r"multiplying to more than 2\*\*63"),
])
def test_numbers_beyond_int64_are_cd101_with_short_messages(tmp_path, shape, stride, shown):
    """A 10**400 stride used to stop the whole scan (internal error: OverflowError)."""
    base = saved({"latent": torch.zeros(256)})
    data = rezip(base, lambda name, body: (name, _pickle_with(shape, stride))
                 if name.endswith("data.pkl") else (name, body))
    (tmp_path / "huge.pt").write_bytes(data)
    evil = rezip(base, extra=[("archive/DATA.PKL", pickle.dumps(Payload(tmp_path / "m")))])
    (tmp_path / "evil.pt").write_bytes(evil)
    result = run_cli("scan", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr  # findings, not a crash
    line = next(x for x in result.stdout.splitlines() if "huge.pt" in x)
    assert "CD101 error" in line and re.search(shown, line) and len(line) < 500
    assert "evil.pt: CD105 error" in result.stdout


def _bomb(entries: int, inflated: int) -> bytes:
    """`entries` central-directory entries that all point at one deflate stream."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(1 << 20)
    body = b"".join(comp.compress(zeros) for _ in range(inflated >> 20)) + comp.flush()
    crc = 0
    for _ in range(inflated >> 20):
        crc = zlib.crc32(zeros, crc)
    name = b"archive/data/0"
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(body),
                        inflated, len(name), 0) + name
    cd = b""
    for _ in range(entries):
        own = name  # one name: only the overlap tells them apart
        cd += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc,
                          len(body), inflated, len(own), 0, 0, 0, 0, 0, 0) + own
    start = len(local) + len(body)
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, entries, entries, len(cd), start, 0)
    return local + body + cd + end


@pytest.mark.parametrize("deep", [False, True])
def test_many_entries_on_one_deflate_stream(tmp_path, deep):
    path = tmp_path / "bomb.pt"
    path.write_bytes(_bomb(60, 256 << 20))
    started = time.perf_counter()
    meta = read_path(str(path), deep=deep)
    assert time.perf_counter() - started < 5
    assert meta.errors and "overlap" in meta.errors[0], meta.errors
    assert codes(scan_paths(tmp_path, deep=deep)) == {"CD101"}


def test_an_entry_count_the_directory_cannot_hold(tmp_path):
    data = bytearray(saved(torch.ones(3)))
    at = data.rfind(b"PK\x06\x06")  # zip64 end record: total entries at +32
    data[at + 32 : at + 40] = struct.pack("<Q", 10**9)
    started = time.perf_counter()
    meta = read_bytes(bytes(data), "x.pt")
    assert time.perf_counter() - started < 1
    assert "claims 1,000,000,000 entries" in meta.errors[0]


def test_a_local_header_name_other_than_the_directorys(tmp_path):
    data = bytearray(saved(torch.ones(3)))
    at = data.find(b"archive/data.pkl")  # the first: in data.pkl's local header
    data[at : at + 16] = b"archive/data.pkx"
    with pytest.raises(zipfile.BadZipFile):  # zipfile refuses; miniz would read it
        zipfile.ZipFile(io.BytesIO(bytes(data))).read("archive/data.pkl")
    meta = read_bytes(bytes(data), "x.pt")
    assert "another name in its local header" in meta.errors[0]


def test_a_hidden_entry_before_the_first_listed_one(paths, tmp_path):
    cache, marker = paths
    evil = pickle.dumps(Payload(marker), protocol=2)
    name = b"archive/data.pkl"
    hidden = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(evil),
                         len(evil), len(evil), len(name), 0) + name + evil
    path = cache / "a.pt"
    path.write_bytes(hidden)
    with open(path, "ab") as f, zipfile.ZipFile(f, "a") as dst, \
            zipfile.ZipFile(io.BytesIO(saved(torch.ones(3)))) as src:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    meta = read_path(str(path))
    # zipfile wrote the archive's offsets from its own start: it shifts them, miniz does not
    assert "record after it starts" in meta.errors[0]
    judged_hostile(path, marker, tmp_path)


def test_an_unlisted_entry_at_the_start(paths, tmp_path):
    """A local entry the central directory leaves out: its bytes are judged by no reader."""
    cache, marker = paths
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("hidden.pkl", pickle.dumps(Payload(marker), protocol=2))
        zf.writestr("notes.txt", "hello")
    data = bytearray(out.getvalue())
    cd_at = data.find(b"PK\x01\x02")
    first = 46 + struct.unpack_from("<H", data, cd_at + 28)[0]
    del data[cd_at : cd_at + first]  # the directory forgets the first entry
    end = data.rfind(b"PK\x05\x06")
    n, size, offset = struct.unpack_from("<HHII", data, end + 8)[0], *struct.unpack_from(
        "<II", data, end + 12)
    struct.pack_into("<HHII", data, end + 8, n - 1, n - 1, size - first, offset)
    path = cache / "bundle.zip"
    path.write_bytes(bytes(data))
    assert zipfile.ZipFile(path).namelist() == ["notes.txt"]
    meta = read_path(str(path))
    assert "before the first entry" in meta.errors[0]
    judged_hostile(path, marker, tmp_path)


def test_a_gap_between_directory_and_end_record(tmp_path):
    """zipfile shifts every offset by such a gap, miniz does not: two readings."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("x.npy", b"")
    data = out.getvalue()
    at = data.rfind(b"PK\x05\x06")
    gapped = data[:at] + bytes(8) + data[at:]
    meta = read_bytes(gapped, "x.npz")
    assert "the record after it starts" in meta.errors[0]


@pytest.mark.parametrize("stem", ["archive", "latent_0001", "Ünïcode", "a.b"])
def test_ordinary_files_stay_clean_and_keep_templates(tmp_path, stem):
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64,
              torch.uint8, torch.bool, *samples.NEW_DTYPES[:1]]  # float8, where torch saves it
    obj = {str(d): torch.ones(3, 2).to(d) for d in dtypes}
    obj["view"] = obj[str(torch.float32)][1:]
    path = tmp_path / f"{stem}.pt"
    torch.save(obj, path)
    meta = read_path(str(path))
    assert meta.errors == () and meta.unsafe_globals == ()
    directory = read_directory(BytesSource(path.read_bytes()))
    assert zip_templates.standard(directory)
    for save in (np.savez, np.savez_compressed):
        npz = tmp_path / f"{stem}_{save.__name__}.npz"
        save(npz, a=np.ones((2, 3), np.float16), b=np.arange(5))
        meta = read_path(str(npz))
        assert meta.errors == () and meta.unsafe_globals == () and len(meta.tensors) == 2
    report = scan_paths(tmp_path)
    assert not [f for f in report.findings if f.severity == Severity.ERROR], report.findings


def test_a_pickle_member_of_an_npz(paths, tmp_path):
    cache, marker = paths
    out = io.BytesIO()
    np.savez(out, latents=np.zeros((4, 8, 8), np.float16))
    path = cache / "a_0512x0512_sd.npz"
    path.write_bytes(rezip(out.getvalue(), extra=[("extra", pickle.dumps(Payload(marker)))]))
    assert OPEN in read_path(str(path)).unsafe_globals
    judged_hostile(path, marker, tmp_path)


def test_a_recorded_size_beyond_deflates_ceiling(tmp_path):
    """One deflate stream of 1 KiB cannot inflate to 1 GiB: said so before anything inflates."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", bytes(1 << 20))
    data = bytearray(out.getvalue())
    for sig, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # uncompressed size
        struct.pack_into("<I", data, data.find(sig) + at, 1 << 30)
    started = time.perf_counter()
    meta = read_bytes(bytes(data), "x.npz", deep=True)
    assert time.perf_counter() - started < 1
    assert "deflate's 1,032:1 ceiling" in meta.errors[0]


def test_compact_refuses_a_twin_before_torch_sees_it(tmp_path):
    """A retained batch storage (CD201, which compact fixes) with a hostile DATA.PKL twin:
    the repair's gate (the scan's reader on the very bytes) refuses it, so torch never loads."""
    from cachedoctor.repair.torch_io import Unloadable, checked

    base = saved(torch.zeros(8, 4, 8, 8)[0])
    data = rezip(base, extra=[("archive/DATA.PKL", pickle.dumps(Payload(tmp_path / "m")))])
    with pytest.raises(Unloadable, match="CD105"):
        checked(data, "a.pt")
    checked(base, "a.pt")  # the same file without the twin passes the gate


def test_a_protocol_0_pickle_is_found_by_its_name(paths, tmp_path):
    """No marker bytes: the .pkl name and a first byte that is an opcode make it a pickle."""
    cache, marker = paths
    path = cache / "bundle.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("model/config.pkl", pickle.dumps(Payload(marker), protocol=0))
        zf.writestr("table.dat", bytes(4096))  # a data file: not taken for a pickle
    assert read_path(str(path)).unsafe_globals == (OPEN,)
    judged_hostile(path, marker, tmp_path)


def _encrypted_stored_zip(name: bytes, data: bytes) -> bytes:
    """One traditionally encrypted, stored member (flag bit 0): 12 bytes of encryption header
    before the data, so its compressed size is its size + 12 (as zip tools write it)."""
    import struct
    import zlib

    body = b"\x00" * 12 + data  # a stand-in encryption header: only the sizes matter here
    crc, csize, usize = zlib.crc32(data), len(body), len(data)
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 1, 0, 0, 0, crc, csize, usize, len(name), 0)
    central = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 1, 0, 0, 0, crc, csize, usize,
                          len(name), 0, 0, 0, 0, 0, 0)
    cd_offset = len(local) + len(name) + csize
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(name), cd_offset, 0)
    return local + name + body + central + name + end


def test_an_encrypted_stored_member_is_no_bomb(tmp_path):
    """picklescan's benign_password_protected.zip: its member's 12-byte encryption header made
    the stored sizes differ, which was called a zip bomb (CD101)."""
    (tmp_path / "notes.zip").write_bytes(_encrypted_stored_zip(b"test.txt", b"hello, world!!!"))
    meta = read_path(str(tmp_path / "notes.zip"))
    assert meta.ok, meta.errors
    # the same sizes without the encryption flag are still refused
    data = bytearray(_encrypted_stored_zip(b"test.txt", b"hello, world!!!"))
    data[6] = data[data.index(b"PK\x01\x02") + 8] = 0
    (tmp_path / "bomb.zip").write_bytes(bytes(data))
    assert "stored bytes" in read_path(str(tmp_path / "bomb.zip")).errors[0]


def object_array(obj: object) -> bytes:
    """An .npy of a one-element object array holding `obj`: its data is a pickle."""
    arr = np.empty(1, dtype=object)
    arr[0] = obj
    out = io.BytesIO()
    np.save(out, arr, allow_pickle=True)
    return out.getvalue()


@pytest.mark.parametrize("member", ["latents.npy", "archive/latents.npy", "archive/blob"])
@pytest.mark.parametrize("name", ["a.npz", "a.pt"])
def test_an_object_array_beside_torchs_records(paths, tmp_path, member, name):
    """np.load reads any zip (whatever its name) and any member that starts with the npy magic
    (whatever its name) as an array: an object array beside a clean torch.save's records ran
    under np.load(allow_pickle=True) and the scan, reading the file as torch's, called it
    clean."""
    cache, marker = paths
    path = cache / name
    base = saved({"latent": torch.zeros(4, 8, 8)})
    path.write_bytes(rezip(base, extra=[(member, object_array(Payload(marker)))]))
    assert unsafe_load(path, marker, NP_LOAD)
    assert OPEN in read_path(str(path)).unsafe_globals
    judged_hostile(path, marker, tmp_path)
    # a plain array there (no pickle) is no finding
    path.write_bytes(rezip(base, extra=[(member, _npy_floats())]))
    meta = read_path(str(path))
    assert meta.ok and meta.unsafe_globals == ()


def _npy_floats() -> bytes:
    out = io.BytesIO()
    np.save(out, np.ones(3, np.float32))
    return out.getvalue()


@pytest.mark.parametrize("member", ["archive/extra.pkl", "archive/data/extra.pkl"])
def test_a_pickle_torch_never_reads_inside_the_prefix(paths, tmp_path, member):
    """archive/extra.pkl sits among torch's records, which the reader alone read: it was never
    scanned, though any other member of any zip is (nor is one in data/ named as no storage
    torch.save writes)."""
    cache, marker = paths
    path = cache / "a.pt"
    path.write_bytes(rezip(saved(torch.ones(3)),
                           extra=[(member, pickle.dumps(Payload(marker), 2))]))
    code = ("import sys, zipfile, pickle; "
            f"pickle.loads(zipfile.ZipFile(sys.argv[1]).read({member!r}))")
    assert unsafe_load(path, marker, code)
    assert OPEN in read_path(str(path)).unsafe_globals
    judged_hostile(path, marker, tmp_path)


def _restamped(data: bytes, edit=lambda name, body: body, extra=()) -> bytes:
    """`data` written again by zipfile, every entry dated alike (so two calls differ only
    where an edit makes them differ): each entry's bytes through `edit`, then `extra`."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        entries = [(i.filename, edit(i.filename, src.read(i))) for i in src.infolist()]
        for name, body in [*entries, *extra]:
            dst.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), body)
    return out.getvalue()


def _id(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return zf.read("archive/.data/serialization_id")


def _same_length(evil: bytes) -> bytes:
    """A benign pickle exactly as long as `evil`."""
    pad = 10 + len(evil) - len(pickle.dumps({"k": "x" * 10}, protocol=2))
    benign = pickle.dumps({"k": "x" * pad}, protocol=2)
    assert len(benign) == len(evil)
    return benign


def _in_standard_member(base: bytes, evil: bytes) -> tuple[bytes, bytes, str]:
    """(clean, hostile, the global named): `archive/.format_version` holding a benign pickle as
    long as `evil`, then `evil` (added where this torch writes no such member)."""
    member = "archive/.format_version"
    with zipfile.ZipFile(io.BytesIO(base)) as zf:
        present = member in zf.namelist()

    def holding(body: bytes) -> bytes:
        if present:
            return _restamped(base, lambda n, b: body if n == member else b)
        return _restamped(base, extra=[(member, body)])

    return holding(_same_length(evil)), holding(evil), OPEN


@pytest.mark.parametrize("deep", [False, True])
def test_a_twin_template_spells_out_the_members_the_reader_scans(tmp_path, deep):
    """A template wildcarded every entry's payload, comparing only the records torch reads: a
    file laid out as a clean one, with a hostile pickle where that one had a benign pickle of
    the same length (or where torch.save writes its serialization_id), took its verdict."""
    evil = pickle.dumps(Payload(tmp_path / "m"), protocol=2)
    base = saved({"latent": torch.zeros(4, 8, 8)})
    system = b"\x80\x02cos\nsystem\nU\x02ab\x85R."  # a pickle as long as torch's id
    pairs = [
        (_restamped(base, extra=[("archive/extra.pkl", _same_length(evil))]),
         _restamped(base, extra=[("archive/extra.pkl", evil)]), OPEN),
        (_restamped(base, extra=[("archive/data/x.pkl", _same_length(evil))]),
         _restamped(base, extra=[("archive/data/x.pkl", evil)]), OPEN),
        (_restamped(base), _restamped(base, lambda n, b: system.ljust(len(b), b".") if n.endswith(
            "serialization_id") else b), "os.system"),
        # a member of a name torch.save writes, past MIN_SKIPPED: its bytes were left out of the
        # template's windows as a storage's are
        _in_standard_member(base, pickle.dumps((Payload(tmp_path / "m"), "z" * 2000), protocol=2)),
    ]
    for clean, hostile, named in pairs:
        assert len(clean) == len(hostile)
        templates = zip_templates.Templates()
        assert read_bytes(clean, "a.pt", deep=deep, templates=templates).unsafe_globals == ()
        assert templates.count == 1
        meta = read_bytes(hostile, "b.pt", deep=deep, templates=templates)
        assert named in meta.unsafe_globals
    # another save (its own serialization_id, digits too) still takes the fast path
    templates = zip_templates.Templates()
    again = saved({"latent": torch.ones(4, 8, 8)})
    assert _id(again) != _id(base) and len(again) == len(base)
    read_bytes(base, "a.pt", deep=deep, templates=templates)
    template, _ = templates.match(len(again), BytesSource(again).windows)
    assert template.twin(template.record_bytes(BytesSource(again).windows), "b.pt", deep)


def test_a_gzip_member_after_zero_padding(paths, tmp_path):
    """Python's gzip skips zero bytes after a member and reads on: a second member there,
    ignored by the scan, appended a zip whose central directory names a hostile data.pkl
    to the clean torch.save SimpleTuner's loader handed torch.load."""
    cache, marker = paths
    clean = saved({"latent": torch.zeros(4, 8, 8)})
    out = io.BytesIO(clean)
    out.seek(len(clean))
    with zipfile.ZipFile(io.BytesIO(saved(Payload(marker)))) as src, \
            zipfile.ZipFile(out, "w") as dst:  # offsets count from the clean file's start
        for info in src.infolist():
            dst.writestr(info, src.read(info))
    tail = out.getvalue()[len(clean):]
    path = cache / "a.pt"
    path.write_bytes(gzip.compress(clean) + bytes(16) + gzip.compress(tail))
    code = ("import gzip, io, sys, torch; torch.load(io.BytesIO(gzip.decompress("
            "open(sys.argv[1], 'rb').read())), weights_only=False)")
    assert unsafe_load(path, marker, code)
    assert read_path(str(path)).errors
    judged_hostile(path, marker, tmp_path)
    # zero padding alone is legal; anything else after a member makes gzip refuse the file
    assert read_bytes(gzip.compress(clean) + bytes(16), "a.pt").ok
    for junk in (b"x", bytes(3) + b"\x1f", b"PK\x03\x04"):
        with pytest.raises(gzip.BadGzipFile):
            gzip.decompress(gzip.compress(clean) + junk)
        assert "Not a gzipped file" in read_bytes(gzip.compress(clean) + junk, "a.pt").errors[0]


@pytest.mark.parametrize("name", ["x.npz", "x.bin"])
def test_object_arrays_of_one_archive_share_one_pickle_budget(tmp_path, monkeypatch, name):
    """Each object-array member had its own PICKLE_READ (64 MiB) to inflate and unpickle, with
    no total: deflated zeros at ~1000:1, a few MB of archive cost minutes. The pickles of one
    archive now share MAX_PICKLE_TOTAL (npz reader and zip_members alike); a small one here."""
    from cachedoctor.formats import numpy_npz, zip_members

    total = 3 * 2**20
    monkeypatch.setattr(zip_members, "MAX_PICKLE_TOTAL", total)
    monkeypatch.setattr(numpy_npz, "MAX_PICKLE_TOTAL", total)
    big = object_array(b"\0" * (total // 3))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for i in range(5):
            zf.writestr(f"m{i}.npy", big)
        if name.endswith(".bin"):
            zf.writestr("readme.txt", "read by zip_members, not the npz reader")
    meta = read_bytes(out.getvalue(), name)
    unchecked = [e for e in meta.errors if "not checked" in e]
    assert unchecked and len(unchecked) <= 3, meta.errors
    assert not any("m0.npy" in e or "m1.npy" in e for e in unchecked), meta.errors
