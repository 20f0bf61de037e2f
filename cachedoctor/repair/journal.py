"""The journal: an SQLite database in `<cache>/.cachedoctor/` recording every run and every
action before it changes a file.

Every update is its own transaction, committed with `synchronous=FULL` in SQLite's rollback
journal mode (WAL needs shared memory, which network file systems lack). Paths are stored as
bytes, relative to the cache root (and absolute, as planned, for people reading the journal):
file names need not be UTF-8, and a cache dir may be moved between a run and its undo.

Run states: running -> done | failed (some action failed and was rolled back) | interrupted
(found running by the next fix or undo, in-flight actions rolled back); undoing -> undone |
undo-incomplete (some file had changed since the run: left alone, see the action's error).

Action states: planned -> started (sha256 before recorded; nothing changed yet) -> ready (new
content written, verified, its sha256 recorded; original untouched) -> done; or failed,
skipped, rolled-back (by recovery), undone, conflict (undo left the file alone).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from cachedoctor import __version__
from cachedoctor.clock import fs_now
from cachedoctor.repair import atomic
from cachedoctor.repair.caches import JOURNAL, KEPT_SUFFIX, ActionPaths, state_dir

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id   TEXT PRIMARY KEY,
    started  REAL NOT NULL,
    finished REAL,
    state    TEXT NOT NULL,
    pid      INTEGER,
    host     TEXT,
    command  TEXT,
    version  TEXT
);
CREATE TABLE IF NOT EXISTS actions (
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    seq         INTEGER NOT NULL,
    action      TEXT NOT NULL,
    relpath     BLOB NOT NULL,
    path        BLOB NOT NULL,
    quarantine  BLOB,
    temp        BLOB,
    codes       TEXT NOT NULL,
    source      BLOB,
    state       TEXT NOT NULL,
    size_before INTEGER,
    sha_before  TEXT,
    sha_after   TEXT,
    error       TEXT,
    updated     REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
);
"""

# table -> the columns SCHEMA gives it (the first word of each column line)
COLUMNS = {
    table: frozenset(line.split()[0] for line in body.strip().splitlines()
                     if not line.strip().startswith("PRIMARY"))
    for table, body in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\n\);", SCHEMA, re.S)
}

RUNNING, DONE, FAILED, INTERRUPTED = "running", "done", "failed", "interrupted"
UNDOING, UNDONE, UNDO_INCOMPLETE = "undoing", "undone", "undo-incomplete"
PLANNED, STARTED, READY = "planned", "started", "ready"
SKIPPED, ROLLED_BACK, CONFLICT = "skipped", "rolled-back", "conflict"  # and DONE, FAILED, UNDONE
IN_FLIGHT = frozenset({STARTED, READY})
# Actions whose changes may still be on disk: what undo walks back over.
UNDOABLE = frozenset({STARTED, READY, DONE, CONFLICT})


class JournalError(Exception):
    """The journal cannot be opened or is of a newer schema."""


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    started: float
    finished: float | None
    state: str
    pid: int | None
    command: str | None


@dataclass(frozen=True)
class ActionRecord:
    run_id: str
    seq: int
    kind: str
    relpath: str
    codes: tuple[str, ...]
    state: str
    size_before: int | None
    sha_before: str | None
    sha_after: str | None
    error: str | None
    kept_suffix: str = KEPT_SUFFIX

    def paths(self, root: str) -> ActionPaths:
        return ActionPaths(root, self.run_id, self.seq, self.relpath, self.kept_suffix)


@dataclass(frozen=True)
class Planned:
    """One action as `begin_run` records it."""

    seq: int
    kind: str
    relpath: str
    codes: tuple[str, ...]
    source: str | None = None  # reencode: the image


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def _kept_suffix(relpath: bytes, kept: bytes | None) -> str:
    """How the run named its quarantined copy: bare (as before KEPT_SUFFIX) only where the
    journal recorded exactly that; anything else gets today's name. The recorded path itself is
    never used: a journal may come with a cache someone else wrote (ActionPaths derives it)."""
    legacy = isinstance(kept, bytes) and isinstance(relpath, bytes) and kept.endswith(b"/" + relpath)
    return "" if legacy else KEPT_SUFFIX


class Journal:
    """One cache root's journal. Open it under that root's lock (lock.py)."""

    def __init__(self, root: str, conn: sqlite3.Connection) -> None:
        self.root = root
        self.conn = conn

    @classmethod
    def existing(cls, root: str) -> Journal | None:
        """The journal of `root`, or None where no run ever wrote one."""
        return cls.open(root) if os.path.exists(os.path.join(state_dir(root), JOURNAL)) else None

    @classmethod
    def open(cls, root: str) -> Journal:
        """The journal of `root`, created if there is none (in `.cachedoctor/`, made in `root`
        if need be: never `root` itself, nor a folder above it)."""
        path = os.path.join(state_dir(root), JOURNAL)
        try:
            os.mkdir(state_dir(root), 0o755)
            atomic.fsync_dir(root)
        except FileExistsError:
            pass
        for link in (state_dir(root), path, path + "-journal"):
            if os.path.islink(link):  # sqlite would follow it: write, or delete, outside the cache
                raise JournalError(f"{link} is a symlink: cachedoctor keeps its state in the cache "
                                   "itself, never through a link; remove the link")
        if not os.path.isdir(state_dir(root)):
            raise JournalError(f"{state_dir(root)} is not a folder: cachedoctor keeps its state "
                               "there; move that file away")
        try:
            conn = sqlite3.connect(path, timeout=30)
            conn.execute("PRAGMA journal_mode=DELETE")
            conn.execute("PRAGMA synchronous=FULL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                conn.close()
                raise JournalError(f"{path} was written by a newer cachedoctor (journal schema "
                                   f"{version}); upgrade cachedoctor to undo its runs")
            if version < SCHEMA_VERSION:  # a new journal (reading one writes nothing)
                with conn:
                    conn.executescript(SCHEMA)
                    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            for table, columns in COLUMNS.items():  # another program's database, or a forged one
                have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
                if not columns <= have:
                    conn.close()
                    raise JournalError(f"{path} is no cachedoctor journal: its table {table} "
                                       f"lacks {', '.join(sorted(columns - have))}")
        except sqlite3.Error as exc:
            raise JournalError(f"cannot open the journal {path}: {exc}") from None
        return cls(root, conn)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writing ---

    @property
    def path(self) -> str:
        return os.path.join(state_dir(self.root), JOURNAL)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One committed transaction; a failed write (a full disk: SQLite's "database or disk
        is full") is a JournalError naming the journal. SQLite rolls the transaction back, so
        the journal stays as it was before it."""
        try:
            with self.conn:
                yield
        except sqlite3.Error as exc:
            raise JournalError(f"cannot write the journal {self.path}: {exc}") from None

    def begin_run(self, run_id: str, planned: Iterable[Planned], command: str) -> None:
        """Record the run and every action it plans, in one transaction, before any change.
        Its start is read from the clock that stamps files (the journal file's own stamp), so
        that --changed-since RUN never leaves out a file the run changed."""
        now = fs_now(self.path) / 1e9
        with self._writing():
            self.conn.execute(
                "INSERT INTO runs (run_id, started, state, pid, host, command, version) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (run_id, now, RUNNING, os.getpid(), socket.gethostname(), command, __version__),
            )
            for p in planned:
                paths = ActionPaths(self.root, run_id, p.seq, p.relpath)
                self.conn.execute(
                    "INSERT INTO actions (run_id, seq, action, relpath, path, quarantine, temp, codes,"
                    " source, state, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, p.seq, p.kind, _b(p.relpath), _b(paths.path),
                     _b(os.path.relpath(paths.quarantine, self.root)),
                     _b(os.path.relpath(paths.temp, self.root)), ",".join(p.codes), _b(p.source),
                     PLANNED, now),
                )

    def update(self, run_id: str, seq: int, state: str, **fields: object) -> None:
        """Set an action's state (and sha_before, sha_after, size_before, error); committed."""
        allowed = {"sha_before", "sha_after", "size_before", "error"}
        if not allowed.issuperset(fields):
            raise ValueError(f"unknown action fields: {sorted(set(fields) - allowed)}")
        columns = "".join(f", {name} = ?" for name in fields)
        with self._writing():
            self.conn.execute(
                f"UPDATE actions SET state = ?, updated = ?{columns} WHERE run_id = ? AND seq = ?",
                (state, time.time(), *fields.values(), run_id, seq),
            )

    def set_run_state(self, run_id: str, state: str) -> None:
        finished = None if state in (RUNNING, UNDOING) else time.time()
        with self._writing():
            self.conn.execute("UPDATE runs SET state = ?, finished = ? WHERE run_id = ?",
                              (state, finished, run_id))

    # --- reading ---

    def runs(self) -> list[RunRecord]:
        rows = self.conn.execute(
            "SELECT run_id, started, finished, state, pid, command FROM runs ORDER BY started, run_id"
        )
        return [RunRecord(*row) for row in rows]

    def run(self, run_id: str) -> RunRecord | None:
        return next((r for r in self.runs() if r.run_id == run_id), None)

    def actions(self, run_id: str, seq: int | None = None) -> list[ActionRecord]:
        """The run's actions in order (or the one numbered `seq`)."""
        rows = self.conn.execute(
            "SELECT run_id, seq, action, relpath, codes, state, size_before, sha_before, sha_after,"
            " error, quarantine FROM actions WHERE run_id = ? AND (? IS NULL OR seq = ?) ORDER BY seq",
            (run_id, seq, seq),
        )
        return [
            ActionRecord(run_id, seq, kind, os.fsdecode(relpath), tuple(filter(None, codes.split(","))),
                         state, size, before, after, error, _kept_suffix(relpath, kept))
            for run_id, seq, kind, relpath, codes, state, size, before, after, error, kept in rows
        ]
