"""kohya sd-scripts: the dataset TOML (`[general]`, `[[datasets]]`, `[[datasets.subsets]]`) and
the `--config_file` TOML, as kohya-ss/sd-scripts 48d368fa (2026-02-16) reads them
(library/config_util.py, train_util.py `read_config_from_file`, `BucketManager`).

Paths: sd-scripts opens relative paths from the directory it is started in; cachedoctor takes
that to be the folder of the config file that was given (or found), since the TOMLs carry no
hint of it. A `--config_file` TOML's sections are flattened into arguments; its
`dataset_config` names the dataset TOML, else `train_data_dir` (and `reg_data_dir`) hold
DreamBooth folders `<repeats>_<class tokens>`. A fine-tuning subset (`metadata_file`) adds the
folders of its metadata's absolute image paths to its image_dir, which it may omit (a relative
path needs it). Each subset's values fall back to its dataset's,
then `[general]`, then the arguments, then kohya's defaults (enable_bucket false,
min/max_bucket_reso 256/1024, bucket_reso_steps 64, bucket_no_upscale false).

Caches sit beside the images by design (no CD401): `<stem>_<WWWW>x<HHHH>_<arch>.npz` where
WWWW x HHHH is the original image size, float32 `latents` of the bucket size / 8 (/ 32 for
HunyuanImage, `_hi`); the legacy `<stem>.npz` wins when present. Text encoder outputs
(`_te_outputs.npz`, `_<arch>_te.npz`) are embeddings. Each image dir is read without its
sub-folders (`glob_images(image_dir, "*")`). A latent's bucket is the one kohya's
BucketManager picks for the size in its file name under the dataset's bucket settings.
FLUX, SD3, Lumina, Anima and HunyuanImage key their latents by size (`latents_<h>x<w>`): one
npz may hold several, and the trainer reads the one of the bucket (see `loaded_shape`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cachedoctor.formats.meta import FileMeta, TensorMeta
from cachedoctor.layouts.base import (
    CacheFacts,
    Dataset,
    DirectoryNaming,
    Layout,
    Naming,
    Origin,
    frozen,
)
from cachedoctor.layouts.bigfiles import BeyondLimit, NotJson, jsonl_lines, object_items
from cachedoctor.layouts.common import Problems, ending, listdir, subdirs, unique
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
from cachedoctor.layouts.sources import load as load_config

NAME = "kohya"
TITLE = "kohya sd-scripts"
LATENT_NAME = re.compile(
    r"^(?P<stem>.+)_(?P<w>\d{4,})x(?P<h>\d{4,})_(?P<arch>sd|sdxl|flux|sd3|lumina|anima|hi)\.npz$")
STRIDE = {"hi": 32}  # HunyuanImage; every other arch: 8
# The archs whose strategy passes multi_resolution=True (library/strategy_{flux,sd3,lumina,anima,
# hunyuan_image}.py at 48d368fa): their npz keys end `_<h>x<w>` of the latent, since 6ab48b09
# (2024-08-20) for FLUX; an unsuffixed `latents` there is never read.
MULTI_RESOLUTION = frozenset({"flux", "sd3", "lumina", "anima", "hi"})
# the archs whose full fine-tune script maps --skip_latents_validity_check onto skip_cache_check
DEPRECATED_SKIP_ARCHS = frozenset({"flux", "sd3", "lumina", "anima"})
# train_util.IMAGE_EXTENSIONS: matched case-sensitively by glob on Linux
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".avif",
                    ".PNG", ".JPG", ".JPEG", ".WEBP", ".BMP", ".AVIF")
CONFIG_FILE_KEYS = frozenset({"dataset_config", "train_data_dir"})
BUCKET_DEFAULTS = {"enable_bucket": False, "min_bucket_reso": 256, "max_bucket_reso": 1024,
                   "bucket_reso_steps": 64, "bucket_no_upscale": False}


def claims(config: ConfigFile) -> bool:
    data = config.data
    if config.kind != "toml" or not isinstance(data, dict):
        return False
    return is_dataset_config(data) or bool(CONFIG_FILE_KEYS & flatten(data).keys())


def is_dataset_config(data: dict) -> bool:
    """A dataset TOML (`--dataset_config`) rather than a `--config_file` TOML."""
    if "datasets" in data:
        return True
    return isinstance(data.get("general"), dict) and "dataset_config" not in flatten(data)


def subset_folder(name: str) -> bool:
    """A DreamBooth-style subset folder of a train_data_dir: `<repeats>_<name>`
    (library/config_util.py `generate_dreambooth_subsets_config_by_subdirs`: the repeats come
    from the folder's name, a folder without them is skipped)."""
    repeats = name.split("_", 1)[0]
    return repeats.isdigit() and int(repeats) >= 1


def discover(folder: str) -> list[str]:
    return [os.path.join(folder, n) for n in listdir(folder, ending(".toml"))]


def flatten(data: dict) -> dict:
    """`read_config_from_file`: every section's keys become top-level arguments."""
    flat: dict = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _flat_origins(config: ConfigFile) -> dict:
    out = {}
    for key, value in config.data.items():
        if isinstance(value, dict):
            out.update({k: config.origin(key, k) for k in value})
        else:
            out[key] = config.origin(key)
    return out


def owner(config: ConfigFile) -> str | None:
    """For a dataset TOML: a `--config_file` TOML beside it whose dataset_config names it."""
    if not is_dataset_config(config.data):
        return None
    folder = os.path.dirname(config.path)
    target = os.path.realpath(config.path)
    for name in listdir(folder):
        path = os.path.join(folder, name)
        if not name.endswith(".toml") or os.path.realpath(path) == target:
            continue
        try:
            other = load_config(path, "toml")
        except Exception:
            continue
        named = flatten(other.data).get("dataset_config") if isinstance(other.data, dict) else None
        if isinstance(named, str) and os.path.realpath(resolve(folder, named)) == target:
            return path
    return None


def _reason(root: str) -> str:
    return f"{root}, the folder of the config (sd-scripts resolves against its working dir)"


def load(config: ConfigFile) -> Layout:
    if is_dataset_config(config.data):
        main = owner(config)
        if main is not None:
            return load(load_config(main, "toml"))
        return _layout(None, config)
    return _layout(config, None)


def _layout(args_file: ConfigFile | None, dataset_file: ConfigFile | None) -> Layout:
    problems = Problems()
    source = args_file or dataset_file
    assert source is not None
    root = os.path.dirname(source.path)
    args = flatten(args_file.data) if args_file else {}
    arg_origins = _flat_origins(args_file) if args_file else {}
    files = [source.path]
    if args_file is not None and dataset_file is None and "dataset_config" in args:
        named = args["dataset_config"]
        if not isinstance(named, str):
            problems.invalid(arg_origins["dataset_config"], f"dataset_config is "
                             f"{type_name(named)}: expected the path of the dataset TOML")
        else:
            path = resolve(root, named)
            if os.path.isfile(path):
                dataset_file = load_config(path, "toml")
            else:
                problems.missing(arg_origins["dataset_config"], "dataset_config", named, path,
                                 _reason(root))
    if dataset_file is not None and dataset_file is not source:
        files.append(dataset_file.path)
    subsets = _subsets(dataset_file, args, arg_origins, root, problems)
    ids = unique(os.path.basename(s.image_dir.rstrip(os.sep)) or s.image_dir for s in subsets)
    to_disk = args.get("cache_latents_to_disk")
    # --skip_cache_check: an existing npz is trusted without opening it (strategy_base.py
    # `_default_is_disk_cached_latents_expected`).
    skip_check = args.get("skip_cache_check") is True
    # The deprecated --skip_latents_validity_check is mapped onto it by the full fine-tune
    # scripts of FLUX, SD3, Lumina and Anima alone (flux_train.py, flux_train_control_net.py,
    # sd3_train.py, lumina_train.py, anima_train.py `train`; not fine_tune.py, sdxl_train.py or
    # the *_train_network.py scripts): read for those archs' npz, and not in a LoRA config
    # (`network_module` set: a *_train_network.py script keeps the unknown key and ignores it;
    # reading it there would report npz files that script simply encodes again).
    deprecated = args.get("skip_latents_validity_check") is True and not args.get("network_module")
    skip_archs = DEPRECATED_SKIP_ARCHS if deprecated and not skip_check else frozenset()
    # Datasets sharing an image dir share its npz files (two resolutions of one FLUX run): the
    # dir is walked once, so each subset's naming also knows the others' buckets and flip_aug.
    shared: dict[str, list[tuple[Buckets, bool]]] = {}
    for subset in subsets:
        if subset.buckets is not None:
            shared.setdefault(os.path.realpath(subset.image_dir), []).append(
                (subset.buckets, subset.flip_aug))
    datasets = []
    for ident, subset in zip(ids, subsets, strict=True):
        if not os.path.isdir(subset.image_dir):
            problems.missing(subset.origin, "image_dir", subset.value, subset.image_dir,
                             _reason(root), ident)
        others = list(shared.get(os.path.realpath(subset.image_dir), ()))
        if (subset.buckets, subset.flip_aug) in others:
            others.remove((subset.buckets, subset.flip_aug))
        naming = KohyaNaming(root=subset.image_dir, buckets=subset.buckets,
                             expects_cache=to_disk is not False, skip_cache_check=skip_check,
                             skip_archs=skip_archs, flip_aug=subset.flip_aug, others=tuple(others))
        datasets.append(Dataset(
            ident, image_dirs=(subset.image_dir,), shallow_image_dirs=(subset.image_dir,),
            latent_cache_dir=subset.image_dir, text_cache_dir=subset.image_dir,
            caches_beside_images=True,
            options=frozen({"cache_latents_to_disk": to_disk, "skip_cache_check": skip_check,
                            "skip_latents_validity_check": deprecated}),
            origins=frozen({"image_dir": subset.origin}), naming=naming,
        ))
    return Layout(NAME, source.path, tuple(datasets), tuple(problems.items), tuple(files), root,
                  _reason(root))


@dataclass
class _Subset:
    """One subset of a kohya dataset config: its image dir and bucket settings."""

    image_dir: str
    value: str
    origin: object
    buckets: Buckets | None
    flip_aug: bool = False  # the subset's, else its dataset's, [general]'s or the arguments'


def _subsets(dataset_file: ConfigFile | None, args: dict, arg_origins: dict, root: str,
             problems: Problems) -> list[_Subset]:
    out: list[_Subset] = []
    if dataset_file is None:
        for key in ("train_data_dir", "reg_data_dir"):
            value = args.get(key)
            if not isinstance(value, str) or not value:
                continue
            base = resolve(root, value)
            if not os.path.isdir(base):
                problems.missing(arg_origins[key], key, value, base, _reason(root))
                continue
            buckets = _buckets([args], [arg_origins], problems)
            flip = _flag("flip_aug", [args], [arg_origins], problems)
            for name in subdirs(base, subset_folder):
                out.append(_Subset(os.path.join(base, name), os.path.join(value, name),
                                   arg_origins[key], buckets, flip))
        return out
    data = dataset_file.data
    general = data.get("general", {}) if isinstance(data.get("general"), dict) else {}
    general_origins = {k: dataset_file.origin("general", k) for k in general}
    datasets = data.get("datasets", [])
    if not isinstance(datasets, list):
        problems.invalid(dataset_file.origin("datasets"), f"datasets is {type_name(datasets)}: "
                         "expected [[datasets]] tables", key="datasets")
        return out
    for i, dataset in enumerate(datasets):
        if not isinstance(dataset, dict):
            problems.invalid(dataset_file.origin("datasets", i), f"datasets[{i}] is "
                             f"{type_name(dataset)}: expected a table")
            continue
        origins = {k: dataset_file.origin("datasets", i, k) for k in dataset}
        buckets = _buckets([dataset, general, args], [origins, general_origins, arg_origins],
                           problems)
        subsets = dataset.get("subsets", [])
        if not isinstance(subsets, list):
            problems.invalid(dataset_file.origin("datasets", i, "subsets"), "subsets is "
                             f"{type_name(subsets)}: expected [[datasets.subsets]] tables")
            continue
        for j, subset in enumerate(subsets):
            where = ("datasets", i, "subsets", j)
            if not isinstance(subset, dict):
                problems.invalid(dataset_file.origin(*where), f"datasets[{i}].subsets[{j}] is "
                                 f"{type_name(subset)}: expected a table")
                continue
            value = subset.get("image_dir")
            named = subset.get("metadata_file")
            metadata = dataset_file.origin(*where, "metadata_file")
            fine_tuning = isinstance(named, str) and named and "\0" not in named
            # a fine-tuning subset: image_dir is optional (config_util.py
            # FineTuningSubsetParams), its metadata's absolute keys name the images
            folders = _metadata_dirs(root, named, value, metadata, problems) if fine_tuning else []
            if not (fine_tuning and value is None) and (
                    not isinstance(value, str) or not value or "\0" in value):  # no path holds a NUL
                what = "has no image_dir" if value is None else f"has image_dir {value!r}"
                problems.invalid(dataset_file.origin(*where, "image_dir") if value is not None
                                 else dataset_file.origin(*where),
                                 f"subset datasets[{i}].subsets[{j}] {what}: expected the path "
                                 "of its image folder", key="image_dir")
                continue
            flip = _flag("flip_aug", [subset, dataset, general, args],
                         [{k: dataset_file.origin(*where, k) for k in subset}, origins,
                          general_origins, arg_origins], problems)
            own = None
            if value is not None:
                out.append(_Subset(resolve(root, value), value,
                                   dataset_file.origin(*where, "image_dir"), buckets, flip))
                own = os.path.realpath(resolve(root, value))
            out.extend(_Subset(f, f, metadata, buckets, flip) for f in folders
                       if os.path.realpath(f) != own)
    return out


# kohya's metadata: ~1 KB an image as finetune/merge_*_to_metadata.py and
# prepare_buckets_latents.py write it (json.dumps indent=2: caption, tags, train_resolution), so
# a million images make ~1 GB. It is streamed (memory holds one entry); past this it is not read.
MAX_METADATA_BYTES = 16 * 2**30


def _metadata_dirs(root: str, named: str, image_dir: object, origin: Origin,
                   problems: Problems) -> list[str]:
    """The folders of a fine-tuning subset's images beside its image_dir: those of its
    metadata's absolute image paths (train_util.py FineTuningDataset: `.jsonl` lines'
    `image_path`, else the JSON object's keys; sd-scripts looks for the npz files in each).
    A relative key needs image_dir (sd-scripts asserts): without one it is CD409. A file past
    MAX_METADATA_BYTES is a CD409 warning, not checked: sd-scripts may read it well."""
    path = resolve(root, named)
    if not os.path.isfile(path):
        problems.missing(origin, "metadata_file", named, path, _reason(root))
        return []
    folders: set[str] = set()
    try:
        for key in _metadata_keys(path):
            if not isinstance(key, str) or "\0" in key:
                continue
            if not os.path.isabs(key):
                if image_dir is None:
                    problems.invalid(origin, f"metadata_file {named!r} names the image {key!r} "
                                     "by a relative path: sd-scripts needs image_dir for it",
                                     key="image_dir")
                    return []
                continue
            folders.add(os.path.dirname(key))
    except BeyondLimit as exc:
        problems.invalid(origin, f"metadata_file {named!r} was not read: {exc}; the folders its "
                         "image paths name are not checked", key="metadata_file",
                         reading_limit=exc.limit)
        return []
    except (NotJson, OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        problems.invalid(origin, f"metadata_file {named!r} cannot be read as sd-scripts reads "
                         f"it: {text}", key="metadata_file")
        return []
    return sorted(folders)


def _metadata_keys(path: str) -> Iterator[object]:
    """The image keys of a metadata file, one at a time: a `.jsonl` line's `image_path`, else
    the JSON object's keys (train_util.py FineTuningDataset.__init__)."""
    if not path.endswith(".jsonl"):
        yield from (key for key, _ in object_items(path, MAX_METADATA_BYTES))
        return
    for number, line in jsonl_lines(path, MAX_METADATA_BYTES):
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"line {number:,} is not UTF-8 text ({exc.reason})") from None
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number:,} is not valid JSON: {exc.msg} "
                             f"(column {exc.colno})") from None
        if not isinstance(item, dict) or "image_path" not in item:
            raise ValueError(f'line {number:,} has no "image_path"')
        yield item["image_path"]


# -- buckets (train_util.BucketManager, model_util.make_bucket_resolutions) ---------------------


@dataclass(frozen=True)
class Buckets:
    """A dataset's bucket settings and the bucket kohya picks for an image size."""

    enabled: bool
    resolution: tuple[int, int]  # (w, h)
    min_size: int
    max_size: int
    steps: int
    no_upscale: bool
    predefined: tuple[tuple[int, int], ...] = field(default=(), compare=False)

    @classmethod
    def make(cls, enabled: bool, resolution: tuple[int, int], min_size: int, max_size: int,
             steps: int, no_upscale: bool) -> Buckets:
        if not enabled:
            predefined = (resolution,)  # one fixed bucket, bucket settings ignored
        elif no_upscale:
            predefined = ()  # buckets come from each image's own size
        else:
            predefined = _bucket_resolutions(resolution, min_size, max_size, steps)
        return cls(enabled, resolution, min_size, max_size, steps, no_upscale, predefined)

    def select(self, width: int, height: int) -> tuple[int, int]:
        """The (w, h) bucket of an image of this size."""
        return self.fit(width, height)[0]

    def fit(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(bucket, resized): the (w, h) bucket of an image of this size, and the (w, h) it is
        resized to before kohya crops it to the bucket (BucketManager.select_bucket)."""
        aspect = width / height
        if not self.enabled or not self.no_upscale:
            if (width, height) in self.predefined:
                reso = (width, height)
            else:
                # the predefined bucket of nearest aspect ratio; the first one on a tie
                best = min(range(len(self.predefined)),
                           key=lambda i: abs(self.predefined[i][0] / self.predefined[i][1] - aspect))
                reso = self.predefined[best]
            scale = reso[1] / height if aspect > reso[0] / reso[1] else reso[0] / width
            return reso, (int(width * scale + 0.5), int(height * scale + 0.5))
        max_area = self.resolution[0] * self.resolution[1]
        if width * height > max_area:
            # shrink to the maximum area keeping the aspect ratio, then round the side whose
            # rounding changes the aspect ratio least to the bucket step
            w = math.sqrt(max_area * aspect)
            h = max_area / w
            w_round = self._round(w)
            h_for_w = self._round(w_round / aspect)
            h_round = self._round(h)
            w_for_h = self._round(h_round * aspect)
            if abs(w_round / h_for_w - aspect) < abs(w_for_h / h_round - aspect):
                size = (w_round, int(w_round / aspect + 0.5))
            else:
                size = (int(h_round * aspect + 0.5), h_round)
        else:
            size = (width, height)
        return (size[0] - size[0] % self.steps, size[1] - size[1] % self.steps), size

    def _round(self, x: float) -> int:
        x = int(x + 0.5)
        return x - x % self.steps


def _bucket_resolutions(resolution: tuple[int, int], min_size: int, max_size: int,
                        steps: int) -> tuple[tuple[int, int], ...]:
    area = resolution[0] * resolution[1]
    side = int(math.sqrt(area) // steps) * steps
    found = {(side, side)}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((area // width) // steps) * steps)
        if height >= min_size:
            found.add((width, height))
            found.add((height, width))
        width += steps
    return tuple(sorted(found))


def _buckets(sources: list[dict], origins: list[dict], problems: Problems) -> Buckets | None:
    """Bucket settings by kohya's fallback order; None when the resolution is unknown."""

    def pick(key: str, kind: type, default: object) -> object:
        for values, where in zip(sources, origins, strict=True):
            if values.get(key) is None:
                continue
            value = values[key]
            if isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
                return value
            want = "true or false" if kind is bool else "a whole number"
            problems.invalid(where[key], f"{key} is {type_name(value)} ({value!r}): expected "
                             f"{want}", key=key, expected=want)
            return default
        return default

    resolution = None
    for values, where in zip(sources, origins, strict=True):
        if values.get("resolution") is None:
            continue
        resolution = _resolution(values["resolution"])
        if resolution is None:
            problems.invalid(where["resolution"], f"resolution is {values['resolution']!r}: "
                             "expected a size such as 1024 or [1024, 768]", key="resolution")
        break
    settings = {k: pick(k, type(v), v) for k, v in BUCKET_DEFAULTS.items()}
    if resolution is None:
        return None
    steps = int(settings["bucket_reso_steps"]) or 64
    return Buckets.make(bool(settings["enable_bucket"]), resolution,
                        int(settings["min_bucket_reso"]), int(settings["max_bucket_reso"]), steps,
                        bool(settings["bucket_no_upscale"]))


def _flag(key: str, sources: list[dict], origins: list[dict], problems: Problems) -> bool:
    """A subset's true-or-false option by config_util's fallback order (subset, dataset,
    [general], arguments); false when unset."""
    for values, where in zip(sources, origins, strict=True):
        if values.get(key) is None:
            continue
        if isinstance(values[key], bool):
            return values[key]
        problems.invalid(where[key], f"{key} is {type_name(values[key])} ({values[key]!r}): "
                         "expected true or false", key=key, expected="true or false")
        return False
    return False


def _resolution(value: object) -> tuple[int, int] | None:
    if isinstance(value, str):  # the --resolution argument: "512" or "512,768"
        parts = [p.strip() for p in value.split(",")]
        if not all(p.isdigit() for p in parts) or len(parts) not in (1, 2):
            return None
        value = [int(p) for p in parts]
        value = value[0] if len(value) == 1 else value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return value[0], value[1]
    return None


# -- naming ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KohyaNaming(Naming):
    """kohya's naming: `<stem>_<WWWW>x<HHHH>_<arch>.npz` beside each image (the legacy
    `<stem>.npz` wins when present)."""

    root: str
    buckets: Buckets | None  # None: settings unknown (a bare image dir), no bucket
    expects_cache: bool = True
    skip_cache_check: bool = False  # --skip_cache_check: an npz that exists is not re-cached
    skip_archs: frozenset[str] = frozenset()  # trusted as well (--skip_latents_validity_check)
    flip_aug: bool = False  # the subset's flip_aug: a flipped latent is read half the time
    # (buckets, flip_aug) of the other datasets of this image dir
    others: tuple[tuple[Buckets, bool], ...] = ()

    stem_collisions = True

    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return _Directory(self, path)

    def entries(self, dataset: Dataset, changes: Changes) -> Entries:
        return _Entries(self, changes)

    def expected_entry(self, image: str) -> str:
        stem = os.path.splitext(os.path.basename(image))[0]
        return f"{stem}_<W>x<H>_<arch>.npz"

    def missing_text(self, image: str, cache_dir: str) -> str:
        stem = os.path.splitext(os.path.basename(image))[0]
        return f"expected {stem}_<W>x<H>_<arch>.npz (or {stem}.npz) beside it"


class _Directory(DirectoryNaming):
    def __init__(self, naming: KohyaNaming, path: str) -> None:
        super().__init__()
        self.naming, self.path = naming, path
        rel = os.path.relpath(path, naming.root)
        self.prefix = "" if rel == "." else rel + "/"

    def image(self, name: str) -> tuple[str, bool] | None:
        if not name.endswith(IMAGE_EXTENSIONS):
            return None
        return self.prefix + os.path.splitext(name)[0], self.naming.expects_cache

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        if not name.endswith(".npz"):
            return CacheFacts()
        match = LATENT_NAME.match(name)
        buckets = self.naming.buckets
        if match is None:
            stem = name[:-4]
            # SD/SDXL read a legacy npz's unsuffixed keys (strategy_sd.py get_latents_npz_path)
            naming = self.naming
            # a legacy <stem>.npz names no size: kohya reads it from the image's header
            # (imagesize.get), as here, when the bucket settings are known
            size = self._image_size(stem) if buckets is not None else None
            if size is None:
                # without a config a `<stem>.npz` may be anyone's: judged only under one (the
                # flip_aug key needs the config all the same)
                return CacheFacts(key=self.prefix + stem, naming="legacy", lacks=lacking(
                    None, meta, None, naming.skip_cache_check, naming.flip_aug)
                    if buckets is not None else None)
            bw, bh = buckets.select(*size)
            return CacheFacts(key=self.prefix + stem, bucket=f"{bw}x{bh}",
                              expected=(bh // 8, bw // 8), naming="legacy", lacks=lacking(
                                  None, meta, (bh // 8, bw // 8), naming.skip_cache_check,
                                  naming.flip_aug))
        stem, arch = match["stem"], match["arch"]
        width, height = int(match["w"]), int(match["h"])
        if buckets is None or width == 0 or height == 0:
            # no bucket: an SD/SDXL file's one `latents` is the one loaded all the same
            return CacheFacts(key=self.prefix + stem, family=arch,
                              lacks=lacking(arch, meta, None, False, False))
        stride = STRIDE.get(arch, 8)
        skip = self.naming.skip_cache_check or arch in self.naming.skip_archs
        judged = []
        for settings, flip in ((buckets, self.naming.flip_aug), *self.naming.others):
            bw, bh = settings.select(width, height)
            expected = (bh // stride, bw // stride)
            facts = CacheFacts(key=self.prefix + stem, bucket=f"{bw}x{bh}", expected=expected,
                               family=arch, shape=loaded_shape(arch, meta, expected, skip),
                               lacks=lacking(arch, meta, expected, skip, flip))
            judged.append(facts)
            if _fails(facts, meta):
                # sd-scripts loads the file for every dataset of the dir: the first one it
                # fails for is the finding (the dir's own dataset's first)
                return facts
        return judged[0]

    def facts_of_its_own(self, name: str) -> bool:
        # a legacy <stem>.npz's bucket is its image's size, read from the image's header
        return self.naming.buckets is None or not name.endswith(".npz") or \
            LATENT_NAME.match(name) is not None

    def _image_size(self, stem: str) -> tuple[int, int] | None:
        from cachedoctor.images import header_size

        for extension in IMAGE_EXTENSIONS:
            size = header_size(os.path.join(self.path, stem + extension))
            if size is not None:
                return size if size[0] > 0 and size[1] > 0 else None
        return None


def _fails(facts: CacheFacts, meta: FileMeta) -> bool:
    """Whether the latent sd-scripts loads for these facts is not of their expected size (the
    facts' shape, else (None) the file's one `latents`), or a key it reads is missing."""
    if facts.lacks is not None:
        return True
    shape = facts.shape
    if shape is None:
        shape = next((t.shape for t in meta.tensors if t.path == ("latents",)), None)
    return bool(shape) and len(shape) >= 2 and tuple(shape[-2:]) != facts.expected


# -- entries (fix --reencode) ------------------------------------------------------------------

RESO_KEY = re.compile(r"^latents(_\d+x\d+)?$")  # `latents`, or multi-resolution `latents_<h>x<w>`
SUFFIX = re.compile(r"_\d+x\d+$")  # a multi-resolution key's `_<h>x<w>`
# what an npz holds beside its latents, which sd-scripts reads with every latent it loads
MADE = ("original_size", "crop_ltrb")
FLIPPED = "latents_flipped"  # with flip_aug: the latent of the image mirrored left to right


def loaded_shape(arch: str, meta: FileMeta, expected: tuple[int, int],
                 skip_cache_check: bool) -> tuple[int, ...] | None:
    """CacheFacts.shape of a kohya npz for a bucket whose latent is `expected` (h, w): the
    shape of the latent sd-scripts trains on; None for an SD/SDXL npz without suffixed keys
    (its one `latents` is read unchecked, CD302 compares it).

    sd-scripts looks up `latents_<h>x<w>` of the bucket, whatever other sizes the file holds
    (strategy_base.py `_default_is_disk_cached_latents_expected`, `_default_load_latents_from_disk`
    at 48d368fa). SD/SDXL npz with suffixed keys come from PR #2269 (refs/pull/2269/head
    58f7b4cd), which falls back to an unsuffixed `latents` of the bucket's size. A file without
    the key is encoded again and the key added, so nothing is judged: (). With --skip_cache_check
    the file is trusted and loading it raises ValueError: the shape of a latent of another size
    it holds stands, for CD302."""
    latents = _latents(meta)
    if arch not in MULTI_RESOLUTION and all(k == "latents" for k in latents):
        return None
    key = loaded_key(arch, latents, expected)
    if key is not None:
        return latents[key].shape
    if not skip_cache_check:
        return ()
    # one of another size (an unsuffixed FLUX `latents` of the bucket's size, as sd-scripts
    # wrote them before 6ab48b09, is not read either: no shape shows it, `lacking` names the key)
    held = [t.shape for t in latents.values() if tuple(t.shape[-2:]) != expected]
    return held[0] if held else ()


def _latents(meta: FileMeta) -> dict[str, TensorMeta]:
    """The npz's latents by key: `latents` and `latents_<h>x<w>`."""
    return {t.path[0]: t for t in meta.tensors if len(t.path) == 1
            and isinstance(t.path[0], str) and RESO_KEY.match(t.path[0])}


def loaded_key(arch: str | None, latents: dict[str, TensorMeta],
               expected: tuple[int, int] | None) -> str | None:
    """Which of `latents` sd-scripts loads for a bucket whose latent is `expected` (h, w);
    None when it holds none of them. An SD/SDXL npz (arch None: a legacy `<stem>.npz`) without
    suffixed keys: its `latents`, of whatever size; with them (PR #2269), the bucket's key, else
    an unsuffixed `latents` of the bucket's size. The other archs: the bucket's key."""
    multi = arch in MULTI_RESOLUTION
    if not multi and all(k == "latents" for k in latents):
        return "latents" if latents else None
    if expected is None:
        return None
    key = f"latents_{expected[0]}x{expected[1]}"
    if key in latents:
        return key
    legacy = latents.get("latents")
    if not multi and legacy is not None and tuple(legacy.shape[-2:]) == expected:
        return "latents"
    return None


def lacking(arch: str | None, meta: FileMeta, expected: tuple[int, int] | None,
            skip_cache_check: bool, flip_aug: bool) -> str | None:
    """CacheFacts.lacks of a kohya npz: a key that sd-scripts reads from the latent it loads
    from this file (the one `loaded_key` names), once it has judged the file valid, and that
    the file lacks; None when it holds them all, or no latent sd-scripts loads. Under
    skip_cache_check a FLUX, SD3, Lumina, Anima or HunyuanImage file without the bucket's
    `latents_<h>x<w>` lacks that key (`_default_load_latents_from_disk` raises ValueError).

    `_default_is_disk_cached_latents_expected` (strategy_base.py, 48d368fa) looks only for
    `latents<suffix>` (and `latents_flipped<suffix>` with flip_aug, `alpha_mask<suffix>` with
    alpha_mask); `_default_load_latents_from_disk` then reads `original_size<suffix>` and
    `crop_ltrb<suffix>` unconditionally: a file without one stops training with `KeyError:
    '<key> is not a file in the archive'` (an npz of the 2023-06/07 `crop_left_top` naming,
    9e9df2b5 to 0ec71660, is one). With flip_aug, a missing `latents_flipped<suffix>` makes the
    check false and the image is encoded again, the key added; under skip_cache_check the file is
    trusted, the flipped latent loads as None, and BaseDataset.__getitem__ (train_util.py) takes
    it for every sample it flips: `torch.FloatTensor(None)` raises TypeError. (The subset's
    alpha_mask, which also sends a file without its mask to be encoded again, is not read here.)"""
    key = loaded_key(arch, _latents(meta), expected)
    if key is None:
        # a size-keyed file without its bucket's key: trusted under skip_cache_check, loading
        # it raises ValueError (CD302 tells it from a key of the wrong size by this)
        return f"latents_{expected[0]}x{expected[1]}" if (
            skip_cache_check and arch in MULTI_RESOLUTION and expected is not None) else None
    suffix = key.removeprefix("latents")
    held = {t.path[0] for t in meta.tensors if len(t.path) == 1}
    if flip_aug and FLIPPED + suffix not in held:
        return FLIPPED + suffix if skip_cache_check else None
    return next((k + suffix for k in MADE if k + suffix not in held), None)


class _Entries(Entries):
    """kohya's latent npz files (strategy_base.py `save_latents_to_disk`, train_util.py
    `trim_and_resize_if_required`): `<stem>_<WWWW>x<HHHH>_<arch>.npz` beside the image, named
    with its pixel size; float32 `latents` (unscaled), `original_size` [W, H] and `crop_ltrb`,
    their keys suffixed `_<h>x<w>` where the neighbours' are (multi-resolution architectures),
    and `latents_flipped` with flip_aug. The image is resized to cover its bucket
    (BucketManager.select_bucket) and cropped in the centre; crop_ltrb is get_crop_ltrb's, in
    the neighbours' dtype.

    An npz replaced at its own path keeps every key but those of the latent written
    (`save_latents_to_disk` loads the file it writes to and adds its keys): the other
    resolutions' latents, original_size and crop_ltrb, their flipped latents and alpha masks.
    That latent's own flipped latent goes unless flip_aug makes it anew (it is the old
    encode's); its alpha_mask is a NoSpec (cachedoctor makes none)."""

    def __init__(self, naming: KohyaNaming, changes: Changes) -> None:
        super().__init__(changes)
        self.naming = naming

    def source(self, entry: str) -> str:
        directory, name = os.path.split(entry)
        match = LATENT_NAME.match(name)
        stem = match["stem"] if match else os.path.splitext(name)[0]
        found = [n for n in listdir(directory)
                 if n.endswith(IMAGE_EXTENSIONS) and os.path.splitext(n)[0] == stem]
        if len(found) != 1:
            raise NoSpec(f"no image {stem}.* beside it" if not found else
                         f"{' and '.join(found)} share its name (CD407): rename one")
        return os.path.join(directory, found[0])

    def spec(self, image: str, replacing: str | None = None) -> EntrySpec:
        from cachedoctor import images

        buckets = self.naming.buckets
        if buckets is None:
            raise NoSpec("the dataset's resolution is unknown, so is its bucket")
        width, height = images.size(image)
        directory = os.path.dirname(image)
        arch, multi, dtype, channels, kinds = self._format(directory)
        stride = STRIDE.get(arch, 8)
        (bucket_w, bucket_h), resized = buckets.fit(width, height)
        latent = (bucket_h // stride, bucket_w // stride)
        suffix = f"_{latent[0]}x{latent[1]}" if multi else ""
        values = {"original_size": (width, height),
                  "crop_ltrb": _crop_ltrb((bucket_w, bucket_h), (width, height))}
        extras = {k + suffix: _stored(v, kinds[k]) for k, v in values.items() if k in kinds}
        stem = os.path.splitext(os.path.basename(image))[0]
        path = os.path.join(directory, f"{stem}_{width:04d}x{height:04d}_{arch}.npz")
        geometry = Geometry((width, height), resized, ((resized[0] - bucket_w) // 2,
                            (resized[1] - bucket_h) // 2, bucket_w, bucket_h), "area")
        same = replacing is not None and os.path.abspath(replacing) == os.path.abspath(path)
        return EntrySpec(image, path, EntryFormat(
            "npz", "latents" + suffix, dtype, channels, extras=extras,
            flipped=FLIPPED + suffix if self.naming.flip_aug else None,
            kept=_kept(path, suffix) if same else ()), geometry, latent)

    def _format(self, directory: str) -> tuple:
        """(arch, multi-resolution keys, latent dtype, channels, {value: dtype}) most healthy
        latent npz files of the folder share."""
        found = self.once(directory, lambda: most_common(filter(None, (
            _npz_format(m) for m in healthy(directory, ".npz", self.unlike))), "latent npz"))
        only((k for k, _ in found[4]), {"latents", FLIPPED, *MADE}, "npz files")
        return (*found[:4], dict(found[4]))


def _npz_format(meta: FileMeta) -> tuple | None:
    """(arch, multi-resolution, dtype, channels, ((value, dtype), ...)) of a latent npz named
    as kohya names them, its latents of one format: those with `_<h>x<w>` keys where it has
    any (an unsuffixed `latents` beside them is an older run's), else its one `latents`; None
    for anything else."""
    match = LATENT_NAME.match(os.path.basename(meta.path))
    if match is None:
        return None
    resolutions: dict[str, dict[str, TensorMeta]] = {}
    for t in meta.tensors:
        if len(t.path) == 1:
            key = str(t.path[0])
            found = SUFFIX.search(key)
            suffix = found[0] if found else ""
            resolutions.setdefault(suffix, {})[key.removesuffix(suffix)] = t
    latents = {s: keys for s, keys in resolutions.items() if "latents" in keys}
    multi = any(latents)
    formats = {(keys["latents"].dtype, keys["latents"].shape[0],
                tuple(sorted((k, t.dtype) for k, t in keys.items() if k != "latents")))
               for s, keys in latents.items() if bool(s) == multi}
    if len(formats) != 1 or any(len(keys["latents"].shape) != 3 for keys in latents.values()):
        return None
    (dtype, channels, values), = formats
    return match["arch"], multi, dtype, channels, values


def _kept(path: str, suffix: str) -> tuple[str, ...]:
    """EntryFormat.kept of the npz at `path` when its latent of `suffix` is written anew:
    every key but that latent's (see _Entries); none of a file the reader cannot read."""
    from cachedoctor.formats import read_path

    meta = read_path(path)
    if meta.errors or meta.unsafe_globals:
        return ()  # np.load cannot read it back either
    keys = [str(t.path[0]) for t in meta.tensors if len(t.path) == 1]
    if "alpha_mask" + suffix in keys:
        raise NoSpec(f"it holds alpha_mask{suffix}, which cachedoctor does not make")
    own = {key + suffix for key in ("latents", FLIPPED, *MADE)}
    return tuple(sorted(k for k in keys if k not in own))


def _stored(value: tuple, dtype: str) -> Any:
    """`value` as save_latents_to_disk stores it, `np.array(value)`, in the neighbours' dtype
    where that holds it exactly (int32 `original_size` of a numpy 1.x on Windows). Where it does
    not, numpy's own: crop_ltrb's quotients (303.288...) cast to the int64 of integral
    neighbours would lose what sd-scripts stores (float64) and reads back: its flipped crop is
    int(bucket_w - crop_ltrb[2])."""
    import numpy as np

    own = np.array(value)
    cast = np.asarray(value, dtype=dtype)
    return cast if np.array_equal(cast, own) else own


def _crop_ltrb(bucket: tuple[int, int], size: tuple[int, int]) -> tuple[float, ...]:
    """BucketManager.get_crop_ltrb: where the image sits in its bucket, resized to cover it."""
    bucket_ar, image_ar = bucket[0] / bucket[1], size[0] / size[1]
    if bucket_ar > image_ar:
        resized_w, resized_h = bucket[1] * image_ar, bucket[1]
    else:
        resized_w, resized_h = bucket[0], bucket[0] / image_ar
    left, top = (bucket[0] - resized_w) // 2, (bucket[1] - resized_h) // 2
    return left, top, left + resized_w, top + resized_h
