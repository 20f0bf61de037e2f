"""Put one action's file back as it was, from the journal and the file system alone; undo a run
in one cache; bring interrupted runs to a consistent state. All work after a kill at any
instruction of the run (or of themselves).

Recovery and undo may delete only three things: cachedoctor's own temp files (names derived
from the run id), a file whose sha256 is the one the run itself recorded for what it wrote, and
the quarantine's second name for a file whose first name holds the same bytes. Anything else
that is in the way (a file a trainer wrote since) is left alone and reported as a conflict.

Per action, what the files say about how far it got:
- quarantine: the file at its place (not moved yet) or in the quarantine (moved): moved back.
- compact, to-cpu: no quarantine copy (not replaced yet); a quarantine copy and the file the
  same (the copy made, the swap not): the copy dropped; the file is what the run wrote, or
  missing: the quarantine copy put back over it.
- reencode: the file is what the run wrote: deleted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from cachedoctor.repair import atomic
from cachedoctor.repair.caches import QUARANTINE_DIR, state_dir
from cachedoctor.repair.journal import (
    CONFLICT,
    IN_FLIGHT,
    INTERRUPTED,
    PLANNED,
    ROLLED_BACK,
    RUNNING,
    SKIPPED,
    UNDO_INCOMPLETE,
    UNDOABLE,
    UNDOING,
    UNDONE,
    ActionRecord,
    Journal,
)
from cachedoctor.repair.plan import QUARANTINE, REENCODE


def roll_back(record: ActionRecord, root: str) -> str | None:
    """Undo what `record`'s action did to its file; None when it is back, else why it was left."""
    paths = record.paths(root)
    for leftover in paths.leftovers:
        atomic.remove(leftover)
    if record.kind == REENCODE:
        if os.path.lexists(paths.path) and record.sha_after and _sha(paths.path) == record.sha_after:
            atomic.remove(paths.path)
        return None
    original, kept = paths.path, paths.quarantine
    if not os.path.lexists(kept):
        return None
    if os.path.lexists(original) and atomic.same_content(original, kept):
        atomic.remove(kept)
        return None
    ours = record.kind != QUARANTINE and record.sha_after and _sha(original) == record.sha_after
    if ours or not os.path.lexists(original):
        atomic.move(kept, original, paths.restore_temp)
        return None
    return f"{original} has changed since the run: left alone; the original is kept at {kept}"


def _sha(path: str) -> str | None:
    try:
        return atomic.sha256_file(path)
    except OSError:
        return None


def recover_caches(roots: Iterable[str], wait: float = 0.0) -> list[str]:
    """`recover` every cache of `roots` that has a journal, under its lock (taken here unless
    the caller holds it). Run it before scanning: a run that was killed may have left a file in
    the quarantine that goes back to its place."""
    from cachedoctor.repair import lock

    roots = list(roots)
    notes = []
    with lock.locked(roots, wait):
        for root in roots:
            journal = Journal.existing(root)
            if journal is not None:
                with journal:
                    notes += recover(journal)
    return notes


def recover(journal: Journal) -> list[str]:
    """Finish or roll back the runs a kill left in `journal` (call it holding the cache's lock,
    so no run found `running` is alive). Returns what was done, one line per run."""
    notes = []
    for run in journal.runs():
        if run.state == RUNNING:
            back = 0
            for record in reversed(journal.actions(run.run_id)):
                if record.state in IN_FLIGHT:
                    why = roll_back(record, journal.root)
                    journal.update(run.run_id, record.seq, CONFLICT if why else ROLLED_BACK, error=why)
                    back += 1
                elif record.state == PLANNED:
                    journal.update(run.run_id, record.seq, SKIPPED)
            journal.set_run_state(run.run_id, INTERRUPTED)
            notes.append(f"run {run.run_id} on {journal.root} had been interrupted: {back} unfinished "
                         f"action(s) rolled back, finished ones kept (`cachedoctor undo {run.run_id}` "
                         "puts them back too)")
        elif run.state == UNDOING:
            restored, conflicts = undo_in(journal, run.run_id)
            notes.append(f"finished undoing run {run.run_id} on {journal.root}: {restored} file(s) put "
                         f"back" + (f", {len(conflicts)} left alone" if conflicts else ""))
    return notes


def undo_in(journal: Journal, run_id: str) -> tuple[int, list[str]]:
    """Undo `run_id` in one cache (holding its lock): (files put back, conflicts). Actions are
    walked back last first (a re-encoded entry goes before the original it replaced comes
    back); the run is marked `undoing` first, so that a kill during undo is finished by the
    next fix or undo."""
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
    quarantine = os.path.join(state_dir(journal.root), QUARANTINE_DIR)
    _prune(os.path.join(quarantine, run_id))
    with contextlib.suppress(OSError):  # the quarantine dir itself, where no other run uses it
        os.rmdir(quarantine)
    return restored, conflicts


def _prune(directory: str) -> None:
    """Remove the run's quarantine dirs that undo left empty (never a file)."""
    for parent, _dirs, files in os.walk(directory, topdown=False):
        if not files:
            with contextlib.suppress(OSError):  # not empty: a conflict's original is still there
                os.rmdir(parent)
