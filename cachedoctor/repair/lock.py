"""One fix or undo at a time per cache: an flock on `<cache>/.cachedoctor/lock`.

flock belongs to the open file: the kernel drops it when its holder exits, however it dies, so
a lock is never stale. The holder writes its pid and command into the file for the message a
second run prints. It guards against other cachedoctor runs only: a trainer writing into the
cache does not take this lock (unless it is taught to), so stop trainers before a fix.

Locks are re-entrant within a process (the CLI holds a cache's lock from its scan to the end of
the run, and the plan's `execute` takes it again).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterable, Iterator

from cachedoctor.repair import atomic
from cachedoctor.repair.caches import LOCK, state_dir

POLL_SECONDS = 0.1

_held: dict[str, tuple[int, int]] = {}  # root -> (fd, depth)


class LockBusy(Exception):
    """Another run holds a cache's lock."""

    def __init__(self, root: str, holder: str) -> None:
        self.root = root
        self.holder = holder
        super().__init__(f"another cachedoctor {holder} is running on {root}; wait for it to "
                         "finish, or pass --wait SECONDS")


@contextlib.contextmanager
def locked(roots: Iterable[str], wait: float = 0.0, command: str = "fix") -> Iterator[None]:
    """Hold the lock of every root (in sorted order, so two runs never deadlock); wait up to
    `wait` seconds for each, else raise LockBusy."""
    deadline = time.monotonic() + max(wait, 0.0)
    taken: list[str] = []
    try:
        for root in sorted(set(roots)):
            _acquire(root, deadline, command)
            taken.append(root)
        yield
    finally:
        for root in reversed(taken):
            _release(root)


def holder(root: str) -> str:
    """What the lock file says about its holder: "fix (pid 123)"."""
    try:
        with open(os.path.join(state_dir(root), LOCK)) as f:
            pid, _, command = f.read().strip().partition(" ")
    except OSError:
        pid, command = "", ""
    return f"{command or 'fix'} (pid {pid or 'unknown'})"


def _acquire(root: str, deadline: float, command: str) -> None:
    if root in _held:
        fd, depth = _held[root]
        _held[root] = (fd, depth + 1)
        return
    atomic.ensure_dir(state_dir(root))
    fd = os.open(os.path.join(state_dir(root), LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise LockBusy(root, holder(root)) from None
            time.sleep(POLL_SECONDS)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
    _held[root] = (fd, 1)


def _release(root: str) -> None:
    fd, depth = _held[root]
    if depth > 1:
        _held[root] = (fd, depth - 1)
        return
    del _held[root]
    os.close(fd)  # closing the last descriptor drops the flock
