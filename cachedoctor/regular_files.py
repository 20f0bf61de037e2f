"""Reading small files a cache or dataset names (captions, lists) without trusting them.

A FIFO in a caption's place would block an ordinary open forever, and a symlink to /dev/zero
would never end a read. So the file is opened without blocking, must be a regular file, and
is read up to a limit.
"""

from __future__ import annotations

import os
import stat


def read_small(path: str, limit: int) -> bytes | None:
    """At most `limit` + 1 bytes of `path` (more than `limit` tells the caller it is too big),
    or None when it cannot be read or is no regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = b""
        while len(raw) <= limit and (chunk := os.read(fd, limit + 1 - len(raw))):
            raw += chunk
        return raw
    except OSError:
        return None
    finally:
        os.close(fd)
