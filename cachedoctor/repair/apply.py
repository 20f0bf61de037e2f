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

Before it records anything, each action checks that its file is the one planned (device, inode,
size, mtime). It reaches the file from the cache root's descriptor, folder by folder, never
through a symlink (confined.py). A file or folder that changed since the plan (renamed, grown,
replaced, swapped for a symlink that may lead out of the cache) is skipped and reported. Moves,
links and renames name both ends by (folder fd, name). A rewrite keeps the file's mode, owner, group and
mtime. An action that fails (verification, a file that changed meanwhile, an I/O error such as
a full disk) is rolled back on the spot (rollback.py) and reported; the run goes on with the
next one. A journal that cannot be written (a full disk) stops the run: the next fix or undo
finishes it. A kill at any point leaves each file either as it was or as the run made it, and
the journal says enough for the next fix or undo to tell which (rollback.recover).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachedoctor.fix_kinds import COMPACT, QUARANTINE, REENCODE, TO_CPU, FixKind
from cachedoctor.repair import atomic, confined, index
from cachedoctor.repair.caches import ActionPaths
from cachedoctor.repair.errors import RepairError
from cachedoctor.repair.journal import (
    DONE,
    FAILED,
    READY,
    SKIPPED,
    STARTED,
    Journal,
    JournalError,
    Planned,
)
from cachedoctor.repair.rollback import roll_back
from cachedoctor.repair.session import Guard, guarded

if TYPE_CHECKING:
    from cachedoctor.repair.encoders import Encoder
    from cachedoctor.repair.plan import Action, Plan


class RunStopped(Exception):
    """A failed action could not be rolled back: the run stops; the next fix or undo finishes
    the rollback from the journal."""


class Changed(RepairError):
    """The file changed between the run reading it and replacing it."""


class Skip(RepairError):
    """The file or a folder above it is not as planned: the action is skipped, nothing done."""


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

    @property
    def skipped(self) -> tuple[Outcome, ...]:
        """Actions left undone because their file changed since the plan."""
        return tuple(o for o in self.outcomes if o.state == SKIPPED)

    def count(self, kind: FixKind, state: str = DONE) -> int:
        return sum(1 for o in self.outcomes if o.action.kind == kind and o.state == state)


def new_run_id() -> str:
    """Sortable and readable: UTC time to the second, and 4 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


def run(plan: Plan, *, guard: Guard | None = None, run_id: str | None = None, wait: float = 0.0,
        command: str = "", on_start: Callable[[str], None] | None = None,
        on_outcome: Callable[[Outcome], None] | None = None) -> RunResult:
    """Apply `plan` under `guard` (the caller's locks, taken with session.guarded and held since
    its scan), else under locks taken here for the run (waiting up to `wait` seconds)."""
    run_id = run_id or new_run_id()
    if not plan.actions:
        return RunResult(run_id, ())
    roots = plan.roots
    notes: list[str] = []
    outcomes: list[Outcome] = []
    with contextlib.ExitStack() as stack:
        if guard is None:
            guard = stack.enter_context(guarded(roots, wait))
            notes += guard.notes
        elif not guard.covers(roots):
            raise ValueError(f"the plan's caches are not all under the guard's locks: {', '.join(roots)}")
        journals: dict[str, Journal] = {}
        root_fds: dict[str, int] = {}
        try:
            for root in roots:
                root_fds[root] = confined.open_root(root)
                journals[root] = Journal.open(root)
                guard.held.hold_in_cache(root)
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
                paths = ActionPaths(action.root, run_id, seq, action.relpath)
                outcome = _apply(_Step(journals[action.root], paths, action, root_fds[action.root]),
                                 plan.encoder)
                outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome)
            for root in roots:
                failed = any(o.state == FAILED for o in outcomes if o.action.root == root)
                journals[root].set_run_state(run_id, FAILED if failed else DONE)
        finally:
            for journal in journals.values():
                journal.close()
            for fd in root_fds.values():
                os.close(fd)
    return RunResult(run_id, tuple(outcomes), tuple(notes))


def _prepare(plan: Plan) -> None:
    """Import and load what the actions need before the run records anything, so a missing
    module or model fails the run before it changes a file."""
    if any(a.kind != QUARANTINE for a in plan.actions):
        import torch  # noqa: F401
    if plan.encoder is not None and plan.of_kind(REENCODE):
        plan.encoder.prepare()


@dataclass
class _Step:
    """One action under way: its journal, names, and the folder descriptors it works through."""

    journal: Journal
    paths: ActionPaths
    action: Action
    root_fd: int
    dir_fd: int | None = None
    quarantine_fd: int | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.paths.relpath)

    def folder(self) -> int:
        """The file's folder, reached from the root without following a symlink; Skip if it
        is gone or no longer a folder inside the cache."""
        if self.dir_fd is None:
            try:
                self.dir_fd = confined.open_dir(self.root_fd, os.path.dirname(self.paths.relpath))
            except confined.Moved as exc:
                raise Skip(f"a folder on its path changed since the plan: {exc}") from None
        return self.dir_fd

    def quarantine_folder(self) -> int:
        """The run's quarantine folder for this file (made on first use)."""
        if self.quarantine_fd is None:
            rel = os.path.relpath(os.path.dirname(self.paths.quarantine), self.paths.root)
            self.quarantine_fd = confined.open_dir(self.root_fd, rel, create=True)
        return self.quarantine_fd

    def update(self, state: str, **fields: object) -> None:
        self.journal.update(self.paths.run_id, self.paths.seq, state, **fields)

    def close(self) -> None:
        for fd in (self.dir_fd, self.quarantine_fd):
            if fd is not None:
                os.close(fd)


def _apply(step: _Step, encoder: Encoder | None) -> Outcome:
    action, paths = step.action, step.paths
    try:
        return STEPS[action.kind](step, encoder)
    except Skip as exc:  # raised before anything was recorded or changed
        step.update(SKIPPED, error=str(exc))
        return Outcome(action, SKIPPED, str(exc))
    except JournalError as exc:
        _roll_back(step, str(exc))
        raise RunStopped(f"{exc}: the run stopped; the next `cachedoctor fix` or "
                         f"`cachedoctor undo {paths.run_id}` finishes it") from None
    except RepairError as exc:
        message = str(exc)
    except OSError as exc:
        message = _os_error(exc, action.path)
    except Exception as exc:  # any failure costs this action, never the cache
        message = f"{type(exc).__name__}: {exc}"
    finally:
        step.close()
    conflict = _roll_back(step, message)
    step.update(FAILED, error=message + (f"; {conflict}" if conflict else ""))
    return Outcome(action, FAILED, message)


def _roll_back(step: _Step, message: str) -> str | None:
    record = step.journal.actions(step.paths.run_id, step.paths.seq)[0]
    try:
        return roll_back(record, step.paths.root)
    except Exception as exc:
        raise RunStopped(f"{step.action.path}: {message}; rolling it back failed too ({exc}): the "
                         f"next `cachedoctor fix` or `cachedoctor undo {step.paths.run_id}` "
                         "finishes it") from exc


def _os_error(exc: OSError, path: str) -> str:
    """One line naming the path: `/c/a.pt: No space left on device`."""
    where = os.fsdecode(exc.filename) if exc.filename else path
    if exc.filename and not os.path.isabs(where):
        where = os.path.join(os.path.dirname(path), where)  # a name relative to the file's folder
    return f"{where}: {exc.strerror or exc}"


def _check(step: _Step, st: os.stat_result | None) -> os.stat_result:
    """`st` (the file as it is now), or Skip if it is not the file the plan saw."""
    if st is None:
        raise Skip("the file vanished since the plan")
    if stat.S_ISLNK(st.st_mode):
        raise Skip("the file is now a symlink: it may lead out of the cache")
    planned = step.action.planned
    why = planned.differs(st) if planned is not None else (
        None if stat.S_ISREG(st.st_mode) else "is no longer a regular file")
    if why:
        raise Skip(f"since the plan, the file {why}")
    return st


def _open_checked(step: _Step) -> tuple[int, os.stat_result]:
    """The planned file, opened (never through a symlink) and checked against the plan."""
    folder = step.folder()
    _check(step, confined.lstat_at(folder, step.name))
    try:
        fd = confined.open_file(folder, step.name)
    except FileNotFoundError:
        raise Skip("the file vanished since the plan") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Skip("the file is now a symlink: it may lead out of the cache") from None
        raise
    try:
        return fd, _check(step, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise


def _same_file(a: os.stat_result, b: os.stat_result | None) -> bool:
    return b is not None and (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == \
        (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def _quarantine(step: _Step, encoder: Encoder | None) -> Outcome:
    fd, before = _open_checked(step)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            sha_before = hashlib.file_digest(f, "sha256").hexdigest()
    finally:
        os.close(fd)
    step.update(STARTED, sha_before=sha_before, size_before=before.st_size)
    folder, quarantine = step.folder(), step.quarantine_folder()
    if not _same_file(before, confined.lstat_at(folder, step.name)):
        raise Changed("the file changed while it was being moved: left as it is now")
    atomic.move_at(folder, step.name, quarantine, os.path.basename(step.paths.quarantine),
                   os.path.basename(step.paths.part))
    step.update(DONE)
    return Outcome(step.action, DONE)


def _rewrite(step: _Step, encoder: Encoder | None) -> Outcome:
    from cachedoctor.repair import rewrite

    fd, before = _open_checked(step)
    try:
        data = confined.read_fd(fd)
    finally:
        os.close(fd)
    sha_before = atomic.sha256_bytes(data)
    step.update(STARTED, sha_before=sha_before, size_before=len(data))
    compact = step.action.kind == COMPACT
    # the scan's reader judges these very bytes again before torch (weights_only) sees them
    new, original, kind = rewrite.rewrite(data, step.paths.path, compact)
    folder, temp = step.folder(), os.path.basename(step.paths.temp)
    atomic.write_new(temp, new, like=before, dir_fd=folder)
    written = confined.read_at(folder, temp)
    rewrite.verify(original, written, step.paths.path, kind, compact)
    step.update(READY, sha_after=atomic.sha256_bytes(written))
    quarantine, kept_name = step.quarantine_folder(), os.path.basename(step.paths.quarantine)
    atomic.second_name_at(folder, step.name, quarantine, kept_name, os.path.basename(step.paths.part))
    kept = confined.lstat_at(quarantine, kept_name)
    if not _same_file(before, kept) and not (
            kept is not None and stat.S_ISREG(kept.st_mode) and _sha_at(quarantine, kept_name) == sha_before):
        raise Changed("the file changed while it was being rewritten: left as it is now")
    os.replace(temp, step.name, src_dir_fd=folder, dst_dir_fd=folder)
    os.fsync(folder)
    step.update(DONE)
    return Outcome(step.action, DONE)


def _sha_at(dir_fd: int, name: str) -> str:
    fd = confined.open_file(dir_fd, name)
    with os.fdopen(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _reencode(step: _Step, encoder: Encoder | None) -> Outcome:
    from cachedoctor.repair import reencode

    action = step.action
    assert action.target is not None and encoder is not None
    folder = step.folder()
    if confined.lstat_at(folder, step.name) is not None:
        raise Skip("the entry exists (written since the plan?)")
    replaced = _replaced(step) if action.target.format.kept else None
    step.update(STARTED)
    kept = reencode.kept_arrays(action.target, replaced) if replaced is not None else None
    data, latent, besides = reencode.encode(action.target, encoder, kept)
    temp = os.path.basename(step.paths.temp)
    atomic.write_new(temp, data, dir_fd=folder)
    written = confined.read_at(folder, temp)
    reencode.verify(action.target, written, latent, besides)
    step.update(READY, sha_after=atomic.sha256_bytes(data))
    atomic.link_new_at(folder, temp, step.name)
    step.update(DONE)
    return Outcome(action, DONE)


def _replaced(step: _Step) -> bytes:
    """The bytes of the entry a reencode replaces: this run's quarantine action moved it to the
    quarantine, under the same name (ActionPaths.quarantine has no sequence number)."""
    try:
        return confined.read_at(step.quarantine_folder(), os.path.basename(step.paths.quarantine))
    except FileNotFoundError:
        raise Skip("the entry it replaces is not in this run's quarantine") from None


STEPS = {QUARANTINE: _quarantine, COMPACT: _rewrite, TO_CPU: _rewrite, REENCODE: _reencode}
