"""Walk the targets and name each file's role, by its name and place only (no content read).

The walk is iterative, follows directory symlinks once (a loop back to a folder above the link
is reported, not followed; a second name of a folder already walked is skipped), skips
`.cachedoctor/` (our own journal and quarantine) and the files a file browser leaves in every
folder (FILE_BROWSER_FILES), and turns every I/O failure into an Entry carrying the error
instead of raising.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterator, Mapping
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
    {".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".safetensors", ".npz", ".npy", ".arrow",
     ".parquet"}
)
# atomicwrites' NamedTemporaryFile (tmp + 8 of [a-z0-9_]); SimpleTuner's Nov-Dec 2024
# `.<name>.tmp`; `*.pt.tmp`; rsync's `.<name>.XXXXXX` (its mkstemp name for a file being
# received, left by an rsync killed mid-copy); and lock files left by writers that died
# holding them.
TEMP_PATTERN = re.compile(
    r"^(tmp[a-z0-9_]{8}|\..+\.tmp|.+\.(pt|pth|npz|safetensors)\.tmp|.+\.lock|.+\.partial"
    r"|\..+\.(pt|pth|npz|npy|safetensors|arrow|bin)\.[A-Za-z0-9]{6})$"
)
METADATA_PATTERN = re.compile(
    r"^(aspect_ratio_bucket_(indices|metadata)_.+\.json|aggregate\.pt|\.aitk_size\.json"
    r"|metadata_cache\.json|all_(image|vae_cache|text_cache)_files_.+\.json"
    r"|dataset_info\.json|state\.json|dataset_dict\.json|grouping_keys\.json"
    r"|cachedoctor\.toml)$"  # cachedoctor's own config may sit in the cache it is about
)
# SimpleTuner md5(caption)-<family>.pt; kohya's text-encoder npz suffixes; musubi-tuner's
# <stem>_<arch>_te.safetensors.
TEXT_PATTERN = re.compile(
    r"^([0-9a-f]{32}-[\w.]+\.pt|.+_te_outputs\.npz|.+_(flux|sd3|lumina|anima|hi)_te\.npz"
    r"|.+_[a-z0-9]+_te\.safetensors)$"
)
TEXT_DIRS = frozenset({"_t_e_cache", "text"})
# what a file browser writes into any folder it shows, caches included: Finder's .DS_Store (and
# AppleDouble `._<name>` beside every file on a volume without extended attributes: exFAT, SMB),
# Explorer's Thumbs.db and desktop.ini, Dolphin's .directory. No trainer reads them (each lists
# its own names or extensions, and kohya's glob skips dotfiles): not files of the cache at all.
FILE_BROWSER_FILES = frozenset({".DS_Store", "Thumbs.db", "ehthumbs.db", "desktop.ini",
                                ".directory", "Icon\r"})


# what an editor leaves beside a file it has open or has saved: vim's swap files
# (`.<name>.swp`, then .swo ... .swa), emacs's lock (`.#<name>`, a symlink to user@host.pid that
# dangles by design), its auto-save `#<name>#`, and the `<name>~` backups of both. A user who
# opened a bucket JSON or a caption in the cache folder leaves them; no trainer lists them.
EDITOR_FILE = re.compile(r"^(\..+\.sw[a-p]|\.#.+|#.+#|.+~)$", re.DOTALL)


def file_browser_file(name: str) -> bool:
    """Whether `name` is a file a file browser or an editor left: no file of the cache, unless
    it also ends like one (`cache_name`)."""
    return name in FILE_BROWSER_FILES or name.startswith("._") or bool(EDITOR_FILE.match(name))


def cache_name(name: str) -> bool:
    """Whether a trainer that lists its cache by extension would take `name` for a cache file.
    SimpleTuner lists with os.walk and endswith (data_backend/local.py list_files), dotfiles
    included, and torch.loads every .pt it listed when it scans its cache: a `._<name>.pt` is
    read like any other, so it is judged like any other."""
    lower = name.lower()
    return lower[lower.rfind("."):] in CACHE_EXTENSIONS if "." in lower else False


# folders the system keeps on a drive, not the user's data: the trash of freedesktop
# (.Trash-<uid>, .Trash), macOS volumes (.Trashes) and Windows ($RECYCLE.BIN), Windows'
# System Volume Information, fsck's lost+found. A cache deleted to the trash is no cache a
# trainer reads; its files would only be reported as strays or broken entries.
SYSTEM_DIRS = frozenset({".Trash", ".Trashes", "$RECYCLE.BIN", "System Volume Information",
                         "lost+found"})


def system_dir(name: str) -> bool:
    return name in SYSTEM_DIRS or name.startswith(".Trash-")


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
    return _role(name, in_text_dir(parent))


def in_text_dir(parent: str) -> bool:
    # OneTrainer keeps text embeds in <cache>/text/<sha>/variation-<n>/<i>.pt
    return not TEXT_DIRS.isdisjoint(parent.split(os.sep)[-3:])


def _role(name: str, text_dir: bool) -> str:
    lower = name.lower()
    ext = lower[lower.rfind(".") :] if "." in lower else ""
    if ext in CACHE_EXTENSIONS and not lower.startswith("._"):
        # most files: tested first, and no temp pattern has these. (A Finder `._<name>` is
        # read, since trainers listing by extension read it, but is no entry of the cache.)
        if lower == "aggregate.pt":
            return METADATA
        if text_dir or TEXT_PATTERN.match(lower):
            return TEXT
        return LATENT
    if ext in IMAGE_EXTENSIONS:
        return IMAGE
    if TEMP_PATTERN.match(name):
        return TEMP
    if METADATA_PATTERN.match(name):
        return METADATA
    return OTHER


def excluded(path: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(os.path.basename(path), p)
               for p in patterns)


class Batch(NamedTuple):
    """Files of one directory, listed by the walk and classified by whoever checks them."""

    directory: str
    names: tuple[str, ...]
    dataset: str | None = None
    bucket: str | None = None
    area: str = "cache"
    errors: tuple[tuple[str, str], ...] = ()  # (path, why) for what could not be listed
    # name -> (size, mtime, ETag) where the listing gives them in place of a stat (S3 objects)
    stats: Mapping[str, tuple[int, float, str]] | None = None
    # a whole chunk of its directory's listing (see `batches`): "" for its last (a directory
    # of one batch: the whole directory), else the name that ended the chunk; None: not one
    part: str | None = None

    def entries(self, exclude: tuple[str, ...] = ()) -> Iterator[Entry]:
        for path, why in self.errors:
            yield Entry(path, OTHER, self.dataset, self.bucket, why, self.area)
        directory = self.directory
        head = os.path.join(directory, "")  # + name: os.path.join(directory, name), cheaper
        text_dir = in_text_dir(directory)
        dataset, bucket, area = self.dataset, self.bucket, self.area
        for name in self.names:
            path = head + name
            if exclude and excluded(path, exclude):
                continue
            yield Entry(path, _role(name, text_dir), dataset, bucket, None, area)


def walk(root: str, *, dataset: str | None = None, exclude: tuple[str, ...] = (),
         area: str = "cache") -> Iterator[Entry]:
    """Every file under `root` (or `root` itself if it is a file), as Entries."""
    for batch in batches(root, dataset=dataset, area=area):
        yield from batch.entries(exclude)


def batches(root: str, *, dataset: str | None = None, area: str = "cache", size: int = 256,
            shard: tuple[int, int] | None = None, recursive: bool = True,
            prune: frozenset[tuple[int, int]] = frozenset()) -> Iterator[Batch]:
    """The files under `root` in batches of about `size` names per directory.

    A big directory is cut where its content says, not by count: after a name whose CRC-32
    is 0 modulo size/2, once the batch has `size` names (at 4 x size names whatever the
    name); one of up to `size` files is one batch.
    Adding or removing a file then changes one batch of an unchanged listing order, not every
    batch after it, so the index can keep a record per batch (`Batch.part`) of any directory.

    The walk lists directories only: d_type tells files from directories without a syscall,
    so only symlinks are stat'ed, and files are first touched by the worker that reads them.
    A directory streams: a batch leaves as soon as it is full, so a flat cache of a million
    files is never held in memory. `shard=(rank, world)` keeps the files whose path under
    `root` hashes to `rank` (the same split on every rank, in any listing order).
    `recursive=False` lists the files of `root` only; sub-directories whose (st_dev, st_ino)
    is in `prune` are skipped (they are walked as roots of their own).
    """
    root = os.path.abspath(root)
    try:
        st = os.stat(root)
    except OSError as exc:
        yield Batch(os.path.dirname(root), (), dataset, None, area,
                    ((root, describe_os_error(exc)),))
        return
    if not stat.S_ISDIR(st.st_mode):
        name = os.path.basename(root)
        if shard is None or _mine(shard, b"")(name):
            yield Batch(os.path.dirname(root), (name,), dataset, None, area)
        return
    seen = {(st.st_dev, st.st_ino)}
    real_root = os.path.realpath(root)
    half = max(1, size // 2)
    most = 4 * size
    stack = [root]
    while stack:
        directory = stack.pop()
        bucket = None if directory == root else os.path.relpath(directory, root)
        mine = None if shard is None else _mine(
            shard, b"" if bucket is None else os.fsencode(bucket) + b"/")
        names: list[str] = []
        errors: list[tuple[str, str]] = []
        try:
            listing = os.scandir(directory)
        except OSError as exc:
            yield Batch(directory, (), dataset, None, area, ((directory, describe_os_error(exc)),))
            continue
        with listing:
            for child in _children(listing, directory, errors):
                try:
                    is_file, is_dir = child.is_file(), child.is_dir()
                except OSError as exc:  # a symlink loop
                    errors.append((child.path, describe_os_error(exc)))
                    continue
                if is_file:
                    if file_browser_file(child.name) and not cache_name(child.name):
                        continue
                    if mine is None or mine(child.name):
                        name = child.name
                        names.append(name)
                        if len(names) >= size and (len(names) >= most or zlib.crc32(
                                name.encode("utf-8", "surrogateescape")) % half == 0):
                            yield _batch(directory, names, dataset, bucket, area, errors, shard,
                                         name)
                            names, errors = [], []
                elif is_dir:
                    if child.name == STATE_DIR or not recursive or system_dir(child.name):
                        continue
                    try:
                        cst = child.stat()
                    except OSError as exc:
                        errors.append((child.path, describe_os_error(exc)))
                        continue
                    key = (cst.st_dev, cst.st_ino)
                    if key in prune:
                        continue
                    if key in seen:
                        # a link to a folder above it loops; one to a folder elsewhere in the
                        # tree (a dataset linked into a project) is another name for files
                        # scanned under their first name
                        if child.is_symlink() and _holds(child.path, os.path.realpath(directory)):
                            errors.append((child.path, "symlink loop: points back to a "
                                                       "directory already scanned"))
                        continue
                    if child.is_symlink() and _holds(child.path, real_root):
                        # (a link to / or to a parent would walk the whole disk first)
                        errors.append((child.path, "symlink loop: points to a directory "
                                                   "that holds the scanned one"))
                        continue
                    seen.add(key)
                    stack.append(child.path)
                elif child.is_symlink() and not file_browser_file(child.name):
                    # neither file nor dir: dangling, or a loop
                    errors.append((child.path, _link_error(child.path)))
                # sockets, FIFOs and devices are no cache files and must never be opened
        if names or (errors and (shard is None or shard[0] == 0)):
            yield _batch(directory, names, dataset, bucket, area, errors, shard, "")


def _holds(link: str, real_root: str) -> bool:
    """Whether the directory `link` points to is `real_root` or one of its ancestors."""
    return os.path.join(real_root, "").startswith(os.path.join(os.path.realpath(link), ""))


def _children(listing: Iterator[os.DirEntry], directory: str,
              errors: list[tuple[str, str]]) -> Iterator[os.DirEntry]:
    """The entries of an open listing; a directory that fails part-way (a dying disk, a
    network share gone) ends with an error row instead of raising."""
    while True:
        try:
            yield next(listing)
        except StopIteration:
            return
        except OSError as exc:
            errors.append((directory, describe_os_error(exc)))
            return


def _batch(directory: str, names: list[str], dataset: str | None, bucket: str | None,
           area: str, errors: list[tuple[str, str]], shard: tuple[int, int] | None,
           part: str) -> Batch:
    if shard is not None and shard[0] != 0:
        errors = []  # rank 0 reports what could not be listed, once
    return Batch(directory, tuple(names), dataset, bucket, area, tuple(errors), None, part)


def _mine(shard: tuple[int, int], prefix: bytes) -> Callable[[str], bool]:
    """Whether a file of a directory (`prefix`: its path under the root, with a slash) is
    this rank's: a CRC-32 of the path, so no rank needs the whole sorted listing."""
    rank, world = shard
    start = zlib.crc32(prefix)
    return lambda name: zlib.crc32(os.fsencode(name), start) % world == rank


def _link_error(path: str) -> str:
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return "cannot read: broken symlink"
        return describe_os_error(exc)
    return "cannot read: the link points to no regular file"



