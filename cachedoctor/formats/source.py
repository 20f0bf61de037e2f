"""Byte sources for readers: positional reads of a file (or of bytes) without reading it all.

A file up to WHOLE_FILE_LIMIT is read in one call (one syscall beats several for a 34 KB
latent); a bigger one is read at its head and tail, where torch keeps data.pkl and the central
directory, and anywhere else only on request. Small windows: copying bytes nobody looks at is
most of what reading a 512 KB Flux latent's metadata costs (8 KiB windows: 14 µs a file
warm, 64 KiB: 19 µs).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Protocol

WHOLE_FILE_LIMIT = 64 * 1024
WINDOW = 8 * 1024
# --deep reads every byte anyway: a file up to this size is read in one call, and checked
# through memoryview slices of that buffer (no copies); a bigger one in bounded chunks
DEEP_WHOLE_LIMIT = 16 * 1024 * 1024


Window = tuple[int, bytes]  # (offset, the bytes there)


class Source(Protocol):
    size: int
    buffer: bytes | None  # every byte, when they are all in memory anyway
    windows: tuple[Window, ...]  # what is in memory: the whole file, its head and tail, or spans

    def pread(self, offset: int, n: int) -> bytes:
        """Up to n bytes at offset; fewer at the end of the data, never an error for a range."""
        ...


class BytesSource:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.buffer = data if isinstance(data, bytes) else bytes(data)
        self.size = len(self.buffer)
        self.windows = ((0, self.buffer),)

    def pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or n <= 0:
            return b""
        return self.buffer[offset : offset + n]


class FileSource:
    """A file opened read-only, with some of its bytes in memory (`windows`): all of a small
    file, a big one's head and tail, or the spans the caller names (zip_templates knows which
    bytes decide a file of a layout it has seen); any other range is read on request."""

    def __init__(self, fd: int, size: int, position: int | None = None,
                 spans: Spans | None = None, whole_limit: int = WHOLE_FILE_LIMIT) -> None:
        self._fd = fd
        self._pos = position  # the descriptor's offset, when known: saves an lseek
        self.size = size
        self.mtime = 0.0
        self.stat: tuple[int, int, int, int, int] | None = None
        self.buffer: bytes | None = None
        self.windows: tuple[Window, ...]
        if spans is not None:
            self.windows = tuple((at, self._read(at, n)) for at, n in spans)
        elif size <= max(whole_limit, WHOLE_FILE_LIMIT):
            self.buffer = self._read(0, size)
            self.windows = ((0, self.buffer),)
        else:
            tail_at = size - WINDOW
            self.windows = ((0, self._read(0, WINDOW)), (tail_at, self._read(tail_at, WINDOW)))

    def _read(self, offset: int, n: int) -> bytes:
        # lseek + read rather than pread: same cost here, and pyfakefs (our tests) fakes them
        if offset != self._pos:
            os.lseek(self._fd, offset, os.SEEK_SET)
        first = os.read(self._fd, n)
        if len(first) == n or not first:  # nearly always: one read does it
            self._pos = offset + len(first)
            return first
        chunks, done = [first], len(first)
        while done < n:
            chunk = os.read(self._fd, n - done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        self._pos = offset + done
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def pread(self, offset: int, n: int) -> bytes:
        return windowed_pread(self, offset, n, self._read)


def windowed_pread(src: Source, offset: int, n: int, read: Callable[[int, int], bytes]) -> bytes:
    """Up to `n` bytes at `offset` of `src`: from a window it holds when one covers them, else
    from `read(offset, count)`; nothing outside the source."""
    if offset < 0 or n <= 0 or offset >= src.size:
        return b""
    end = min(offset + n, src.size)
    for at, data in src.windows:
        if at <= offset and end <= at + len(data):
            return data[offset - at : end - at]
    return read(offset, end - offset)


def view(src: Source, offset: int, n: int) -> bytes | memoryview:
    """src.pread(offset, n), as a memoryview into the source's buffer when it holds every byte:
    --deep's CRC and NaN/Inf checks take a slice of a file without copying it."""
    buffer = src.buffer
    if buffer is None:
        return src.pread(offset, n)
    if offset < 0 or n <= 0:
        return b""
    return memoryview(buffer)[offset : offset + n]


Spans = tuple[tuple[int, int], ...]  # (offset, length) ranges of a file


def open_source(path: str, spans_for: Callable[[int], Spans | None] | None = None,
                deep: bool = False) -> tuple[int, FileSource]:
    """Open `path` for reading; the caller closes the returned descriptor. `spans_for(size)`
    may name the (offset, length) spans to read, given the file's size; `deep` reads a file
    up to DEEP_WHOLE_LIMIT whole.

    O_NONBLOCK keeps a FIFO or device node from hanging the scan; those are refused here.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file: {path}")
        spans = spans_for(st.st_size) if spans_for is not None else None
        src = FileSource(fd, st.st_size, position=0, spans=spans,
                         whole_limit=DEEP_WHOLE_LIMIT if deep else WHOLE_FILE_LIMIT)
        src.mtime = st.st_mtime
        src.stat = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)
        return fd, src
    except BaseException:
        os.close(fd)
        raise
