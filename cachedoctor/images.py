"""Source images, read for `fix --reencode`: their size (cheap: the plan needs it for the
trainer's naming and bucket) and their pixels (when the entry is encoded).

With Pillow installed every format it knows is read (as RGB, like the trainers), turned upright
by its EXIF orientation where asked (`oriented`: SimpleTuner, OneTrainer's mgds and ai-toolkit
call exif_transpose; kohya's sd-scripts reads the stored pixels as they are). Without it only
PNGs of the kind the fixtures write (8-bit RGB, not interlaced) can be read; any other image is
an ImageError that names its format and the package that reads it.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, BinaryIO

from cachedoctor.regular_files import NotRegular, open_regular

if TYPE_CHECKING:
    import torch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_RGB8 = (8, 2, 0, 0, 0)  # bit depth, colour type RGB, compression, filter method, no interlace
# What the first bytes say a file is, for the message when it cannot be read.
MAGIC = ((b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"),
         (b"MM\x00*", "TIFF"), (b"\xff\x0a", "JPEG XL"), (b"\x00\x00\x00\x0cJXL ", "JPEG XL"))
NEEDS_PILLOW = "reading it needs Pillow (pip install pillow)"


class ImageError(ValueError):
    """An image that cannot be read here; str() says why, with the file's name."""


def open_image(path: str) -> BinaryIO:
    """The image file, open for reading: a regular file only (a FIFO would block the open, a
    symlink to /dev/zero would never end), opened without blocking. ImageError otherwise."""
    name = os.path.basename(path)
    try:
        fd, _ = open_regular(path)
    except NotRegular as exc:
        raise ImageError(f"{name}: {exc}") from None
    except OSError as exc:
        raise ImageError(f"{name}: cannot read it ({exc.strerror or exc})") from None
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _pillow(path: str):
    """Pillow's lazy image (the header read, no pixel decoded); ImageError for a file it
    cannot read, or one whose header claims more pixels than Pillow's decompression-bomb limit
    (a PNG of a few bytes may claim 100,000 x 100,000)."""
    from PIL import Image

    name = os.path.basename(path)
    f = open_image(path)
    try:
        img = Image.open(f)
    except Image.DecompressionBombError as exc:
        f.close()
        raise ImageError(f"{name}: {exc}: not decoded (a decompression bomb?)") from None
    except OSError as exc:
        f.close()
        raise ImageError(f"{name}: Pillow cannot read it ({exc})") from None
    except BaseException:
        f.close()
        raise
    limit = Image.MAX_IMAGE_PIXELS
    if limit and img.size[0] * img.size[1] > limit:
        img.close()
        f.close()
        raise ImageError(f"{name}: {img.size[0]}x{img.size[1]} is more than Pillow's {limit:,} "
                         "pixels for an image from an untrusted source: not decoded")
    return img, f


def size(path: str, oriented: bool = False) -> tuple[int, int]:
    """(width, height) of the image at `path`, from its header; `oriented`: as it stands
    upright (width and height swapped where its EXIF orientation turns it a quarter)."""
    try:
        from PIL import Image  # noqa: F401 (whether Pillow is there)
    except ImportError:
        width, height, form = _png_header(path)
        if form != PNG_RGB8:
            raise ImageError(f"{os.path.basename(path)} is a PNG other than 8-bit RGB: "
                             f"{NEEDS_PILLOW}") from None
        return width, height
    img, f = _pillow(path)
    with f, img:
        width, height = img.size
        return (height, width) if oriented and _orientation(img) in QUARTER_TURNS else (width, height)


QUARTER_TURNS = frozenset({5, 6, 7, 8})  # EXIF orientations that swap width and height


def _orientation(img) -> int:
    """The EXIF orientation tag (1: upright) of a Pillow image, as ImageOps.exif_transpose reads it."""
    try:
        return int(img.getexif().get(0x0112, 1))
    except (OSError, ValueError, TypeError, SyntaxError, struct.error):  # a broken EXIF block
        return 1


HEADER_BYTES = 65536  # a JPEG's frame header follows its EXIF block, thumbnail and all
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOFn (not DHT, JPG, DAC)


def header_size(path: str) -> tuple[int, int] | None:
    """(width, height) as stored in the header of a PNG, JPEG, GIF, BMP or WebP (no EXIF
    rotation: what `imagesize`, which kohya uses, reads); None when it cannot tell."""
    try:
        with open_image(path) as f:
            head = f.read(HEADER_BYTES)
    except (OSError, ImageError):
        return None
    try:
        if head.startswith(PNG_SIGNATURE) and head[12:16] == b"IHDR":
            return struct.unpack(">II", head[16:24])
        if head[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", head[6:10])
        if head[:2] == b"BM":
            width, height = struct.unpack("<ii", head[18:26])
            return width, abs(height)
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp_size(head)
        if head[:3] == b"\xff\xd8\xff":
            return _jpeg_size(head)
    except struct.error:
        return None
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and head[20:21] == b"\x2f":
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def _jpeg_size(head: bytes) -> tuple[int, int] | None:
    at = 2
    while at + 9 <= len(head):
        if head[at] != 0xFF:
            return None
        marker = head[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _JPEG_FRAMES:
            height, width = struct.unpack(">HH", head[at + 5 : at + 9])
            return width, height
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            at += 2
            continue
        at += 2 + struct.unpack(">H", head[at + 2 : at + 4])[0]
    return None


def load(path: str, oriented: bool = False) -> torch.Tensor:
    """The image at `path` as uint8 RGB [3, H, W]; `oriented`: turned upright by its EXIF
    orientation, as PIL.ImageOps.exif_transpose turns it."""
    import numpy as np
    import torch

    try:
        from PIL import Image  # noqa: F401 (whether Pillow is there)
    except ImportError:
        from cachedoctor.fixtures.images import read_png

        size(path)  # the one-line reason for images the fallback reader cannot read
        try:
            return read_png(path)[2]
        except ValueError as exc:
            raise ImageError(f"{exc}: {NEEDS_PILLOW}") from None
    from PIL import ImageOps

    img, f = _pillow(path)
    try:
        with f, img:
            upright = ImageOps.exif_transpose(img) if oriented else img
            rgb = np.asarray(upright.convert("RGB"))
    except OSError as exc:  # a file cut short after its header
        raise ImageError(f"{os.path.basename(path)}: Pillow cannot read it ({exc})") from None
    except (ValueError, TypeError, SyntaxError, struct.error) as exc:  # its EXIF, as the trainer's exif_transpose
        raise ImageError(f"{os.path.basename(path)}: its EXIF block cannot be applied ({exc})") from None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()


def _png_header(path: str) -> tuple[int, int, tuple[int, ...]]:
    name = os.path.basename(path)
    try:
        with open_image(path) as f:
            head = f.read(33)
    except OSError as exc:
        raise ImageError(f"{name}: cannot read it ({exc.strerror or exc})") from None
    if not head.startswith(PNG_SIGNATURE):
        kind = next((k for magic, k in MAGIC if head.startswith(magic)), None)
        if kind is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            kind = "WebP"
        if kind is None and head[4:8] == b"ftyp":
            kind = "HEIF/AVIF"
        what = f"a {kind} image" if kind else "no PNG"
        raise ImageError(f"{name} is {what}: {NEEDS_PILLOW}")
    if len(head) < 33 or head[12:16] != b"IHDR":
        raise ImageError(f"{name}: a PNG cut short before its header")
    width, height, *form = struct.unpack(">II5B", head[16:29])
    return width, height, tuple(form)
