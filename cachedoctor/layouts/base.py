"""What a trainer's configuration tells us: datasets, where their files live, how each cache
file maps to its image and bucket, and what was wrong with the configuration itself.

Everything here is frozen data built once by a layout module (layouts/<trainer>.py) and then
only read: by the engine (what to walk), by the worker processes (a dataset's Naming turns each
file into its coverage key, bucket and expected latent size) and by the rules.

Problems in a configuration are data too. A target that cannot be understood at all (a config
that is not valid JSON, TOML or YAML, an unreadable file) is a TargetError: exit code 2 with one
line naming the file, the place and what was expected. Everything else found while reading a
config that parses (a key of the wrong type, a dataset without `instance_data_dir`, an unset
`{env:VAR}`, a path that does not exist) is a ConfigProblem on the Layout, which rules CD408 and
CD409 report as findings pointing at the file and line; the rest of the config is still used.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from cachedoctor.formats.meta import FileMeta

if TYPE_CHECKING:
    from cachedoctor.layouts.entries import Changes, Entries


class TargetError(Exception):
    """A target cannot be scanned at all (missing, unreadable or unparsable config): exit 2."""


class FrozenMap(Mapping[Any, Any]):
    """A read-only mapping that pickles (MappingProxyType does not): layouts cross into worker
    processes, pickled where the platform has no fork."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[Any, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __reduce__(self):
        return (FrozenMap, (self._data,))


def frozen(mapping: Mapping[Any, Any] | None = None) -> Mapping[Any, Any]:
    return FrozenMap(mapping)


@dataclass(frozen=True)
class Origin:
    """Where a fact came from: a config file, the key as the user wrote it, and its line."""

    file: str
    key: str  # "vae_cache_clear_each_epoch", "datasets[0].subsets[1].image_dir"
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


MISSING_PATH = "missing-path"  # CD408
INVALID = "invalid"  # CD409
# Dataset.expected_device of a trainer that loads its cache with map_location=<its device>,
# whose device is not known (a OneTrainer cache scanned without its config)
ANY_DEVICE = "any"


@dataclass(frozen=True)
class ConfigProblem:
    """Something wrong in a config that parses; `message` says what was expected."""

    origin: Origin
    message: str
    kind: str = INVALID  # INVALID (CD409) or MISSING_PATH (CD408)
    dataset: str | None = None
    details: Mapping[str, Any] = field(default_factory=frozen)


class CacheFacts(NamedTuple):
    """What a trainer's naming says about one cache file."""

    key: str | None = None  # coverage key shared with the file's image; None: cannot tell
    bucket: str | None = None  # the aspect bucket whose latents must all share one shape
    expected: tuple[int, int] | None = None  # (h, w) the latent must have, in latent pixels
    family: str | None = None  # model family / architecture, when files of several coexist
    naming: str | None = None  # which naming scheme the file follows ("unhashed", "legacy")
    # the shape of the latent the trainer loads, where the file holds several (kohya's
    # multi-resolution keys) and its primary latent is not that one; () when it loads none from
    # this file (it encodes the image anew); None: the primary latent stands
    shape: tuple[int, ...] | None = None
    # a key the trainer reads from this file, trusting it as it is, that the file lacks (kohya's
    # `latents_flipped[_<h>x<w>]` with flip_aug under skip_cache_check); None: none is missing
    lacks: str | None = None


NO_FACTS = CacheFacts()

# The model family a text-encoder cache file's name tells: SimpleTuner `<md5>-<family>.pt`,
# kohya `<stem>_<arch>_te.npz` and SDXL's `<stem>_te_outputs.npz` (sd-scripts strategy_*.py),
# musubi-tuner `<item>_<arch>_te.safetensors` (dataset/cache_io.py).
# Files of two families side by side (kohya keeps them beside the images) are compared apart.
TEXT_FAMILY = re.compile(r"^[0-9a-f]{32}-(?P<family>[A-Za-z0-9_.]+)\.pt$"
                         r"|_(?P<arch>[a-z0-9]+)_te\.(?:npz|safetensors)$|(?P<sdxl>_te_outputs\.npz)$")


def text_family(name: str) -> str | None:
    """The model family in a text-encoder cache file's name, or None."""
    match = TEXT_FAMILY.search(name)
    if match is None:
        return None
    return match["family"] or match["arch"] or "sdxl"


class DirectoryNaming:
    """A Naming bound to one directory (made once per batch of files, in the worker).

    `group`: where a layout holds several datasets of its own (a bare tree: one per folder of
    cache files), the folder of the dataset this directory's files belong to; the dataset rules
    compare only files of one group. None: the layout's dataset is one group.

    `expected_device`: where this directory's trainer loads its tensors, when the folder itself
    shows a trainer the dataset does not (a OneTrainer cache deep in a bare tree: mgds maps every
    tensor to its train device, ANY_DEVICE). None: the dataset's expected_device stands.
    """

    group: str | None = None
    expected_device: str | None = None
    # lower-cased suffixes of sources that are no images (an ai-toolkit video dataset's clips):
    # image() is asked about those files too
    source_suffixes: tuple[str, ...] = ()

    def __init__(self, bucket: str | None = None) -> None:
        self.bucket = bucket

    def images_belong(self) -> bool:
        """Whether a trainer keeps its caches beside the images in this directory of a cache
        dir (kohya's npz, ai-toolkit's `_latent_cache/`): its images and captions are then the
        trainer's, walked as an image dir's are, no foreign files."""
        return False

    def image(self, name: str) -> tuple[str, bool] | None:
        """(coverage key, whether the trainer expects a cache entry for it) for an image of
        the dataset, or None when this file is no image of the dataset."""
        return None

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        """The facts of a latent cache file; by default its folder is its bucket."""
        return CacheFacts(bucket=self.bucket)

    def facts_of_its_own(self, name: str) -> bool:
        """Whether cache() tells a latent's facts from its name, its content and the dataset
        alone: the incremental index keeps a verdict only while the file's stat is unchanged,
        so facts read from another file (kohya's legacy npz takes its bucket from its image)
        must be made afresh every scan."""
        return True


@dataclass(frozen=True)
class Naming:
    """How a trainer names its cache files. The base class: no images, folder buckets.

    A trainer's subclass is a frozen dataclass holding what its mapping needs (dirs, bucket
    metadata) and must stay picklable: the workers get it once, at start-up.
    """

    stem_collisions = False  # two images differing only by extension map to one cache entry

    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return DirectoryNaming(bucket)

    def expected_entry(self, image: str) -> str:
        """How the cache entry of `image` is named, for messages."""
        return "a cache entry"

    def missing_text(self, image: str, cache_dir: str) -> str:
        """What is missing for `image`, for CD404's message."""
        return f"expected {self.expected_entry(image)} in {cache_dir}"

    def entries(self, dataset: Dataset, changes: Changes) -> Entries | None:
        """How the trainer writes `dataset`'s entries, for `fix --reencode` (built at repair
        time, never in the scan's workers, knowing what the repair `changes` first); None where
        the layout cannot say."""
        return None


FOLDERS = Naming()


@dataclass(frozen=True)
class Dataset:
    """One dataset of a trainer config (a bare cache dir is one dataset too)."""

    id: str
    cache_dirs: tuple[str, ...] = ()  # walked as area "cache" (absolute)
    image_dirs: tuple[str, ...] = ()  # walked as area "images"; images are only stat'ed
    latent_cache_dir: str | None = None
    text_cache_dir: str | None = None
    caches_beside_images: bool = False  # kohya's npz, ai-toolkit's <img>/_latent_cache
    shallow_image_dirs: tuple[str, ...] = ()  # image dirs whose sub-folders the trainer ignores
    vae_factor: int = 8
    model_family: str | None = None
    processes: int = 1
    expected_device: str | None = None  # where the trainer loads cached tensors; None = cpu,
    # ANY_DEVICE: the trainer maps every tensor to its device on load, whichever that is
    cache_rebuilt_at_start: bool = False  # coverage does not matter: the trainer starts afresh
    options: Mapping[str, Any] = field(default_factory=frozen)  # trainer cache options
    origins: Mapping[str, Origin] = field(default_factory=frozen)  # fact or option -> origin
    naming: Naming = FOLDERS
    listed_images: frozenset[str] = frozenset()  # images the trainer's metadata lists (absolute)
    listing: Origin | None = None  # the metadata file that lists them

    def origin(self, fact: str) -> Origin | None:
        return self.origins.get(fact)

    def image_origin(self, image_dir: str) -> Origin | None:
        """Where `image_dir` was configured (datasets with several image dirs key them by
        path: "image_dir:<path>")."""
        return self.origins.get(f"image_dir:{image_dir}") or self.origins.get("image_dir")


@dataclass(frozen=True)
class Layout:
    """What one trainer config (or a bare cache) says: its datasets and its problems."""

    trainer: str  # "bare" when no trainer config was given
    source: str | None  # the config file the layout came from
    datasets: tuple[Dataset, ...]
    problems: tuple[ConfigProblem, ...] = ()
    files: tuple[str, ...] = ()  # every config file read (absolute)
    base: str | None = None  # the directory relative paths were resolved against
    base_reason: str = ""  # why that directory ("the trainer's working dir: the parent of config/")
