"""ai-toolkit: a job config (YAML, or JSON) with `config.process[].datasets[]`, as
ostris/ai-toolkit 27a03a91 (2026-08-21) reads it (toolkit/config_modules.py DatasetConfig,
toolkit/data_loader.py, toolkit/dataloader_mixins.py).

Paths: ai-toolkit is run as `python run.py config/<job>.yaml` from its own folder and opens
relative paths from there: a config in a `config/` folder resolves against that folder's
parent, any other config against its own folder.

Each dataset's `folder_path` is walked with its sub-folders (hidden ones and `_controls` are
skipped); with `cache_latents_to_disk`, each image's latent goes to
`<its folder>/_latent_cache/<stem>_<md5b64>.safetensors`: a `latent` tensor, and the latent
info dict in the header metadata (`filename`, `scale_to_width/height`, `crop_x/y`,
`crop_width/height`, `latent_space_version`, ...). The hash covers those values, so a changed
resolution or model writes new files beside the old ones. The bucket of a latent is its crop
size; its expected size is the crop size / 8 for the VAE families known to use factor 8.
Caches beside the images are by design (no CD401). A `resolution` list makes one dataset per
resolution (config_modules.py preprocess_dataset_raw_config), all caching into the same
folders: each image then has one entry per distinct bucket (toolkit/buckets.py).
A video dataset (`num_frames` > 1 or `auto_frame_count`, e.g. Wan) walks videos beside the
images; a clip's entry holds a 4-D `latent` [C, F, h, w] (and a 0-d `num_frames`), and its
bucket adds the frame count (`<w>x<h>x<n>f`), as ai-toolkit never batches clips with images.

Without a config (layouts/bare.py: an image folder holding `_latent_cache/`, a folder of them,
or a `_latent_cache/` itself) the naming is the same with `bare`. The header's `filename` still
pairs entries with images. An image needs an entry where its folder has a `_latent_cache/`. The
resolution list, which only the config holds, is read off the files: an image lacks a bucket
that images of its size have (`same_size_gaps`), and the finding says the config would tell.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cachedoctor.formats import read_path
from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.base import (
    CacheFacts,
    Dataset,
    DirectoryNaming,
    Layout,
    Naming,
    frozen,
)
from cachedoctor.layouts.common import Problems, ending, listdir, typed, unique, working_dir
from cachedoctor.layouts.entries import (
    Changes,
    Entries,
    EntryFormat,
    EntrySpec,
    Geometry,
    NoSpec,
    healthy,
    most_common,
    only,
)
from cachedoctor.layouts.paths import resolve
from cachedoctor.layouts.sources import ConfigFile, type_name

NAME = "ai-toolkit"
TITLE = "ai-toolkit"
LATENT_DIR = "_latent_cache"
TEXT_DIR = "_t_e_cache"
SKIPPED_DIRS = frozenset({LATENT_DIR, TEXT_DIR, "_clip_vision_cache", "_controls"})
# toolkit/data_loader.py image_extensions and video_extensions (matched lower-cased); a video
# dataset (num_frames > 1 or auto_frame_count) walks both
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".webm", ".mkv", ".wmv", ".m4v", ".flv")
FACTOR_8 = frozenset({"sd1", "sd2", "sdxl", "sd3", "flux1"})  # latent_space_version values


def claims(config: ConfigFile) -> bool:
    data = config.data
    if config.kind not in ("yaml", "json") or not isinstance(data, dict):
        return False
    inner = data.get("config")
    return isinstance(inner, dict) and isinstance(inner.get("process"), list)


def discover(folder: str) -> list[str]:
    found = []
    for where, suffixes in ((os.path.join(folder, "config"), (".yaml", ".yml", ".json")),
                            (folder, (".yaml", ".yml"))):
        found += [os.path.join(where, n) for n in listdir(where, ending(*suffixes))]
    return found


def _reason(root: str) -> str:
    return f"{root}, ai-toolkit's working dir (the folder that holds config/)"


def load(config: ConfigFile) -> Layout:
    problems = Problems()
    root = working_dir(config.path, "config")
    found = []
    for p, process in enumerate(config.data["config"]["process"]):
        where = ("config", "process", p)
        if not isinstance(process, dict):
            problems.invalid(config.origin(*where), f"config.process[{p}] is "
                             f"{type_name(process)}: expected a mapping")
            continue
        datasets = typed(config, problems, where, process, "datasets", list, [])
        train = process.get("train") if isinstance(process.get("train"), dict) else {}
        for d, dataset in enumerate(datasets):
            at = (*where, "datasets", d)
            if not isinstance(dataset, dict):
                problems.invalid(config.origin(*at), f"config.process[{p}].datasets[{d}] is "
                                 f"{type_name(dataset)}: expected a mapping")
                continue
            folder = typed(config, problems, at, dataset, "folder_path", str, None)
            if folder is None:
                if dataset.get("folder_path") is None and dataset.get("dataset_path") is None:
                    problems.invalid(config.origin(*at), f"config.process[{p}].datasets[{d}] has "
                                     "no folder_path: expected the path of its image folder",
                                     key="folder_path")
                continue  # a dataset_path JSON of captions: no folder to walk
            found.append((at, folder, dataset, train))
    ids = unique(os.path.basename(os.path.normpath(f)) or f for _, f, _, _ in found)
    out = []
    for ident, (at, folder, dataset, train) in zip(ids, found, strict=True):
        directory = resolve(root, folder)
        origin = config.origin(*at, "folder_path")
        if not os.path.isdir(directory):
            problems.missing(origin, "folder_path", folder, directory, _reason(root), ident)
        to_disk = typed(config, problems, at, dataset, "cache_latents_to_disk", bool, False, ident)
        text = typed(config, problems, at, dataset, "cache_text_embeddings", bool,
                     bool(train.get("cache_text_embeddings", False)), ident)
        resolution = typed(config, problems, at, dataset, "resolution", (int, list), 512, ident,
                           "a size such as 1024 or a list of sizes")
        buckets = _buckets(dataset, resolution)
        frames = typed(config, problems, at, dataset, "num_frames", int, 1, ident)
        videos = frames > 1 or typed(config, problems, at, dataset, "auto_frame_count", bool,
                                     False, ident)
        incomplete = _incomplete(directory, buckets) if to_disk and buckets is not None \
            and len(buckets.resolutions) > 1 else {}
        out.append(Dataset(
            ident, image_dirs=(directory,), latent_cache_dir=os.path.join(directory, LATENT_DIR),
            text_cache_dir=os.path.join(directory, TEXT_DIR), caches_beside_images=True,
            options=frozen({"cache_latents_to_disk": to_disk, "cache_text_embeddings": text}),
            origins=frozen({"image_dir": origin, "dataset": config.origin(*at)}),
            naming=AIToolkitNaming(directory, expects_cache=to_disk, buckets=buckets,
                                   incomplete=frozen(incomplete), videos=videos),
        ))
    return Layout(NAME, config.path, tuple(out), tuple(problems.items), (config.path,), root,
                  _reason(root))


@dataclass(frozen=True)
class AIToolkitNaming(Naming):
    """ai-toolkit's `_latent_cache/<stem>_<hash>.safetensors` naming."""

    root: str  # the dataset's folder_path (a bare scan: the image folder or folder of them)
    expects_cache: bool = True
    buckets: Buckets | None = None  # the dataset's bucket settings (None for a bare cache)
    # multi-resolution datasets: image key -> the buckets ("WxH") of the resolutions whose entry
    # is missing, for images that have the entry of some other resolution
    incomplete: Mapping[str, tuple[str, ...]] = field(default_factory=frozen)
    # no job config (layouts/bare.py): images need entries where their folder has a
    # `_latent_cache`; a missing bucket is one that images of the same size have (`same_size_gaps`);
    # each `_latent_cache` folder is a group of its own for the dataset rules
    bare: bool = False
    # a video dataset (num_frames > 1 or auto_frame_count): its clips are sources too. A bare
    # scan counts clips beside a `_latent_cache` as sources that need no entry (the config says
    # whether the dataset trains them)
    videos: bool = False

    def entries(self, dataset: Dataset, changes: Changes) -> Entries:
        return _Entries(changes, self)

    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return _Directory(self, path)

    def expected_entry(self, image: str) -> str:
        stem = os.path.splitext(os.path.basename(image))[0]
        return f"{LATENT_DIR}/{stem}_<hash>.safetensors"

    def missing_text(self, image: str, cache_dir: str) -> str:
        missing = self.incomplete.get(self.key(image))
        buckets = f"{' and '.join(missing)} bucket{'s' * (len(missing) > 1)}" if missing else ""
        if missing and self.bare:
            return (f"no {LATENT_DIR} entry for its {buckets}, though it has another bucket's "
                    "and the images of the same size have one (a scan without the job config, "
                    "which lists the resolutions: give it to be sure)")
        if missing:
            return (f"no {LATENT_DIR} entry for its {buckets} (one resolution of the dataset's "
                    "list), though it has another resolution's")
        if self.bare:
            return (f"expected {self.expected_entry(image)} beside it, with its name in the "
                    "header (one per resolution: which ones, only the job config says)")
        return f"expected {self.expected_entry(image)} beside it, with its name in the header"

    def key(self, image: str) -> str:
        rel = os.path.relpath(image, self.root)
        return rel.replace(os.sep, "/")


class _Directory(DirectoryNaming):
    def __init__(self, naming: AIToolkitNaming, path: str) -> None:
        super().__init__()
        self.naming = naming
        self.in_latents = os.path.basename(path) == LATENT_DIR
        rel = os.path.relpath(os.path.dirname(path) if self.in_latents else path, naming.root)
        parts = [] if rel == "." else rel.split(os.sep)
        # ai-toolkit skips hidden folders and _controls; cache folders hold no images
        self.skipped = any(p.startswith(".") or p in SKIPPED_DIRS or p == ".." for p in parts)
        self.prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        self.expects = naming.expects_cache
        self.keyed = True
        if naming.videos or naming.bare:
            self.source_suffixes = VIDEO_EXTENSIONS
        if naming.bare:
            # without the config, images need entries only where their folder has a cache, and
            # a cache whose folder holds no image at all (copied away from its images) is judged
            # file by file: its entries are no orphans of images it never had
            self.expects = not self.in_latents and os.path.isdir(os.path.join(path, LATENT_DIR))
            self.group = path if self.in_latents else None
            if self.in_latents:
                parent = os.path.dirname(path)
                try:
                    self.keyed = _holds_images(parent, os.stat(parent).st_mtime_ns)
                except OSError:
                    self.keyed = False

    def image(self, name: str) -> tuple[str, bool] | None:
        if self.in_latents or self.skipped or name.startswith("."):
            return None
        lower = name.lower()
        if lower.endswith(VIDEO_EXTENSIONS) and (self.naming.videos or self.naming.bare):
            return self.prefix + name, self.expects and not self.naming.bare
        if not lower.endswith(IMAGE_EXTENSIONS):
            return None
        key = self.prefix + name
        if key in self.naming.incomplete:  # one of its resolutions' entries is missing: CD404
            return f"{key}@{','.join(self.naming.incomplete[key])}", self.expects
        return key, self.expects

    def facts_of_its_own(self, name: str) -> bool:
        # bare, whether a cache's entries are keyed depends on its image folder's listing
        return not (self.naming.bare and self.in_latents)

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        if not self.in_latents or not name.endswith(".safetensors"):
            return CacheFacts()
        facts = header_facts(meta, self.prefix)
        if not self.keyed:
            return facts._replace(key=None)
        if facts.key in self.naming.incomplete:
            return facts._replace(key=None)  # its image is reported missing another entry
        return facts


@functools.lru_cache(maxsize=256)
def _holds_images(folder: str, _mtime_ns: int) -> bool:
    """Whether `folder` holds an image ai-toolkit would cache (stops at the first). Per worker,
    once per folder as it is (the mtime in the key): each batch of a big cache would ask again."""
    try:
        with os.scandir(folder) as found:
            return any(e.name.lower().endswith(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)
                       and not e.name.startswith(".")
                       for e in found)
    except OSError:
        return False


def header_facts(meta: FileMeta, prefix: str = "") -> CacheFacts:
    """Key, bucket and expected size from an ai-toolkit latent's header metadata."""
    info = meta.metadata
    filename = info.get("filename")
    key = prefix + filename if filename else None
    try:
        width, height = int(info["crop_width"]), int(info["crop_height"])
    except (KeyError, ValueError):
        return CacheFacts(key=key)
    family = info.get("latent_space_version")
    expected = (height // 8, width // 8) if family in FACTOR_8 else None
    lacks = None
    if meta.tensors and not any(t.path == ("latent",) for t in meta.tensors):
        # get_latent (dataloader_mixins.py, 27a03a91) reads state_dict['latent'] of any entry
        # that exists: KeyError. Its other tensors (the pixel `tensor`) are no latent: () shape.
        lacks = "latent"
    return CacheFacts(key=key, bucket=f"{width}x{height}{_frames(meta)}", expected=expected,
                      family=family, lacks=lacks, shape=() if lacks else None)


def _frames(meta: FileMeta) -> str:
    """A clip's part of its bucket: ai-toolkit buckets a video dataset's items by crop size and
    frame count (BucketsMixin.setup_buckets), so clips never share a batch with the dataset's
    images (one frame) or with clips of another count. The count is `num_frames` in the header;
    with auto_frame_count it is per clip and not in the header, so the latent's frame axis
    stands for it."""
    info = meta.metadata
    if info.get("num_frames"):
        return f"x{info['num_frames']}f"
    if info.get("auto_frame_count") == "true":
        latent = next((t for t in meta.tensors if t.path == ("latent",)), None)
        if latent is not None and len(latent.shape) == 4:
            return f"x{latent.shape[1]} latent frames"
        return "x? frames"
    return ""


# -- buckets (toolkit/buckets.py, dataloader_mixins.py BucketsMixin.setup_buckets) -------------


class Buckets(NamedTuple):
    """What decides an ai-toolkit dataset's buckets. ai-toolkit splits a dataset whose
    `resolution` is a list into one dataset per resolution (config_modules.py
    preprocess_dataset_raw_config), all caching into the same `_latent_cache`: an image has one
    entry per distinct bucket of those resolutions."""

    resolutions: tuple[int, ...]
    tolerance: int = 64  # bucket_tolerance: the divisibility of bucket sides
    scale: float = 1.0
    square: bool = False  # square_crop

    def crops(self, size: tuple[int, int]) -> list[tuple[int, int]]:
        """The distinct (crop width, crop height) of an image of `size`, by resolution."""
        return list(dict.fromkeys(self.geometry(size, r)[4:] for r in self.resolutions))

    def geometry(self, size: tuple[int, int], resolution: int) -> tuple[int, int, int, int, int, int]:
        """(scale_to_width, scale_to_height, crop_x, crop_y, crop_width, crop_height) with the
        centre crop, as setup_buckets computes them."""
        width, height = int(size[0] * self.scale), int(size[1] * self.scale)
        if self.square:
            factor = max(resolution / width, resolution / height)
            to_w, to_h = math.ceil(width * factor), math.ceil(height * factor)
            x = int(to_w / 2 - resolution / 2) if width > height else 0
            y = 0 if width > height else int(to_h / 2 - resolution / 2)
            return to_w, to_h, x, y, resolution, resolution
        crop_w, crop_h = bucket_for(width, height, resolution, self.tolerance)
        factor = max(crop_w / width, crop_h / height)
        to_w, to_h = math.ceil(width * factor), math.ceil(height * factor)
        return to_w, to_h, int((to_w - crop_w) / 2), int((to_h - crop_h) / 2), crop_w, crop_h


def bucket_for(width: int, height: int, resolution: int, divisibility: int) -> tuple[int, int]:
    """toolkit/buckets.py get_bucket_for_image_size: the sides, multiples of `divisibility`,
    whose area is nearest the image's capped at resolution², never above that cap."""
    total, cap = width * height, resolution * resolution
    target = min(total, cap)
    scaler = (target / total) ** 0.5
    w_raw, h_raw = width * scaler / divisibility, height * scaler / divisibility
    candidates = [(math.floor(w_raw) * divisibility, math.floor(h_raw) * divisibility),
                  (math.floor(w_raw) * divisibility, math.ceil(h_raw) * divisibility),
                  (math.ceil(w_raw) * divisibility, math.floor(h_raw) * divisibility),
                  (math.ceil(w_raw) * divisibility, math.ceil(h_raw) * divisibility)]
    capped = [(w, h) for w, h in candidates if w > 0 and h > 0 and w * h <= cap]
    if not capped:
        capped = [(max(divisibility, math.floor(w_raw) * divisibility),
                   max(divisibility, math.floor(h_raw) * divisibility))]
    return min(capped, key=lambda wh: abs(wh[0] * wh[1] - target))


def _buckets(dataset: Mapping[str, Any], resolution: object) -> Buckets | None:
    """The dataset's bucket settings, or None where a value is not what ai-toolkit takes."""
    values = resolution if isinstance(resolution, list) else [resolution]
    tolerance, scale = dataset.get("bucket_tolerance", 64), dataset.get("scale", 1.0)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                             for v in values) \
            or not isinstance(tolerance, int) or isinstance(tolerance, bool) or tolerance <= 0 \
            or not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
        return None
    return Buckets(tuple(values), tolerance, float(scale), dataset.get("square_crop") is True)


def _incomplete(directory: str, buckets: Buckets) -> dict[str, tuple[str, ...]]:
    """Image key -> the buckets ("WxH") it has no entry for, for images that have an entry of
    some bucket (an image with none is plainly missing). Reads image and safetensors headers."""
    from cachedoctor import images

    out: dict[str, tuple[str, ...]] = {}
    for folder, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS)
        latent_dir = os.path.join(folder, LATENT_DIR)
        present: dict[str, set[tuple[int, int]]] = {}
        try:
            latents = sorted(n for n in os.listdir(latent_dir) if n.endswith(".safetensors"))
        except OSError:  # none, or unreadable: the file rules say so
            continue
        for name in latents:
            info = read_path(os.path.join(latent_dir, name)).metadata
            try:
                crop = (int(info["crop_width"]), int(info["crop_height"]))
            except (KeyError, ValueError):
                continue
            present.setdefault(str(info.get("filename")), set()).add(crop)
        if not present:
            continue
        rel = os.path.relpath(folder, directory)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for name in sorted(names):
            if name.startswith(".") or not name.lower().endswith(IMAGE_EXTENSIONS) \
                    or name not in present:
                continue
            try:
                size = images.size(os.path.join(folder, name), oriented=True)
            except (OSError, ValueError):
                continue
            missing = [c for c in buckets.crops(size) if c not in present[name]]
            if missing:
                out[prefix + name] = tuple(f"{w}x{h}" for w, h in missing)
    return out


def same_size_gaps(directory: str, recursive: bool = True) -> dict[str, tuple[str, ...]]:
    """A bare scan's `incomplete` (no config, so no resolution list): image key -> the buckets
    ("WxH") that images of the same size and latent space have an entry for and it has not, for
    images with an entry of that latent space. ai-toolkit's bucket of an image follows from its
    size and the dataset's settings only, so images of one size share their buckets. Reads the
    headers only of folders where some stem has several entries (known from the names), and
    image headers only of images with entries there."""
    from cachedoctor import images

    out: dict[str, tuple[str, ...]] = {}
    for folder, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if recursive and not d.startswith(".")
                         and d not in SKIPPED_DIRS)
        latent_dir = os.path.join(folder, LATENT_DIR)
        try:  # os.listdir: layouts' shared listings keep no .safetensors names
            latents = sorted(n for n in os.listdir(latent_dir) if n.endswith(".safetensors"))
        except OSError:  # none, or unreadable: the file rules say so
            continue
        stems = [m["stem"] for m in map(HASHED_NAME.match, latents) if m is not None]
        if len(set(stems)) == len(stems):  # one entry per image: no resolution list to recover
            continue
        present: dict[tuple[str, str], set[tuple[int, int]]] = {}
        for name in latents:
            try:
                info = read_path(os.path.join(latent_dir, name)).metadata
                crop = (int(info["crop_width"]), int(info["crop_height"]))
            except (KeyError, ValueError, OSError):  # the file rules judge it
                continue
            key = (str(info.get("filename")), str(info.get("latent_space_version")))
            present.setdefault(key, set()).add(crop)
        here = set(names)
        sizes: dict[str, tuple[int, int]] = {}
        shared: dict[tuple[tuple[int, int], str], set[tuple[int, int]]] = {}
        for (name, family), crops in present.items():
            if name not in here or not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            try:
                size = sizes.get(name) or images.size(os.path.join(folder, name), oriented=True)
            except (OSError, ValueError):
                continue
            sizes[name] = size
            shared.setdefault((size, family), set()).update(crops)
        rel = os.path.relpath(folder, directory)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for (name, family), crops in sorted(present.items()):
            if name in sizes:
                missing = sorted(shared[(sizes[name], family)] - crops)
                if missing:
                    out[prefix + name] = tuple(dict.fromkeys(
                        (*out.get(prefix + name, ()), *(f"{w}x{h}" for w, h in missing))))
    return out


# -- entries (fix --reencode) ------------------------------------------------------------------

HASHED_NAME = re.compile(r"^(?P<stem>.+)_(?P<hash>[A-Za-z0-9_-]{22})\.safetensors$")
STRINGS = frozenset({"filename", "latent_space_version"})  # info values that are strings
GEOMETRY = ("scale_to_width", "scale_to_height", "crop_x", "crop_y", "crop_width", "crop_height")
HEADER_ONLY = frozenset({"software", "format"})  # metadata.py adds these beside the info dict


def latent_hash(info: Mapping[str, Any]) -> str:
    """The `<hash>` of `<stem>_<hash>.safetensors`: urlsafe base64 of the md5 of the latent info
    dict's sorted JSON, without padding (dataloader_mixins.py `get_latent_path`)."""
    import hashlib  # here, not at the top: OpenSSL's import is 3 ms of every scan's start

    digest = hashlib.md5(json.dumps(dict(info), sort_keys=True).encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").replace("=", "")


class _Template(NamedTuple):
    """An entry's latent info dict (as ai-toolkit hashed it) and its header metadata."""

    info: dict[str, Any]
    metadata: dict[str, str]


def _template(meta: FileMeta) -> _Template | None:
    """The info dict a header holds, when hashing it gives the file's own name (so it is
    rebuilt exactly: strings, numbers and flags as ai-toolkit had them); else None."""
    match = HASHED_NAME.match(os.path.basename(meta.path))
    metadata = dict(meta.metadata)
    if match is None or not metadata.get("filename"):
        return None
    info: dict[str, Any] = {}
    for key, value in metadata.items():
        if key in HEADER_ONLY:
            continue
        try:
            info[key] = value if key in STRINGS else json.loads(value)
        except (ValueError, RecursionError):  # the cache's text: any string, nested past json's reach
            info[key] = value
    geometry = [info.get(k) for k in ("scale_to_width", "scale_to_height", "crop_x", "crop_y",
                                      "crop_width", "crop_height")]
    if latent_hash(info) != match["hash"] or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in geometry):
        return None
    return _Template(info, metadata)


def _fits(info: Mapping[str, Any], size: tuple[int, int]) -> bool:
    """Whether ai-toolkit's scale and crop of an info dict are what it computes for an image of
    `size` in the same bucket (BucketsMixin.setup_buckets): scaled up to cover the crop, the
    crop inside (in the centre, or anywhere with random_crop)."""
    width, height = size
    crop_w, crop_h = info["crop_width"], info["crop_height"]
    scale = max(crop_w / width, crop_h / height)
    scaled = (math.ceil(width * scale), math.ceil(height * scale))
    return (info["scale_to_width"], info["scale_to_height"]) == scaled and crop_w > 0 \
        and crop_h > 0 and 0 <= info["crop_x"] <= scaled[0] - crop_w \
        and 0 <= info["crop_y"] <= scaled[1] - crop_h


class _Entries(Entries):
    """ai-toolkit's latent cache (dataloader_mixins.py `LatentCachingMixin`):
    `<image dir>/_latent_cache/<stem>_<hash>.safetensors`, a `latent` tensor (scaled and shifted,
    in the model's dtype) and the latent info dict in the header. ai-toolkit's bucket of an image
    (its scale_to_* and crop_*) depends on the image's size and the dataset's settings only, so
    it is taken from the entry being replaced (when its header still fits the image) or from a
    healthy entry of an image of the same size; the hash in the name follows from the info."""

    def __init__(self, changes: Changes, naming: AIToolkitNaming | None = None) -> None:
        super().__init__(changes)
        self.buckets = naming.buckets if naming is not None else None
        self.naming = naming

    def source(self, entry: str) -> str:
        parent = os.path.dirname(os.path.dirname(entry))
        filename = read_path(entry).metadata.get("filename")
        if filename and os.path.basename(filename) == filename \
                and os.path.isfile(os.path.join(parent, filename)):
            return os.path.join(parent, filename)
        match = HASHED_NAME.match(os.path.basename(entry))
        found = [n for n in listdir(parent) if n.lower().endswith(IMAGE_EXTENSIONS)
                 and match is not None and os.path.splitext(n)[0] == match["stem"]]
        if len(found) != 1:
            raise NoSpec("no image of its name beside its _latent_cache" if not found else
                         f"{' and '.join(found)} share its name: rename one")
        return os.path.join(parent, found[0])

    def spec(self, image: str, replacing: str | None = None) -> EntrySpec:
        from cachedoctor import images

        if image.lower().endswith(VIDEO_EXTENSIONS):
            raise NoSpec("a clip of a video dataset: cachedoctor encodes no videos")
        size = images.size(image, oriented=True)  # exif_transpose'd (data_loader.py)
        latent_dir = os.path.join(os.path.dirname(image), LATENT_DIR)
        template = _template(read_path(replacing)) if replacing is not None else None
        if self.buckets is not None and len(self.buckets.resolutions) > 1:
            template = self._resolution(image, size, latent_dir, replacing, template)
        elif template is None or not _fits(template.info, size):
            template = self._of_same_size(image, size, latent_dir, replacing)
        if template is None:
            raise NoSpec(f"no healthy entry of a {size[0]}x{size[1]} image beside it to take "
                         "ai-toolkit's bucket (scale and crop) from")
        name = os.path.basename(image)
        info = {**template.info, "filename": name}
        family = info.get("latent_space_version")
        if family not in FACTOR_8:
            raise NoSpec(f"latent_space_version {family!r}: cachedoctor knows the VAE factor of "
                         f"{', '.join(sorted(FACTOR_8))}")
        dtype, channels = self._format(latent_dir)
        stem = os.path.splitext(name)[0]
        path = os.path.join(latent_dir, f"{stem}_{latent_hash(info)}.safetensors")
        geometry = Geometry(size, (info["scale_to_width"], info["scale_to_height"]),
                            (info["crop_x"], info["crop_y"], info["crop_width"],
                             info["crop_height"]), "bicubic",
                            flip_x=info.get("flip_x") is True, flip_y=info.get("flip_y") is True,
                            oriented=True)
        fmt = EntryFormat("safetensors", "latent", dtype, channels, scaled=True,
                          metadata={**template.metadata, "filename": name})
        return EntrySpec(image, path, fmt, geometry, geometry.latent_size(8))

    def _resolution(self, image: str, size: tuple[int, int], latent_dir: str,
                    replacing: str | None, template: _Template | None) -> _Template:
        """A multi-resolution dataset: the template of the entry of one resolution, its scale
        and crop as ai-toolkit computes them for that resolution. A replaced entry is the one
        whose name's hash that resolution's info gives; a missing one, the first bucket the
        image has no entry for. The other values come from a healthy entry of the folder."""
        assert self.buckets is not None and self.naming is not None
        base = template or next(iter(self._same_size(latent_dir).values()), (None,))[0] \
            or next(iter(self._any(latent_dir)), None)
        if base is None:
            raise NoSpec("no healthy entry beside it to take ai-toolkit's latent info from")
        name = os.path.basename(image)
        made = []
        for resolution in self.buckets.resolutions:
            values = dict(zip(GEOMETRY, self.buckets.geometry(size, resolution), strict=True))
            info = {**base.info, **values, "filename": name}
            made.append((f"{values['crop_width']}x{values['crop_height']}", info))
        if replacing is not None:
            match = HASHED_NAME.match(os.path.basename(replacing))
            found = [info for _, info in made if match and latent_hash(info) == match["hash"]]
            if not found:
                raise NoSpec(f"no resolution of the dataset's {list(self.buckets.resolutions)} "
                             "gives its name's hash: which one it was is not known")
        else:
            missing = self.naming.incomplete.get(self.naming.key(image), ())
            found = [info for bucket, info in made if not missing or bucket in missing]
        info = found[0]
        metadata = {**base.metadata, **{k: str(info[k]) for k in (*GEOMETRY, "filename")}}
        return _Template(info, metadata)

    def _of_same_size(self, image: str, size: tuple[int, int], latent_dir: str,
                      replacing: str | None) -> _Template | None:
        """The template of a healthy entry of an image of the same size (ai-toolkit's scale and
        crop follow from the size). Where such images have entries of several buckets (several
        resolutions), a replaced entry's is the bucket whose info gives its name's hash, a
        missing one's the bucket its image lacks (`AIToolkitNaming.incomplete`)."""
        found = self._same_size(latent_dir).get(size, ())
        if len(found) < 2:
            return found[0] if found else None
        name = os.path.basename(image)
        if replacing is not None:
            match = HASHED_NAME.match(os.path.basename(replacing))
            hashed = [t for t in found if match is not None
                      and latent_hash({**t.info, "filename": name}) == match["hash"]]
            if not hashed:
                raise NoSpec(f"images of its size have entries of {len(found)} buckets and none "
                             "gives its name's hash: which one it was is not known")
            return hashed[0]
        missing = self.naming.incomplete.get(self.naming.key(image), ()) if self.naming else ()
        return next((t for t in found if _bucket(t) in missing), found[0])

    def _any(self, latent_dir: str) -> list[_Template]:
        return self.once(("any", latent_dir), lambda: list(filter(None, (
            _template(m) for m in healthy(latent_dir, ".safetensors", self.unlike)))))

    def _same_size(self, latent_dir: str) -> dict[tuple[int, int], tuple[_Template, ...]]:
        """Image size -> the info of a healthy entry of an image of that size, one per bucket."""
        return self.once(("sizes", latent_dir), lambda: _templates_by_size(latent_dir, self.unlike))

    def _format(self, latent_dir: str) -> tuple[str, int]:
        """(dtype, channels) of the `latent` most healthy entries share."""
        dtype, channels, others = self.once(latent_dir, lambda: most_common(filter(None, (
            _latent_format(m) for m in healthy(latent_dir, ".safetensors", self.unlike))),
            "latent file"))
        only(others, {"latent"}, "entries")
        return dtype, channels


def _bucket(template: _Template) -> str:
    return f"{template.info['crop_width']}x{template.info['crop_height']}"


def _templates_by_size(latent_dir: str, unlike: frozenset[str]
                       ) -> dict[tuple[int, int], tuple[_Template, ...]]:
    """(width, height) of an image -> healthy entries' templates that fit images of that size,
    the first of each bucket (crop size), in name order."""
    from cachedoctor import images

    found: dict[tuple[int, int], dict[str, _Template]] = {}
    for meta in healthy(latent_dir, ".safetensors", unlike):
        template = _template(meta)
        if template is None:
            continue
        try:
            size = images.size(os.path.join(os.path.dirname(latent_dir), template.info["filename"]),
                               oriented=True)
        except (OSError, ValueError):
            continue
        if _fits(template.info, size):
            found.setdefault(size, {}).setdefault(_bucket(template), template)
    return {size: tuple(by_bucket.values()) for size, by_bucket in found.items()}


def _latent_format(meta: FileMeta) -> tuple | None:
    latent = next((t for t in meta.tensors if t.path == ("latent",)), None)
    if latent is None or len(latent.shape) != 3:
        return None
    others = tuple(sorted(str(t.path[0]) for t in meta.tensors if t.path))
    return latent.dtype, latent.shape[0], others
