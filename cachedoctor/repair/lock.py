"""One fix or undo at a time per cache, nested caches included: flocks in cachedoctor's own
state dir (index.state_home()/locks/), one file per real folder path.

A run on cache R holds an exclusive flock on R's file and a shared one on the file of every
folder above R, so `fix P` and `fix P/sub` exclude each other (P's file: exclusive against
shared) while `fix P/a` and `fix P/b` run side by side. Locks are taken in path order, so two
runs never deadlock. Keyed by the real path: `fix link-to-P` and `fix P` take the same lock.
The lock files live outside the cache, so taking a lock creates no folder in it (a dataset's
cache dir that does not exist yet stays absent). Where the cache already has `.cachedoctor/`,
the run also holds `<cache>/.cachedoctor/lock`, which a trainer can flock to keep fix out.

flock belongs to the open file: the kernel drops it when its holder exits, however it dies, so
a lock is never stale. The holder of an exclusive lock writes its pid, command and cache into
the file for the message a second run prints. It guards against other cachedoctor runs of this
user (and, through `.cachedoctor/lock`, of others): a trainer writing into the cache does not
take it unless taught to, so stop trainers before a fix.

A `locked` block is taken once per command (session.guarded: with the recovery of interrupted
runs) and handed down; it is not re-entrant, and nothing under it takes it again. A cache
inside another root of the same block is covered by that root's lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
from collections.abc import Iterable, Iterator

from cachedoctor.repair.caches import LOCK, state_dir

POLL_SECONDS = 0.1
LOCKS_DIR = "locks"


class LockBusy(Exception):
    """Another run holds a cache's lock (or one of a cache nested in or around it)."""

    def __init__(self, root: str, holder: str) -> None:
        self.root = root
        self.holder = holder
        super().__init__(f"another cachedoctor {holder} is running on {root}; wait for it to "
                         "finish, or pass --wait SECONDS")


class Held:
    """The locks one `locked` block holds: real root -> its fds (a covered root has none)."""

    def __init__(self) -> None:
        self._fds: dict[str, list[int]] = {}

    def covers(self, root: str) -> bool:
        """Whether `root` is one of the held roots or inside one."""
        return self._covering(os.path.realpath(root)) is not None

    def hold_in_cache(self, root: str) -> None:
        """Also flock `<root>/.cachedoctor/lock` for as long as `root`'s lock is held (call it
        once the run has made `.cachedoctor/`); LockBusy if someone else holds it."""
        real = os.path.realpath(root)
        fds = self._fds.get(self._covering(real) or real)
        if fds is None or any(getattr(fd, "in_cache", False) for fd in fds):
            return
        fd = _in_cache(real, time.monotonic())
        if fd is not None:
            fds.insert(0, fd)

    def _covering(self, real: str) -> str | None:
        for held in self._fds:
            if real == held or real.startswith(held.rstrip(os.sep) + os.sep):
                return held
        return None

    def _acquire(self, root: str, deadline: float, command: str) -> None:
        if self._covering(root) is not None:
            return
        self._fds[root] = _acquire(root, deadline, command)

    def _release(self) -> None:
        for root in reversed(list(self._fds)):
            for fd in reversed(self._fds.pop(root)):
                os.close(fd)  # closing the last descriptor drops the flock


@contextlib.contextmanager
def locked(roots: Iterable[str], wait: float = 0.0, command: str = "fix") -> Iterator[Held]:
    """Hold the lock of every root (in path order, so two runs never deadlock); wait up to
    `wait` seconds for each, else raise LockBusy. Not re-entrant: a second block on a root this
    one holds waits for it like any other run."""
    deadline = time.monotonic() + max(wait, 0.0)
    held = Held()
    try:
        for root in sorted({os.path.realpath(r) for r in roots}):
            held._acquire(root, deadline, command)
        yield held
    finally:
        held._release()


def holder(root: str) -> str:
    """What the lock file of `root` says about its holder: "fix (pid 123)"."""
    return _describe(_read(_lock_file(os.path.realpath(root)))[:2])


def _lock_dir() -> str:
    from cachedoctor.repair.index import state_home

    return os.path.join(state_home(), LOCKS_DIR)


def _lock_file(real: str) -> str:
    return os.path.join(_lock_dir(), hashlib.sha256(os.fsencode(real)).hexdigest()[:32])


def _ancestors(real: str) -> list[str]:
    out = []
    parent = os.path.dirname(real)
    while parent != real:
        out.append(real := parent)
        parent = os.path.dirname(real)
    return sorted(out)


def _acquire(root: str, deadline: float, command: str) -> list[int]:
    os.makedirs(_lock_dir(), exist_ok=True)
    fds: list[int] = []
    try:
        for folder in _ancestors(root):
            fds.append(_flock(folder, fcntl.LOCK_SH, deadline, root))
        fds.append(_flock(root, fcntl.LOCK_EX, deadline, root))
        _note(fds[-1], f"{os.getpid()} {command}\n".encode() + os.fsencode(root) + b"\n")
        in_cache = _in_cache(root, deadline)
        if in_cache is not None:
            fds.append(in_cache)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


class _InCache(int):
    """The fd of `<cache>/.cachedoctor/lock` (told apart from the state dir's lock fds)."""

    in_cache = True


def _in_cache(root: str, deadline: float) -> int | None:
    """flock `<root>/.cachedoctor/lock` where `.cachedoctor/` exists (never created here)."""
    try:  # `.cachedoctor` itself opened without following a symlink: no lock file made elsewhere
        folder = os.open(state_dir(root), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644,
                         dir_fd=folder)
        finally:
            os.close(folder)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EROFS, errno.ELOOP):
            return None  # no .cachedoctor/ (or one we cannot write): the state dir's lock rules
        raise
    _wait_for(fd, fcntl.LOCK_EX, deadline, lambda: LockBusy(root, _describe(_read_fd(fd)[:2])))
    _note(fd, f"{os.getpid()} fix\n".encode())
    return _InCache(fd)


def _note(fd: int, holder: bytes) -> None:
    """Tell a waiting run who holds the lock; a full disk costs only that message."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder, 0)


def _flock(folder: str, mode: int, deadline: float, root: str) -> int:
    fd = os.open(_lock_file(folder), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _wait_for(fd, mode, deadline, lambda: _busy(root))
    return fd


def _wait_for(fd: int, mode: int, deadline: float, busy) -> None:
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                error = busy()
                os.close(fd)
                raise error from None
            time.sleep(POLL_SECONDS)


def _busy(root: str) -> LockBusy:
    """Name the run that holds `root`, a cache above it or one inside it."""
    try:
        names = os.listdir(_lock_dir())
    except OSError:
        names = []
    for name in sorted(names):
        pid, command, held = _read(os.path.join(_lock_dir(), name))
        if not held or not (held == root or root.startswith(held.rstrip(os.sep) + os.sep)
                            or held.startswith(root.rstrip(os.sep) + os.sep)):
            continue
        if _is_held(os.path.join(_lock_dir(), name)):
            return LockBusy(held, _describe((pid, command)))
    return LockBusy(root, _describe(("", "")))


def _is_held(path: str) -> bool:
    """Whether some process holds an exclusive flock on `path` (a shared probe fails)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _read(path: str) -> tuple[str, str, str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return "", "", ""
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_fd(fd: int) -> tuple[str, str, str]:
    """(pid, command, root) as the holder wrote them."""
    try:
        first, _, rest = os.pread(fd, 8192, 0).partition(b"\n")
    except OSError:
        return "", "", ""
    pid, _, command = first.decode(errors="replace").strip().partition(" ")
    return pid, command, os.fsdecode(rest.rstrip(b"\n"))


def _describe(found: tuple[str, str]) -> str:
    pid, command = found
    return f"{command or 'fix'} (pid {pid or 'unknown'})"

