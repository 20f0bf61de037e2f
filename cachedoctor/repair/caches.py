"""Which cache a file belongs to, and where that cache keeps cachedoctor's own state.

A cache root is a dataset's cache dir: a bare target dir, or the dir of a single-file target;
for trainers that keep their caches beside the images (kohya, ai-toolkit), the image dir.
Each root a run changes holds `.cachedoctor/` (the scan never walks it):

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
from cachedoctor.layouts import Layout
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
                if STATE_DIR in root.split(os.sep):
                    raise ValueError(f"{cache_dir} is inside cachedoctor's own {STATE_DIR}/ dir: "
                                     "give the cache dir instead")
                if root not in roots:
                    roots.append(root)
    return tuple(roots)


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
