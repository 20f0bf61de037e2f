"""Byte sources for readers: positional reads of a file (or of bytes) without reading it all.

A file up to WHOLE_FILE_LIMIT is read in one call (one syscall beats several for a 34 KB
latent); a bigger one is read at its head and tail, where torch keeps data.pkl and the central
directory, and anywhere else only on request.
"""

from __future__ import annotations

import os
import stat
from typing import Protocol

WHOLE_FILE_LIMIT = 256 * 1024
WINDOW = 64 * 1024


class Source(Protocol):
    size: int

    def pread(self, offset: int, n: int) -> bytes:
        """Up to n bytes at offset; fewer at the end of the data, never an error for a range."""
        ...


class BytesSource:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._data = memoryview(data)
        self.size = len(self._data)

    def pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or n <= 0 or offset >= self.size:
            return b""
        return bytes(self._data[offset : offset + n])


class FileSource:
    """A file opened read-only, with its head and tail cached."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self.size = size
        if size <= WHOLE_FILE_LIMIT:
            self._head = self._read(0, size)
            self._tail_at, self._tail = size, b""
        else:
            self._head = self._read(0, WINDOW)
            self._tail_at = size - WINDOW
            self._tail = self._read(self._tail_at, WINDOW)

    def _read(self, offset: int, n: int) -> bytes:
        # lseek + read rather than pread: same cost here, and pyfakefs (our tests) fakes them
        os.lseek(self._fd, offset, os.SEEK_SET)
        chunks, done = [], 0
        while done < n:
            chunk = os.read(self._fd, n - done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)

    def pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or n <= 0 or offset >= self.size:
            return b""
        end = min(offset + n, self.size)
        if end <= len(self._head):
            return self._head[offset:end]
        if offset >= self._tail_at and self._tail:
            return self._tail[offset - self._tail_at : end - self._tail_at]
        return self._read(offset, end - offset)

    @property
    def head(self) -> bytes:
        return self._head


def open_source(path: str) -> tuple[int, FileSource]:
    """Open `path` for reading; the caller closes the returned descriptor.

    O_NONBLOCK keeps a FIFO or device node from hanging the scan; those are refused here.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file: {path}")
        return fd, FileSource(fd, st.st_size)
    except BaseException:
        os.close(fd)
        raise
