"""The caches this user has run `fix` on, so that `cachedoctor undo [RUN_ID]` needs no target.

A small SQLite file in `$CACHEDOCTOR_STATE_DIR`, else `$XDG_STATE_HOME/cachedoctor`, else
`~/.local/state/cachedoctor`. It only points at caches: what a run did lives in each cache's
own journal, so a cache dir that was moved, or copied to another host, is undone with
`undo --cache DIR`. Failing to write it costs a warning, never a fix.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from cachedoctor.repair.caches import JOURNAL, state_dir

FILE = "caches.sqlite"


def state_home() -> Path:
    explicit = os.environ.get("CACHEDOCTOR_STATE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "cachedoctor"


def _connect() -> sqlite3.Connection:
    home = state_home()
    home.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(home / FILE, timeout=30)
    conn.execute("CREATE TABLE IF NOT EXISTS caches (root BLOB PRIMARY KEY, used REAL NOT NULL)")
    return conn


def remember(roots: Iterable[str]) -> str | None:
    """Record `roots` as used now; a warning (not an exception) when that fails."""
    try:
        conn = _connect()
        try:
            with conn:
                conn.executemany("INSERT OR REPLACE INTO caches (root, used) VALUES (?, ?)",
                                 [(os.fsencode(r), time.time()) for r in roots])
        finally:
            conn.close()
    except (OSError, sqlite3.Error) as exc:
        return (f"cannot record the caches in {state_home() / FILE} ({exc}): "
                "`cachedoctor undo` will need --cache DIR for this run")
    return None


def known_roots(only_readable: bool = True) -> list[str]:
    """Every recorded cache that still has a journal, most recently used first; only those
    whose journal opens unless `only_readable` is false (to list the others' errors)."""
    try:
        conn = _connect()
    except (OSError, sqlite3.Error):
        return []
    try:
        rows = conn.execute("SELECT root FROM caches ORDER BY used DESC").fetchall()
    except sqlite3.Error:
        rows = []
    finally:
        conn.close()
    roots = [os.fsdecode(r) for (r,) in rows]
    return [r for r in roots if os.path.exists(os.path.join(state_dir(r), JOURNAL))
            and (not only_readable or _opens(r))]


def _opens(root: str) -> bool:
    """Whether `root`'s journal can be opened: a damaged one (or one behind a symlink) must not
    stop undo, purge or the run list for every other cache; `--cache DIR` names its error."""
    from cachedoctor.repair.journal import Journal, JournalError

    try:
        Journal.open(root).close()
    except JournalError:
        return False
    return True
