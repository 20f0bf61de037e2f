"""`cachedoctor undo [RUN_ID]`: put back every file a run changed, byte for byte, and the runs
listing (`fix --list-runs`). Neither imports torch: undo only moves and hashes files.

A run's actions are walked back last first (a re-encoded entry goes before the quarantined
original it replaced comes back). The run is marked `undoing` first, so a kill during undo is
finished by the next fix or undo.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

from cachedoctor.repair import index, lock
from cachedoctor.repair.caches import QUARANTINE, state_dir
from cachedoctor.repair.journal import (
    CONFLICT,
    UNDO_INCOMPLETE,
    UNDOABLE,
    UNDOING,
    UNDONE,
    Journal,
    RunRecord,
)
from cachedoctor.repair.rollback import recover, roll_back


class NothingToUndo(Exception):
    """No run matches (or every run is undone already)."""


@dataclass(frozen=True)
class UndoResult:
    run_id: str
    root: str
    restored: int
    conflicts: tuple[str, ...]
    recovered: tuple[str, ...] = ()  # what recovery of other interrupted runs did first


@dataclass(frozen=True)
class RunSummary:
    root: str
    run: RunRecord
    counts: dict[str, dict[str, int]]  # action kind -> state -> count


def undo_in(journal: Journal, run_id: str) -> tuple[int, list[str]]:
    """Undo `run_id` in one cache (holding its lock): (files put back, conflicts)."""
    journal.set_run_state(run_id, UNDOING)
    restored, conflicts = 0, []
    for record in reversed(journal.actions(run_id)):
        if record.state not in UNDOABLE:
            continue
        why = roll_back(record, journal.root)
        journal.update(run_id, record.seq, CONFLICT if why else UNDONE, error=why)
        if why:
            conflicts.append(why)
        else:
            restored += 1
    journal.set_run_state(run_id, UNDO_INCOMPLETE if conflicts else UNDONE)
    _prune(os.path.join(state_dir(journal.root), QUARANTINE, run_id))
    return restored, conflicts


def undo_run(run_id: str | None = None, roots: Iterable[str] | None = None,
             wait: float = 0.0) -> list[UndoResult]:
    """Undo `run_id` (default: the latest run not undone yet) in every cache of `roots` (default:
    every cache this user ran fix on) that has it. Raises NothingToUndo, LockBusy."""
    roots = [os.path.abspath(r) for r in roots] if roots else index.known_roots()
    found = [(s.root, s.run) for s in list_runs(roots) if run_id is None or s.run.run_id == run_id]
    if run_id is None:
        pending = [(root, run) for root, run in found if run.state != UNDONE]
        if not pending:
            raise NothingToUndo("nothing to undo: every run is undone"
                                if found else "no runs to undo" + _where(roots))
        run_id = max(pending, key=lambda p: (p[1].started, p[1].run_id))[1].run_id
        found = [(root, run) for root, run in found if run.run_id == run_id]
    if not found:
        raise NothingToUndo(f"no run {run_id}" + _where(roots))
    results = []
    with lock.locked([root for root, _ in found], wait, "undo"):
        for root, _ in found:
            journal = Journal.open(root)
            assert journal is not None
            with journal:
                recovered = recover(journal)
                restored, conflicts = undo_in(journal, run_id)
            results.append(UndoResult(run_id, root, restored, tuple(conflicts), tuple(recovered)))
    return results


def list_runs(roots: Iterable[str] | None = None) -> list[RunSummary]:
    """Every run in the journals of `roots` (default: every cache this user ran fix on), oldest
    first."""
    out = []
    for root in (roots if roots is not None else index.known_roots()):
        journal = Journal.open(root, create=False)
        if journal is None:
            continue
        with journal:
            for run in journal.runs():
                counts: dict[str, dict[str, int]] = {}
                for record in journal.actions(run.run_id):
                    per_kind = counts.setdefault(record.kind, {})
                    per_kind[record.state] = per_kind.get(record.state, 0) + 1
                out.append(RunSummary(root, run, counts))
    return sorted(out, key=lambda s: (s.run.started, s.run.run_id, s.root))


def _where(roots: list[str]) -> str:
    if not roots:
        return ": no cache has a journal yet (give --cache DIR if the cache was moved)"
    return f" in {', '.join(roots)}"


def _prune(directory: str) -> None:
    """Remove the run's quarantine dirs that undo left empty (never a file)."""
    for parent, _dirs, files in os.walk(directory, topdown=False):
        if not files:
            with contextlib.suppress(OSError):  # not empty: a conflict's original is still there
                os.rmdir(parent)
