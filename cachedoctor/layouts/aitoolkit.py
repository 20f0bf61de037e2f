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
Caches beside the images are by design (no CD401).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.base import (
    CacheFacts,
    Dataset,
    DirectoryNaming,
    Layout,
    Naming,
    frozen,
)
from cachedoctor.layouts.common import Problems, listdir, typed, unique, working_dir
from cachedoctor.layouts.paths import resolve
from cachedoctor.layouts.sources import ConfigFile, type_name

NAME = "ai-toolkit"
TITLE = "ai-toolkit"
LATENT_DIR = "_latent_cache"
TEXT_DIR = "_t_e_cache"
SKIPPED_DIRS = frozenset({LATENT_DIR, TEXT_DIR, "_clip_vision_cache", "_controls"})
# toolkit/data_loader.py image_extensions (matched lower-cased)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
FACTOR_8 = frozenset({"sd1", "sd2", "sdxl", "sd3", "flux1"})  # latent_space_version values


def claims(config: ConfigFile) -> bool:
    data = config.data
    if config.kind not in ("yaml", "json") or not isinstance(data, dict):
        return False
    inner = data.get("config")
    return isinstance(inner, dict) and isinstance(inner.get("process"), list)


def discover(folder: str) -> list[str]:
    found = []
    for where in (os.path.join(folder, "config"), folder):
        found += [os.path.join(where, n) for n in listdir(where)
                  if n.endswith((".yaml", ".yml")) or (where != folder and n.endswith(".json"))]
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
        typed(config, problems, at, dataset, "resolution", (int, list), None, ident,
              "a size such as 1024 or a list of sizes")
        out.append(Dataset(
            ident, image_dirs=(directory,), latent_cache_dir=os.path.join(directory, LATENT_DIR),
            text_cache_dir=os.path.join(directory, TEXT_DIR), caches_beside_images=True,
            options=frozen({"cache_latents_to_disk": to_disk, "cache_text_embeddings": text}),
            origins=frozen({"image_dir": origin, "dataset": config.origin(*at)}),
            naming=AIToolkitNaming(directory, expects_cache=to_disk),
        ))
    return Layout(NAME, config.path, tuple(out), tuple(problems.items), (config.path,), root,
                  _reason(root))


@dataclass(frozen=True)
class AIToolkitNaming(Naming):
    root: str  # the dataset's folder_path; None-like "" for a bare cache
    expects_cache: bool = True


    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return _Directory(self, path)

    def expected_entry(self, image: str) -> str:
        stem = os.path.splitext(os.path.basename(image))[0]
        return f"{LATENT_DIR}/{stem}_<hash>.safetensors"

    def missing_text(self, image: str, cache_dir: str) -> str:
        return f"expected {self.expected_entry(image)} beside it, with its name in the header"


class _Directory(DirectoryNaming):
    def __init__(self, naming: AIToolkitNaming, path: str) -> None:
        super().__init__()
        self.naming = naming
        self.in_latents = os.path.basename(path) == LATENT_DIR
        rel = os.path.relpath(os.path.dirname(path) if self.in_latents else path, naming.root)
        parts = [] if rel == "." else rel.split(os.sep)
        # ai-toolkit skips hidden folders and _controls; cache folders hold no images
        self.skipped = any(p.startswith(".") or p in SKIPPED_DIRS or p == ".." for p in parts)
        self.prefix = "" if rel == "." else rel + "/"

    def image(self, name: str) -> tuple[str, bool] | None:
        if self.in_latents or self.skipped or name.startswith("."):
            return None
        if not name.lower().endswith(IMAGE_EXTENSIONS):
            return None
        return self.prefix + name, self.naming.expects_cache

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        if not self.in_latents or not name.endswith(".safetensors"):
            return CacheFacts()
        return header_facts(meta, self.prefix)


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
    return CacheFacts(key=key, bucket=f"{width}x{height}", expected=expected, family=family)
