"""reencode: a new cache entry encoded from its source image, written as the trainer writes it.

A job is a `ReencodeTarget`: the trainer's `EntrySpec` for an image (layouts/entries.py: the
entry's path, the bucket's resize and crop, and its `EntryFormat`: container, key, dtype, device,
channels, scaling, the values stored beside the latent and the header metadata), plus the codes
of the findings it answers. Trainer layouts describe their entries; for a bare cache the format
is that of the healthy neighbouring files (`neighbour_format`), which works where an entry holds
the latent only (SimpleTuner's bare tensors; single-tensor safetensors or npz files).

The image is read, mirrored where the entry is a mirrored item's (ai-toolkit's flip_x and
flip_y), resized and cropped as the trainer does (torch's resampling standing in for
the trainer's own: the geometry is exact, the pixels close), encoded, scaled where the trainer
stores scaled latents, and written in the trainer's container. Where the format asks for a
flipped latent (kohya's flip_aug), the cropped pixels mirrored left to right are encoded too.
Where it keeps keys of the entry it replaces (kohya's other resolutions), they are read from
that entry, which the run has just moved to the quarantine (`kept_arrays`), and written back
as they were. The written file, read back through its folder's descriptor, is checked with the
scan's reader (same container, key, dtype, device and shape as asked, nothing unsafe) and those
same bytes are loaded with the trainer's own call: torch.load(weights_only=True,
map_location="cpu") (after gzip.decompress for gzip), safetensors.torch's loader,
np.load(allow_pickle=False); the latent must be bit-identical to
what was encoded, the flipped latent and kept keys to what was written, and the values and
metadata beside them as asked.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from cachedoctor.formats import read_bytes
from cachedoctor.layouts.entries import (
    EntryFormat,
    EntrySpec,
    Geometry,
    container_of,
    format_of,
    neighbour_format,
)
from cachedoctor.layouts.entries import NoSpec as NoFormat
from cachedoctor.repair import torch_io
from cachedoctor.repair.errors import RepairError

if TYPE_CHECKING:
    import torch

    from cachedoctor.repair.encoders import Encoder

__all__ = ["EntryFormat", "EntryMismatch", "NoFormat", "ReencodeTarget", "encode", "format_of",
           "neighbour_format", "verify"]


class EntryMismatch(RepairError):
    """The written entry is not what was asked for."""


@dataclass(frozen=True)
class ReencodeTarget(EntrySpec):
    """One entry to encode: the trainer's EntrySpec, and why (the codes of the findings)."""

    codes: tuple[str, ...] = ("CD404",)  # missing (CD404), or the codes that quarantined it

    @classmethod
    def of(cls, spec: EntrySpec, codes: tuple[str, ...]) -> ReencodeTarget:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(EntrySpec)}, codes=codes)


def encode(target: ReencodeTarget, encoder: Encoder, kept: Mapping[str, Any] | None = None
           ) -> tuple[bytes, torch.Tensor, dict[str, Any]]:
    """(the entry's bytes, the latent as stored in it, what is stored beside it but the
    format's extras: the flipped latent and the `kept` arrays, by key)."""
    fmt = target.format
    rgb = pixels(target.image, target.geometry)
    value = _latent(target, encoder, rgb)
    besides: dict[str, Any] = dict(kept or {})
    if fmt.flipped is not None:
        besides[fmt.flipped] = _latent(target, encoder, rgb.flip(-1).contiguous())
    return _dumps(value, fmt, besides), value, besides


def _latent(target: ReencodeTarget, encoder: Encoder, rgb: torch.Tensor) -> torch.Tensor:
    """The latent of `rgb` as the entry stores it (scaled, of its dtype and dims)."""
    from cachedoctor.fixtures.latents import as_dtype
    from cachedoctor.repair.encoders import EncoderError

    fmt = target.format
    latent = encoder.encode(rgb, fmt.channels)
    if target.latent_size is not None and tuple(latent.shape[-2:]) != target.latent_size:
        h, w = target.latent_size
        raise EncoderError(f"encoder {encoder.spec} gives {latent.shape[-2]}x{latent.shape[-1]} "
                           f"latents here; the trainer's bucket needs {h}x{w} (a VAE of another "
                           "downsampling factor?)")
    if fmt.scaled:
        latent = (latent - encoder.shift_factor) * encoder.scaling_factor
    value = latent.to(as_dtype(fmt.dtype)).contiguous().clone()
    if fmt.batch_dim:
        value = value[None].clone()
    return value


def kept_arrays(target: ReencodeTarget, data: bytes) -> dict[str, Any]:
    """The format's `kept` keys of the replaced entry whose bytes are `data` (an npz, read as
    the trainer reads it: np.load(allow_pickle=False)); EntryMismatch if one is missing."""
    import numpy as np

    keys = target.format.kept
    if not keys:
        return {}
    if target.format.container != "npz":
        raise EntryMismatch(f"keys are kept from npz entries only, not {target.format.container}")
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        missing = [k for k in keys if k not in npz.files]
        if missing:
            raise EntryMismatch(f"the entry it replaces no longer holds {', '.join(missing)}")
        return {k: npz[k] for k in keys}


def pixels(image: str, geometry: Geometry | None) -> torch.Tensor:
    """The uint8 RGB pixels [3, h, w] the trainer encodes: the image (upright by its EXIF
    orientation where the trainer turns it, mirrored where the item is mirrored), resized and
    cropped."""
    import torch
    import torch.nn.functional as F

    from cachedoctor.images import load

    rgb = load(image, oriented=geometry is not None and geometry.oriented)
    if geometry is None:
        return rgb
    height, width = rgb.shape[-2:]
    if (width, height) != geometry.size:
        raise EntryMismatch(f"the image is {width}x{height} now, not {geometry.size[0]}x"
                            f"{geometry.size[1]} as planned: it changed since the plan")
    if geometry.flip_x:  # before the resize and crop, as ai-toolkit transposes the image
        rgb = rgb.flip(-1)
    if geometry.flip_y:
        rgb = rgb.flip(-2)
    if geometry.resize != geometry.size:
        mode = geometry.filter
        if mode == "area" and (geometry.resize[0] > width or geometry.resize[1] > height):
            mode = "bicubic"  # area averaging only shrinks
        resized = F.interpolate(rgb[None].float(), size=(geometry.resize[1], geometry.resize[0]),
                                mode=mode, antialias=mode != "area",
                                **({} if mode == "area" else {"align_corners": False}))
        rgb = resized[0].round().clamp(0, 255).to(torch.uint8)
    left, top, w, h = geometry.crop
    return rgb[:, top:top + h, left:left + w].contiguous()


def _dumps(value: torch.Tensor, fmt: EntryFormat, besides: Mapping[str, Any]) -> bytes:
    if fmt.container == "safetensors":
        import torch
        from safetensors.torch import save

        tensors = {fmt.key: value, **{k: torch.as_tensor(v) for k, v in
                                      {**fmt.extras, **besides}.items()}}
        return save(tensors, metadata=dict(fmt.metadata) or None)
    if fmt.container == "npz":
        import numpy as np
        import torch

        try:
            arrays = {k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
                      for k, v in {fmt.key: value, **fmt.extras, **besides}.items()}
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            raise EntryMismatch(f"npz cannot hold {fmt.dtype}") from None
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()
    obj: Any = value if fmt.key is None else {fmt.key: value, **fmt.extras, **besides}
    if fmt.location == "cpu":
        return torch_io.dumps(obj, fmt.container)
    from cachedoctor.fixtures.devices import stored_as

    with stored_as(fmt.location):  # as the trainer saves from its device (OneTrainer: no .cpu())
        return torch_io.dumps(obj, fmt.container)


def verify(target: ReencodeTarget, data: bytes, expected: torch.Tensor,
           besides: Mapping[str, Any] | None = None) -> None:
    """Raise EntryMismatch unless `data`, the bytes of the file written (read back through its
    folder's descriptor: its path may lead elsewhere by now), is the entry asked for, loaded by
    the trainer's own call, holding `expected` and `besides` (encode's) bit for bit and the
    asked values beside them. The very bytes the reader judged are the ones loaded."""
    besides = besides or {}
    import torch

    fmt = target.format
    meta = read_bytes(data, target.path)
    if meta.errors or meta.unsafe_globals:
        raise EntryMismatch(f"the reader rejects it: {(meta.errors or meta.unsafe_globals)[0]}")
    where = (fmt.key,) if fmt.key is not None else ()
    stored = [t for t in meta.tensors if t.path == where]
    kind = container_of(meta)
    if kind != fmt.container or len(stored) != 1 or stored[0].dtype != fmt.dtype:
        raise EntryMismatch(f"written as {kind} with {[t.display_path for t in meta.tensors]}"
                            f", not as {fmt.container} with a {fmt.dtype} latent at {where}")
    if meta.locations not in ((), (fmt.location,)):
        raise EntryMismatch(f"its tensors are stored on {', '.join(meta.locations)}, not "
                            f"{fmt.location}")
    if dict(meta.metadata) != dict(fmt.metadata):
        raise EntryMismatch("its header metadata is not the one asked for")
    loaded = _trainer_load(fmt, data)
    value = loaded if fmt.key is None else loaded[fmt.key]
    if not isinstance(value, torch.Tensor):
        value = torch.from_numpy(value)
    if value.dtype != expected.dtype or value.shape != expected.shape:
        raise EntryMismatch(f"loads as {value.dtype} {tuple(value.shape)}, not {expected.dtype} "
                            f"{tuple(expected.shape)}")
    if not torch.equal(value.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)):
        raise EntryMismatch("the latent read back differs from the one encoded")
    keys = [] if fmt.key is None else sorted(loaded)
    asked = sorted([fmt.key, *fmt.extras, *besides]) if fmt.key is not None else []
    if keys != asked:
        raise EntryMismatch(f"it holds {keys}, not {asked}")
    for name, want in fmt.extras.items():
        if not _same(loaded[name], want):
            raise EntryMismatch(f"{name} reads back as {loaded[name]!r}, not {want!r}")
    for name, want in besides.items():
        if not _bits(loaded[name], want):
            raise EntryMismatch(f"{name} reads back other than it was written")


def _bits(got: Any, want: Any) -> bool:
    """The same dtype, shape and bytes (NaN included), numpy or torch either side."""
    import numpy as np
    import torch

    got, want = (v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in (got, want))
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def _same(got: Any, want: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(want, np.ndarray) or isinstance(got, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == np.asarray(want).dtype \
            and np.array_equal(got, want)
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    return type(got) is type(want) and got == want


def _trainer_load(fmt: EntryFormat, data: bytes) -> Any:
    """The trainer's loading call (safetensors.torch.load_file, np.load, torch.load), on bytes."""
    if fmt.container == "safetensors":
        from safetensors.torch import load

        return load(data)
    if fmt.container == "npz":
        import numpy as np

        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    import torch

    raw = gzip.decompress(data) if fmt.container == torch_io.GZIP else data
    return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
