"""Reading small files a cache or dataset names (captions, lists) without trusting them.

A FIFO in a caption's place would block an ordinary open forever, and a symlink to /dev/zero
would never end a read. So the file is opened without blocking, must be a regular file, and
is read up to a limit.
"""

from __future__ import annotations

import os
import stat


class NotRegular(OSError):
    """A FIFO, a device or a folder where a file was expected."""

    def __init__(self) -> None:
        super().__init__("not a regular file (a FIFO, a device or a folder)")


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A descriptor of `path` opened without blocking, and its fstat; the caller closes it.
    OSError when it cannot be opened, NotRegular when it is no regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small(path: str, limit: int) -> bytes | None:
    """At most `limit` + 1 bytes of `path` (more than `limit` tells the caller it is too big),
    or None when it cannot be read or is no regular file."""
    try:
        fd, _ = open_regular(path)
    except OSError:
        return None
    try:
        raw = b""
        while len(raw) <= limit and (chunk := os.read(fd, limit + 1 - len(raw))):
            raw += chunk
        return raw
    except OSError:
        return None
    finally:
        os.close(fd)
