"""A cache directory (or file) given with no trainer config: one dataset named for it.

Roles come from the files. Buckets come from bucket folders (`1024x1024`, `1.33`: see
PART_OF_PARENT) in a dataset's folder; files directly in a dataset's folder are no bucket,
whether the scan starts there or above it (a SimpleTuner VAE cache is flat with every aspect
mixed, and unhashed `<stem>.pt` names or sub-folders mirroring the image folders do not change
that), except where a file's name or place shows a trainer's own layout, whose bucket
semantics then apply:
- `_latent_cache/*.safetensors` (ai-toolkit): the crop size in the header metadata;
- `<stem>_<W>x<H>_<arch>.npz` and legacy `<stem>.npz` (kohya): no bucket (the name gives the
  image's size, the bucket needs the dataset's settings); a directory that holds such files
  beside images, or a train_data_dir whose `<repeats>_<name>` sub-folders do, is an image dir
  with kohya's caches, where images belong;
- an image folder holding `_latent_cache/` (ai-toolkit), a folder of such image folders, or a
  `_latent_cache/` itself: the images belong, the `_latent_cache` folders are its caches, and
  their headers name the images, so coverage rules run (layouts/aitoolkit.py, `bare`);
- `variation-<n>/<i>.pt` (OneTrainer; before mgds a8e7480 `image/epoch-<n>/`, `text/epoch-<n>/`):
  `crop_resolution` from the folder's `aggregate.pt`, or no bucket without one; the latent size
  that crop needs by the factor most samples show against theirs (no model_type without the
  config: Sana's 32, else 8; onetrainer.seen_factor);
- `<sha256>.pt` (SimpleTuner): no bucket (its sub-folders mirror the image folders);
- `<stem>_<W>x<H>_<arch>.safetensors` with musubi-tuner's header (`format_version`,
  `architecture`): no bucket, the architecture its family; a folder holding such files beside
  images or videos is a musubi-tuner media dir with its caches, where the media belong;
- a diffusion-pipe `[[directory]]` folder (`cache/<model>/metadata/grouping_keys.json`): the
  media belong, `cache/` holds every model's sharded caches.
- an LTX-Video-Trainer dataset dir (`.precomputed/latents`, `conditions`): its own files (the
  dataset file, media) belong, `.precomputed/` is a bare tree of caches;
- finetrainers' `finetrainers-precomputed-data/` (and its older `*_precomputed/latents/`,
  `conditions/`): no bucket; saved from the GPU and loaded with a map_location, so the devices
  tensors were saved from are not judged (layouts/finetrainers.py).

A tree is not one dataset: every folder that holds cache files is a dataset of its own (the
dataset rules compare files of one dataset only), so that `cache/vae/sdxl/photos` and
`cache/vae/flux/photos`, as SimpleTuner's `{model_family}` paths lay them out, or two text
caches, never judge each other. A folder belongs to its parent's dataset only where a layout
says it is part of one: a bucket folder (`1024x1024`, `768x1344`, an aspect ratio such as
`1.33`) and OneTrainer's `variation-<n>` (one variation of its sha256 group folder). A kohya
image dir or train_data_dir is one dataset (kohya trains its `<repeats>_<name>` subsets as one),
its files compared per architecture (`_sdxl.npz`, `_flux.npz`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cachedoctor.formats.meta import FileMeta
from cachedoctor.inventory import LATENT, TEXT, classify
from cachedoctor.layouts import aitoolkit, diffusion_pipe, finetrainers, kohya, ltx_video, musubi, onetrainer
from cachedoctor.layouts.base import ANY_DEVICE, NO_FACTS, CacheFacts, Dataset, DirectoryNaming, Layout, Naming, frozen
from cachedoctor.layouts.common import listdir, names, subdirs

SHA256_PT = re.compile(r"^[0-9a-f]{64}\.pt$")
# folders that are part of their parent's dataset: resolution and aspect buckets, OneTrainer
# variations (mgds DiskCache: `<group sha256>/variation-<n>`)
PART_OF_PARENT = re.compile(r"^(\d+x\d+|\d+\.\d+|variation-\d+)$")
# mgds names a OneTrainer group folder by a sha256 hexdigest (Nerogar/mgds:
# src/mgds/pipelineModules/DiskCache.py, `__string_key`): only such folders are looked into.
GROUP = re.compile(r"^[0-9a-f]{64}$")


def layout(path: str) -> Layout:
    path = os.path.abspath(path)
    isdir = os.path.isdir(path)
    # a single file belongs to the dataset of its folder (a label, not the file's own name)
    named = path if isdir or not os.path.lexists(path) else os.path.dirname(path)
    name = os.path.basename(named.rstrip(os.sep)) or named
    if isdir and (_kohya_image_dir(path) or any(
            _kohya_image_dir(os.path.join(path, sub)) for sub in subdirs(path, kohya.subset_folder))):
        naming = kohya.KohyaNaming(root=path, buckets=None)
        dataset = Dataset(name, image_dirs=(path,), latent_cache_dir=path, text_cache_dir=path,
                          caches_beside_images=True, naming=naming)
        return Layout("bare", None, (dataset,))
    if isdir and musubi.media_dir(path):
        dataset = Dataset(name, image_dirs=(path,), latent_cache_dir=path, text_cache_dir=path,
                          caches_beside_images=True, naming=BareNaming(frozen({})))
        return Layout("bare", None, (dataset,))
    if isdir and diffusion_pipe.dataset_folder(path):
        return Layout("bare", None, diffusion_pipe.bare_datasets(path, name))
    if isdir and ltx_video.dataset_folder(path):
        # its own files (dataset file, media) are the dataset's; `.precomputed/` is judged as
        # a bare tree of its own (layouts/ltx_video.py)
        pre = os.path.join(path, ltx_video.PRECOMPUTED_DIR)
        dataset = Dataset(name, cache_dirs=(pre,), image_dirs=(path,), shallow_image_dirs=(path,),
                          caches_beside_images=True, naming=BareNaming(frozen({}), pre))
        return Layout("bare", None, (dataset,))
    if isdir and os.path.basename(path) == aitoolkit.LATENT_DIR:
        return _aitoolkit(path, os.path.dirname(path), (path,))
    latent_caches = _aitoolkit_caches(path) if isdir else []
    if latent_caches:
        return _aitoolkit(name, path, tuple(latent_caches))
    aggregates = _aggregates(path) if isdir else {}
    factor = onetrainer.seen_factor(aggregates) if aggregates else onetrainer.VAE_FACTOR
    naming = BareNaming(frozen(aggregates), path, factor)
    # OneTrainer saves from and loads to its train_device (mgds DiskCache: torch.save without
    # .cpu(), torch.load with map_location): without the config, any device is its own
    device = ANY_DEVICE if aggregates else None
    return Layout("bare", None, (Dataset(name, (path,), naming=naming, expected_device=device,
                                         vae_factor=factor),))


def dataset_folder(directory: str, root: str) -> str:
    """The folder of the dataset `directory`'s files belong to: `directory` itself, or, for a
    bucket or variation folder, the folder it is part of (never above `root`)."""
    folder = directory
    while len(folder) > len(root) and PART_OF_PARENT.match(os.path.basename(folder)):
        folder = os.path.dirname(folder)
    return folder


# what a kohya npz adds to its image's stem, besides `_<W>x<H>_<arch>.npz`
KOHYA_STEM = re.compile(r"(_te_outputs|_(sd3|flux|lumina|anima|hi)_te)?\.npz$")


def _kohya_image_dir(path: str) -> bool:
    """Images beside kohya npz files: `<stem>_<W>x<H>_<arch>.npz`, or an image's legacy
    `<stem>.npz` (written before v0.9.0: train_util.py `save_latents_to_disk` at v0.8.7
    bfb352bc; still read, strategy_sd.py `get_latents_npz_path`) or text encoder outputs
    (`<stem>_te_outputs.npz` since 516f64f4, `<stem>_<arch>_te.npz`), cached without latents."""
    found = names(path)
    stems = {os.path.splitext(n)[0] for n in found if n.endswith(kohya.IMAGE_EXTENSIONS)}
    return bool(stems) and any(n.endswith(".npz") and (
        kohya.LATENT_NAME.match(n) is not None or KOHYA_STEM.sub("", n) in stems) for n in found)


def _aitoolkit_caches(path: str) -> list[str]:
    """The `_latent_cache` folders of an ai-toolkit image folder, or of the image folders in
    it (a stat per sub-folder, not a listing)."""
    if aitoolkit.LATENT_DIR in subdirs(path):
        return [os.path.join(path, aitoolkit.LATENT_DIR)]
    found = (os.path.join(path, sub, aitoolkit.LATENT_DIR) for sub in subdirs(path))
    return [cache for cache in found if os.path.isdir(cache)]


def _aitoolkit(target: str, images: str, caches: tuple[str, ...]) -> Layout:
    """An ai-toolkit image folder (or folder of them) with its `_latent_cache` folders, or one
    `_latent_cache` (its image folder's images only, not the sub-folders' images): the
    headers name the images, so coverage is counted as with the job config. The dataset is named
    for the image folder, as its config's dataset is."""
    only_cache = caches == (target,)
    naming = aitoolkit.AIToolkitNaming(
        images, bare=True, incomplete=frozen(aitoolkit.same_size_gaps(images, not only_cache)))
    dataset = Dataset(os.path.basename(images.rstrip(os.sep)) or images, cache_dirs=caches,
                      image_dirs=(images,), shallow_image_dirs=(images,) if only_cache else (),
                      latent_cache_dir=caches[0] if len(caches) == 1 else None,
                      caches_beside_images=True, naming=naming)
    return Layout("bare", None, (dataset,))


def _aggregates(path: str) -> dict[str, onetrainer.Samples]:
    """OneTrainer aggregates when `path` is a cache_dir, its image/ folder, a group folder or
    a variation folder (fixed depths: no walk)."""
    out: dict[str, onetrainer.Samples] = {}
    root = os.path.dirname(path)
    image = os.path.join(path, "image")
    for variations in (lambda: _variations(image, groups=True),
                       lambda: _variations(path, groups=True),
                       lambda: _variations(path, groups=False),
                       lambda: _epochs(image),
                       lambda: _epochs(path),
                       lambda: [path] if onetrainer.sample_folder(path) else []):
        for folder in variations():
            found = os.path.join(folder, "aggregate.pt")
            if os.path.lexists(found):
                entries = onetrainer.aggregate_entries(found, root)
                if entries is not None:
                    out[folder] = entries
        if out:
            break
    return out


def _variations(parent: str, groups: bool) -> list[str]:
    """The variation-<n> folders in `parent`, or (groups) in each of its group folders, sorted.
    Plain listings rather than glob: a big cache folder's names are each tested once, cheaply,
    and only group-named folders are listed (a flat cache's files are not tried as folders)."""
    tops = [os.path.join(parent, n) for n in listdir(parent, _group)] if groups else [parent]
    return sorted(os.path.join(top, n) for top in tops for n in listdir(top, _variation))


def _epochs(area: str) -> list[str]:
    """The `epoch-<n>` folders of mgds before a8e7480 in a cache_dir's image/ folder, sorted."""
    if os.path.basename(area) != "image":
        return []
    return sorted(os.path.join(area, n) for n in listdir(area, onetrainer.EPOCH.match))


def _group(name: str) -> bool:
    return len(name) == 64 and GROUP.match(name) is not None


def _variation(name: str) -> bool:
    return name.startswith("variation-") and onetrainer.VARIATION.match(name) is not None


@dataclass(frozen=True)
class BareNaming(Naming):
    """A cache dir without a config: folder buckets, and OneTrainer aggregates when present."""

    aggregates: Mapping[str, onetrainer.Samples]
    root: str = ""  # the dir scanned (absolute): dataset folders stop there
    vae_factor: int = onetrainer.VAE_FACTOR  # OneTrainer samples' (onetrainer.seen_factor)

    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return _Directory(self, path, bucket)


@functools.lru_cache(maxsize=256)
def _beside_images(path: str, _mtime_ns: int) -> bool:
    """Whether `path`, a folder deep in a bare tree, is a kohya image dir, a musubi-tuner media
    dir or an ai-toolkit image folder (as `layout` tells for the folder scanned). Per worker,
    once per folder as it is (the mtime in the key): a big folder's batches would each list it
    again."""
    return _kohya_image_dir(path) or musubi.media_dir(path) or \
        os.path.isdir(os.path.join(path, aitoolkit.LATENT_DIR))


# What a trainer saves beside its weights (accelerate's save_state, used by SimpleTuner, kohya's
# --save_state, musubi-tuner and the diffusers scripts: `optimizer.bin`, `random_states_<rank>.pkl`,
# accelerate/utils/constants.py; ai-toolkit: `optimizer.pt` in its save_root; the diffusers
# scripts and SimpleTuner: `pytorch_lora_weights.safetensors`): a folder holding one is a
# training output (weights, model card, training_state.json), not a cache
TRAINER_OUTPUT = ("optimizer.bin", "optimizer.pt", "random_states_0.pkl",
                  "pytorch_lora_weights.safetensors")
# where trainers save their sample images: kohya sd-scripts and musubi-tuner `<output_dir>/sample`,
# ai-toolkit and OneTrainer `samples`, the diffusers scripts `<output_dir>/validation_images`
SAMPLE_DIRS = frozenset({"sample", "samples", "validation_images"})


def _project_images(path: str, root: str) -> bool:
    """Whether `path`, a folder below the bare tree scanned at `root`, is a project's folder:
    no cache file in it nor in a folder above it up to `root` (a scan of a folder of projects;
    images nested in a cache are strays), or a trainer's output (its weights folder, its sample
    images). The folder scanned itself is none: its files are read and judged, so a hostile
    file given at the top (a zip holding a pickle) is never only stat'ed as a project's."""
    if not root or not path.startswith(root + os.sep):
        return False
    folder = path
    while len(folder) >= len(root):
        try:
            if _trainer_output(folder):
                return True
            if _holds_cache_files(folder, os.stat(folder).st_mtime_ns):
                return False
        except OSError:
            return False
        if os.path.basename(folder) in SAMPLE_DIRS:
            return True
        folder = os.path.dirname(folder)
    return True


def _trainer_output(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TRAINER_OUTPUT)


@functools.lru_cache(maxsize=256)
def _holds_cache_files(path: str, _mtime_ns: int) -> bool:
    """Whether `path` (as it is at that mtime) holds a cache file; stops at the first (a cache
    folder's first names answer), where names() keeps no `.pt` of a million-file listing. A
    folder named like one (`$RECYCLE.BIN` at the top of every Windows drive) is none."""
    try:
        with os.scandir(path) as listing:
            return any(classify(entry.name) in (LATENT, TEXT) and entry.is_file()
                       for entry in listing)
    except OSError:
        return False


class _Directory(DirectoryNaming):
    def __init__(self, naming: BareNaming, path: str, bucket: str | None) -> None:
        self.root = naming.root
        self.group = dataset_folder(path, naming.root)
        # a folder is its files' bucket only where it is part of its parent's dataset (a
        # bucket folder): a dataset's own folder holds every aspect mixed (SimpleTuner's flat
        # VAE cache), whether the scan started there or above it
        super().__init__(bucket if self.group != path else None)
        self.path = path
        base = os.path.basename(path)
        self.kind = None
        self.folder = CacheFacts(bucket=self.bucket)  # made once: most files get exactly this
        if base == aitoolkit.LATENT_DIR:
            self.kind = "ai-toolkit"
        elif finetrainers.precomputed_folder(path):
            # saved from the GPU, loaded with map_location (layouts/finetrainers.py)
            self.expected_device = ANY_DEVICE
        elif onetrainer.sample_folder(path):
            self.kind = "onetrainer"
            # mgds' `<sha256>/variation-<n>`, or `image/epoch-<n>` and `text/epoch-<n>` before
            # a8e7480: mgds loads with map_location=train_device
            if _group(os.path.basename(os.path.dirname(path))) or onetrainer.EPOCH.match(base):
                self.expected_device = ANY_DEVICE
            self.onetrainer = onetrainer.OneTrainerNaming(
                naming.aggregates, vae_factor=naming.vae_factor).directory(path, bucket, "cache")

    def images_belong(self) -> bool:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return False
        return _beside_images(self.path, mtime) or _project_images(self.path, self.root)

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        if self.kind == "ai-toolkit" and name.endswith(".safetensors"):
            return aitoolkit.header_facts(meta)._replace(key=None)
        if self.kind == "onetrainer":
            return self.onetrainer.cache(name, meta)._replace(key=None)
        if name.endswith(".safetensors") and meta.metadata.get("format_version"):
            family = musubi.header_family(name, meta)
            if family is not None:  # musubi's buckets need the dataset's settings
                return CacheFacts(family=family)
        if name.endswith(".npz"):
            # kohya's `_<arch>.npz`: its family in any folder (`_sdxl.npz` beside `_flux.npz`,
            # as scanning the image dir itself compares them), no bucket (see the docstring)
            match = kohya.LATENT_NAME.match(name)
            if match:
                return CacheFacts(family=match["arch"])
        if self.bucket is None:
            return NO_FACTS
        if name.endswith(".npz"):
            return self.folder
        if len(name) == 67 and SHA256_PT.match(name):
            return NO_FACTS
        return self.folder
