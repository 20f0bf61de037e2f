"""The one place a command takes the caches' locks and recovers interrupted runs.

`guarded(roots)` holds every root's lock (lock.py) for the whole command and first brings each
journaled cache to a consistent state (rollback.recover): fix holds it from its scan to the end of
the run, undo and purge for their work. What runs inside gets the `Guard` and takes neither
again; `Plan.execute()` with no guard takes its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from cachedoctor.repair import lock
from cachedoctor.repair.caches import with_earlier
from cachedoctor.repair.journal import Journal
from cachedoctor.repair.rollback import recover


@dataclass(frozen=True)
class Guard:
    """The locks a command holds, and what recovery did on taking them (root -> notes)."""

    roots: tuple[str, ...]
    held: lock.Held
    recovered: Mapping[str, tuple[str, ...]]

    @property
    def notes(self) -> list[str]:
        return [note for notes in self.recovered.values() for note in notes]

    def covers(self, roots: Iterable[str]) -> bool:
        return all(self.held.covers(root) for root in roots)

    def recover(self) -> list[str]:
        """Recover again under the held locks (after an interrupted run)."""
        return [note for notes in _recover(self.roots, self.held).values() for note in notes]


@contextlib.contextmanager
def guarded(roots: Iterable[str], wait: float = 0.0, command: str = "fix") -> Iterator[Guard]:
    """Hold the lock of every root (LockBusy after `wait` seconds) and recover each cache that
    has a journal: a run that was killed may have left a file in the quarantine that goes back
    to its place, so recover before scanning."""
    roots = tuple(roots)
    with lock.locked(roots, wait, command) as held:
        yield Guard(roots, held, MappingProxyType(_recover(roots, held)))


def recover_caches(roots: Iterable[str], wait: float = 0.0) -> list[str]:
    """Recover every cache of `roots` under its lock, then let it go; what was done."""
    with guarded(roots, wait) as guard:
        return guard.notes


def _recover(roots: tuple[str, ...], held: lock.Held) -> dict[str, tuple[str, ...]]:
    out = {}
    for root in with_earlier(roots):  # a cache's state at an earlier place: inside a root held
        # a run that keeps its locks in another state dir (another user, another machine on a
        # shared cache) holds `.cachedoctor/lock`, which may have appeared since ours were
        # taken: a run the journal says is `running` is dead only once that lock is ours too
        held.hold_in_cache(root)
        journal = Journal.existing(root)
        if journal is not None:
            with journal:
                out[root] = tuple(recover(journal))
    return out
