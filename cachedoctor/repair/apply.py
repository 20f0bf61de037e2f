"""Apply a plan: under each cache's lock, every action journaled before it touches a file.

Per action (journal states in capitals, each committed before the next step):

    quarantine       STARTED (sha256) -> move the file to the quarantine -> DONE
    compact, to-cpu  STARTED (sha256) -> new bytes to a temp file beside it, fsynced, read back
                     and verified -> READY (sha256 of the new bytes) -> a second name for the
                     original in the quarantine (hard link, else a copy) -> temp renamed over
                     the file -> DONE
    reencode         STARTED -> encode, write a temp file, verify with the trainer's loading
                     call -> READY (sha256) -> linked in under the entry's name (never over an
                     existing file) -> DONE

An action that fails (verification, a file that changed meanwhile, an I/O error) is rolled back
on the spot (rollback.py) and reported; the run goes on with the next one. A kill at any point
leaves each file either as it was or as the run made it, and the journal says enough for the
next fix or undo to tell which (rollback.recover).
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachedoctor.repair import atomic, index, lock
from cachedoctor.repair.caches import ActionPaths
from cachedoctor.repair.errors import RepairError
from cachedoctor.repair.journal import DONE, FAILED, READY, SKIPPED, STARTED, Journal, Planned
from cachedoctor.repair.plan import COMPACT, QUARANTINE, REENCODE, TO_CPU, Action, Plan
from cachedoctor.repair.rollback import recover_caches, roll_back

if TYPE_CHECKING:
    from cachedoctor.repair.encoders import Encoder


class RunStopped(Exception):
    """A failed action could not be rolled back: the run stops; the next fix or undo finishes
    the rollback from the journal."""


class Changed(RepairError):
    """The file changed between the run reading it and replacing it."""


@dataclass(frozen=True)
class Outcome:
    action: Action
    state: str  # done, failed, skipped
    message: str = ""


@dataclass(frozen=True)
class RunResult:
    run_id: str
    outcomes: tuple[Outcome, ...]
    notes: tuple[str, ...] = ()  # recovery of earlier runs, index warnings

    @property
    def failed(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if o.state == FAILED)

    def count(self, kind: str, state: str = DONE) -> int:
        return sum(1 for o in self.outcomes if o.action.kind == kind and o.state == state)


def new_run_id() -> str:
    """Sortable and readable: UTC time to the second, and 4 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


def run(plan: Plan, *, run_id: str | None = None, wait: float = 0.0, command: str = "",
        on_start: Callable[[str], None] | None = None,
        on_outcome: Callable[[Outcome], None] | None = None) -> RunResult:
    run_id = run_id or new_run_id()
    if not plan.actions:
        return RunResult(run_id, ())
    roots = plan.roots
    notes: list[str] = []
    outcomes: list[Outcome] = []
    with lock.locked(roots, wait, "fix"):
        journals: dict[str, Journal] = {}
        try:
            notes += recover_caches(roots)
            for root in roots:
                journals[root] = Journal.open(root)
            _prepare(plan)
            warning = index.remember(roots)
            if warning:
                notes.append(warning)
            numbered = list(enumerate(plan.actions, 1))
            for root in roots:
                journals[root].begin_run(
                    run_id,
                    [Planned(seq, a.kind, a.relpath, a.codes, a.target.image if a.target else None)
                     for seq, a in numbered if a.root == root],
                    command or " ".join(["cachedoctor", *sys.argv[1:]]),
                )
            if on_start is not None:
                on_start(run_id)
            for seq, action in numbered:
                outcome = _apply(journals[action.root], ActionPaths(action.root, run_id, seq, action.relpath),
                                 action, plan.encoder)
                outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome)
            for root in roots:
                failed = any(o.state == FAILED for o in outcomes if o.action.root == root)
                journals[root].set_run_state(run_id, FAILED if failed else DONE)
        finally:
            for journal in journals.values():
                journal.close()
    return RunResult(run_id, tuple(outcomes), tuple(notes))


def _prepare(plan: Plan) -> None:
    """Import and load what the actions need before the run records anything, so a missing
    module or model fails the run before it changes a file."""
    if any(a.kind != QUARANTINE for a in plan.actions):
        import torch  # noqa: F401
    if plan.encoder is not None and plan.of_kind(REENCODE):
        plan.encoder.prepare()


def _apply(journal: Journal, paths: ActionPaths, action: Action, encoder: Encoder | None) -> Outcome:
    try:
        return STEPS[action.kind](journal, paths, action, encoder)
    except RepairError as exc:
        message = str(exc)
    except Exception as exc:  # any failure costs this action, never the cache
        message = f"{type(exc).__name__}: {exc}"
    record = journal.actions(paths.run_id, paths.seq)[0]
    try:
        conflict = roll_back(record, paths.root)
    except Exception as exc:
        raise RunStopped(f"{action.path}: {message}; rolling it back failed too ({exc}): the next "
                         f"`cachedoctor fix` or `cachedoctor undo {paths.run_id}` finishes it") from exc
    journal.update(paths.run_id, paths.seq, FAILED, error=message + (f"; {conflict}" if conflict else ""))
    return Outcome(action, FAILED, message)


def _vanished(journal: Journal, paths: ActionPaths, action: Action) -> Outcome:
    journal.update(paths.run_id, paths.seq, SKIPPED, error="the file vanished")
    return Outcome(action, SKIPPED, "the file vanished before it was changed")


def _quarantine(journal: Journal, paths: ActionPaths, action: Action, encoder: Encoder | None) -> Outcome:
    try:
        sha_before, size = atomic.sha256_file(paths.path), os.lstat(paths.path).st_size
    except FileNotFoundError:
        return _vanished(journal, paths, action)
    journal.update(paths.run_id, paths.seq, STARTED, sha_before=sha_before, size_before=size)
    atomic.move(paths.path, paths.quarantine, paths.part)
    journal.update(paths.run_id, paths.seq, DONE)
    return Outcome(action, DONE)


def _rewrite(journal: Journal, paths: ActionPaths, action: Action, encoder: Encoder | None) -> Outcome:
    from cachedoctor.repair import rewrite

    try:
        data, before = atomic.read_file(paths.path)
    except FileNotFoundError:
        return _vanished(journal, paths, action)
    sha_before = atomic.sha256_bytes(data)
    journal.update(paths.run_id, paths.seq, STARTED, sha_before=sha_before, size_before=len(data))
    compact = action.kind == COMPACT
    new, original, kind = rewrite.rewrite(data, paths.path, compact)
    atomic.write_new(paths.temp, new, like=before)
    written, _ = atomic.read_file(paths.temp)
    rewrite.verify(original, written, paths.path, kind, compact)
    journal.update(paths.run_id, paths.seq, READY, sha_after=atomic.sha256_bytes(written))
    atomic.second_name(paths.path, paths.quarantine, paths.part)
    kept = os.lstat(paths.quarantine)
    if (kept.st_ino, kept.st_size, kept.st_mtime_ns) != (before.st_ino, before.st_size, before.st_mtime_ns) \
            and atomic.sha256_file(paths.quarantine) != sha_before:
        raise Changed("the file changed while it was being rewritten: left as it is now")
    os.replace(paths.temp, paths.path)
    atomic.fsync_dir(os.path.dirname(paths.path))
    journal.update(paths.run_id, paths.seq, DONE)
    return Outcome(action, DONE)


def _reencode(journal: Journal, paths: ActionPaths, action: Action, encoder: Encoder | None) -> Outcome:
    from cachedoctor.repair import reencode

    assert action.target is not None and encoder is not None
    if os.path.lexists(paths.path):
        journal.update(paths.run_id, paths.seq, SKIPPED, error="the entry exists")
        return Outcome(action, SKIPPED, "the entry exists (written since the plan?)")
    journal.update(paths.run_id, paths.seq, STARTED)
    data, latent = reencode.encode(action.target, encoder)
    atomic.write_new(paths.temp, data)
    reencode.verify(action.target, paths.temp, latent)
    journal.update(paths.run_id, paths.seq, READY, sha_after=atomic.sha256_bytes(data))
    atomic.link_new(paths.temp, paths.path)
    journal.update(paths.run_id, paths.seq, DONE)
    return Outcome(action, DONE)


STEPS = {QUARANTINE: _quarantine, COMPACT: _rewrite, TO_CPU: _rewrite, REENCODE: _reencode}
