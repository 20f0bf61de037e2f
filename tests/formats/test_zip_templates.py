"""The template fast path gives exactly what a full directory parse gives, or stays out."""

from __future__ import annotations

import io
import os

import pytest

from cachedoctor.formats import read_bytes, zip_templates

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


@pytest.fixture(autouse=True)
def fresh_templates(monkeypatch):
    monkeypatch.setattr(zip_templates, "_templates", {})
    monkeypatch.setattr(zip_templates, "_count", 0)


def slow(data: bytes, path: str):
    """The same read with no template to lean on."""
    saved_state = zip_templates._templates
    zip_templates._templates = {}
    try:
        return read_bytes(data, path)
    finally:
        zip_templates._templates = saved_state


def test_files_of_one_layout_take_the_fast_path_with_the_same_result(monkeypatch) -> None:
    import cachedoctor.formats as formats

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
    assert zip_templates._count == 1
    for at in range(len(b)):
        damaged = bytes(b[:at]) + bytes([b[at] ^ 0x5A]) + bytes(b[at + 1 :])
        assert fields(read_bytes(damaged, "b.pt")) == fields(slow(damaged, "b.pt")), at


def test_other_prefix_lengths_and_sizes_are_other_layouts() -> None:
    read_bytes(saved(torch.ones(3), "x" * 10), "x.pt")
    other = saved(torch.ones(3), "y" * 11)
    meta = read_bytes(other, "y.pt")
    assert fields(meta) == fields(slow(other, "y.pt")) and meta.ok
    assert zip_templates._count == 2


def test_a_damaged_first_file_makes_no_template() -> None:
    blob = bytearray(saved(torch.ones(3), "z" * 8))
    blob[-30] ^= 0xFF  # inside the end records
    read_bytes(bytes(blob), "z.pt")
    assert zip_templates._count == 0


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
    from cachedoctor.formats import read_path

    paths = []
    for i in range(5):
        path = tmp_path / f"{i:08x}.pt"
        torch.save(torch.full((4, 8, 8), float(i)).half(), path)
        paths.append(str(path))
    metas = [read_path(p) for p in paths]
    assert all(m.ok and m.tensors[0].shape == (4, 8, 8) for m in metas)
    assert zip_templates._count == 1
    os.truncate(paths[3], 900)
    assert not read_path(paths[3]).ok
