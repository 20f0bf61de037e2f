"""diffusion-pipe: a training TOML (`dataset = '<dataset TOML>'`, `[model] type = ...`) and the
dataset TOML it names (`[[directory]] path = ...`), as tdrussell/diffusion-pipe 8f83dbf2 reads
them (train.py, utils/dataset.py, utils/cache.py).

Paths: train.py opens `config['dataset']` from its working dir, diffusion-pipe's own folder,
where the examples keep configs in `examples/`: a relative dataset path resolves against the
config's folder, else (a config in a sub-folder of that working dir) its parent. Each
`[[directory]]`'s files are listed without sub-folders (`path.glob('*')`), and its cache is
`<path>/cache/<model name>/`: `metadata/` (🤗 datasets Arrow files), then per size bucket
`cache_<AR>x<W>x<H>x<frames>/` holding `latents/` and `text_embeddings_<i>/` (with aspect
buckets, the text embeddings are in `ar_frames_<AR>_<frames>/`), each a sharded cache (metadata.db + shard_<n>.bin, see
formats/shard_blobs.py) and `iteration_order/`; beside the buckets, `uncond_text_embeddings_<i>/`
holds text encoder i's embedding of the empty caption (used where a caption is dropped out).
The model name is the model class's `name`,
mostly the configured type; where the folder of that name is absent, all of `<path>/cache/` is
checked, each model's folder as a dataset of its own when there are several (a Wan type caches
in `wan_i2v/`, `wan2.2_5b/`, ... by its checkpoint, models/wan/wan.py). A cache inside the
image dir is by design (no CD401), and a size bucket's folder is its bucket: its latents must
share one shape.
"""

from __future__ import annotations

import os

from cachedoctor.layouts import sources
from cachedoctor.layouts.base import Dataset, Layout, TargetError, frozen
from cachedoctor.layouts.common import Problems, ending, listdir, subdirs, typed, unique
from cachedoctor.layouts.paths import resolve
from cachedoctor.layouts.sources import ConfigFile, type_name

NAME = "diffusion-pipe"
TITLE = "diffusion-pipe"
CACHE_DIR = "cache"
# model classes whose `name` differs from the `[model] type` that selects them (models/*.py)
MODEL_NAMES = {"hunyuan_video_15": "hunyuan_video_1.5"}


def dataset_folder(path: str) -> bool:
    """A `[[directory]]` folder: its images or videos, and diffusion-pipe's cache of some model
    in `cache/<model name>/` (`metadata/grouping_keys.json`, written by cache_metadata before
    any shard). Scanned bare, its files are the dataset's media, not stray files of a cache."""
    cache = os.path.join(path, CACHE_DIR)
    try:
        models = os.listdir(cache)
    except OSError:
        return False
    return any(os.path.isfile(os.path.join(cache, m, "metadata", "grouping_keys.json"))
               for m in models[:64])


def bare_datasets(path: str, name: str) -> tuple[Dataset, ...]:
    """The datasets of a `[[directory]]` folder scanned with no config: one per model cache
    under `cache/` (an SDXL and a FLUX cache of one folder are never compared)."""
    cache = os.path.join(path, CACHE_DIR)
    models = model_folders(cache)
    return tuple(Dataset(
        name if len(models) == 1 else f"{name} ({model})",
        cache_dirs=(os.path.join(cache, model),), image_dirs=(path,),
        shallow_image_dirs=(path,), latent_cache_dir=os.path.join(cache, model),
        caches_beside_images=True, model_family=model) for model in models)


def model_folders(cache: str) -> list[str]:
    """The model caches under `<path>/cache/`: its sub-folders, less our own `.cachedoctor/`
    (a scan that fell back to all of `cache/` keeps its index there) and other dot-folders,
    which diffusion-pipe never names."""
    return subdirs(cache, lambda n: not n.startswith("."))


def claims(config: ConfigFile) -> bool:
    data = config.data
    if config.kind != "toml" or not isinstance(data, dict):
        return False
    return _is_training_config(data) or _is_dataset_config(data)


def _is_training_config(data: dict) -> bool:
    model = data.get("model")
    return isinstance(data.get("dataset"), str) and isinstance(model, dict) and "type" in model


def _is_dataset_config(data: dict) -> bool:
    directories = data.get("directory")
    return isinstance(directories, list) and any(
        isinstance(d, dict) and "path" in d for d in directories)


def discover(folder: str) -> list[str]:
    found = []
    for where in (folder, os.path.join(folder, "examples")):
        found += [os.path.join(where, n) for n in listdir(where, ending(".toml"))]
    return found


def load(config: ConfigFile) -> Layout:
    problems = Problems()
    if _is_training_config(config.data):
        return _load(config, problems)
    main = _including(config)
    if main is not None:
        return _load(main, problems)
    return _datasets(config, None, problems, [config.path], os.path.dirname(config.path))


def _including(dataset_config: ConfigFile) -> ConfigFile | None:
    """A training TOML beside the dataset TOML (or in its parent) that names it."""
    here = os.path.dirname(dataset_config.path)
    for where in (here, os.path.dirname(here)):
        for name in listdir(where, ending(".toml")):
            path = os.path.join(where, name)
            if os.path.realpath(path) == os.path.realpath(dataset_config.path):
                continue
            try:
                candidate = sources.load(path)
            except TargetError:
                continue
            if not isinstance(candidate.data, dict) or not _is_training_config(candidate.data):
                continue
            for base in _bases(candidate.path):
                named = resolve(base, candidate.data["dataset"])
                if os.path.realpath(named) == os.path.realpath(dataset_config.path):
                    return candidate
    return None


def _bases(config_path: str) -> tuple[str, str]:
    here = os.path.dirname(os.path.abspath(config_path))
    return here, os.path.dirname(here)


def _load(config: ConfigFile, problems: Problems) -> Layout:
    model = config.data["model"]
    model_type = typed(config, problems, ("model",), model, "type", str, None)
    value = typed(config, problems, (), config.data, "dataset", str, "")
    bases = _bases(config.path)
    base = next((b for b in bases if os.path.isfile(resolve(b, value))), None) if value else None
    reason = (f"{bases[0]} (the config's folder), else {bases[1]} (diffusion-pipe's working dir "
              "when configs live in a sub-folder of it)")
    if base is None:
        problems.missing(config.origin("dataset"), "dataset", value, resolve(bases[0], value),
                         reason)
        return Layout(NAME, config.path, (), tuple(problems.items), (config.path,), bases[0],
                      reason)
    found = resolve(base, value)
    try:
        dataset_config = sources.load(found)
    except TargetError as exc:
        problems.invalid(config.origin("dataset"), f"dataset {value!r}: {exc}", key="dataset")
        return Layout(NAME, config.path, (), tuple(problems.items), (config.path,), base, reason)
    return _datasets(dataset_config, model_type, problems, [config.path, found], base)


def _datasets(config: ConfigFile, model_type: str | None, problems: Problems, files: list[str],
              base: str) -> Layout:
    data = config.data if isinstance(config.data, dict) else {}
    directories = typed(config, problems, (), data, "directory", list, [])
    found = []
    for i, directory in enumerate(directories):
        at = ("directory", i)
        if not isinstance(directory, dict):
            problems.invalid(config.origin(*at), f"directory[{i}] is {type_name(directory)}: "
                             "expected a table with a path")
            continue
        path = typed(config, problems, at, directory, "path", str, None)
        if path is None:
            if directory.get("path") is not None:
                continue  # of the wrong type: typed() said so
            problems.invalid(config.origin(*at), f"directory[{i}] has no path: expected the "
                             "folder of its images or videos", key="path")
            continue
        found.append((at, path))
    ids = unique(os.path.basename(os.path.normpath(p)) or p for _, p in found)
    reason = f"{base}, diffusion-pipe's working dir"
    out = []
    for ident, (at, value) in zip(ids, found, strict=True):
        folder = resolve(base, value)
        origin = config.origin(*at, "path")
        if not os.path.isdir(folder):
            problems.missing(origin, "path", value, folder, reason, ident)
        cache = os.path.join(folder, CACHE_DIR)
        caches = [(ident, cache)]
        if model_type:
            named = os.path.join(cache, MODEL_NAMES.get(model_type, model_type))
            if os.path.isdir(named):
                caches = [(ident, named)]
            elif len(models := model_folders(cache)) > 1:
                # the class name is not the type (Wan: wan_i2v, wan2.2_5b, skyreels_v2; LTX:
                # the checkpoint's stem): each model's cache is judged apart, never compared
                caches = [(f"{ident} ({m})", os.path.join(cache, m)) for m in models]
        out += [Dataset(
            name, cache_dirs=(where,), image_dirs=(folder,), shallow_image_dirs=(folder,),
            latent_cache_dir=where, caches_beside_images=True,
            model_family=model_type,
            origins=frozen({"image_dir": origin, "dataset": config.origin(*at)}),
        ) for name, where in caches]
    return Layout(NAME, files[0], tuple(out), tuple(problems.items), tuple(files), base, reason)
