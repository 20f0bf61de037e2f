"""What runs did, read from their journals (read-only): an interrupted run's account, each
run's actions as done / rolled back / not started, and what a finished run measurably freed.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from cachedoctor.fix_kinds import QUARANTINE, REENCODE
from cachedoctor.repair.caches import with_earlier
from cachedoctor.repair.journal import (
    CONFLICT,
    DONE,
    FAILED,
    IN_FLIGHT,
    PLANNED,
    ROLLED_BACK,
    SKIPPED,
    UNDONE,
    Journal,
    JournalError,
    RunRecord,
)
from cachedoctor.repair.purge import purged_in

# How a listing words each action state: never "planned" for an action that finished.
WORDS = {DONE: "done", FAILED: "failed (rolled back)", ROLLED_BACK: "rolled back",
         PLANNED: "not started", SKIPPED: "not started", UNDONE: "undone", CONFLICT: "left alone"}
for _state in IN_FLIGHT:
    WORDS[_state] = "in flight"


def word(state: str, error: str | None = None) -> str:
    """The listing's word for an action state (a skip with a reason was judged, not skipped by
    an interruption: "skipped")."""
    if state == SKIPPED and error:
        return "skipped"
    return WORDS.get(state, state)


@dataclass(frozen=True)
class Account:
    """One run in one cache as its journal tells it."""

    root: str
    run_id: str
    state: str
    done: int
    rolled_back: int
    not_started: int  # planned (still, or marked skipped by recovery)
    in_flight: int  # started or ready: the next fix or undo rolls them back


def account(root: str, run_id: str) -> Account | None:
    """The run's account in `root`'s journal, or None where the journal lacks it."""
    journal = Journal.existing(root)
    if journal is None:
        return None
    with journal:
        run = journal.run(run_id)
        if run is None:
            return None
        records = journal.actions(run_id)
    states = [r.state for r in records]
    return Account(root, run_id, run.state,
                   done=states.count(DONE),
                   rolled_back=states.count(ROLLED_BACK) + states.count(FAILED),
                   not_started=sum(1 for r in records if r.state == PLANNED
                                   or (r.state == SKIPPED and not r.error)),
                   in_flight=sum(1 for s in states if s in IN_FLIGHT))


def accounts(roots: Iterable[str], run_id: str) -> list[Account]:
    return [a for a in (account(r, run_id) for r in roots) if a is not None]


@dataclass(frozen=True)
class Listed:
    """One run of one cache for `fix --list-runs`."""

    root: str
    run: RunRecord
    counts: dict[str, Counter[str]]  # action kind -> word (done, rolled back, ...) -> count
    purged: float | None  # when its quarantine was purged


def listing(roots: Iterable[str], unreadable: list[str] | None = None) -> list[Listed]:
    """Every run in the journals of `roots`, oldest first. A journal that cannot be opened
    (damaged, a symlink) is left out, and why is added to `unreadable`: one cache's bad
    journal does not hide the others' runs."""
    out = []
    for root in with_earlier(roots):
        try:
            journal = Journal.existing(root)
        except JournalError as exc:
            if unreadable is not None:
                unreadable.append(str(exc))
            continue
        if journal is None:
            continue
        with journal:
            purged = purged_in(journal)
            for run in journal.runs():
                counts: dict[str, Counter[str]] = {}
                for record in journal.actions(run.run_id):
                    counts.setdefault(record.kind, Counter())[word(record.state, record.error)] += 1
                out.append(Listed(root, run, counts, purged.get(run.run_id)))
    return sorted(out, key=lambda s: (s.run.started, s.run.run_id, s.root))


@dataclass(frozen=True)
class Freed:
    """What a run's done actions changed on disk, measured (apparent bytes, see reclaim.py)."""

    shrank: int  # bytes the cache files (outside .cachedoctor/) shrank by; negative: grew
    kept: int  # bytes of originals now in the quarantine, until `cachedoctor purge`
    by_kind: dict[str, int]  # shrink per action kind


def measure(done: Iterable[tuple[str, str, int]]) -> Freed:
    """From (kind, path, size before) of each done action, the files as they are now."""
    shrank, kept, by_kind = 0, 0, {}
    for kind, path, size in done:
        now = os.lstat(path).st_size if os.path.lexists(path) else 0
        # a quarantined file is gone whatever now stands at its name (a re-encoded entry
        # counts under reencode)
        change = size if kind == QUARANTINE else -now if kind == REENCODE else size - now
        if kind != REENCODE:
            kept += size
        shrank += change
        by_kind[kind] = by_kind.get(kind, 0) + change
    return Freed(shrank, kept, by_kind)
