"""Source images, read for `fix --reencode`: their size (cheap: the plan needs it for the
trainer's naming and bucket) and their pixels (when the entry is encoded).

With Pillow installed every format it knows is read (as RGB, like the trainers). Without it only
PNGs of the kind the fixtures write (8-bit RGB, not interlaced) can be read; any other image is
an ImageError that names its format and the package that reads it.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING

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


def size(path: str) -> tuple[int, int]:
    """(width, height) of the image at `path`, from its header."""
    try:
        from PIL import Image
    except ImportError:
        width, height, form = _png_header(path)
        if form != PNG_RGB8:
            raise ImageError(f"{os.path.basename(path)} is a PNG other than 8-bit RGB: "
                             f"{NEEDS_PILLOW}") from None
        return width, height
    try:
        with Image.open(path) as img:
            return img.size
    except OSError as exc:
        raise ImageError(f"{os.path.basename(path)}: Pillow cannot read it ({exc})") from None


def load(path: str) -> torch.Tensor:
    """The image at `path` as uint8 RGB [3, H, W]."""
    import numpy as np
    import torch

    try:
        from PIL import Image
    except ImportError:
        from cachedoctor.fixtures.images import read_png

        size(path)  # the one-line reason for images the fallback reader cannot read
        try:
            return read_png(path)[2]
        except ValueError as exc:
            raise ImageError(f"{exc}: {NEEDS_PILLOW}") from None
    try:
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB"))
    except OSError as exc:
        raise ImageError(f"{os.path.basename(path)}: Pillow cannot read it ({exc})") from None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()


def _png_header(path: str) -> tuple[int, int, tuple[int, ...]]:
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
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
