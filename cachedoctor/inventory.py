"""Walk the targets and name each file's role, by its name and place only (no content read).

The walk is iterative, follows directory symlinks once (a loop back to a directory already
seen is reported, not followed), skips `.cachedoctor/` (our own journal and quarantine) and
turns every I/O failure into an Entry carrying the error instead of raising.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
from collections.abc import Iterator
from typing import NamedTuple

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


class Entry(NamedTuple):
    """A file to check. Size and times come later, from the worker's fstat of the open file:
    the walk itself only lists directories, so it never stats a regular file."""

    path: str  # absolute; str from os.fsdecode, so undecodable names survive (surrogateescape)
    role: str
    dataset: str | None = None
    bucket: str | None = None
    error: str | None = None  # why it could not be listed or reached; nothing else is known
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
         bucket_from_folders: bool = True, area: str = "cache") -> Iterator[Entry]:
    """Every file under `root` (or `root` itself if it is a file), as Entries."""
    root = os.path.abspath(root)
    try:
        st = os.stat(root)
    except OSError as exc:
        yield Entry(root, OTHER, dataset, None, describe_os_error(exc), area)
        return
    if not stat.S_ISDIR(st.st_mode):
        yield Entry(root, classify(os.path.basename(root), os.path.dirname(root)), dataset, None,
                    None, area)
        return
    seen = {(st.st_dev, st.st_ino)}
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as it:
                children = list(it)
        except OSError as exc:
            yield Entry(directory, OTHER, dataset, None, describe_os_error(exc), area)
            continue
        bucket = _bucket(root, directory) if bucket_from_folders else None
        for child in children:
            path = child.path
            if exclude and excluded(path, exclude):
                continue
            # d_type answers is_dir/is_file without a syscall; only symlinks are stat'ed
            try:
                is_file, is_dir = child.is_file(), child.is_dir()
            except OSError as exc:  # a symlink loop
                yield Entry(path, OTHER, dataset, bucket, describe_os_error(exc), area)
                continue
            if is_file:
                yield Entry(path, classify(child.name, directory), dataset, bucket, None, area)
            elif is_dir:
                if child.name == STATE_DIR:
                    continue
                try:
                    cst = child.stat()
                except OSError as exc:
                    yield Entry(path, OTHER, dataset, bucket, describe_os_error(exc), area)
                    continue
                key = (cst.st_dev, cst.st_ino)
                if key in seen:
                    if child.is_symlink():
                        yield Entry(path, OTHER, dataset, bucket,
                                    "symlink loop: points back to a directory already scanned", area)
                    continue
                seen.add(key)
                stack.append(path)
            elif child.is_symlink():  # neither file nor dir: dangling, or a loop
                yield Entry(path, OTHER, dataset, bucket, _link_error(path), area)
            # sockets, FIFOs and devices are no cache files and must never be opened


def _link_error(path: str) -> str:
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return "cannot read: broken symlink"
        return describe_os_error(exc)
    return "cannot read: the link points to no regular file"




def _bucket(root: str, directory: str) -> str | None:
    """With no trainer metadata, a sub-folder of the cache dir is a bucket (the root is none)."""
    if directory == root:
        return None
    return os.path.relpath(directory, root)
