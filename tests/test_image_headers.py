"""Image sizes from headers only (kohya's legacy npz names no size: its bucket comes from the
image, as kohya's `imagesize.get` reads it)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from cachedoctor.fixtures.images import write_png
from cachedoctor.images import header_size


def _jpeg(width: int, height: int) -> bytes:
    """SOI, an EXIF APP1 longer than the old 4 KiB window, DQT, then the SOF0 frame header."""
    exif = b"Exif\x00\x00" + bytes(6000)
    return (b"\xff\xd8" + b"\xff\xe1" + struct.pack(">H", len(exif) + 2) + exif
            + b"\xff\xdb" + struct.pack(">H", 67) + bytes(65)
            + b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + bytes(9) + b"\xff\xd9")


@pytest.mark.parametrize(("name", "data", "size"), [
    ("a.jpg", _jpeg(1023, 769), (1023, 769)),
    ("a.gif", b"GIF89a" + struct.pack("<HH", 320, 192) + bytes(8), (320, 192)),
    ("a.bmp", b"BM" + bytes(16) + struct.pack("<ii", 7, -1000) + bytes(30), (7, 1000)),
    ("a.webp", b"RIFF\x00\x00\x00\x00WEBPVP8L\x00\x00\x00\x00\x2f"
     + ((320 - 1) | (192 - 1) << 14).to_bytes(4, "little"), (320, 192)),
    ("b.webp", b"RIFF\x00\x00\x00\x00WEBPVP8X" + bytes(8) + (319).to_bytes(3, "little")
     + (191).to_bytes(3, "little"), (320, 192)),
    ("cut.jpg", _jpeg(10, 10)[:3000], None),
    ("junk.png", b"\x89PNG\r\n\x1a\n" + bytes(8), None),
    ("empty.jpg", b"", None),
])
def test_header_sizes(name: str, data: bytes, size: tuple | None, tmp_path: Path) -> None:
    (tmp_path / name).write_bytes(data)
    assert header_size(str(tmp_path / name)) == size


def test_png_as_written(tmp_path: Path) -> None:
    write_png(tmp_path / "a.png", 320, 192)
    assert header_size(str(tmp_path / "a.png")) == (320, 192)
    assert header_size(str(tmp_path / "missing.png")) is None


@pytest.mark.parametrize(("fmt", "options"), [("JPEG", {}), ("JPEG", {"progressive": True}),
                                              ("WEBP", {}), ("WEBP", {"lossless": True})])
def test_sizes_of_files_pillow_wrote(fmt: str, options: dict, tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    for mode, size in (("RGB", (1023, 769)), ("RGBA", (7, 1000))):
        if fmt == "JPEG" and mode == "RGBA":
            continue
        path = tmp_path / f"a.{fmt.lower()}"
        image.new(mode, size).save(path, fmt, **options)
        assert header_size(str(path)) == size
