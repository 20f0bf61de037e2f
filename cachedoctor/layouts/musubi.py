"""musubi-tuner: the dataset config TOML (`[general]`, `[[datasets]]` with `image_directory` /
`video_directory`, `cache_directory`, `resolution`, `target_frames`, ...), as
kohya-ss/musubi-tuner 30c658c4 (2026-06-24) reads it (dataset/config_utils.py,
image_video_dataset.py, bucket.py, cache_io.py).

Paths: musubi-tuner opens relative paths from the directory it is started in; cachedoctor takes
that to be the folder of the config file, as for kohya. Each dataset's values fall back to
`[general]`, then musubi's defaults (resolution 960x544, enable_bucket false, target_frames
[1], frame_extraction "head"); `cache_directory` defaults to the image or video directory.

The caches are safetensors written by `save_latent_cache_common` and
`save_text_encoder_output_cache_common`, globbed back by architecture (`*_<arch>.safetensors`):
- image latents `<stem>_<WWWW>x<HHHH>_<arch>.safetensors`, WWWW x HHHH the original image size;
- video latents `<stem>_<pos:05d>-<frames:03d>_<WWWW>x<HHHH>_<arch>.safetensors`, one per
  extracted clip, WWWW x HHHH the original frame size;
- text encoder outputs `<stem>_<arch>_te.safetensors`, the caption in the `caption1` metadata.
Latent keys are `latents_<F>x<H>x<W>_<dtype>` (`latents_image_`, `latents_control_` alike), the
tensor [C, F, H, W]; other keys end in their dtype (`clip_bfloat16`, `f_indices_int32`). The
header metadata holds `architecture`, `width`, `height`, `format_version` and `frame_count`.
A latent's bucket is the one musubi's BucketSelector picks for the size in its name (images:
the dataset's bucket settings; videos: bucketing is always on when caching).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cachedoctor.formats import read_path
from cachedoctor.formats.meta import FileMeta, TensorMeta
from cachedoctor.layouts.base import (
    CacheFacts,
    Dataset,
    DirectoryNaming,
    Layout,
    Naming,
    frozen,
)
from cachedoctor.layouts.bigfiles import BeyondLimit, jsonl_lines
from cachedoctor.layouts.common import Problems, ending, listdir, names, typed, unique
from cachedoctor.layouts.entries import Changes, Entries, EntrySpec, NoSpec
from cachedoctor.layouts.paths import resolve
from cachedoctor.layouts.sources import ConfigFile, type_name
from cachedoctor.regular_files import read_small

NAME = "musubi"
TITLE = "musubi-tuner"

# short name -> (architecture metadata, VAE spatial factor or None when it depends on the model
# version or the latent is no VAE's, bucket step, script prefix of the caching scripts)
# The /16 factors, as 30c658c4 encodes (the bucket's sides are multiples of its 16-px step):
# - FLUX.2: flux_2_cache_latents.py loads one AutoEncoder for every --model_version
#   (flux2_utils.load_ae: AutoEncoderParams(), ch_mult [1, 2, 4, 4], three stride-2
#   Downsamples, /8) and flux_2/flux2_models.AutoEncoder.encode folds 2x2 patches into the
#   channels: [128, H/16, W/16], saved by cache_io.save_latent_cache_flux_2.
# - Ideogram 4: ideogram4_cache_latents.py, ideogram4/ideogram4_autoencoder.AutoEncoder (the
#   FLUX.2 Encoder, the same 2x2 fold in (pi pj c) order): [128, H/16, W/16].
# - HunyuanVideo 1.5: hv_1_5_cache_latents.py, hunyuan_video_1_5_vae.load_vae_from_checkpoint
#   (AutoencoderKLConv3D ffactor_spatial 16, ffactor_temporal 4): [32, F, H/16, W/16]. With
#   tiling (--vae_sample_size, default 128; 256; 0 = off) the tiles' rows add up to H/16 as
#   long as the sample size is a multiple of 64, as those are.
ARCHITECTURES: dict[str, tuple[str, int | None, int, str]] = {
    "hv": ("hunyuan_video", 8, 16, ""),
    "wan": ("wan", None, 16, "wan_"),  # Wan 2.1 VAE: /8, Wan 2.2 TI2V-5B VAE: /16
    "fp": ("framepack", 8, 16, "fpack_"),
    "fk": ("flux_kontext", 8, 16, "flux_kontext_"),
    "f2d": ("flux_2_dev", 16, 16, "flux_2_"),
    "f2k4b": ("flux_2_klein_4b", 16, 16, "flux_2_"),
    "f2k9b": ("flux_2_klein_9b", 16, 16, "flux_2_"),
    "qi": ("qwen_image", 8, 16, "qwen_image_"),
    "qie": ("qwen_image_edit", 8, 16, "qwen_image_"),
    "qil": ("qwen_image_layered", 8, 16, "qwen_image_"),
    "k5": ("kandinsky5", 8, 16, "kandinsky5_"),
    "hv15": ("hunyuan_video_1_5", 16, 16, "hv_1_5_"),
    "zi": ("z_image", 8, 16, "zimage_"),
    "ho1": ("hidream_o1_image", None, 32, "hidream_o1_"),  # pixel patch tokens, no latent
    "i4": ("ideogram4", 16, 16, "ideogram4_"),
    "kr2": ("krea2", 8, 16, "krea2_"),
    # ERNIE-Image: not in 30c658c4's architectures.py; PR #935 (head d94e2d6) adds it, its
    # latents patchified FLUX.2 VAE output [128, H/16, W/16] under `latents_<H>x<W>_<dtype>`
    "ei": ("ernie_image", 16, 16, "ernie_image_"),
}
FULL_NAMES = {full: short for short, (full, *_) in ARCHITECTURES.items()}
TEMPORAL_FACTOR = 4  # every video VAE musubi supports: latent frames = (frames - 1) // 4 + 1
# kandinsky5_cache_latents.py --nabla_resize: the bucketed frames are scaled up to the next
# multiple of 128 px before encoding (NABLA attention), so the latent is that size / 8
NABLA_ROUND = {"k5": 128}
NABLA_NAMES = tuple(f"_{arch}.safetensors" for arch in NABLA_ROUND)

ARCH = r"(?P<arch>[a-z0-9]+)"  # musubi's short names hold no underscore
SIZE = r"(?P<w>\d{4,})x(?P<h>\d{4,})"
IMAGE_LATENT = re.compile(rf"^(?P<stem>.+)_{SIZE}_{ARCH}\.safetensors$")
VIDEO_LATENT = re.compile(
    rf"^(?P<stem>.+)_(?P<pos>\d{{5,}})-(?P<frames>\d{{3,}})(?:-\d+)?_{SIZE}_{ARCH}\.safetensors$")
TEXT_ENTRY = re.compile(rf"^(?P<stem>.+)_{ARCH}_te\.safetensors$")
# key `latents_<F>x<H>x<W>_<dtype>` (also `latents_image_`, `latents_control_<i>_`, ...)
LATENT_KEY = re.compile(r"^latents_(?:[a-z0-9_]+_)?(?P<f>\d+)x(?P<h>\d+)x(?P<w>\d+)_[a-z0-9_]+$")
MAIN_LATENT_KEY = re.compile(r"^latents_\d+x\d+x\d+_[a-z0-9_]+$")

# media_utils.IMAGE_EXTENSIONS / VIDEO_EXTENSIONS (globbed case-sensitively on Linux)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".avif",
                    ".PNG", ".JPG", ".JPEG", ".WEBP", ".BMP", ".AVIF")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".avi", ".mkv", ".mov", ".flv", ".wmv", ".m4v", ".mpg",
                    ".mpeg", ".MP4", ".WEBM", ".AVI", ".MKV", ".MOV", ".FLV", ".WMV", ".M4V",
                    ".MPG", ".MPEG")
DATASET_KEYS = frozenset({"image_directory", "video_directory", "image_jsonl_file",
                          "video_jsonl_file", "cache_directory"})
DEFAULTS = {"resolution": (960, 544), "enable_bucket": False, "bucket_no_upscale": False,
            "target_frames": (1,), "frame_extraction": "head"}
MAX_CAPTION_BYTES = 65536
# a jsonl line is ~250 bytes (image_path and caption): 1 GiB is ~4 million images. Its captions
# are kept to compare, so past this they are not (a CD409 warning says so)
MAX_JSONL_BYTES = 2**30


def claims(config: ConfigFile) -> bool:
    """A TOML whose datasets (or [general]) name musubi's keys: kohya's datasets hold
    `[[datasets.subsets]]` with `image_dir` instead."""
    data = config.data
    if config.kind != "toml" or not isinstance(data, dict):
        return False
    datasets = data.get("datasets")
    tables = [d for d in datasets if isinstance(d, dict)] if isinstance(datasets, list) else []
    return any(DATASET_KEYS & t.keys() for t in tables)


def discover(folder: str) -> list[str]:
    return [os.path.join(folder, n) for n in listdir(folder, ending(".toml"))]


def _reason(root: str) -> str:
    return f"{root}, the folder of the config (musubi-tuner resolves against its working dir)"


def load(config: ConfigFile) -> Layout:
    problems = Problems()
    root = os.path.dirname(config.path)
    data = config.data
    general = _general(config, data.get("general") if isinstance(data.get("general"), dict)
                       else {}, problems)
    tables = data.get("datasets", [])
    found: list[tuple[dict, tuple]] = []
    if not isinstance(tables, list):
        problems.invalid(config.origin("datasets"), f"datasets is {type_name(tables)}: "
                         "expected [[datasets]] tables", key="datasets")
        tables = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            problems.invalid(config.origin("datasets", i), f"datasets[{i}] is "
                             f"{type_name(table)}: expected a table")
            continue
        found.append((table, ("datasets", i)))
    labels = [_media(t)[1] or _media(t)[2] or f"dataset{i}" for i, (t, _) in enumerate(found)]
    ids = unique(os.path.basename(str(n).rstrip("/")) or str(n) for n in labels)
    datasets = []
    for ident, (table, where) in zip(ids, found, strict=True):
        dataset = _dataset(config, root, ident, table, where, general, problems)
        if dataset is not None:
            datasets.append(dataset)
    return Layout(NAME, config.path, tuple(datasets), tuple(problems.items), (config.path,),
                  root, _reason(root))


def _media(table: dict) -> tuple[bool, str | None, str | None]:
    """(video dataset, media directory, jsonl file) as the table names them."""
    video = "video_directory" in table or "video_jsonl_file" in table
    prefix = "video" if video else "image"
    directory, jsonl = table.get(f"{prefix}_directory"), table.get(f"{prefix}_jsonl_file")
    return (video, directory if isinstance(directory, str) else None,
            jsonl if isinstance(jsonl, str) else None)


ASCENDABLE = {"resolution": (int, list), "caption_extension": str, "enable_bucket": bool,
              "bucket_no_upscale": bool}  # config_utils.DATASET_ASCENDABLE_SCHEMA (those used)


def _general(config: ConfigFile, general: dict, problems: Problems) -> dict:
    """[general]'s values, checked once (each dataset falls back to them), else the defaults."""
    out = {key: _checked(config, problems, ("general",), general, key, None)
           for key in ASCENDABLE}
    return {k: DEFAULTS.get(k) if v is None else v for k, v in out.items()}


def _checked(config: ConfigFile, problems: Problems, where: tuple, table: dict, key: str,
             ident: str | None) -> object:
    """table[key] when it is what musubi accepts, else None (and a CD409 problem)."""
    value = typed(config, problems, where, table, key, ASCENDABLE[key], None, ident)
    if key == "resolution" and value is not None:
        value = _resolution(value)
        if value is None:
            problems.invalid(config.origin(*where, key), "resolution is not a size such as 960 "
                             f"or [960, 544] (at most {MAX_SIDE:,})", ident, key=key)
    return value


def _setting(config: ConfigFile, problems: Problems, where: tuple, table: dict,
             general: dict, key: str, ident: str) -> object:
    """A dataset's value, else [general]'s (DATASET_ASCENDABLE_SCHEMA), else the default."""
    if key in table:
        value = _checked(config, problems, where, table, key, ident)
        if value is not None:
            return value
    return general[key]


def _dataset(config: ConfigFile, root: str, ident: str, table: dict, where: tuple,
             general: dict, problems: Problems) -> Dataset | None:
    video, directory, jsonl = _media(table)
    media_key = ("video" if video else "image") + ("_directory" if directory else "_jsonl_file")
    if directory is None and jsonl is None:
        problems.invalid(config.origin(*where), f"dataset {ident} has no image_directory, "
                         "video_directory or jsonl file: expected one", ident,
                         key="image_directory")
        return None
    for key in (media_key, "cache_directory"):
        if "\0" in str(table.get(key, "")):  # os.path and os.listdir raise ValueError on it
            problems.invalid(config.origin(*where, key), f"{key} holds a NUL byte: no path can",
                             ident, key=key)
            return None
    media = resolve(root, directory) if directory else None
    if media is not None and not os.path.isdir(media):
        problems.missing(config.origin(*where, media_key), media_key, directory, media,
                         _reason(root), ident)
    if media is None and jsonl is not None and not os.path.isfile(resolve(root, jsonl)):
        problems.missing(config.origin(*where, media_key), media_key, jsonl,
                         resolve(root, jsonl), _reason(root), ident)
    cache_value = typed(config, problems, where, table, "cache_directory", str, None, ident)
    if cache_value is None and media is None:
        problems.invalid(config.origin(*where), f"dataset {ident} names a jsonl file and no "
                         "cache_directory: musubi-tuner requires one", ident,
                         key="cache_directory")
        return None
    cache = resolve(root, cache_value) if cache_value else media
    assert cache is not None
    resolution = _setting(config, problems, where, table, general, "resolution", ident)
    caption_ext = _setting(config, problems, where, table, general, "caption_extension", ident)
    frames = typed(config, problems, where, table, "target_frames", list, [1], ident)
    targets = tuple(sorted({(f - 1) // TEMPORAL_FACTOR * TEMPORAL_FACTOR + 1
                            for f in frames if isinstance(f, int) and f > 0})) or (1,)
    extraction = typed(config, problems, where, table, "frame_extraction", str, "head", ident)

    def beyond(exc: BeyondLimit) -> None:
        problems.invalid(config.origin(*where, media_key), f"{media_key} {jsonl!r} was not "
                         f"read: {exc}; its captions are not compared", ident, key=media_key,
                         reading_limit=exc.limit)

    captions = _captions(media, caption_ext, jsonl and resolve(root, jsonl), video, beyond)
    # glob_images(caption_extension=...): images without a caption file are no items
    captioned = frozenset(captions) if captions is not None and media is not None else None
    naming = MusubiNaming(
        cache=cache, media=media, video=video, resolution=resolution, captioned=captioned,
        enabled=bool(_setting(config, problems, where, table, general, "enable_bucket", ident)),
        no_upscale=bool(_setting(config, problems, where, table, general, "bucket_no_upscale",
                                 ident)),
        config=config.path)
    beside = media is not None and os.path.realpath(cache) == os.path.realpath(media)
    options = {"target_frames": targets if video else None,
               "frame_extraction": extraction if video else None,
               "captions": frozen(captions) if captions is not None else None,
               "caption_extension": caption_ext}
    origins = {"cache_dir": config.origin(*where, "cache_directory")}
    if media is not None:
        origins["image_dir"] = config.origin(*where, media_key)
    if video:
        origins["target_frames"] = config.origin(*where, "target_frames")
    return Dataset(
        ident, cache_dirs=() if beside else (cache,),
        image_dirs=(media,) if media else (), shallow_image_dirs=(media,) if media else (),
        latent_cache_dir=cache, text_cache_dir=cache, caches_beside_images=beside,
        options=frozen(options), origins=frozen(origins), naming=naming)


MAX_SIDE = 1 << 16  # a larger side is a typo, and its bucket list would take long to make


def _resolution(value: object) -> tuple[int, int] | None:
    def side(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_SIDE

    if side(value):
        return value, value  # type: ignore[return-value]
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(side(v) for v in value):
        return value[0], value[1]
    return None


def _captions(media: str | None, extension: object, jsonl: str | None, video: bool,
              beyond: Callable[[BeyondLimit], None] | None = None) -> dict[str, str] | None:
    """{stem: caption} as musubi reads them (the caption file's text, stripped; a jsonl line's
    "caption"), or None when the captions cannot be known; `beyond` is told of a jsonl file
    past cachedoctor's reading limit."""
    out: dict[str, str] = {}
    if media is not None and isinstance(extension, str) and extension:
        kinds = VIDEO_EXTENSIONS if video else IMAGE_EXTENSIONS
        try:
            listed = os.listdir(media)
        except OSError:
            return None
        present = set(listed)
        for name in listed:
            if not name.endswith(kinds):
                continue
            stem = os.path.splitext(name)[0]
            if stem + extension in present:
                text = _read_caption(os.path.join(media, stem + extension))
                if text is not None:
                    out[stem] = text
        return out
    if jsonl is not None:
        try:
            # a regular file only (a FIFO must not hang the scan), line by line, each line and
            # the file bounded (nor /dev/zero fill memory)
            for _, line in jsonl_lines(jsonl, MAX_JSONL_BYTES):
                try:
                    item = json.loads(line.decode("utf-8"))
                except (ValueError, RecursionError):  # a line nested past json's reach
                    continue
                path = item.get("video_path" if video else "image_path") if isinstance(
                    item, dict) else None
                if isinstance(path, str) and isinstance(item.get("caption"), str):
                    out[os.path.splitext(os.path.basename(path))[0]] = item["caption"]
        except BeyondLimit as exc:
            if beyond is not None:
                beyond(exc)
            return None
        except (OSError, UnicodeDecodeError):
            return None
        return out
    return None


def _read_caption(path: str) -> str | None:
    raw = read_small(path, MAX_CAPTION_BYTES)
    if raw is None or len(raw) > MAX_CAPTION_BYTES:
        return None
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None


# -- buckets (bucket.BucketSelector) -------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def bucket_resolutions(resolution: tuple[int, int], steps: int) -> tuple[tuple[int, int], ...]:
    """BucketSelector's buckets: widths from half the square side up, each with the height
    that keeps the area, both rounded down to the step."""
    area = resolution[0] * resolution[1]
    side = int(math.sqrt(area))
    found = set()
    for w in range(_floor(side // 2, steps), side + steps, steps):
        h = _floor(area // w, steps)
        found.update({(w, h), (h, w)})
    return tuple(sorted(found))


def select_bucket(size: tuple[int, int], resolution: tuple[int, int], enabled: bool,
                  no_upscale: bool, steps: int) -> tuple[int, int]:
    """BucketSelector.get_bucket_resolution: the (w, h) bucket of an image of `size`."""
    if not enabled:
        return resolution
    width, height = size
    if no_upscale and width * height <= resolution[0] * resolution[1]:
        return _floor(width, steps), _floor(height, steps)
    buckets = bucket_resolutions(resolution, steps)
    aspect = width / height
    # np.argmin over |bucket aspect - aspect|: the first bucket on a tie
    return buckets[min(range(len(buckets)), key=lambda i: abs(buckets[i][0] / buckets[i][1]
                                                               - aspect))]


def _floor(value: int, step: int) -> int:
    return value - value % step


def latent_frames(frames: int) -> int:
    return (frames - 1) // TEMPORAL_FACTOR + 1


def script(arch: str, what: str) -> str:
    """The musubi-tuner script that (re)builds an architecture's latents or text outputs."""
    prefix = ARCHITECTURES.get(arch, ("", None, 16, ""))[3]
    return f"src/musubi_tuner/{prefix}cache_{what}.py"


def header_family(name: str, meta: FileMeta) -> str | None:
    """The architecture of a latent named and headed as musubi writes them, else None."""
    match = VIDEO_LATENT.match(name) or IMAGE_LATENT.match(name)
    full = meta.metadata.get("architecture")
    if match is None or full not in FULL_NAMES:
        return None
    return match["arch"]


def _names(path: str) -> list[str]:
    # os.listdir, not common.listdir: that one keeps only config and image names
    try:
        return os.listdir(path)
    except OSError:
        return []


def media_dir(path: str) -> bool:
    """A folder holding musubi latents beside images or videos (no cache_directory set). The
    shared listing (images, videos) first: only a folder with media is listed whole. A latent
    of an architecture this table does not know (a newer musubi) counts when its header is
    musubi's: one such header is read."""
    if not any(n.endswith(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS) for n in names(path)):
        return False
    unknown = None
    for n in _names(path):
        if n.endswith(".safetensors") and (IMAGE_LATENT.match(n) or VIDEO_LATENT.match(n)):
            if n.rsplit("_", 1)[-1][:-12] in ARCHITECTURES:
                return True
            unknown = unknown or n
    return unknown is not None and _musubi_header(os.path.join(path, unknown))


def _musubi_header(path: str) -> bool:
    try:  # (read_path reports what it cannot read; a layout guess must never raise either)
        metadata = read_path(path).metadata
    except Exception:
        return False
    return "architecture" in metadata and "format_version" in metadata


# -- naming --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MusubiNaming(Naming):
    """musubi's naming: latents and text outputs in the cache directory, keyed by the media
    file's stem."""

    cache: str
    media: str | None
    video: bool
    resolution: tuple[int, int]
    enabled: bool
    no_upscale: bool
    captioned: frozenset[str] | None = None  # stems with a caption file, when musubi filters
    config: str = ""

    stem_collisions = True  # a.png and a.jpg both map to a_<W>x<H>_<arch>.safetensors

    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return _Directory(self, path)

    def entries(self, dataset: Dataset, changes: Changes) -> Entries:
        return _Entries(self, changes)

    def expected_entry(self, image: str) -> str:
        stem = os.path.splitext(os.path.basename(image))[0]
        return f"{stem}_<W>x<H>_<arch>.safetensors"

    def facts(self, name: str, latent: tuple[int, int] | None = None) -> CacheFacts:
        """What a latent's file name says: its media stem, bucket, latent size, architecture.
        `latent`: the (h, w) of the file's main latent, where it is known (NABLA_ROUND)."""
        match = (VIDEO_LATENT if self.video else IMAGE_LATENT).match(name)
        if match is None:
            return CacheFacts()
        arch = match["arch"]
        width, height = int(match["w"]), int(match["h"])
        known = ARCHITECTURES.get(arch)
        key = match["stem"] if self.media is not None else None
        if known is None or width == 0 or height == 0:
            return CacheFacts(key=key, family=arch)
        _, factor, steps, _ = known
        if self.video:  # caching buckets videos whatever enable_bucket says (VideoDataset)
            bw, bh = select_bucket((width, height), self.resolution, True, False, steps)
            bucket = f"{bw}x{bh}x{int(match['frames'])}f"
        else:
            bw, bh = select_bucket((width, height), self.resolution, self.enabled,
                                   self.no_upscale, steps)
            bucket = f"{bw}x{bh}"
        expected = (bh // factor, bw // factor) if factor else None
        step = NABLA_ROUND.get(arch)
        if step and factor and latent == (-(-bh // step) * step // factor,
                                          -(-bw // step) * step // factor):
            expected = latent  # encoded with --nabla_resize
        return CacheFacts(key=key, bucket=bucket, expected=expected, family=arch)


class _Directory(DirectoryNaming):
    def __init__(self, naming: MusubiNaming, path: str) -> None:
        super().__init__()
        self.naming = naming
        self.media = naming.media is not None and (
            path == naming.media or os.path.realpath(path) == os.path.realpath(naming.media))

    def image(self, name: str) -> tuple[str, bool] | None:
        if not self.media or self.naming.video or not name.endswith(IMAGE_EXTENSIONS):
            return None
        stem = os.path.splitext(name)[0]
        captioned = self.naming.captioned
        return stem, captioned is None or stem in captioned

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        if not name.endswith(".safetensors") or TEXT_ENTRY.match(name):
            return CacheFacts()
        facts = self.naming.facts(name, _main_latent(meta) if name.endswith(NABLA_NAMES)
                                  else None)
        if self.naming.video:  # videos are no images of the walk: no coverage key
            return facts._replace(key=None)
        return facts


def main_latents(meta: FileMeta) -> Iterator[TensorMeta]:
    """The tensors of a musubi latent cache under the main key `latents_<F>x<H>x<W>_<dtype>`
    ([C, F, H, W]), in the file's order."""
    return (t for t in meta.tensors if len(t.path) == 1 and isinstance(t.path[0], str)
            and MAIN_LATENT_KEY.match(t.path[0]))


def _main_latent(meta: FileMeta) -> tuple[int, int] | None:
    """(h, w) of the main latent."""
    return next(((t.shape[-2], t.shape[-1]) for t in main_latents(meta) if len(t.shape) >= 2),
                None)


class _Entries(Entries):
    """musubi-tuner's caches are rebuilt by its own caching scripts: a latent needs the model's
    VAE (and, for Wan and FramePack, its image encoder) and is written with keys and metadata
    of the architecture, so the plan names the command instead of writing the entry."""

    def __init__(self, naming: MusubiNaming, changes: Changes) -> None:
        super().__init__(changes)
        self.naming = naming

    def source(self, entry: str) -> str:
        raise NoSpec(self._rebuild(entry))

    def spec(self, image: str, replacing: str | None = None) -> EntrySpec:
        raise NoSpec(self._rebuild(replacing or image))

    def _rebuild(self, path: str) -> str:
        name = os.path.basename(path)
        match = TEXT_ENTRY.match(name) or IMAGE_LATENT.match(name) or VIDEO_LATENT.match(name)
        arch = match["arch"] if match else self.once("arch", self._neighbours)
        what = "text_encoder_outputs" if TEXT_ENTRY.match(name) else "latents"
        model = "the text encoder arguments of your run" if what != "latents" else "--vae <VAE>"
        command = f"python {script(arch, what)}" if arch in ARCHITECTURES else (
            f"the {what} caching script of the model (cache_{what}.py, wan_cache_{what}.py, ...)")
        return (f"musubi-tuner rebuilds it: {command} --dataset_config "
                f"{self.naming.config} {model} --skip_existing (only the missing entries are "
                "written)")

    def _neighbours(self) -> str | None:
        """The architecture most latents of the cache directory have (a missing entry's)."""
        pattern = VIDEO_LATENT if self.naming.video else IMAGE_LATENT
        found = Counter(m["arch"] for m in map(pattern.match, _names(self.naming.cache))
                        if m is not None)
        return found.most_common(1)[0][0] if found else None
