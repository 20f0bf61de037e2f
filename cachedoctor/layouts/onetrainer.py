"""OneTrainer: a training config JSON (`"__version"`, `cache_dir`, `concepts` or
`concept_file_name`), as Nerogar/OneTrainer 23df3832 (2026-08-19) with Nerogar/mgds 3a6994ad
reads it (modules/util/config/TrainConfig.py, ConceptConfig.py; mgds DiskCache.py).

Paths: OneTrainer opens every relative path (`cache_dir`, `concept_file_name`, concept `path`)
from its working dir, the OneTrainer folder, where the UI saves configs in
`training_presets/`. So a config in `<root>/training_presets/` resolves against `<root>`, any
other config against its own folder.

Cache: `<cache_dir>/image/<sha256>/variation-<n>/<i>.pt` (one dict per sample, keys as the
model's data loader names them: `latent_image` alone for SD 1.x/2.x, PixArt and Sana, with
`original_resolution` and `crop_offset` for SDXL, SD3, Flux and most others; before 474dd2c6,
2024-07-14, a `latent_image_distribution` in place of `latent_image`, whose mean is the latent,
see summary.primary_latent) and `aggregate.pt`
beside them, written last: a list whose item i holds `image_path` and `crop_resolution` (h, w)
of `<i>.pt`; the latent is crop / 8 but for Sana (crop / 32) and Wuerstchen/Stable Cascade
(not sized), by `model_type`. The group hash covers the concept's whole image config with defaults filled in, so
files are mapped to images through `aggregate.pt`, read with cachedoctor's restricted unpickler,
never torch.load. Text embeddings go to `<cache_dir>/text/...` with an aggregate of empty dicts.
mgds saves tensors from `train_device` without `.cpu()` and loads them with
`map_location=train_device`: whatever device a file was saved from, its tensors land on the
train device (no CD501, no CD502). With `clear_cache_before_training` (the default) and
`latent_caching`, the master process deletes `image/` and `text/` at every start
(GenericTrainer.__clear_cache), so missing, orphan or stale entries do not matter then.

Concepts: enabled ones, but those of `type` VALIDATION only with `validation` on (only the
validation data loader reads them). A concept none of whose images an aggregate.pt lists is
one mgds has yet to cache (at its loader's start): its images are expected of no entry.

One dataset per config (named after the config file): OneTrainer's concepts share one cache.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from cachedoctor.findings import display_path
from cachedoctor.formats.meta import FileMeta
from cachedoctor.formats.torch_object import ObjectError, read_object
from cachedoctor.layouts.base import (
    ANY_DEVICE,
    CacheFacts,
    Dataset,
    DirectoryNaming,
    Layout,
    Naming,
    frozen,
)
from cachedoctor.layouts.common import Problems, ending, listdir, typed, working_dir
from cachedoctor.layouts.entries import (
    Changes,
    Entries,
    EntryFormat,
    EntrySpec,
    Geometry,
    NoSpec,
    container_of,
    healthy,
    most_common,
    only,
)
from cachedoctor.layouts.paths import canonical, resolve, under
from cachedoctor.layouts.sources import ConfigFile
from cachedoctor.layouts.sources import load as load_config

NAME = "onetrainer"
TITLE = "OneTrainer"
KEYS = frozenset({"cache_dir", "concepts", "concept_file_name", "latent_caching",
                  "clear_cache_before_training", "train_device", "workspace_dir"})
VARIATION = re.compile(r"^variation-\d+$")
LISTED = "listed"  # CacheFacts.naming of a sample its folder's aggregate.pt lists
# mgds before a8e7480 (2023-12-16, "replace epochs with variations"; OneTrainer before 49e3ad38):
# DiskCache wrote `<cache_dir>/image/epoch-<n>/` and `text/epoch-<n>/` (n: the epoch modulo
# latent_caching_epochs), no group folder, the same `<i>.pt` and `aggregate.pt` in them
# (GenericDataLoaderModules.py DiskCache.__current_cache_dir; StableDiffusion*BaseDataLoader.py)
EPOCH = re.compile(r"^epoch-\d+$")
AREAS = ("image", "text")


def sample_folder(path: str) -> bool:
    """A folder of mgds DiskCache samples: `variation-<n>`, or before a8e7480 an `epoch-<n>`
    directly in the cache_dir's image/ or text/ folder."""
    base = os.path.basename(path)
    if VARIATION.match(base):
        return True
    return EPOCH.match(base) is not None and os.path.basename(os.path.dirname(path)) in AREAS
# mgds CollectPaths: the supported image types, and the masks/conditioning images beside them
IMAGE_EXTENSIONS = (".bmp", ".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp", ".jxl", ".avif")
NOT_SAMPLES = ("-masklabel", "-condlabel")
VAE_FACTOR = 8
# model_type -> the latent's downscale where it is not 8: Sana's DC-AE is 1/32
# (SanaBaseDataLoader.py masks at factor 0.03125); Wuerstchen and Stable Cascade encode a 0.75
# scaled image with EfficientNet at 1/32 (WuerstchenBaseDataLoader.py), no whole factor: None
VAE_FACTORS: dict[str, int | None] = {"SANA": 32, "WUERSTCHEN_2": None, "STABLE_CASCADE_1": None}
INPAINTING = frozenset({"STABLE_DIFFUSION_15_INPAINTING", "STABLE_DIFFUSION_20_INPAINTING",
                        "STABLE_DIFFUSION_XL_10_BASE_INPAINTING", "FLUX_FILL_DEV_1"})
# ConceptConfig `type`: DataLoaderMgdsMixin._create_mgds gives the training loader every other
# concept and the validation loader these; GenericTrainer makes that loader only with
# `validation` on, so with it off nothing caches or reads them
VALIDATION = "VALIDATION"
PRESETS = "training_presets"  # where the UI saves configs, in OneTrainer's working dir
SESSION = "#.json"  # the UI's last-session state, saved in PRESETS at every change
SUGGESTED = '"cache_dir": "workspace-cache/run"'  # OneTrainer's default


def claims(config: ConfigFile) -> bool:
    data = config.data
    # a shipped preset (training_presets/#<name>.json, in <Model>/ subfolders since 2025) holds
    # only what it changes, no __version nor cache_dir: train.py loads it over the defaults
    # (TrainConfig.default_values().from_dict), and every one names these four
    preset = {"base_model_name", "model_type", "training_method", "output_model_format"}
    return (config.kind == "json" and isinstance(data, dict)
            and (("__version" in data and bool(KEYS & data.keys()))
                 or {"cache_dir", "concept_file_name"} <= data.keys()
                 or preset <= data.keys()))


def discover(folder: str) -> list[str]:
    """Config JSONs at the top of the folder and the user's ones in training_presets/: those
    saved by name and `#.json`, the UI's last session (the only config of many projects).
    OneTrainer's shipped presets are the other `#<name>.json` files (TopBarController)."""
    found = [os.path.join(folder, n) for n in listdir(folder, ending(".json"))]
    presets = os.path.join(folder, PRESETS)
    found += [os.path.join(presets, n) for n in listdir(presets)
              if n.endswith(".json") and (n == SESSION or not n.startswith("#"))]
    return found


def _reason(root: str) -> str:
    return f"{root}, OneTrainer's working dir"


def load(config: ConfigFile) -> Layout:
    problems = Problems()
    data = config.data
    root = working_dir(config.path, PRESETS)
    ident = os.path.splitext(os.path.basename(config.path))[0]
    files = [config.path]

    def get(key: str, kind: type, default: object) -> object:
        return typed(config, problems, (), data, key, kind, default, ident)

    cache_value = get("cache_dir", str, "workspace-cache/run")
    cache_dir = resolve(root, str(cache_value))
    latent_caching = bool(get("latent_caching", bool, True))
    clear = bool(get("clear_cache_before_training", bool, True))
    train_device = str(get("train_device", str, "cuda"))
    temp_device = str(get("temp_device", str, "cpu"))
    multi_gpu = bool(get("multi_gpu", bool, False))
    model_type = str(get("model_type", str, ""))
    factor = VAE_FACTORS.get(model_type, VAE_FACTOR)
    sample_keys = loaded_keys(model_type, bool(get("masked_training", bool, False)))
    validation = bool(get("validation", bool, False))
    indexes = str(get("device_indexes", str, ""))
    processes = (len([i for i in indexes.split(",") if i.strip()]) or 2) if multi_gpu else 1
    concepts, concepts_file = _concepts(config, root, ident, problems)
    if concepts_file:
        files.append(concepts_file.path)
    image_dirs, shallow, concept_origins = [], [], {}
    concept_caches: dict[str, list[str]] = {}  # image dir -> its concepts' aggregate.pt files
    pairs: list[tuple[str, str]] = []  # (image variation folder, text aggregate.pt) of a concept
    for index, concept in enumerate(concepts or []):
        where = concepts_file or config
        at = (index,) if concepts_file else ("concepts", index)
        if not isinstance(concept, dict):
            problems.invalid(where.origin(*at), f"concept #{index + 1} is "
                             f"{type(concept).__name__}: expected an object", ident)
            continue
        if not typed(where, problems, at, concept, "enabled", bool, True, ident):
            continue
        if concept.get("type") == VALIDATION and not validation:
            continue  # only the validation data loader reads it, and it runs with validation on
        path = typed(where, problems, at, concept, "path", str, "", ident)
        name = concept.get("name") or f"#{index + 1}"
        if not path:
            problems.invalid(where.origin(*at, "path"), f"concept '{name}' has no path: expected "
                             "its image folder", ident, key="path")
            continue
        directory = resolve(root, path)
        origin = where.origin(*at, "path")
        if not os.path.isdir(directory):
            problems.missing(origin, f"concept '{name}' path", path, directory, _reason(root),
                             ident)
        image_dirs.append(directory)
        concept_origins[directory] = origin
        groups = _group_aggregates(cache_dir, concept)
        concept_caches.setdefault(directory, []).extend(groups["image"] + groups["text"])
        if len(groups["image"]) == len(groups["text"]) == 1:  # one variation each: paired by number
            pairs.append((os.path.dirname(groups["image"][0]), groups["text"][0]))
        if not typed(where, problems, at, concept, "include_subdirectories", bool, False, ident):
            shallow.append(directory)
    aggregates = read_aggregates(os.path.join(cache_dir, "image"), root)
    text_gone = _text_gone(aggregates, pairs)
    uncached = _uncached(image_dirs, concept_caches, aggregates)
    shared = _sharing(config.path, root, cache_dir) if clear and latent_caching else ()
    origins = {
        "latent_cache_dir": config.origin("cache_dir"),
        "text_cache_dir": config.origin("cache_dir"),
        "clear_cache_before_training": config.origin("clear_cache_before_training"),
        "image_dir": next(iter(concept_origins.values()), config.origin("concepts")),
        "dataset": config.origin(),
    }
    origins.update({f"image_dir:{d}": o for d, o in concept_origins.items()})
    if multi_gpu:
        origins["processes"] = config.origin("multi_gpu")
    dataset = Dataset(
        ident,
        cache_dirs=(os.path.join(cache_dir, "image"), os.path.join(cache_dir, "text")),
        image_dirs=tuple(image_dirs),
        shallow_image_dirs=tuple(shallow),
        latent_cache_dir=os.path.join(cache_dir, "image"),
        text_cache_dir=os.path.join(cache_dir, "text"),
        vae_factor=factor or VAE_FACTOR,
        processes=processes,
        expected_device=ANY_DEVICE,  # mgds loads with map_location=train_device
        cache_rebuilt_at_start=clear and latent_caching,
        options=frozen({"cache_dir": cache_dir, "latent_caching": latent_caching,
                        "clear_cache_before_training": clear, "multi_gpu": multi_gpu,
                        "train_device": train_device, "temp_device": temp_device,
                        "sample_keys": sample_keys,
                        "cache_shared_with": shared,
                        "suggest:latent_cache_dir": SUGGESTED, "suggest:text_cache_dir": SUGGESTED}),
        origins=frozen(origins),
        naming=OneTrainerNaming(aggregates=frozen(aggregates), expects_cache=latent_caching,
                                vae_factor=factor,
                                concept_caches=frozen({d: tuple(a) for d, a in concept_caches.items()}),
                                uncached=uncached,
                                text_gone=frozen(text_gone)),
    )
    return Layout(NAME, config.path, (dataset,), tuple(problems.items), tuple(files), root,
                  _reason(root))


def loaded_keys(model_type: str, masked_training: bool) -> tuple[str, ...]:
    """The tensors besides the latent that OneTrainer's data loader reads from every image
    sample (its `image_split_names`, modules/dataLoader/*BaseDataLoader.py `_cache_modules`):
    `latent_mask` with masked_training or an inpainting model type, and
    `latent_conditioning_image` for those model types (ModelType.has_mask_input,
    has_conditioning_image_input)."""
    keys = []
    if masked_training or model_type in INPAINTING:
        keys.append("latent_mask")
    if model_type in INPAINTING:
        keys.append("latent_conditioning_image")
    return tuple(keys)


def _concepts(config: ConfigFile, root: str, ident: str,
              problems: Problems) -> tuple[list | None, ConfigFile | None]:
    data = config.data
    inline = data.get("concepts")
    if inline is not None:
        if not isinstance(inline, list):
            problems.invalid(config.origin("concepts"), f"concepts is {type(inline).__name__}: "
                             "expected a list of concepts", ident, key="concepts")
            return None, None
        return inline, None
    name = typed(config, problems, (), data, "concept_file_name", str,
                 "training_concepts/concepts.json", ident)
    path = resolve(root, name)
    if not os.path.isfile(path):
        problems.missing(config.origin("concept_file_name"), "concept_file_name", name, path,
                         _reason(root), ident)
        return None, None
    concepts = load_config(path, "json")
    if not isinstance(concepts.data, list):
        problems.invalid(concepts.origin(), f"the concept file holds "
                         f"{type(concepts.data).__name__}: expected a list of concepts", ident)
        return None, concepts
    return concepts.data, concepts


def _sharing(path: str, root: str, cache_dir: str) -> tuple[str, ...]:
    """The other OneTrainer configs of this working dir that use the same cache_dir."""
    mine = canonical(cache_dir)
    found = []
    for other in discover(root) + discover(os.path.dirname(path)):
        if os.path.realpath(other) == os.path.realpath(path) or other in found:
            continue
        name = os.path.basename(other)
        if name.startswith("#") and name != SESSION:  # a shipped preset: a template, not a run
            continue
        try:
            config = load_config(other, "json")
        except Exception:  # a broken sibling is not what is being scanned
            continue
        if not claims(config):
            continue
        value = config.data.get("cache_dir", "workspace-cache/run")
        if isinstance(value, str) and canonical(resolve(working_dir(other, PRESETS), value)) == mine:
            found.append(other)
    return tuple(found)


def _text_gone(aggregates: Mapping[str, Samples], pairs: list[tuple[str, str]]) -> dict[str, str]:
    """Image -> its text-encoder sample, where the text folder's aggregate.pt lists that sample
    and its file is gone (mgds' get_item would raise FileNotFoundError). Both caches number a
    concept's samples alike (the same group indices), so text sample i is image sample i's."""
    out = {}
    for image_folder, text_aggregate in pairs:
        samples, listed = aggregates.get(image_folder), _listed(text_aggregate)
        if samples is None or listed is None:
            continue
        folder = os.path.dirname(text_aggregate)
        for index, (image, _) in enumerate(samples[:listed]):
            path = os.path.join(folder, f"{index}.pt")
            if image is not None and not os.path.lexists(path):
                out[image] = path
    return out


def _uncached(image_dirs: list[str], concept_caches: Mapping[str, list[str]],
              aggregates: Mapping[str, Samples]) -> tuple[str, ...]:
    """The concept folders mgds has yet to cache: no aggregate.pt of their group folders exists
    and none under image/ lists an image of theirs. mgds (DiskCache.__is_caching_done) caches
    such a concept's group at the start of its data loader, as it does a whole new cache: its
    images are no missing entries. A concept whose aggregate.pt lists some of its images is
    cached, and an image it does not list is one mgds never caches."""
    parents = {os.path.dirname(image) for samples in aggregates.values()
               for image, _ in samples if image is not None}
    return tuple(d for d in dict.fromkeys(image_dirs)
                 if not concept_caches.get(d) and not any(under(p, d) for p in parents))


def _group_aggregates(cache_dir: str, concept: dict) -> dict[str, list[str]]:
    """The aggregate.pt files of a concept's image and text cache folders that exist. mgds names
    a group folder by the sha256 of the compact sorted JSON of the concept values OneTrainer
    groups by (DiskCache.__string_key; DataLoaderText2ImageMixin: path, seed,
    include_subdirectories, and image or text); the concept as saved gives it where it holds
    every value (the UI saves them all)."""
    import hashlib

    found: dict[str, list[str]] = {"image": [], "text": []}
    for area, part, count in (("image", "image", "image_variations"),
                              ("text", "text", "text_variations")):
        values = [concept.get(k) for k in ("path", "seed", "include_subdirectories", part)]
        variations = concept.get(count, 1)
        if any(v is None for v in values) or not isinstance(variations, int):
            continue
        text = json.dumps(values, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
        group = os.path.join(cache_dir, area, hashlib.sha256(text.encode("utf-8")).hexdigest())
        found[area] += [a for n in range(max(variations, 1))
                        if os.path.isfile(a := os.path.join(group, f"variation-{n}", AGGREGATE))]
    return found


# -- aggregate.pt --------------------------------------------------------------------------------

Samples = tuple[tuple[str | None, tuple[int, int] | None], ...]


def read_aggregates(image_cache: str, root: str) -> dict[str, Samples]:
    """sample folder (`<group>/variation-<n>`, before mgds a8e7480 `epoch-<n>`) -> (image path,
    crop (h, w)) per sample index, from each aggregate.pt.

    A missing or unreadable aggregate.pt leaves its folder out: OneTrainer re-caches a folder
    without one, and a broken one is reported by the file rules (CD101).
    """
    out: dict[str, Samples] = {}
    top = glob.escape(image_cache)
    found = glob.glob(os.path.join(top, "*", "variation-*", AGGREGATE))
    found += glob.glob(os.path.join(top, "epoch-*", AGGREGATE))  # mgds before a8e7480
    for path in sorted(found):
        if not sample_folder(os.path.dirname(path)):
            continue
        entries = aggregate_entries(path, root)
        if entries is not None:
            out[os.path.dirname(path)] = entries
    return out


def aggregate_entries(path: str, root: str) -> Samples | None:
    try:
        obj = read_object(path)
    except (ObjectError, OSError):
        return None
    if not isinstance(obj, list):
        return None
    entries = []
    for item in obj:
        image, crop = None, None
        if isinstance(item, dict):
            raw = item.get("image_path")
            if isinstance(raw, str) and raw:
                image = resolve(root, raw)
            size = item.get("crop_resolution")
            if isinstance(size, tuple | list) and len(size) == 2 and all(
                    isinstance(v, int) and v > 0 for v in size):
                crop = (int(size[0]), int(size[1]))
        entries.append((image, crop))
    return tuple(entries)


# A cache scanned without its config has no model_type: its latent factor is the one most of
# its samples show, crop_resolution over the latent's size (8, or Sana's 32: mgds writes what
# the model's VAE made). Headers of at most FACTOR_SAMPLES samples, spread over the folders.
SEEN_FACTORS = (8, 16, 32)
FACTOR_SAMPLES = 32
LATENT_PATHS = (("latent_image",), ("latent_image_distribution", "mean"))  # before 474dd2c6


def seen_factor(aggregates: Mapping[str, Samples]) -> int:
    """The VAE factor most samples' latents have against their aggregate.pt crop_resolution;
    VAE_FACTOR where none tells (no readable sample, no whole factor, a tie)."""
    from collections import Counter

    from cachedoctor.formats import read_path

    listed = [(folder, i, crop) for folder, samples in sorted(aggregates.items())
              for i, (_, crop) in enumerate(samples) if crop is not None]
    step = max(1, len(listed) // FACTOR_SAMPLES)
    votes: Counter[int] = Counter()
    for folder, index, (crop_h, crop_w) in listed[::step][:FACTOR_SAMPLES]:
        try:
            meta = read_path(os.path.join(folder, f"{index}.pt"))
        except OSError:
            continue
        latent = next((t for t in meta.tensors if t.path in LATENT_PATHS), None)
        if meta.errors or latent is None or len(latent.shape) < 2:
            continue
        h, w = latent.shape[-2:]
        factor = crop_h // h if h and crop_h % h == 0 else None
        if factor in SEEN_FACTORS and w * factor == crop_w:
            votes[factor] += 1
    ranked = votes.most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return VAE_FACTOR
    return ranked[0][0]


@dataclass(frozen=True)
class OneTrainerNaming(Naming):
    """OneTrainer's naming: numbered samples per variation folder, mapped by aggregate.pt."""

    aggregates: Mapping[str, Samples]  # variation dir -> (image, crop) by sample index
    expects_cache: bool = True
    concept_caches: Mapping[str, tuple[str, ...]] = field(default_factory=frozen)
    text_gone: Mapping[str, str] = field(default_factory=frozen)  # image -> missing text sample
    vae_factor: int | None = VAE_FACTOR  # the model type's (VAE_FACTORS); None: not a whole one
    uncached: tuple[str, ...] = ()  # concept folders mgds has yet to cache (_uncached)

    def entries(self, dataset: Dataset, changes: Changes) -> Entries:
        return _Entries(self, changes)

    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return _Directory(self, path, area)

    @cached_property
    def listings(self) -> dict[str, str]:
        """image -> the sample file an aggregate.pt lists for it (the first, by folder)."""
        out: dict[str, str] = {}
        for folder, samples in sorted(self.aggregates.items()):
            for index, (image, _) in enumerate(samples):
                if image is not None:
                    out.setdefault(image, os.path.join(folder, f"{index}.pt"))
        return out

    def concept_aggregates(self, folder: str) -> tuple[str, ...]:
        """The aggregate.pt files (image and text) of the concept whose image cache holds the
        variation folder `folder`; () where the concept's group folders are not known."""
        mine = os.path.join(folder, AGGREGATE)
        return next((found for found in self.concept_caches.values() if mine in found), ())

    def expected_entry(self, image: str) -> str:
        listed = self.listings.get(image)
        return listed if listed is not None else "an entry in an aggregate.pt"

    def missing_text(self, image: str, cache_dir: str) -> str:
        text = self.text_gone.get(image)
        if text is not None:
            folder, name = os.path.split(text)
            return (f"its text-encoder sample {name} is missing from {display_path(folder)}, "
                    "whose aggregate.pt lists it")
        listed = self.listings.get(image)
        if listed is not None:  # mgds get_item opens it: FileNotFoundError in training
            folder, name = os.path.split(listed)
            return (f"{display_path(os.path.join(folder, AGGREGATE))} lists it as sample "
                    f"{name[:-3]}, but {name} is missing")
        # mgds (DiskCache.get_item) takes group index i for the concept's i-th image as listed
        # now: with more images than the aggregate lists, the last index runs past it
        return (f"no aggregate.pt under {cache_dir} lists it (added after its concept was cached:"
                " mgds does not cache it again while the folder's aggregate.pt exists, and stops "
                "with IndexError at the concept's last image, past what aggregate.pt lists)")


class _Directory(DirectoryNaming):
    def __init__(self, naming: OneTrainerNaming, path: str, area: str) -> None:
        super().__init__()
        self.path, self.area = path, area
        self.naming = naming
        self.entries = naming.aggregates.get(path)
        self.in_variation = sample_folder(path)
        self.pending = any(under(path, d) for d in naming.uncached)

    def image(self, name: str) -> tuple[str, bool] | None:
        if self.area != "images":
            return None
        stem, ext = os.path.splitext(name)
        if ext.lower() not in IMAGE_EXTENSIONS or stem.endswith(NOT_SAMPLES):
            return None
        key = os.path.join(self.path, name)
        if key in self.naming.text_gone:  # its latent is there, its text sample is not: CD404
            return f"{key}@text", self.naming.expects_cache
        return key, self.naming.expects_cache and not self.pending

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        if not self.in_variation or not name.endswith(".pt"):
            return CacheFacts()
        if self.entries is None:
            return CacheFacts(naming="no-aggregate")  # OneTrainer re-caches this folder
        try:
            index = int(name[:-3])
        except ValueError:
            return CacheFacts()
        if not 0 <= index < len(self.entries):
            return CacheFacts(key=f"unlisted:{self.path}/{index}", naming="unlisted")
        image, crop = self.entries[index]
        if image in self.naming.text_gone:
            image = None  # its image is reported for its missing text sample, this is no orphan
        # "listed": mgds loads it by number whatever became of its image (CD406 when it is gone)
        if crop is None:
            return CacheFacts(key=image, naming=LISTED)
        h, w = crop
        factor = self.naming.vae_factor
        return CacheFacts(key=image, bucket=f"{w}x{h}", naming=LISTED,
                          expected=(h // factor, w // factor) if factor else None)


# -- rebuilds (fix) ------------------------------------------------------------------------------

AGGREGATE = "aggregate.pt"
REBUILT = ("mgds caches this variation folder again at OneTrainer's next start, for its "
           "samples the repair removes: no aggregate.pt means caching is not done")


def rebuilds(removed: Iterable[str], replaced: Iterable[str] = ()) -> dict[str, tuple[str, ...]]:
    """aggregate.pt -> the samples it lists that a repair removes and does not write again.

    mgds (DiskCache.__is_caching_done) takes a variation folder as cached while its
    aggregate.pt exists, and get_item then opens `<i>.pt` for every sample the aggregate lists:
    one that is gone raises FileNotFoundError in training. Without aggregate.pt it caches the
    folder again, every sample, with OneTrainer's own VAE or text encoders. So the aggregate
    goes with its removed samples. Samples it does not list (CD405) are never opened: they need
    no rebuild."""
    gone = sorted(set(removed) - set(replaced))
    removed_set = set(removed)
    out: dict[str, list[str]] = {}
    for path in gone:
        folder, name = os.path.split(path)
        aggregate = os.path.join(folder, AGGREGATE)
        if (not name[:-3].isdigit() or not name.endswith(".pt") or aggregate in removed_set
                or not sample_folder(folder) or not os.path.isfile(aggregate)):
            continue
        listed = _listed(aggregate)
        if listed is None or int(name[:-3]) < listed:
            out.setdefault(aggregate, []).append(path)
    return {a: tuple(p) for a, p in out.items()}


def _listed(aggregate: str) -> int | None:
    """How many samples an aggregate.pt lists; None when it cannot be read (rebuild anyway)."""
    try:
        obj = read_object(aggregate)
    except (ObjectError, OSError):
        return None
    return len(obj) if isinstance(obj, list) else None


# -- entries (fix --reencode) ------------------------------------------------------------------

LATENT_KEY = "latent_image"
MADE = frozenset({"original_resolution", "crop_offset"})  # what a sample holds beside its latent
NEW_SAMPLE = ("OneTrainer pairs its image and text cache entries by sample number, so a new "
              "sample needs a text-encoder entry too, which cachedoctor cannot make: let "
              "OneTrainer cache this concept again (clear_cache_before_training, or remove its "
              "folders under image/ and text/)")


class _Entries(Entries):
    """OneTrainer's image cache samples (mgds DiskCache): `<i>.pt` in a variation folder, a dict
    of `latent_image` (the VAE's mean, unscaled, in vae_train_dtype, saved from train_device)
    and, where its neighbours hold them (the SDXL-style loaders), `original_resolution` (h, w)
    and `crop_offset` (y, x). The image is scaled to cover the
    sample's `crop_resolution` in aggregate.pt and cropped in the centre (mgds AspectBucketing,
    ScaleCropImage; with crop jitter OneTrainer draws the offset, the centre being one it can
    draw). A sample keeps its number, so aggregate.pt stays as it is; it is saved on the device
    its neighbours were saved from, unless the repair rewrites them on the CPU."""

    def __init__(self, naming: OneTrainerNaming, changes: Changes) -> None:
        super().__init__(changes)
        self.naming = naming

    def _sample(self, entry: str) -> tuple[str, tuple[int, int] | None]:
        folder, name = os.path.split(entry)
        listed = self.naming.aggregates.get(folder)
        if listed is None:
            raise NoSpec("its folder has no readable aggregate.pt")
        stem = name[:-3] if name.endswith(".pt") else ""
        if not stem.isdigit() or int(stem) >= len(listed):
            raise NoSpec("its folder's aggregate.pt lists no sample of its number")
        image, crop = listed[int(stem)]
        if image is None:
            raise NoSpec("aggregate.pt names no image for it")
        return image, crop

    def source(self, entry: str) -> str:
        return self._sample(entry)[0]

    def _new_sample(self, image: str) -> str:
        """NEW_SAMPLE, naming the aggregate.pt files to move away where the concept's folders
        are known: without them mgds caches those folders again, this image included."""
        folders = [a for d, found in self.naming.concept_caches.items() if under(image, d)
                   for a in found]
        if not folders:
            return NEW_SAMPLE
        return (f"{NEW_SAMPLE.split(': let')[0]}: move {' and '.join(dict.fromkeys(folders))} "
                "out of the cache, and OneTrainer caches this concept again at its next start")

    def spec(self, image: str, replacing: str | None = None) -> EntrySpec:
        from cachedoctor import images

        if self.naming.vae_factor is None:
            raise NoSpec("the model type's latents have no whole VAE factor (Wuerstchen, Stable "
                         "Cascade): cachedoctor cannot size one")
        text = self.naming.text_gone.get(image)
        if text is not None and replacing is None:
            raise NoSpec(f"its text-encoder sample is what is missing, which cachedoctor cannot "
                         f"make: move {os.path.join(os.path.dirname(text), AGGREGATE)} out of the"
                         " cache, and OneTrainer caches that folder again at its next start")
        if replacing is None:
            replacing = self.naming.listings.get(image)  # listed, its file gone: same number
            if replacing is None:
                raise NoSpec(self._new_sample(image))
        crop = self._sample(replacing)[1]
        if crop is None:
            raise NoSpec("aggregate.pt gives no crop_resolution for it")
        width, height = images.size(image, oriented=True)  # mgds LoadImage: EXIF applied
        crop_h, crop_w = crop
        if height / width > crop_h / crop_w:  # AspectBucketing: scale to cover the crop
            scaled = (round(height * (crop_w / width)), crop_w)
        else:
            scaled = (crop_h, round(width * (crop_h / height)))
        y, x = (scaled[0] - crop_h) // 2, (scaled[1] - crop_w) // 2
        geometry = Geometry((width, height), (scaled[1], scaled[0]), (x, y, crop_w, crop_h),
                            "bilinear", oriented=True)
        fmt, kinds = self._format(os.path.dirname(replacing))
        values = {"original_resolution": (height, width), "crop_offset": (y, x)}
        extras = {k: (list(v) if kinds[k] == "list" else v) for k, v in values.items() if k in kinds}
        return EntrySpec(image, replacing, EntryFormat(
            fmt.container, LATENT_KEY, fmt.dtype, fmt.channels, location=fmt.location,
            extras=extras), geometry, geometry.latent_size(self.naming.vae_factor))

    def _format(self, folder: str) -> tuple[EntryFormat, dict[str, str]]:
        """The container, dtype, channels and device most healthy samples of the folder share,
        and the type (tuple, list) of each value they hold beside the latent."""
        found = self.once(folder, lambda: most_common(filter(None, (_sample_format(m) for m in healthy(
            folder, ".pt", {*self.unlike, os.path.join(folder, "aggregate.pt")}))), "sample"))
        only((k for k, _ in found[4]), {LATENT_KEY, *MADE}, "samples")
        container, dtype, channels, location, kinds = found
        if any(os.path.dirname(p) == folder for p in self.changes.to_cpu):
            location = "cpu"  # the repair stores the folder's samples on the CPU: so this one too
        return EntryFormat(container, LATENT_KEY, dtype, channels, location=location), dict(kinds)


def _sample_format(meta: FileMeta) -> tuple | None:
    """(container, latent dtype, channels, device, ((key, type name), ...)) of a sample file,
    read with the restricted unpickler; None for anything that is no sample dict."""
    try:
        obj = read_object(meta.path)
    except (ObjectError, OSError):
        return None
    latent = next((t for t in meta.tensors if t.path == (LATENT_KEY,)), None)
    if not isinstance(obj, dict) or latent is None or len(latent.shape) != 3:
        return None
    kinds = tuple(sorted((str(k), type(v).__name__) for k, v in obj.items() if k != LATENT_KEY))
    return container_of(meta), latent.dtype, latent.shape[0], latent.location, kinds
