"""`cachedoctor undo [RUN_ID]`: find a run in the caches' journals and put back every file it
changed, byte for byte (rollback.undo_in); and the runs listing (`fix --list-runs`). Neither
imports torch: undo only moves and hashes files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from cachedoctor.repair import index
from cachedoctor.repair.caches import with_earlier
from cachedoctor.repair.journal import (
    UNDONE,
    Journal,
    RunRecord,
)
from cachedoctor.repair.rollback import undo_in
from cachedoctor.repair.session import guarded


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


def undo_run(run_id: str | None = None, roots: Iterable[str] | None = None,
             wait: float = 0.0) -> list[UndoResult]:
    """Undo `run_id` (default: the latest run not undone yet) in every cache of `roots` (default:
    every cache this user ran fix on) that has it. Raises NothingToUndo, LockBusy."""
    roots = with_earlier(os.path.abspath(r) for r in roots) if roots else index.known_roots()
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
    with guarded([root for root, _ in found], wait, "undo") as guard:
        for root, _ in found:
            recovered = guard.recovered.get(root, ())
            with Journal.open(root) as journal:
                restored, conflicts = undo_in(journal, run_id)
            results.append(UndoResult(run_id, root, restored, tuple(conflicts), tuple(recovered)))
    return results


def list_runs(roots: Iterable[str] | None = None) -> list[RunSummary]:
    """Every run in the journals of `roots` (default: every cache this user ran fix on), oldest
    first."""
    out = []
    for root in with_earlier(roots) if roots is not None else index.known_roots():
        journal = Journal.existing(root)
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
