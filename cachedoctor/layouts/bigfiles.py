"""Reading the large JSON files a trainer writes beside its dataset, healthy or hostile.

kohya's fine-tuning `metadata_file` and SimpleTuner's `aspect_ratio_bucket_*.json` grow with
the dataset: at a million images they are hundreds of MB to a few GB, and the trainers read
them whole (sd-scripts train_util.py FineTuningDataset.__init__: `json.load`; SimpleTuner
metadata/backends/discovery.py reload_cache, load_image_metadata: `json.loads`). A healthy
file of that size must be read, not refused; a 100 GB file of garbage must not fill memory.

So a file is opened as a regular file only (a FIFO would hang the scan), its size is taken
from fstat before a byte is read, and past its limit it is BeyondLimit: a file cachedoctor did
not check, which is no proof the dataset is broken. `object_items` streams the entries of a
top-level JSON object one at a time, so memory holds one entry and a chunk, not the millions
of Python objects `json.load` would build; `read_whole` reads a file that must be parsed at
once, and allocates what the file holds, not its limit.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from cachedoctor.regular_files import open_regular, read_upto

CHUNK = 1 << 20
# One entry of a streamed object: a kohya entry (caption, tags, train_resolution) or a
# SimpleTuner image's metadata is a few KB; an entry past this is no entry of theirs.
MAX_ENTRY = 16 * 2**20


def size_text(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:g} GiB"
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n:,} bytes"


class BeyondLimit(Exception):
    """A file (or one entry of it) larger than cachedoctor reads: not checked."""

    def __init__(self, size: int | None, limit: int, what: str = "the file") -> None:
        self.size, self.limit = size, limit
        held = f"{size:,} bytes" if size is not None else "more"
        super().__init__(f"{what} holds {held}, beyond cachedoctor's reading limit of "
                         f"{size_text(limit)}: not checked")


class NotJson(ValueError):
    """A file that json.load would refuse; the message names the line and column."""


class NotAnObject(NotJson):
    """A file that starts as JSON of another kind than the object expected (a list)."""


def read_whole(path: str, limit: int) -> bytes:
    """The bytes of the regular file `path`. BeyondLimit past `limit` bytes (by its size, or as
    it grows while read), OSError when it cannot be read or is no regular file."""
    fd, st = open_regular(path)
    try:
        if st.st_size > limit:
            raise BeyondLimit(st.st_size, limit)
        raw = read_upto(fd, st.st_size, limit)
        if len(raw) > limit:  # (it grew while read)
            raise BeyondLimit(None, limit)
        return raw
    finally:
        os.close(fd)


_WS = re.compile(r"[ \t\n\r]*")
SLACK = 64  # more than any token the chunk's end can cut into a different error


class _NeedMore(Exception):
    pass


class _Stream:
    """Text of a file read a chunk at a time; `pos` is where the next unparsed entry starts."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd, self.left = fd, limit + 1
        self.limit = limit
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf, self.pos, self.eof = "", 0, False
        self.state = "start"  # of _parse
        self.line_base, self.col_base = 0, 0  # line and column of buf[0] in the file

    def more(self) -> None:
        if self.pos > CHUNK:  # drop what is parsed, keeping count of its lines for messages
            dropped = self.buf[:self.pos]
            lines = dropped.count("\n")
            self.line_base += lines
            self.col_base = (self.pos - dropped.rfind("\n") - 1) if lines else self.col_base + self.pos
            self.buf, self.pos = self.buf[self.pos:], 0
        if len(self.buf) - self.pos > MAX_ENTRY:
            raise BeyondLimit(None, MAX_ENTRY, "one entry of the file")
        raw = os.read(self.fd, min(CHUNK, self.left)) if self.left > 0 else b""
        self.left -= len(raw)
        if self.left <= 0:
            raise BeyondLimit(None, self.limit)
        try:
            self.buf += self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as exc:
            raise NotJson(f"not UTF-8 text ({exc.reason})") from None
        self.eof = not raw

    def error(self, message: str, at: int) -> NotJson:
        before = self.buf[:at]
        lines = before.count("\n")
        column = at - before.rfind("\n") if lines else at + 1 + self.col_base
        line = self.line_base + lines + 1
        return NotJson(f"not valid JSON: {message} (line {line}, column {column})")

    def fail(self, message: str, at: int) -> Exception:
        """The JSON error at `at`, or _NeedMore where the chunk's end may have caused it: a
        string, literal or number cut short fails at most SLACK characters before the end
        ("1e" read as 1 then 'e'), or says the string is unterminated."""
        if not self.eof and (len(self.buf) - at <= SLACK or message.startswith("Unterminated")):
            return _NeedMore()
        return self.error(message, at)


_SCAN = json.JSONDecoder().scan_once  # the C scanner json.loads uses for a value
_SPACE = " \t\n\r"


def object_items(path: str, limit: int) -> Iterator[tuple[str, Any]]:
    """The (key, value) entries of the JSON object in `path`, in file order, read a chunk at a
    time; an entry's value is parsed as json.loads would. NotJson where json.load would
    refuse the file (a duplicate key is yielded again, json.load keeps its last value),
    NotAnObject when it starts as JSON of another kind; BeyondLimit past `limit` bytes or an
    entry past MAX_ENTRY; OSError when it cannot be read."""
    fd, st = open_regular(path)
    try:
        if st.st_size > limit:
            raise BeyondLimit(st.st_size, limit)
        stream = _Stream(fd, limit)
        out: list[tuple[str, Any]] = []
        while stream.state != "done":
            try:
                _parse(stream, out)
                more = False
            except _NeedMore:
                more = True
            except RecursionError:
                raise NotJson("not valid JSON: nested too deeply") from None
            yield from out
            out.clear()
            if more:
                stream.more()
    finally:
        os.close(fd)


def _parse(s: _Stream, out: list[tuple[str, Any]]) -> None:
    """Parse the buffer from s.pos into `out`, an entry (with the delimiter after it) at a
    time, moving s.pos and s.state past each; _NeedMore where the buffer ends inside one.
    States: start, first (after the opening brace), next (after a comma), end (after the
    closing brace), done. One loop for the whole buffer: a million entries are parsed here."""
    buf, pos, eof = s.buf, s.pos, s.eof
    n = len(buf)
    while True:
        at = _WS.match(buf, pos).end() if pos < n and buf[pos] in _SPACE else pos
        if at >= n and not eof:
            s.pos = at  # whitespace is no part of an entry: a long run must not count as one
            raise _NeedMore
        char = buf[at] if at < n else ""
        state = s.state
        if state == "start":
            if char != "{":
                if char == "[":
                    raise NotAnObject("holds a JSON list, not an object")
                if char and char in '"-0123456789tfn':
                    raise NotAnObject("holds a single JSON value, not an object")
                raise s.fail("Expecting value", at)
            s.state, s.pos = "first", at + 1
            pos = at + 1
            continue
        if state == "end":
            if at < n:
                raise s.fail("Extra data", at)
            s.state = "done"
            return
        if state == "first" and char == "}":
            s.state, s.pos = "end", at + 1
            pos = at + 1
            continue
        if char != '"':
            raise s.fail("Expecting property name enclosed in double quotes", at)
        try:
            key, end = json.decoder.scanstring(buf, at + 1)
        except json.JSONDecodeError as exc:
            raise s.fail(exc.msg, exc.pos) from None
        if end < n and buf[end] in _SPACE:
            end = _WS.match(buf, end).end()
        if end >= n or buf[end] != ":":
            raise s.fail("Expecting ':' delimiter", end)
        end += 1
        if end < n and buf[end] in _SPACE:
            end = _WS.match(buf, end).end()
        try:
            value, end = _SCAN(buf, end)
        except StopIteration as err:
            raise s.fail("Expecting value", err.value) from None
        except json.JSONDecodeError as exc:
            raise s.fail(exc.msg, exc.pos) from None
        if end < n and buf[end] in _SPACE:
            end = _WS.match(buf, end).end()
        # the delimiter must be in the buffer: it also proves a number was not cut short
        char = buf[end] if end < n else ""
        if char == ",":
            s.state = "next"
        elif char == "}":
            s.state = "end"
        else:
            raise s.fail("Expecting ',' delimiter", end)
        s.pos = pos = end + 1
        out.append((key, value))


def jsonl_lines(path: str, limit: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the regular file `path`, one line at a time; BeyondLimit past
    `limit` bytes or a line past MAX_ENTRY, OSError when it cannot be read."""
    fd, st = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise BeyondLimit(st.st_size, limit)
        total = 0
        for number, line in enumerate(iter(lambda: f.readline(MAX_ENTRY + 1), b""), 1):
            total += len(line)
            if total > limit:
                raise BeyondLimit(None, limit)
            if len(line) > MAX_ENTRY and not line.endswith(b"\n"):
                raise BeyondLimit(None, MAX_ENTRY, f"line {number:,} of the file")
            yield number, line
