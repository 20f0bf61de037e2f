"""Walk the targets and name each file's role, by its name and place only (no content read).

The walk is iterative, follows directory symlinks once (a loop back to a directory already
seen is reported, not followed), skips `.cachedoctor/` (our own journal and quarantine) and
turns every I/O failure into an Entry carrying the error instead of raising.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from cachedoctor.formats import describe_os_error

LATENT = "latent"
TEXT = "text"
METADATA = "metadata"
TEMP = "temp"
IMAGE = "image"
OTHER = "other"

STATE_DIR = ".cachedoctor"
IMAGE_EXTENSIONS = frozenset(
    {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".jxl", ".avif"}
)
CACHE_EXTENSIONS = frozenset(
    {".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".safetensors", ".npz", ".npy"}
)
# atomicwrites' NamedTemporaryFile (tmp + 8 of [a-z0-9_]); SimpleTuner's Nov-Dec 2024
# `.<name>.tmp`; `*.pt.tmp`; and lock files left by writers that died holding them.
TEMP_PATTERN = re.compile(
    r"^(tmp[a-z0-9_]{8}|\..+\.tmp|.+\.(pt|pth|npz|safetensors)\.tmp|.+\.lock|.+\.partial)$"
)
METADATA_PATTERN = re.compile(
    r"^(aspect_ratio_bucket_(indices|metadata)_.+\.json|aggregate\.pt|\.aitk_size\.json"
    r"|metadata_cache\.json|all_(image|vae_cache|text_cache)_files_.+\.json)$"
)
# SimpleTuner md5(caption)-<family>.pt; kohya's text-encoder npz suffixes.
TEXT_PATTERN = re.compile(
    r"^([0-9a-f]{32}-[\w.]+\.pt|.+_te_outputs\.npz|.+_(flux|sd3|lumina|anima|hi)_te\.npz)$"
)
TEXT_DIRS = frozenset({"_t_e_cache", "text"})


@dataclass(frozen=True, slots=True)
class Entry:
    path: str  # absolute; str from os.fsdecode, so undecodable names survive (surrogateescape)
    size: int
    mtime: float
    role: str
    dataset: str | None = None
    bucket: str | None = None
    error: str | None = None  # why it could not be listed or stat'ed; nothing else is known
    area: str = "cache"  # "cache": a cache dir; "images": an image dir (kohya caches live there)


def classify(name: str, parent: str = "") -> str:
    """The role a file plays, judged from its name and its directory's name."""
    lower = name.lower()
    ext = os.path.splitext(lower)[1]
    if TEMP_PATTERN.match(name):
        return TEMP
    if ext in IMAGE_EXTENSIONS:
        return IMAGE
    if METADATA_PATTERN.match(name):
        return METADATA
    if ext in CACHE_EXTENSIONS:
        # OneTrainer keeps text embeds in <cache>/text/<sha>/variation-<n>/<i>.pt
        if TEXT_PATTERN.match(lower) or TEXT_DIRS.intersection(parent.split(os.sep)[-3:]):
            return TEXT
        return LATENT
    return OTHER


def excluded(path: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(os.path.basename(path), p)
               for p in patterns)


def walk(root: str, *, dataset: str | None = None, exclude: tuple[str, ...] = (),
         bucket_from_folders: bool = True) -> Iterator[Entry]:
    """Every file under `root` (or `root` itself if it is a file), as Entries."""
    root = os.path.abspath(root)
    try:
        st = os.stat(root)
    except OSError as exc:
        yield Entry(root, 0, 0.0, OTHER, dataset, None, describe_os_error(exc))
        return
    if not stat.S_ISDIR(st.st_mode):
        yield _entry(root, st, dataset, None)
        return
    seen = {(st.st_dev, st.st_ino)}
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as it:
                children = list(it)
        except OSError as exc:
            yield Entry(directory, 0, 0.0, OTHER, dataset, None, describe_os_error(exc))
            continue
        bucket = _bucket(root, directory) if bucket_from_folders else None
        for child in children:
            path = child.path
            if exclude and excluded(path, exclude):
                continue
            try:
                is_dir = child.is_dir()  # follows symlinks
            except OSError:
                is_dir = False
            if is_dir:
                if child.name == STATE_DIR:
                    continue
                try:
                    cst = child.stat()
                except OSError as exc:
                    yield Entry(path, 0, 0.0, OTHER, dataset, bucket, describe_os_error(exc))
                    continue
                key = (cst.st_dev, cst.st_ino)
                if key in seen:
                    if child.is_symlink():
                        yield Entry(path, 0, 0.0, OTHER, dataset, bucket,
                                    "symlink loop: points back to a directory already scanned")
                    continue
                seen.add(key)
                stack.append(path)
                continue
            try:
                cst = child.stat()
            except OSError as exc:
                reason = describe_os_error(exc)
                if child.is_symlink() and exc.errno == 2:
                    reason = "cannot read: broken symlink"
                yield Entry(path, 0, 0.0, OTHER, dataset, bucket, reason)
                continue
            if not stat.S_ISREG(cst.st_mode):
                continue  # sockets, FIFOs and devices are no cache files and must not be opened
            yield _entry(path, cst, dataset, bucket)


def _entry(path: str, st: os.stat_result, dataset: str | None, bucket: str | None) -> Entry:
    return Entry(path, st.st_size, st.st_mtime, classify(os.path.basename(path),
                                                         os.path.dirname(path)), dataset, bucket)


def _bucket(root: str, directory: str) -> str | None:
    """With no trainer metadata, a sub-folder of the cache dir is a bucket (the root is none)."""
    if directory == root:
        return None
    return os.path.relpath(directory, root)
