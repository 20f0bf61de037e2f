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


CHUNK = 1 << 20  # what a file that grows while it is read is read on by


def read_upto(fd: int, size: int, limit: int) -> bytes:
    """The bytes of the open file `fd`, whose fstat said `size`, up to `limit` + 1 of them
    (more than `limit` tells the caller it is too big). One read of `size` and a byte more to
    see the end; a file that grows meanwhile is read on in small reads: os.read reserves what
    it is asked for, so asking for `limit` would reserve it for every small file."""
    parts, total = [], 0
    want = size + 1
    while total <= limit and (chunk := os.read(fd, min(want, limit + 1 - total))):
        parts.append(chunk)
        total += len(chunk)
        want = min(CHUNK, max(4096, total))
    return b"".join(parts)


def read_small(path: str, limit: int) -> bytes | None:
    """At most `limit` + 1 bytes of `path` (more than `limit` tells the caller it is too big),
    or None when it cannot be read or is no regular file."""
    try:
        fd, st = open_regular(path)
    except OSError:
        return None
    try:
        return read_upto(fd, st.st_size, limit)
    except OSError:
        return None
    finally:
        os.close(fd)
