"""The cache entry a trainer writes for one image: what `fix --reencode` creates in its place.

A trainer's Naming builds an `Entries` for its dataset at repair time (layouts/<trainer>.py).
`source(entry)` is the image a cache entry was encoded from; `spec(image, replacing)` is the
entry the trainer would write for it: the path (its naming), the geometry (the bucket's resize
and crop) and the format (container, key, dtype, device, scaling, the values stored beside the
latent and the header metadata), taken from the healthy entries beside it. Both raise NoSpec
with a one-line reason, which the plan shows.

The readers here take no decision on findings: they give facts, and files are only read, never
written.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from cachedoctor.formats import read_path
from cachedoctor.formats.meta import NPZ, SAFETENSORS, TORCH_LEGACY, TORCH_ZIP, FileMeta

ZIP, GZIP, LEGACY = "zip", "gzip", "legacy"  # torch containers: SimpleTuner writes all three
TORCH_CONTAINERS = (ZIP, GZIP, LEGACY)
CONTAINERS = (*TORCH_CONTAINERS, "safetensors", "npz")
FILTERS = ("bilinear", "bicubic", "area")  # resampling, as torch's interpolate names it
NEIGHBOURS_READ = 16  # healthy neighbours whose format is compared
T = TypeVar("T")


class NoSpec(Exception):
    """The entry for an image cannot be described; str() says why."""


@dataclass(frozen=True)
class EntryFormat:
    """How a trainer stores one latent."""

    container: str  # zip, gzip (gzip around a torch zip), legacy, safetensors, npz
    key: str | None  # None: the file is the bare tensor; else its dict key, tensor or member name
    dtype: str  # torch's dtype name: float16, bfloat16, float32
    channels: int | None = None  # C of [C, h, w]; None: whatever the encoder gives
    batch_dim: bool = False  # stored as [1, C, h, w]
    scaled: bool = False  # stored as (latent - shift_factor) * scaling_factor (SimpleTuner, ai-toolkit)
    location: str = "cpu"  # the device torch records for the storages (OneTrainer: its train_device)
    # The values stored beside the latent (kohya's original_size and crop_ltrb as numpy arrays,
    # OneTrainer's original_resolution and crop_offset) and safetensors header metadata
    # (ai-toolkit): the entry's own, so neither hashed nor compared (two entries of one format
    # differ there).
    extras: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False,
                                      compare=False)
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False,
                                        compare=False)
    # kohya's flip_aug: the key of the latent of the image mirrored left to right (after the
    # crop), stored beside the latent; None: none is made
    flipped: str | None = None
    # the keys of the entry being replaced that are written back as they were, read from it
    # when the run writes the new entry (kohya's npz hold other resolutions' latents, and
    # sd-scripts adds to a file, never takes keys away): the entry's own, like extras
    kept: tuple[str, ...] = field(default=(), hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.container not in CONTAINERS:
            raise ValueError(f"container must be one of {CONTAINERS}, got {self.container!r}")
        if self.container in ("safetensors", "npz") and self.key is None:
            raise ValueError(f"a {self.container} entry needs a key (the latent's name)")
        for name in ("extras", "metadata"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass(frozen=True)
class Geometry:
    """The pixels a trainer encodes: the image (upright where `oriented`, then mirrored where
    `flip_x`/`flip_y`) resized to `resize`, then cropped. `size` is the image's as the trainer
    reads it (upright where `oriented`)."""

    size: tuple[int, int]  # (w, h) of the image when the plan was made
    resize: tuple[int, int]  # (w, h)
    crop: tuple[int, int, int, int]  # (left, top, width, height) in the resized image
    filter: str = "bilinear"  # the torch mode nearest to how the trainer resamples
    flip_x: bool = False  # mirrored left to right before the resize (ai-toolkit's flip_x items)
    flip_y: bool = False  # mirrored top to bottom before the resize (its flip_y items)
    oriented: bool = False  # turned upright by its EXIF orientation first (exif_transpose)

    def __post_init__(self) -> None:
        left, top, width, height = self.crop
        if self.filter not in FILTERS:
            raise ValueError(f"filter must be one of {FILTERS}, got {self.filter!r}")
        if left < 0 or top < 0 or width < 1 or height < 1 or left + width > self.resize[0] \
                or top + height > self.resize[1]:
            raise NoSpec(f"the crop {self.crop} does not fit the image resized to "
                         f"{self.resize[0]}x{self.resize[1]}")

    def latent_size(self, factor: int) -> tuple[int, int]:
        """(h, w) of the latent of the crop, for a VAE of this factor."""
        return self.crop[3] // factor, self.crop[2] // factor


@dataclass(frozen=True)
class EntrySpec:
    """The entry a trainer writes for `image`: at `path`, stored as `format`."""

    image: str
    path: str
    format: EntryFormat
    geometry: Geometry | None = None  # None: the image is encoded as it is
    latent_size: tuple[int, int] | None = None  # (h, w) the latent must have; None: any

    @property
    def shape(self) -> str:
        """The stored latent's shape, as far as it is known: [4, 24, 16], [C, h, w]."""
        fmt = self.format
        h, w = self.latent_size or ("h", "w")
        return f"[{'1, ' if fmt.batch_dim else ''}{fmt.channels or 'C'}, {h}, {w}]"


@dataclass(frozen=True)
class Changes:
    """What a repair plan does to the caches before it writes new entries there."""

    # entries it takes away whose format is not the trainer's (broken, hostile, of another VAE
    # family): never copied. Entries taken away for their size or age still show the format.
    unlike: frozenset[str] = frozenset()
    to_cpu: frozenset[str] = frozenset()  # entries it rewrites with every tensor on the CPU


NO_CHANGES = Changes()


class Entries:
    """A dataset's cache entries as its trainer names and writes them (the base: nothing known)."""

    def __init__(self, changes: Changes = NO_CHANGES) -> None:
        self.changes = changes
        self.unlike = changes.unlike
        self._known: dict[Any, Any] = {}

    def once(self, key: Any, find: Callable[[], T]) -> T:
        """`find()` once per key (a folder's format, say); the NoSpec it raised is raised again."""
        if key not in self._known:
            try:
                self._known[key] = find()
            except NoSpec as exc:
                self._known[key] = exc
        found = self._known[key]
        if isinstance(found, NoSpec):
            raise found
        return found

    def source(self, entry: str) -> str:
        """The image the entry at `entry` was encoded from."""
        raise NoSpec("its source image is unknown (a bare cache; give the trainer's config)")

    def spec(self, image: str, replacing: str | None = None) -> EntrySpec:
        """The entry the trainer writes for `image` (in place of the entry `replacing`, when
        one is being replaced)."""
        raise NoSpec("this layout does not say how its trainer writes entries")


def container_of(meta: FileMeta) -> str | None:
    """zip, gzip, legacy, safetensors or npz; None for files of no latent container."""
    if meta.format == TORCH_ZIP:
        return GZIP if meta.compression == "gzip" else ZIP if meta.compression is None else None
    if meta.format == TORCH_LEGACY:
        return LEGACY if meta.compression is None else None
    return {SAFETENSORS: "safetensors", NPZ: "npz"}.get(meta.format) if meta.compression is None \
        else None


def neighbours(directory: str, suffix: str, exclude: Collection[str] = ()) -> Iterator[str]:
    """The files named `*<suffix>` in `directory` (not hidden, not excluded), in name order."""
    skip = {os.path.abspath(p) for p in exclude}
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if not name.startswith(".") and name.lower().endswith(suffix) and \
                os.path.abspath(path) not in skip:
            yield path


def healthy(directory: str, suffix: str, exclude: Collection[str] = ()) -> Iterator[FileMeta]:
    """The readable, safe files of a latent container among `neighbours(...)`."""
    for path in neighbours(directory, suffix, exclude):
        meta = read_path(path)
        if not meta.errors and not meta.unsafe_globals and container_of(meta) is not None:
            yield meta


def format_of(meta: FileMeta) -> EntryFormat:
    """The format of a healthy file that holds one latent and nothing image-specific besides."""
    name = os.path.basename(meta.path)
    kind = container_of(meta)
    if meta.errors or meta.unsafe_globals or kind is None:
        raise NoSpec(f"{name} is itself broken" if meta.errors or meta.unsafe_globals
                     else f"{name} is {meta.format}: no latent container")
    if len(meta.tensors) != 1 or meta.metadata:
        what = f"{len(meta.tensors)} tensors" if len(meta.tensors) != 1 else "header metadata"
        raise NoSpec(f"entries like {name} hold {what}: only the trainer's layout can write them")
    latent = meta.tensors[0]
    if len(latent.shape) not in (3, 4):
        raise NoSpec(f"{name} holds no [C, h, w] latent")
    if latent.path and kind in TORCH_CONTAINERS:
        raise NoSpec(f"entries like {name} are dicts, whose other values only the trainer's "
                     "layout knows")
    batch = len(latent.shape) == 4 and latent.shape[0] == 1
    return EntryFormat(kind, str(latent.path[0]) if latent.path else None, latent.dtype,
                       latent.shape[1] if batch else latent.shape[0], batch)


def neighbour_format(path: str, exclude: Collection[str] = ()) -> EntryFormat:
    """The format most healthy single-latent files beside `path` (same extension) share."""
    directory = os.path.dirname(path)
    ext = os.path.splitext(path)[1].lower()
    if not os.path.isdir(directory):
        raise NoSpec(f"cannot list {directory}: no such directory")
    found: collections.Counter[EntryFormat] = collections.Counter()
    reasons = []
    for neighbour in neighbours(directory, ext, {*exclude, path}):
        try:
            found[format_of(read_path(neighbour))] += 1
        except NoSpec as exc:
            reasons.append(str(exc))
        if sum(found.values()) >= NEIGHBOURS_READ:
            break
    if not found:
        raise NoSpec(reasons[0] if reasons else f"no healthy {ext or 'cache'} file beside it "
                     "to take the format from")
    return found.most_common(1)[0][0]


def only(held: Iterable[str], made: Collection[str], entries: str) -> None:
    """NoSpec unless the entries hold nothing beside what cachedoctor makes."""
    others = sorted(set(held) - set(made))
    if others:
        raise NoSpec(f"its {entries} also hold {', '.join(others)}: cachedoctor makes "
                     f"{', '.join(sorted(made))} only")


def most_common(values: Iterable[Any], what: str) -> Any:
    """The value most of the first NEIGHBOURS_READ `values` share; NoSpec naming `what` if none."""
    found: collections.Counter[Any] = collections.Counter()
    for value in values:
        found[value] += 1
        if sum(found.values()) >= NEIGHBOURS_READ:
            break
    if not found:
        raise NoSpec(f"no healthy {what} beside it to take the format from")
    return found.most_common(1)[0][0]
