"""Both sides of a comparison: the cached latent as the trainer loads it, and a fresh encode.

The cached file is first read by the scan's reader; a file it finds broken or unsafe is not
loaded (the scan reports it). The rest load with the trainer's own call, restricted to plain
tensors: torch.load(weights_only=True, map_location="cpu") (after gzip.decompress for gzip),
safetensors' load_file, np.load(allow_pickle=False).

Fresh latents: the image resized and cropped by the entry's geometry (repair/reencode.pixels,
what `fix --reencode` encodes), encoded, then scaled and shifted as the trainer stores it. A
diffusers VAE encodes a bucket's images in batches on the chosen device and gives the mean of
the posterior (`latent_dist.mode()`, which for a diagonal Gaussian is its mean): the same image
always gives the same latent, which a sample of the posterior would not.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cachedoctor.layouts.entries import EntryFormat, EntrySpec, Geometry
from cachedoctor.regular_files import NotRegular, open_regular
from cachedoctor.repair.encoders import DiffusersEncoder, Encoder, EncoderError

if TYPE_CHECKING:
    import torch


class Unreadable(Exception):
    """The cached entry cannot be compared; str() says why."""


ENTRY_LIMIT = 1 << 30  # bytes of one cache entry read for a comparison (latents are MBs)


def cached_latent(path: str, fmt: EntryFormat) -> torch.Tensor:
    """The latent stored at `path`, float32 [C, h, w], as the trainer loads it."""
    import torch

    data = checked_bytes(path)
    try:
        loaded = _load_container(data, fmt.container)
        value: Any = loaded if fmt.key is None else loaded[fmt.key]
    except (KeyError, OSError, ValueError, RuntimeError, EOFError) as exc:
        raise Unreadable(f"cannot load it as its neighbours are stored: {exc}") from None
    if not isinstance(value, torch.Tensor):
        value = torch.from_numpy(value)
    if value.ndim == 4 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != 3:
        raise Unreadable(f"it holds shape {tuple(value.shape)}, not a [C, h, w] latent")
    return value.float()


def checked_bytes(path: str) -> bytes:
    """The entry's bytes, read once and judged by the scan's reader: what is loaded is what
    was judged (a file swapped between a check by name and a load by name would not be), and
    a FIFO, a device or a file past ENTRY_LIMIT is refused before a byte is read."""
    from cachedoctor.formats import read_bytes

    try:
        fd, st = open_regular(path)
    except NotRegular as exc:
        raise Unreadable(str(exc)) from None
    except OSError as exc:
        raise Unreadable(f"cannot open it: {exc.strerror or exc}") from None
    try:
        if st.st_size > ENTRY_LIMIT:
            raise Unreadable(f"{st.st_size:,} bytes: larger than any latent (not loaded)")
        chunks, left = [], ENTRY_LIMIT + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise Unreadable(f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > ENTRY_LIMIT:
        raise Unreadable("it grew past its size while read (not loaded)")
    meta = read_bytes(data, path)
    if meta.errors or meta.unsafe_globals:
        raise Unreadable("the scan's reader rejects it (run cachedoctor scan)")
    return data


def load_tensors(data: bytes, path: str) -> Any:
    """A file's tensors from its bytes, loaded as its name says: safetensors, npz, else torch
    (gzip around it too)."""
    container = "safetensors" if path.endswith(".safetensors") else "npz" if path.endswith(".npz") else "zip"
    return _load_container(data, container)


def _load_container(data: bytes, container: str) -> Any:
    """Plain tensors only: the trainers' own loaders, restricted (module doc)."""
    if container == "safetensors":
        from safetensors.torch import load

        return load(data)
    if container == "npz":
        import numpy as np

        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    import torch

    # the reader inflated it under its cap before accepting it: the same bytes, bounded
    source: Any = io.BytesIO(gzip.decompress(data)) if data[:2] == b"\x1f\x8b" else io.BytesIO(data)
    return torch.load(source, weights_only=True, map_location="cpu")


def pixels_of(spec: EntrySpec, geometry: Geometry | None = None, flip: bool = False) -> torch.Tensor:
    """The uint8 pixels the trainer encodes for `spec` (or with another `geometry`), mirrored."""
    from cachedoctor.repair.reencode import pixels

    rgb = pixels(spec.image, spec.geometry if geometry is None else geometry)
    return rgb.flip(-1).contiguous() if flip else rgb


class Fresh:
    """Encodes pixels as the trainer stores its latents, batching on the chosen device."""

    def __init__(self, encoder: Encoder, device: str, batch_size: int,
                 counted: Callable[[int], None] = lambda n: None) -> None:
        self.encoder, self.device, self.batch_size, self.counted = encoder, device, batch_size, counted

    def prepare(self) -> None:
        self.encoder.prepare()
        if isinstance(self.encoder, DiffusersEncoder) and self.device != "cpu":
            self.encoder.vae.to(self.device)

    def encode(self, images: Sequence[torch.Tensor], fmt: EntryFormat) -> list[torch.Tensor]:
        """Stored-form latents (float32, CPU) of same-size uint8 images [3, H, W]."""
        out: list[torch.Tensor] = []
        for start in range(0, len(images), self.batch_size):
            batch = images[start:start + self.batch_size]
            out.extend(self._batch(batch, fmt.channels))
            self.counted(len(batch))
        if fmt.scaled:
            out = [(x - self.encoder.shift_factor) * self.encoder.scaling_factor for x in out]
        return out

    def _batch(self, images: Sequence[torch.Tensor], channels: int | None) -> list[torch.Tensor]:
        try:
            return self._run(images, channels)
        except EncoderError:
            raise
        except Exception as exc:  # the user's callable, a CUDA out-of-memory: one line, not a traceback
            from cachedoctor.checks.checker_error import describe

            height, width = images[0].shape[-2:]
            raise EncoderError(f"encoder {self.encoder.spec} failed on {len(images)} image(s) of "
                               f"{width}x{height}: {describe(exc)}") from None

    def _run(self, images: Sequence[torch.Tensor], channels: int | None) -> list[torch.Tensor]:
        import torch

        if not isinstance(self.encoder, DiffusersEncoder):
            return [self.encoder.encode(image, channels) for image in images]
        vae = self.encoder.vae
        x = torch.stack(list(images)).to(self.device).float() / 127.5 - 1.0
        with torch.no_grad():
            latents = vae.encode(x.to(vae.dtype)).latent_dist.mode()
        if channels is not None and latents.shape[1] != channels:
            raise EncoderError(f"encoder {self.encoder.spec} gives {latents.shape[1]} channels; "
                               f"the cache holds {channels}-channel latents (another VAE family)")
        return [latent.float().cpu() for latent in latents]
