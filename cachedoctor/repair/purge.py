"""`cachedoctor purge`: delete runs' quarantines for good, so that the cache shrinks by what the
plan said (reclaim.py). A purged run can no longer be undone, and its journal says so.

The journal records the purge (table `purged`, beside runs and actions; older cachedoctor
versions ignore it) before the first file is deleted: a purge killed half-way still marks the
run purged, and undo refuses it rather than put back half a run. Interrupted runs are recovered
first (their quarantine may hold files that go back to their place).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cachedoctor.repair import confined, index
from cachedoctor.repair.caches import QUARANTINE_DIR, plain_run_id, state_dir, with_earlier
from cachedoctor.repair.journal import RUNNING, UNDOING, UNDONE, Journal
from cachedoctor.repair.session import guarded

TABLE = ("CREATE TABLE IF NOT EXISTS purged (run_id TEXT PRIMARY KEY, purged REAL NOT NULL, "
         "files INTEGER NOT NULL, bytes INTEGER NOT NULL)")
UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|min|m|h|d|w)")


class PurgeError(Exception):
    """Nothing matches, or a duration that cannot be read."""


def parse_duration(text: str) -> float:
    """'30d' -> seconds. Units: s, m (or min), h, d, w."""
    match = DURATION.fullmatch(text.strip())
    if match is None:
        raise PurgeError(f"--older-than {text!r}: expected a number and a unit (s, m, h, d, w), e.g. 7d")
    return float(match.group(1)) * UNITS[match.group(2)]


def purged_in(journal: Journal) -> dict[str, float]:
    """run id -> when its quarantine was purged, for the runs of this journal."""
    try:
        rows = journal.conn.execute("SELECT run_id, purged FROM purged").fetchall()
    except sqlite3.OperationalError:  # no purge ever ran on this cache
        return {}
    return dict(rows)


@dataclass(frozen=True)
class Target:
    """One run's quarantine in one cache."""

    root: str
    run_id: str
    files: int
    bytes: int

    @property
    def directory(self) -> str:
        return quarantine_of(self.root, self.run_id)


def quarantine_of(root: str, run_id: str) -> str:
    return os.path.join(state_dir(root), QUARANTINE_DIR, run_id)


def _contents(directory: str) -> tuple[int, int]:
    files = size = 0
    for parent, _dirs, names in os.walk(directory):
        for name in names:
            files += 1
            with contextlib.suppress(OSError):  # gone meanwhile: nothing to count
                size += os.lstat(os.path.join(parent, name)).st_size
    return files, size


def targets(run_id: str | None, older_than: float | None,
            roots: Iterable[str] | None = None) -> list[Target]:
    """The runs to purge: `run_id`, or every run started more than `older_than` seconds ago,
    in `roots` (default: every cache this user ran fix on). Runs purged already are left out;
    runs under way (or interrupted) are included: purge recovers them first."""
    roots = with_earlier(os.path.abspath(r) for r in roots) if roots else index.known_roots()
    now = time.time()
    found = []
    for root in roots:
        journal = Journal.existing(root)
        if journal is None:
            continue
        with journal:
            purged = purged_in(journal)
            for run in journal.runs():
                if run.run_id in purged or not plain_run_id(run.run_id):
                    continue  # purged already; or no name of ours (a hostile journal's `../..`)
                if run_id is not None and run.run_id != run_id:
                    continue
                if older_than is not None and run.started > now - older_than:
                    continue
                found.append(Target(root, run.run_id, *_contents(quarantine_of(root, run.run_id))))
    return found


def was_purged(run_id: str, roots: Iterable[str] | None = None) -> float | None:
    """When `run_id`'s quarantine was purged in any of `roots`, or None."""
    for root in (with_earlier(os.path.abspath(r) for r in roots) if roots else index.known_roots()):
        journal = Journal.existing(root)
        if journal is not None:
            with journal:
                when = purged_in(journal).get(run_id)
            if when is not None:
                return when
    return None


def undo_target(run_id: str | None, roots: Iterable[str] | None = None) -> str | None:
    """The run `cachedoctor undo` would pick: `run_id`, else the latest run not undone."""
    if run_id is not None:
        return run_id
    latest = None
    for root in (with_earlier(os.path.abspath(r) for r in roots) if roots else index.known_roots()):
        journal = Journal.existing(root)
        if journal is None:
            continue
        with journal:
            for run in journal.runs():
                if run.state != UNDONE and (latest is None or (run.started, run.run_id) > latest):
                    latest = (run.started, run.run_id)
    return latest[1] if latest else None


@dataclass(frozen=True)
class Purged:
    target: Target
    notes: tuple[str, ...]  # what recovering an interrupted run did first
    failed: tuple[str, ...] = ()  # what could not be deleted (the first of them)


def purge(chosen: list[Target], wait: float = 0.0) -> list[Purged]:
    """Delete the quarantines of `chosen`, each cache under its lock, each purge journaled before
    its first file goes. Raises LockBusy."""
    out = []
    # guarded recovers first: an interrupted run puts its files back before its quarantine goes
    with guarded(sorted({t.root for t in chosen}), wait, "purge") as guard:
        reported: set[str] = set()
        for target in chosen:
            notes = () if target.root in reported else guard.recovered.get(target.root, ())
            reported.add(target.root)
            with Journal.open(target.root) as journal:
                run = journal.run(target.run_id)
                if run is not None and run.state in (RUNNING, UNDOING):
                    continue  # recovery settles these; never reached under the lock
                files, size = _contents(target.directory)
                with journal.conn:
                    journal.conn.execute(TABLE)
                    journal.conn.execute("INSERT OR REPLACE INTO purged VALUES (?, ?, ?, ?)",
                                         (target.run_id, time.time(), files, size))
            failed = _delete(target.root, target.run_id)
            out.append(Purged(Target(target.root, target.run_id, files, size), tuple(notes),
                              tuple(failed[:1])))
    return out


def _delete(root: str, run_id: str) -> list[str]:
    """Delete the run's quarantine tree; why each part that stays could not go. The quarantine
    is reached through folder descriptors (confined.py) and deleted by name in its folder: a
    `.cachedoctor`, `quarantine` or run folder that is a symlink leads nowhere outside."""
    failed: list[str] = []

    def note(_func: object, path: str, info: tuple) -> None:
        failed.append(f"cannot delete {path}: {getattr(info[1], 'strerror', None) or info[1]}")

    if not plain_run_id(run_id):
        return [f"cannot delete {quarantine_of(root, run_id)}: {run_id!r} is no run id"]
    try:
        root_fd = confined.open_root(root)
    except OSError as exc:
        return [f"cannot open {root}: {exc.strerror or exc}"]
    try:
        folder = confined.open_dir(root_fd, os.path.join(state_dir("."), QUARANTINE_DIR))
    except confined.Gone:
        return failed
    except (confined.Moved, OSError) as exc:
        return [f"cannot delete {quarantine_of(root, run_id)}: {exc}"]
    finally:
        os.close(root_fd)
    try:
        if confined.lstat_at(folder, run_id) is not None:
            shutil.rmtree(run_id, onerror=note, dir_fd=folder)
    finally:
        os.close(folder)
    return failed
