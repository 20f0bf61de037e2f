"""A SimpleTuner project on disk: images with captions, `config/config.json`,
`config/multidatabackend.json`, and SimpleTuner's cache names and bucket files.

Everything here is plain files and JSON (no torch), so the parent process writes the project and
the rank processes read it back from `project.json`. Names follow SimpleTuner's own (README,
"How each trainer's files map"): VAE entries `sha256(<image stem>).pt`, text entries
`md5(caption)-<family>.pt`, bucket files `aspect_ratio_bucket_{indices,metadata}_<id>.json` in
the image dir.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cachedoctor.fixtures.images import write_png

T = TypeVar("T")
FAMILY_CHANNELS = {"sdxl": 4, "flux": 16}
VAE_FACTOR = 8
# Three aspect buckets, SimpleTuner's keys (round(w/h, 2)) -> (width, height), 64-aligned.
BUCKETS = {"1.0": (128, 128), "1.5": (192, 128), "0.67": (128, 192)}
MIN_PER_BUCKET = 8
DEFAULT_BUCKET = "1.0"
_SUBJECTS = ("fox", "lighthouse", "teapot", "bicycle", "cactus", "violin", "owl", "harbor")
_STYLES = ("watercolor", "photo", "charcoal sketch")


@dataclass(frozen=True)
class Sample:
    """One image of the dataset (or, when the cache lives among the images, a stray file)."""

    path: str
    caption: str
    bucket: str
    size: tuple[int, int] | None  # (width, height); None when the file has no image header


@dataclass(frozen=True)
class Project:
    root: str
    processes: int
    per_bucket: int = MIN_PER_BUCKET  # images per aspect bucket
    family: str = "sdxl"
    dataset_id: str = "photos"
    overlap: bool = False  # the image dir is the VAE cache dir (docs/incidents.md, incident 5)
    clear_each_epoch: bool = False  # vae_cache_clear_each_epoch (incident 2)
    # the harness loads entries with a plain torch.load, not SimpleTuner's map_location="cpu":
    # scanned as caches whose loader is unknown, not through the SimpleTuner config (incident 3)
    plain_loader: bool = False

    @property
    def channels(self) -> int:
        return FAMILY_CHANNELS[self.family]

    @property
    def image_dir(self) -> Path:
        return Path(self.root) / "datasets" / self.dataset_id

    @property
    def vae_cache_dir(self) -> Path:
        if self.overlap:
            return self.image_dir
        return Path(self.root) / "cache" / "vae" / self.family / self.dataset_id

    @property
    def text_cache_dir(self) -> Path:
        return Path(self.root) / "cache" / "text" / self.family

    @property
    def output_dir(self) -> Path:
        return Path(self.root) / "output"

    @property
    def config_path(self) -> Path:
        return Path(self.root) / "config" / "config.json"

    @property
    def backend_path(self) -> Path:
        return Path(self.root) / "config" / "multidatabackend.json"

    @property
    def cache_dirs(self) -> tuple[Path, ...]:
        return (self.vae_cache_dir, self.text_cache_dir)

    def vae_cache_path(self, image: str | Path) -> Path:
        """SimpleTuner hashes the stem only (the extension is dropped): `sha256(stem).pt`."""
        stem = Path(image).stem
        return self.vae_cache_dir / f"{hashlib.sha256(stem.encode()).hexdigest()}.pt"

    def text_cache_path(self, caption: str) -> Path:
        return self.text_cache_dir / f"{hashlib.md5(caption.encode()).hexdigest()}-{self.family}.pt"

    def bucket_file(self, kind: str) -> Path:
        return self.image_dir / f"aspect_ratio_bucket_{kind}_{self.dataset_id}.json"

    def backend_entry(self) -> dict:
        return {
            "id": self.dataset_id,
            "type": "local",
            "dataset_type": "image",
            "instance_data_dir": str(self.image_dir),
            "cache_dir_vae": str(self.vae_cache_dir),
            "caption_strategy": "textfile",
            "resolution": 128,
            "resolution_type": "pixel",
            "crop": False,
            "minimum_image_size": 64,
            "vae_cache_clear_each_epoch": self.clear_each_epoch,
            "repeats": 0,
        }

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Project:
        return cls(**json.loads(path.read_text()))


def write_project(root: Path, processes: int, **options: object) -> Project:
    """Images (three buckets), captions and both SimpleTuner config files under `root`.

    Each bucket holds at least 4 images per rank, so that every rank encodes full VAE batches
    of 4 and trains on two batches of 2 per bucket, whatever --ranks is.
    """
    per_bucket = max(MIN_PER_BUCKET, 4 * processes)
    project = Project(str(Path(root).absolute()), processes, per_bucket, **options)  # type: ignore[arg-type]
    project.image_dir.mkdir(parents=True, exist_ok=True)
    for directory in (*project.cache_dirs, project.output_dir, project.config_path.parent):
        directory.mkdir(parents=True, exist_ok=True)
    sizes = [size for size in BUCKETS.values() for _ in range(per_bucket)]
    for index, (width, height) in enumerate(sizes):
        image = write_png(project.image_dir / f"img_{index:03d}.png", width, height, seed=index)
        image.with_suffix(".txt").write_text(caption(index) + "\n")
    project.backend_path.write_text(json.dumps([
        project.backend_entry(),
        {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
         "cache_dir": str(project.text_cache_dir)},
    ], indent=2))
    project.config_path.write_text(json.dumps({
        "--model_family": project.family,
        "--num_processes": processes,
        "--data_backend_config": str(project.backend_path),
        "--output_dir": str(project.output_dir),
        "--train_batch_size": 2,
        "--vae_batch_size": 4,
        "--compress_disk_cache": False,
        "--resolution": 128,
        "--resolution_type": "pixel",
    }, indent=2))
    return project


def caption(index: int) -> str:
    subject = _SUBJECTS[index % len(_SUBJECTS)]
    return f"a {_STYLES[index // len(_SUBJECTS) % len(_STYLES)]} of a {subject}, plate {index}"


def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Rank `rank`'s contiguous share of `items`, as accelerate's split_between_processes gives it."""
    per, extra = divmod(len(items), world)
    start = rank * per + min(rank, extra)
    return list(items[start : start + per + (rank < extra)])


def image_size(path: str | Path) -> tuple[int, int] | None:
    """(width, height) from a PNG header, without decoding; None for anything else."""
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def aspect_bucket(width: int, height: int) -> str:
    return str(round(width / height, 2))


def discover(project: Project) -> list[Sample]:
    """Every sample file in the image dir, as the reference trainer's file discovery finds them.

    Captions and bucket metadata are not samples; everything else is. A file with no image
    header (a pre-encoded latent) gets the dataset's default bucket, and `<stem>.txt` or the
    empty caption. This is how cache files in the image dir become samples (incident 5).
    """
    samples = []
    for name in sorted(os.listdir(project.image_dir)):
        path = project.image_dir / name
        if not path.is_file() or name.endswith(".txt") or name.startswith("aspect_ratio_bucket_"):
            continue
        size = image_size(path)
        text = path.with_suffix(".txt")
        samples.append(Sample(
            str(path),
            text.read_text().strip() if text.exists() else "",
            aspect_bucket(*size) if size else DEFAULT_BUCKET,
            size,
        ))
    return samples


def write_bucket_files(project: Project, samples: list[Sample]) -> None:
    """SimpleTuner's `aspect_ratio_bucket_indices_<id>.json` and `..._metadata_<id>.json`.

    Written by the main process only; in SimpleTuner the other ranks then `reload_cache()`.
    """
    indices: dict[str, list[str]] = {}
    metadata = {}
    for s in samples:
        indices.setdefault(s.bucket, []).append(s.path)
        if s.size is not None:
            metadata[s.path] = {"original_size": list(s.size), "crop_coordinates": [0, 0],
                                "target_size": list(s.size), "intermediary_size": list(s.size),
                                "aspect_ratio": float(s.bucket)}
    _write_json(project.bucket_file("indices"),
                {"config": project.backend_entry(), "aspect_ratio_bucket_indices": indices})
    _write_json(project.bucket_file("metadata"), metadata)


def read_buckets(project: Project) -> list[Sample]:
    """The samples as the bucket files list them (what non-main ranks load)."""
    indices = json.loads(project.bucket_file("indices").read_text())["aspect_ratio_bucket_indices"]
    metadata = json.loads(project.bucket_file("metadata").read_text())
    samples = []
    for bucket, paths in indices.items():
        for path in paths:
            size = metadata.get(path, {}).get("original_size")
            text = Path(path).with_suffix(".txt")
            samples.append(Sample(path, text.read_text().strip() if text.exists() else "", bucket,
                                  tuple(size) if size else None))
    return sorted(samples, key=lambda s: s.path)


def _write_json(path: Path, data: object) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)
