"""The template fast path gives exactly what a full directory parse gives, or stays out."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from cachedoctor import formats
from cachedoctor.formats import zip_templates

torch = pytest.importorskip("torch")


def saved(obj, stem: str) -> bytes:
    """torch.save to a path names the archive prefix after the file's stem."""
    buffer = io.BytesIO()
    buffer.name = f"{stem}.pt"
    torch.save(obj, buffer)
    return buffer.getvalue()


def fields(meta):
    return (meta.format, meta.root, meta.tensors, meta.globals, meta.unsafe_globals, meta.errors,
            meta.notes)


# Each test is one scan's worth of reads: they share the templates a fresh fixture makes.
templates = zip_templates.Templates()


@pytest.fixture(autouse=True)
def fresh_templates(monkeypatch):
    monkeypatch.setitem(globals(), "templates", zip_templates.Templates())


def read_bytes(data: bytes, path: str = "<bytes>", *, deep: bool = False):
    return formats.read_bytes(data, path, deep=deep, templates=templates)


def read_path(path: str, *, deep: bool = False):
    return formats.read_path(path, deep=deep, templates=templates)


def slow(data: bytes, path: str):
    """The same read with no template to lean on."""
    return formats.read_bytes(data, path)


def test_files_of_one_layout_take_the_fast_path_with_the_same_result(monkeypatch) -> None:
    parsed = []
    real = formats.read_directory
    monkeypatch.setattr(formats, "read_directory", lambda src: parsed.append(1) or real(src))
    gen = torch.Generator().manual_seed(0)
    blobs = []
    for i in range(20):
        latent = torch.randn(4, 16, 16, generator=gen).half()
        blobs.append(saved({"latent": latent, "original_size": (i + 100, 128)}, f"{i:064x}"))
    metas = [read_bytes(b, f"{i}.pt") for i, b in enumerate(blobs)]
    assert len(parsed) == 1  # only the first file's directory was parsed
    for i, (blob, meta) in enumerate(zip(blobs, metas, strict=True)):
        assert fields(meta) == fields(slow(blob, f"{i}.pt"))


def test_every_damaged_byte_reads_as_without_templates() -> None:
    a = saved({"latent": torch.ones(2, 4, 4).half()}, "a" * 16)
    b = bytearray(saved({"latent": torch.zeros(2, 4, 4).half()}, "b" * 16))
    read_bytes(a, "a.pt")  # the template
    assert templates.count == 1
    for at in range(len(b)):
        damaged = bytes(b[:at]) + bytes([b[at] ^ 0x5A]) + bytes(b[at + 1 :])
        assert fields(read_bytes(damaged, "b.pt")) == fields(slow(damaged, "b.pt")), at


def test_other_prefix_lengths_and_sizes_are_other_layouts(tmp_path) -> None:
    # saved to paths: torch names the prefix of a file after its stem (a buffer's is "archive")
    for stem in ("x" * 10, "y" * 11):
        torch.save(torch.ones(3), tmp_path / f"{stem}.pt")
    read_bytes((tmp_path / f"{'x' * 10}.pt").read_bytes(), "x.pt")
    other = (tmp_path / f"{'y' * 11}.pt").read_bytes()
    meta = read_bytes(other, "y.pt")
    assert fields(meta) == fields(slow(other, "y.pt")) and meta.ok
    assert templates.count == 2


def test_a_damaged_first_file_makes_no_template() -> None:
    blob = bytearray(saved(torch.ones(3), "z" * 8))
    blob[-30] ^= 0xFF  # inside the end records
    read_bytes(bytes(blob), "z.pt")
    assert templates.count == 0


def test_deep_reads_never_use_templates() -> None:
    from cachedoctor.formats.source import BytesSource
    from cachedoctor.formats.zipdir import read_directory

    a = saved(torch.ones(64), "c" * 8)
    b = bytearray(saved(torch.ones(64), "d" * 8))
    read_bytes(a, "a.pt")
    (storage,) = [e for e in read_directory(BytesSource(bytes(b))).entries if e.name.endswith("data/0")]
    b[storage.data_offset + 10] ^= 1  # a payload bit: only a CRC check sees it
    assert read_bytes(bytes(b), "b.pt", deep=True).crc_errors


def test_real_files_through_read_path(tmp_path) -> None:

    paths = []
    for i in range(5):
        path = tmp_path / f"{i:08x}.pt"
        torch.save(torch.full((4, 8, 8), float(i)).half(), path)
        paths.append(str(path))
    metas = [read_path(p) for p in paths]
    assert all(m.ok and m.tensors[0].shape == (4, 8, 8) for m in metas)
    assert templates.count == 1
    os.truncate(paths[3], 900)
    assert not read_path(paths[3]).ok


def test_files_with_the_same_records_take_the_reader_s_result_at_their_own_path(monkeypatch, tmp_path) -> None:
    reads = []
    real = formats.torch_zip.read
    monkeypatch.setattr(formats.torch_zip, "read", lambda *a, **k: reads.append(1) or real(*a, **k))
    paths = []
    for i in range(6):
        path = tmp_path / f"{i:032x}.pt"  # one stem length: one layout; serialization_id differs
        torch.save({"latent": torch.randn(4, 8, 8).half(), "original_size": (64, 64)}, path)
        paths.append(str(path))
    metas = [read_path(p) for p in paths]
    assert len(reads) == 1  # only the first file went through the torch reader
    for path, meta in zip(paths, metas, strict=True):
        assert meta.path == path and meta.mtime == os.stat(path).st_mtime
        assert fields(meta) == fields(slow(Path(path).read_bytes(), path))
    # a different data.pkl (another original_size) is read, with the directory of the template
    torch.save({"latent": torch.randn(4, 8, 8).half(), "original_size": (64, 72)}, paths[2])
    before = len(reads)
    meta = read_path(paths[2])
    assert len(reads) == before + 1 and meta.ok and meta.path == paths[2]


def _big(path, value: float) -> None:
    torch.save({"latent": torch.full((16, 96, 96), value).half()}, path)  # 295 KB: head + tail


def test_files_too_big_to_read_whole_match_on_their_head_and_tail(monkeypatch, tmp_path) -> None:
    import cachedoctor.formats as formats
    from cachedoctor.formats.source import WHOLE_FILE_LIMIT

    parsed = []
    real = formats.read_directory
    monkeypatch.setattr(formats, "read_directory", lambda src: parsed.append(1) or real(src))
    paths = [str(tmp_path / f"{i:08x}.pt") for i in range(4)]
    for i, path in enumerate(paths):
        _big(path, float(i))
    assert os.path.getsize(paths[0]) > WHOLE_FILE_LIMIT
    metas = [read_path(p) for p in paths]
    assert len(parsed) == 1 and templates.count == 1
    assert all(m.ok and m.tensors[0].shape == (16, 96, 96) for m in metas)
    assert [m.path for m in metas] == paths


def test_a_damaged_structural_byte_of_a_big_file_reads_as_without_templates(tmp_path) -> None:
    from cachedoctor.formats.source import WINDOW, BytesSource
    from cachedoctor.formats.zipdir import read_directory

    first, other = str(tmp_path / "aaaaaaaa.pt"), str(tmp_path / "bbbbbbbb.pt")
    _big(first, 1.0)
    _big(other, 2.0)
    read_path(first)  # the template
    assert templates.count == 1
    good = Path(other).read_bytes()
    entries = read_directory(BytesSource(good)).entries
    storage = next(e for e in entries if e.name.endswith("/data/0"))
    # every byte of the head and tail windows but the storage's payload (a flipped payload
    # byte is found only by --deep, with or without templates)
    spots = [at for at in [*range(WINDOW), *range(len(good) - WINDOW, len(good))]
             if not storage.data_offset <= at < storage.data_offset + storage.compressed_size]
    damaged_path = str(tmp_path / "cccccccc.pt")
    for at in spots:
        damaged = good[:at] + bytes([good[at] ^ 0x5A]) + good[at + 1 :]
        with open(damaged_path, "wb") as f:
            f.write(damaged)
        assert fields(read_path(damaged_path)) == fields(slow(damaged, damaged_path)), at


def test_a_file_of_a_known_layout_s_size_is_read_only_where_it_decides(monkeypatch, tmp_path) -> None:
    from cachedoctor.formats.source import FileSource

    first, second = tmp_path / "aaaaaaaa.pt", tmp_path / "bbbbbbbb.pt"
    for path, value in ((first, 1.0), (second, 2.0)):
        torch.save({"latent": torch.full((4, 32, 32), value).half()}, path)  # 8 KiB of storage
    read_path(str(first))
    read = []
    real = FileSource._read
    monkeypatch.setattr(FileSource, "_read", lambda self, at, n: read.append(n) or real(self, at, n))
    meta = read_path(str(second))
    assert meta.ok and meta.same_as is not None and meta.path == str(second)
    size = second.stat().st_size
    assert len(read) == 2 and sum(read) == size - 8192  # all but the storage
    assert fields(meta) == fields(slow(second.read_bytes(), str(second)))


def test_every_damaged_byte_of_a_file_read_in_spans_reads_as_without_templates(tmp_path) -> None:

    first = tmp_path / "aaaaaaaa.pt"
    torch.save({"latent": torch.ones(4, 16, 16).half()}, first)
    good = bytearray(first.read_bytes())
    torch.save({"latent": torch.zeros(4, 16, 16).half()}, first)
    read_path(str(first))  # the template (2 KiB storage: skipped, so the file is read in spans)
    assert templates.spans(len(good)) is not None and len(templates.spans(len(good))) == 2
    damaged_path = tmp_path / "cccccccc.pt"
    for at in range(len(good)):
        damaged = bytes(good[:at]) + bytes([good[at] ^ 0x5A]) + bytes(good[at + 1 :])
        damaged_path.write_bytes(damaged)
        assert fields(read_path(str(damaged_path))) == fields(slow(damaged, str(damaged_path))), at


def test_files_of_many_sizes_leave_no_trace_once_the_templates_are_full(monkeypatch) -> None:
    """Memory stays flat: past MAX_TEMPLATES, a file of a new size adds nothing."""
    monkeypatch.setattr(zip_templates, "MAX_TEMPLATES", 2)
    for n in range(1, 8):
        read_bytes(saved(torch.ones(n * 100), f"{n:08x}"), f"{n}.pt")  # sizes 400 B apart
    assert templates.count == 2
    assert len(templates.by_size) == 2 and len(templates._spans) == 2
