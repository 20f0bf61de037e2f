"""Which cache a file belongs to, and where that cache keeps cachedoctor's own state.

A cache root is a dataset's cache dir: a bare target dir, or the dir of a single-file target;
for trainers that keep their caches beside the images (kohya, ai-toolkit), the image dir; for
OneTrainer, the configured `cache_dir`, never the `image/` and `text/` folders in it, which
OneTrainer deletes at every start (see `kept_root`). Each root a run changes holds
`.cachedoctor/` (the scan never walks it):

    .cachedoctor/journal.sqlite                 what every run did, written before it does it
    .cachedoctor/lock                           flock'ed by the fix or undo working on the cache
    .cachedoctor/quarantine/<run>/<relpath>.quarantined   every file a run removed or replaced

(The lock that orders runs, nested caches included, is in cachedoctor's state dir: lock.py.)

Everything a run touches has a name derived from (root, run id, sequence number, relative
path), so recovery finds it from the journal alone, even where the cache dir was moved.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from cachedoctor.inventory import STATE_DIR
from cachedoctor.layouts import Layout, onetrainer
from cachedoctor.layouts.bare import GROUP
from cachedoctor.layouts.base import Dataset
from cachedoctor.remote import is_remote

JOURNAL = "journal.sqlite"
LOCK = "lock"
QUARANTINE_DIR = "quarantine"
# Appended to every file the quarantine keeps: trainers that list their cache by extension
# walk hidden folders too (SimpleTuner's list_files: os.walk and endswith(".pt")), and would
# take `.cachedoctor/quarantine/<run>/x.pt` for a cache entry, load it (a hostile pickle
# included) or delete it (scan_for_errors). Runs journaled before it keep bare names.
KEPT_SUFFIX = ".quarantined"


def state_dir(root: str) -> str:
    return os.path.join(root, STATE_DIR)


def plain_run_id(run_id: str) -> bool:
    """Whether `run_id` is one plain name: a journal may come with a cache someone else wrote,
    and its run ids name folders of the quarantine that purge deletes (`../..` must not)."""
    return run_id not in ("", ".", "..") and "/" not in run_id and os.sep not in run_id \
        and "\0" not in run_id


def plain_relpath(relpath: str) -> bool:
    """Whether `relpath` names a file below a cache root as a run records one: relative, and
    no part of it empty, `.` or `..` (a hostile journal's `a/..` names the folder `a` itself,
    which undo would hash and unlink as a file)."""
    return bool(relpath) and not os.path.isabs(relpath) and "\0" not in relpath and all(
        part not in ("", ".", "..") for part in relpath.split(os.sep))


def cache_roots(layouts: Iterable[Layout]) -> tuple[str, ...]:
    """Every cache root of the layouts' datasets, absolute, in order, without repeats: their
    cache dirs, or, for caches beside the images (kohya, ai-toolkit), their image dirs. Raises
    ValueError for a root inside a `.cachedoctor/` dir (the quarantine is not a cache to fix)."""
    roots: list[str] = []
    for layout in layouts:
        for dataset in layout.datasets:
            dirs = dataset.cache_dirs or (dataset.image_dirs if dataset.caches_beside_images else ())
            for cache_dir in dirs:
                if is_remote(cache_dir):  # an S3 prefix: the root is the prefix (repair/remote.py)
                    if cache_dir not in roots:
                        roots.append(cache_dir)
                    continue
                path = os.path.abspath(cache_dir)
                root = path if os.path.isdir(path) else os.path.dirname(path)
                root = kept_root(layout.trainer, dataset, root)
                if STATE_DIR in root.split(os.sep):
                    raise ValueError(f"{cache_dir} is inside cachedoctor's own {STATE_DIR}/ dir: "
                                     "give the cache dir instead")
                if root not in roots:
                    roots.append(root)
    return tuple(roots)


def kept_root(trainer: str, dataset: Dataset, root: str) -> str:
    """The root to keep `root`'s repair state in: one the trainer's own cache clearing leaves.

    OneTrainer (GenericTrainer.__clear_cache, Nerogar/OneTrainer 23df3832, run at every start
    with clear_cache_before_training and latent_caching, both on by default) lists its
    `cache_dir` and shutil.rmtree's each folder named `image`, `text` or `epoch-*` there, but
    never the cache_dir itself. mgds reads samples by group key and index
    (DiskCache.get_item) and never lists the cache_dir, so `<cache_dir>/.cachedoctor/` is
    neither deleted nor read as a cache. A state dir in `image/` would vanish, quarantine
    and journal with it, at the next launch. The other trainers fix repairs delete files, not
    the folders holding `.cachedoctor/`: SimpleTuner's VAECache.clear_cache and scan_for_errors
    delete the `.pt` files its list_files found (kept copies end in KEPT_SUFFIX), musubi-tuner's
    cache_latents removes `<cache_directory>/*_<arch>.safetensors` (a glob of that folder only),
    kohya and ai-toolkit delete no cache file. One exception is left to the user (README):
    SimpleTuner's web UI dataset scan with clear_vae_cache (DatasetScanService.clear_vae_cache,
    bghira/SimpleTuner bc8e6ab7) rmtree's the whole cache_dir_vae, whose parent may hold
    other datasets' caches: no folder of its own is safe to take for the state."""
    if trainer == onetrainer.NAME:
        cache_dir = dataset.options.get("cache_dir")
        if isinstance(cache_dir, str):
            cache_dir = os.path.abspath(cache_dir)
            if root == cache_dir or root.startswith(cache_dir.rstrip(os.sep) + os.sep):
                return cache_dir
    elif trainer == "bare":  # a OneTrainer cache given without its config
        return mgds_cache_dir(root) or root
    return root


def mgds_cache_dir(path: str) -> str | None:
    """The OneTrainer cache_dir above `path` where `path` is a folder its clear deletes or one
    inside it, as mgds lays them out: `<cache_dir>/image|text`, `.../<sha256 group>`,
    `.../<group>/variation-<n>`, or before mgds a8e7480 `<cache_dir>/image|text/epoch-<n>`.
    Each shape is told by the folders mgds names (a group folder holding `variation-<n>`), not
    by a folder merely called `image`."""
    name, parent = os.path.basename(path), os.path.dirname(path)
    if onetrainer.VARIATION.match(name) and _group(parent):
        path, name, parent = parent, os.path.basename(parent), os.path.dirname(parent)
    elif onetrainer.EPOCH.match(name) and os.path.basename(parent) in onetrainer.AREAS:
        return os.path.dirname(parent)
    elif name in onetrainer.AREAS and any(_group(os.path.join(path, n)) or onetrainer.EPOCH.match(n)
                                          for n in _listdir(path)):
        return parent
    if _group(path) and os.path.basename(parent) in onetrainer.AREAS:
        return os.path.dirname(parent)
    return None


def _group(path: str) -> bool:
    """Whether `path` is an mgds group folder: a sha256 name, holding `variation-<n>` folders."""
    return GROUP.match(os.path.basename(path)) is not None and any(
        onetrainer.VARIATION.match(n) for n in _listdir(path))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def earlier_roots(root: str) -> list[str]:
    """Where earlier versions of cachedoctor kept the state of the OneTrainer cache_dir `root`:
    in its `image/` and `text/` folders (then the roots), those that hold a journal and are
    mgds areas (a folder of another trainer's cache named `image` is a cache of its own). undo,
    purge, recovery and the run list look there too, so that runs journaled there stay
    undoable. Never through a symlink: a journal reached so is no run of this cache."""
    out = []
    for area in onetrainer.AREAS:
        folder = os.path.join(root, area)
        if not os.path.islink(folder) and not os.path.islink(state_dir(folder)) \
                and os.path.isfile(os.path.join(state_dir(folder), JOURNAL)) \
                and mgds_cache_dir(folder) == root:
            out.append(folder)
    return out


def with_earlier(roots: Iterable[str]) -> list[str]:
    """`roots`, each followed by its earlier_roots, without repeats."""
    out: list[str] = []
    for root in roots:
        for found in (root, *(() if is_remote(root) else earlier_roots(root))):
            if found not in out:
                out.append(found)
    return out


def root_of(path: str, roots: Iterable[str]) -> str | None:
    """The innermost root that holds `path` (an absolute path, as findings carry)."""
    best = None
    for root in roots:
        if path.startswith(root.rstrip(os.sep) + os.sep) and (best is None or len(root) > len(best)):
            best = root
    return best


@dataclass(frozen=True)
class ActionPaths:
    """The names one action of one run uses. Temp names start with `.cachedoctor-<run>-` and
    belong to cachedoctor: recovery removes them; nothing else of the user's is ever removed."""

    root: str
    run_id: str
    seq: int
    relpath: str
    kept_suffix: str = KEPT_SUFFIX  # "" for a run journaled before KEPT_SUFFIX (Journal.actions)

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.relpath)

    @property
    def quarantine(self) -> str:
        return os.path.join(state_dir(self.root), QUARANTINE_DIR, self.run_id,
                            self.relpath + self.kept_suffix)

    def _beside(self, path: str, suffix: str) -> str:
        return os.path.join(os.path.dirname(path), f".cachedoctor-{self.run_id}-{self.seq}{suffix}")

    @property
    def temp(self) -> str:
        """The new content, written beside the file and renamed over it."""
        return self._beside(self.path, ".tmp")

    @property
    def part(self) -> str:
        """A copy into the quarantine under way (only where a hard link or rename cannot do)."""
        return self._beside(self.quarantine, ".part")

    @property
    def restore_temp(self) -> str:
        """A copy back from the quarantine under way (only where a rename cannot do)."""
        return self._beside(self.path, ".undo.tmp")
