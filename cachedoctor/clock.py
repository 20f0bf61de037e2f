"""The clock that stamps files, for times that are compared with files' mtimes and ctimes
(a scan's start for --changed-since, a repair run's start)."""

from __future__ import annotations

import contextlib
import os
import sys
import time


def fs_now(path: str | None) -> int:
    """Now in ns, by the clock that stamps files. The kernel stamps a change with a clock that
    lags time.time_ns() by up to a tick (4-10 ms), truncated to the file system's granularity,
    so a file changed just after time.time_ns() can look older than it (and --changed-since
    would leave it out). Touching `path` (stat'ed first: Linux then stamps its change finely
    and no later stamp is older) and reading its mtime asks the clock itself; without such a
    file, Linux's coarse clock is the floor of its stamps."""
    if path is not None:
        with contextlib.suppress(OSError, NotImplementedError):
            os.lstat(path)
            os.utime(path, follow_symlinks=False)
            return os.lstat(path).st_mtime_ns
    now = time.time_ns()
    coarse = getattr(time, "CLOCK_REALTIME_COARSE", 5 if sys.platform.startswith("linux") else None)
    if coarse is not None:
        with contextlib.suppress(OSError):
            now = min(now, time.clock_gettime_ns(coarse))
    return now
