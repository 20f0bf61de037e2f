"""reencode: a new cache entry encoded from its source image, written as the trainer writes it.

A job is a `ReencodeTarget`: the image, the path of the entry, and its `EntryFormat` (container,
key, dtype, channels, batch dim, scaling, the other entries and header metadata the trainer
stores). Trainer layouts build targets for their entries; for a bare cache the format is that
of the healthy neighbouring files (`neighbour_format`), which works where an entry holds the
latent only (SimpleTuner's bare tensors; single-tensor safetensors or npz files).

The written file is checked with the scan's reader (same container, key, dtype and shape as
asked, nothing unsafe) and loaded with the trainer's own call: torch.load(weights_only=True,
map_location="cpu") (after gzip.decompress for gzip), safetensors.torch.load_file, np.load
(allow_pickle=False); the latent must be bit-identical to what was encoded.
"""

from __future__ import annotations

import collections
import gzip
import io
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from cachedoctor.formats import read_bytes, read_path
from cachedoctor.formats.meta import NPZ, SAFETENSORS, TORCH_LEGACY, TORCH_ZIP, FileMeta
from cachedoctor.repair import torch_io
from cachedoctor.repair.errors import RepairError

if TYPE_CHECKING:
    import torch

    from cachedoctor.repair.encoders import Encoder

TORCH_CONTAINERS = (torch_io.ZIP, torch_io.GZIP, torch_io.LEGACY)
CONTAINERS = (*TORCH_CONTAINERS, "safetensors", "npz")
NEIGHBOURS_READ = 8  # healthy neighbours whose format is compared


class NoFormat(RepairError):
    """No entry format can be taken from the neighbouring files."""


class EntryMismatch(RepairError):
    """The written entry is not what was asked for."""


@dataclass(frozen=True)
class EntryFormat:
    """How a trainer stores one latent."""

    container: str  # zip, gzip (gzip around a torch zip), legacy, safetensors, npz
    key: str | None  # None: the file is the bare tensor; else its dict key, tensor or member name
    dtype: str  # torch's dtype name: float16, bfloat16, float32
    channels: int | None = None  # C of [C, h, w]; None: whatever the encoder gives
    batch_dim: bool = False  # stored as [1, C, h, w]
    scaled: bool = False  # stored as (latent - shift_factor) * scaling_factor (SimpleTuner, ai-toolkit)
    # Other entries (kohya's original_size, crop_ltrb) and safetensors header metadata (ai-toolkit);
    # left out of the hash (mappings have none), not out of equality.
    extras: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    def __post_init__(self) -> None:
        if self.container not in CONTAINERS:
            raise ValueError(f"container must be one of {CONTAINERS}, got {self.container!r}")
        if self.container in ("safetensors", "npz") and self.key is None:
            raise ValueError(f"a {self.container} entry needs a key (the latent's name)")
        for name in ("extras", "metadata"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @property
    def shape_of(self) -> str:
        return f"[{'1, ' if self.batch_dim else ''}{self.channels or 'C'}, h, w]"


@dataclass(frozen=True)
class ReencodeTarget:
    """One entry to encode: `image` -> `path`, stored as `format`."""

    image: str
    path: str
    format: EntryFormat
    codes: tuple[str, ...] = ("CD404",)  # why: missing (CD404), or the codes that quarantined it


def format_of(meta: FileMeta) -> EntryFormat:
    """The format of a healthy file that holds one latent and nothing image-specific besides."""
    name = os.path.basename(meta.path)
    if meta.errors or meta.unsafe_globals:
        raise NoFormat(f"{name} is itself broken")
    kind = _container(meta)
    if len(meta.tensors) != 1 or meta.metadata:
        what = f"{len(meta.tensors)} tensors" if len(meta.tensors) != 1 else "header metadata"
        raise NoFormat(f"entries like {name} hold {what}: only the trainer's layout can write them")
    latent = meta.tensors[0]
    if len(latent.shape) not in (3, 4):
        raise NoFormat(f"{name} holds no [C, h, w] latent")
    if latent.path and kind in TORCH_CONTAINERS:
        raise NoFormat(f"entries like {name} are dicts, whose other values only the trainer's "
                       "layout knows")
    batch = len(latent.shape) == 4 and latent.shape[0] == 1
    return EntryFormat(kind, str(latent.path[0]) if latent.path else None, latent.dtype,
                       latent.shape[1] if batch else latent.shape[0], batch)


def neighbour_format(path: str, exclude: Iterable[str] = ()) -> EntryFormat:
    """The format most healthy files beside `path` (same extension) share; NoFormat if none."""
    directory, name = os.path.split(path)
    ext = os.path.splitext(name)[1].lower()
    skip = {os.path.basename(p) for p in exclude} | {name}
    try:
        names = sorted(n for n in os.listdir(directory)
                       if n not in skip and not n.startswith(".") and n.lower().endswith(ext))
    except OSError as exc:
        raise NoFormat(f"cannot list {directory}: {exc.strerror}") from None
    found: collections.Counter[EntryFormat] = collections.Counter()
    reasons = []
    for neighbour in names:
        try:
            found[format_of(read_path(os.path.join(directory, neighbour)))] += 1
        except NoFormat as exc:
            reasons.append(str(exc))
        if sum(found.values()) >= NEIGHBOURS_READ:
            break
    if not found:
        raise NoFormat(reasons[0] if reasons else f"no healthy {ext or 'cache'} file beside it "
                       "to take the format from")
    return found.most_common(1)[0][0]


def _container(meta: FileMeta) -> str:
    if meta.format in (TORCH_ZIP, TORCH_LEGACY):
        try:
            return torch_io.container(meta)
        except torch_io.Unloadable as exc:
            raise NoFormat(str(exc)) from None
    if meta.format == SAFETENSORS:
        return "safetensors"
    if meta.format == NPZ:
        return "npz"
    raise NoFormat(f"{os.path.basename(meta.path)} is {meta.format}: no latent container")


def encode(target: ReencodeTarget, encoder: Encoder) -> tuple[bytes, torch.Tensor]:
    """(the entry's bytes, the latent as stored in it)."""
    from cachedoctor.fixtures.latents import as_dtype
    from cachedoctor.repair.encoders import load_image

    fmt = target.format
    latent = encoder.encode(load_image(target.image), fmt.channels)
    if fmt.scaled:
        latent = (latent - encoder.shift_factor) * encoder.scaling_factor
    value = latent.to(as_dtype(fmt.dtype)).contiguous().clone()
    if fmt.batch_dim:
        value = value[None].clone()
    return _dumps(value, fmt), value


def _dumps(value: torch.Tensor, fmt: EntryFormat) -> bytes:
    if fmt.container == "safetensors":
        import torch
        from safetensors.torch import save

        tensors = {fmt.key: value, **{k: torch.as_tensor(v) for k, v in fmt.extras.items()}}
        return save(tensors, metadata=dict(fmt.metadata) or None)
    if fmt.container == "npz":
        import numpy as np

        try:
            array = value.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            raise EntryMismatch(f"npz cannot hold {fmt.dtype}") from None
        buffer = io.BytesIO()
        np.savez(buffer, **{fmt.key: array, **{k: np.asarray(v) for k, v in fmt.extras.items()}})
        return buffer.getvalue()
    obj: Any = value if fmt.key is None else {fmt.key: value, **fmt.extras}
    return torch_io.dumps(obj, fmt.container)


def verify(target: ReencodeTarget, written: str, expected: torch.Tensor) -> None:
    """Raise EntryMismatch unless the file `written` is the entry asked for, loaded by the
    trainer's own call, holding `expected` bit for bit."""
    import torch

    with open(written, "rb") as f:
        data = f.read()
    fmt = target.format
    meta = read_bytes(data, target.path)
    if meta.errors or meta.unsafe_globals:
        raise EntryMismatch(f"the reader rejects it: {(meta.errors or meta.unsafe_globals)[0]}")
    where = (fmt.key,) if fmt.key is not None else ()
    stored = [t for t in meta.tensors if t.path == where]
    if _container(meta) != fmt.container or len(stored) != 1 or stored[0].dtype != fmt.dtype:
        raise EntryMismatch(f"written as {_container(meta)} with {[t.display_path for t in meta.tensors]}"
                            f", not as {fmt.container} with a {fmt.dtype} latent at {where}")
    loaded = _trainer_load(fmt, written, data)
    value = loaded if fmt.key is None else loaded[fmt.key]
    if not isinstance(value, torch.Tensor):
        value = torch.from_numpy(value)
    if value.dtype != expected.dtype or value.shape != expected.shape:
        raise EntryMismatch(f"loads as {value.dtype} {tuple(value.shape)}, not {expected.dtype} "
                            f"{tuple(expected.shape)}")
    if not torch.equal(value.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)):
        raise EntryMismatch("the latent read back differs from the one encoded")
    missing = [k for k in fmt.extras if k not in loaded]
    if missing:
        raise EntryMismatch(f"entries {missing} are missing")


def _trainer_load(fmt: EntryFormat, path: str, data: bytes) -> Any:
    if fmt.container == "safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    if fmt.container == "npz":
        import numpy as np

        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    import torch

    source: Any = io.BytesIO(gzip.decompress(data)) if fmt.container == torch_io.GZIP else path
    return torch.load(source, weights_only=True, map_location="cpu")

