"""Put one action's file back as it was, from the journal and the file system alone; undo a run
in one cache; bring interrupted runs to a consistent state. All work after a kill at any
instruction of the run (or of themselves).

Recovery and undo may delete only three things: cachedoctor's own temp files (names derived
from the run id), a file whose sha256 is the one the run itself recorded for what it wrote, and
the quarantine's second name for a file whose first name holds the same bytes. Anything else
that is in the way (a file a trainer wrote since) is left alone and reported as a conflict.
Where a file's folder is gone since the run (a trainer cleared its cache) and its original is
kept, the folders are made again to put it back.

Per action, what the files say about how far it got:
- quarantine: the file at its place (not moved yet) or in the quarantine (moved): moved back.
- compact, to-cpu: no quarantine copy (not replaced yet); a quarantine copy and the file the
  same (the copy made, the swap not): the copy dropped; the file is what the run wrote, or
  missing: the quarantine copy put back over it.
- reencode: the file is what the run wrote: deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat

from cachedoctor.fix_kinds import QUARANTINE, REENCODE
from cachedoctor.repair import atomic, confined
from cachedoctor.repair.caches import (
    QUARANTINE_DIR,
    ActionPaths,
    plain_relpath,
    plain_run_id,
    state_dir,
)
from cachedoctor.repair.journal import (
    CONFLICT,
    DONE,
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


def roll_back(record: ActionRecord, root: str) -> str | None:
    """Undo what `record`'s action did to its file; None when it is back, else why it was left.
    Works through folder descriptors from the root (confined.py): a folder of the cache swapped
    for a symlink since the run leaves the file where it is, reported, never moved out."""
    if not plain_run_id(record.run_id):  # a hostile journal's: its temp names are no one's
        return f"{record.run_id!r} is no run id cachedoctor writes: {record.relpath!r} left alone"
    if not plain_relpath(record.relpath):
        return f"{record.relpath!r} is no file path cachedoctor records: left alone"
    root_fd = confined.open_root(root)
    fds: list[int] = []
    try:
        return _roll_back(record, record.paths(root), root_fd, fds)
    finally:
        for fd in (*fds, root_fd):
            os.close(fd)


def _roll_back(record: ActionRecord, paths: ActionPaths, root_fd: int, fds: list[int]) -> str | None:
    name, kept_name = os.path.basename(paths.relpath), os.path.basename(paths.quarantine)
    folder, moved = _folder(root_fd, os.path.dirname(paths.relpath), fds)
    kept_rel = os.path.relpath(os.path.dirname(paths.quarantine), paths.root)
    quarantine, quarantine_moved = _folder(root_fd, kept_rel, fds)
    if folder is not None:
        for leftover in (paths.temp, paths.restore_temp):
            _remove_at(folder, os.path.basename(leftover))
    if quarantine is not None:
        _remove_at(quarantine, os.path.basename(paths.part))
    if record.kind == REENCODE:
        if folder is not None and record.sha_after and _sha_at(folder, name) == record.sha_after:
            _remove_at(folder, name)
        return None
    if quarantine_moved:
        return f"{quarantine_moved}: left alone; the original may still be at {paths.quarantine}"
    if quarantine is None or confined.lstat_at(quarantine, kept_name) is None:
        # nothing kept: the action had not moved it yet (recovery), or a finished action's
        # original was deleted since (the quarantine removed by hand, or with the folder
        # holding it): then undo cannot put it back, and says so rather than count it back
        if record.state in (DONE, CONFLICT) and not (
                folder is not None and record.sha_before and _sha_at(folder, name) == record.sha_before):
            return f"{paths.path}: its original is no longer in the quarantine ({paths.quarantine}): cannot be put back"
        return None
    if folder is None and moved is None:
        # the file's folder is gone while its original is kept: a trainer's own cache clear
        # deletes whole folders (OneTrainer's GenericTrainer.__clear_cache rmtree's image/ and
        # text/ at every start). Made again, from the root, never through a symlink
        try:
            folder = confined.open_dir(root_fd, os.path.dirname(paths.relpath), create=True)
        except confined.Moved as exc:
            moved = str(exc)
        else:
            fds.append(folder)
    if folder is None:
        return f"{moved}: left alone; the original is kept at {paths.quarantine}"
    here = confined.lstat_at(folder, name)
    if here is not None and _same_at(folder, name, here, quarantine, kept_name):
        _remove_at(quarantine, kept_name)
        return None
    ours = record.kind != QUARANTINE and record.sha_after and _sha_at(folder, name) == record.sha_after
    kept = confined.lstat_at(quarantine, kept_name)
    if (ours or here is None) and (kept is None or not stat.S_ISREG(kept.st_mode)):
        # the run kept a regular file there: a symlink or FIFO in its place was planted since
        return (f"{paths.quarantine} is no longer a regular file (a symlink, FIFO or folder was "
                "put in its place since the run): left alone")
    if ours or here is None:
        atomic.move_at(quarantine, kept_name, folder, name, os.path.basename(paths.restore_temp))
        return None
    return f"{paths.path} has changed since the run: left alone; the original is kept at {paths.quarantine}"


def _folder(root_fd: int, reldir: str, fds: list[int]) -> tuple[int | None, str | None]:
    """(descriptor, None); (None, None) where the folder is gone; (None, why) where a folder on
    the way is now a symlink or a file."""
    try:
        fd = confined.open_dir(root_fd, reldir)
    except confined.Gone:
        return None, None
    except confined.Moved as exc:
        return None, str(exc)
    fds.append(fd)
    return fd, None


def _remove_at(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        return
    os.fsync(folder)


def _sha_at(folder: int, name: str) -> str | None:
    """The sha256 of the regular file `name` (None if it is missing, a symlink, or no regular
    file: a folder or FIFO put in its place since the run)."""
    try:
        fd = confined.open_file(folder, name)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _same_at(folder: int, name: str, st: os.stat_result, other: int, other_name: str) -> bool:
    """Whether two files hold the same bytes (cheaply true for two names of one file)."""
    kept = confined.lstat_at(other, other_name)
    if kept is None or not stat.S_ISREG(st.st_mode):
        return False
    if (kept.st_dev, kept.st_ino) == (st.st_dev, st.st_ino):
        return True
    return kept.st_size == st.st_size and _sha_at(folder, name) == _sha_at(other, other_name)


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
    if plain_run_id(run_id):  # a hostile journal's `../..` names no folder of ours
        _prune(journal.root, run_id)
    return restored, conflicts


def _prune(root: str, run_id: str) -> None:
    """Remove the run's quarantine dirs that undo left empty (never a file), then the quarantine
    dir where no other run uses it. Through folder descriptors (confined.py), like purge: a
    `.cachedoctor` or `quarantine` swapped for a symlink leads no rmdir out of the cache."""
    try:
        root_fd = confined.open_root(root)
    except OSError:
        return
    try:
        state = confined.open_dir(root_fd, state_dir("."))
    except (confined.Moved, OSError):
        return
    finally:
        os.close(root_fd)
    try:
        with contextlib.suppress(confined.Moved, OSError):
            quarantine = confined.open_dir(state, QUARANTINE_DIR)
            try:
                for _parent, dirs, _files, fd in os.fwalk(run_id, topdown=False, dir_fd=quarantine):
                    for name in dirs:  # fwalk lists a symlink to a folder here: rmdir refuses it
                        with contextlib.suppress(OSError):  # not empty: a conflict's original
                            os.rmdir(name, dir_fd=fd)
                with contextlib.suppress(OSError):
                    os.rmdir(run_id, dir_fd=quarantine)
            finally:
                os.close(quarantine)
            os.rmdir(QUARANTINE_DIR, dir_fd=state)
    finally:
        os.close(state)
