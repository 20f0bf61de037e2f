"""Zip layouts seen before: a fast, exact check that a torch file is laid out like another.

The files of one cache are mostly byte-for-byte alike outside their payloads: the same entries
at the same offsets, differing only in the archive prefix (torch names it after the file's
stem), the CRC32 fields and the stored bytes. After a file's central directory has been parsed
and found sound, its layout becomes a template: a regular expression per window of the file
in memory that spells out every structural byte literally (local headers, data descriptors,
central directory, zip64 and end records) and leaves as wildcards only the prefix (one and the
same everywhere), the CRC fields and the payloads. A later file of the same size that matches
it has exactly that directory, so parsing it again is skipped: the match runs in C. A small
file is one window; a file too big to read whole is matched on the head and tail windows the
source keeps (source.py) when every byte between them is payload: torch puts data.pkl and the
small records first and the central directory last, so a file of one large storage qualifies.
A file that matches is still read by the torch reader (data.pkl, the version record), unless it
is a twin (below); --deep never uses templates, since CRCs are what it checks.

A template also keeps the sound FileMetas of its files, by the bytes of the records the torch
reader reads (torch_zip.READ_RECORDS: data.pkl, version, byteorder). Those and the directory
are all a read without --deep looks at, so a file that matches the layout and holds the same
bytes in them (a cache of one shape and dtype, bare tensors above all) has that same FileMeta
but for its path: the reader is skipped too. (Records it never reads, such as the
serialization_id torch makes unique per save, may differ.)
"""

from __future__ import annotations

import re
import struct

from cachedoctor.formats.meta import FileMeta
from cachedoctor.formats.source import Window
from cachedoctor.formats.torch_zip import READ_RECORDS
from cachedoctor.formats.zipdir import LOCAL, ZipDirectory

MAX_TEMPLATES = 256
MAX_PER_SIZE = 8
MAX_TWINS = 64  # FileMetas kept per template (distinct data.pkl bytes)
DESCRIPTOR_SIG = b"PK\x07\x08"
CD_FIXED = 46  # central-directory entry header size; its name follows


class Template:
    __slots__ = ("directory", "patterns", "records", "twins")

    def __init__(self, patterns: tuple[tuple[int, int, re.Pattern[bytes]], ...],
                 directory: ZipDirectory, records: tuple[tuple[int, int, int], ...]) -> None:
        self.patterns = patterns  # (window offset, window length, pattern) per window
        self.directory = directory
        self.records = records  # (window, start, end) of each record the reader reads
        self.twins: dict[bytes, FileMeta] = {}  # by records(): a sound file's FileMeta

    def prefix(self, windows: tuple[Window, ...]) -> str | None:
        """This file's archive prefix if `windows` match the layout, else None."""
        if len(windows) != len(self.patterns):
            return None
        prefix = None
        for (at, data), (t_at, t_len, pattern) in zip(windows, self.patterns, strict=True):
            if at != t_at or len(data) != t_len:
                return None
            found = pattern.fullmatch(data)
            if found is None:
                return None
            if "prefix" in pattern.groupindex:
                own = found.group("prefix")
                if prefix is not None and own != prefix:
                    return None
                prefix = own
        return None if prefix is None else prefix.decode("utf-8", "replace")

    def record_bytes(self, windows: tuple[Window, ...]) -> bytes:
        """The bytes of the records the reader reads, of a file that matched this layout
        (one fixed length each, so the concatenation is unambiguous)."""
        return b"".join([windows[w][1][start:end] for w, start, end in self.records])

    def twin(self, records: bytes, path: str) -> FileMeta | None:
        """The FileMeta of the file at `path` if a file with these record bytes was read."""
        known = self.twins.get(records)
        return None if known is None else known.renamed(path)

    def learn(self, records: bytes, meta: FileMeta) -> None:
        """Keep the FileMeta of a file of this layout that read sound."""
        if meta.ok and len(self.twins) < MAX_TWINS:
            self.twins[records] = meta


_templates: dict[int, list[Template]] = {}
_count = 0


def match(size: int, windows: tuple[Window, ...]) -> tuple[Template, str] | None:
    """If the file of `size` bytes whose `windows` these are is laid out like a file seen
    before: that file's template (whose directory's entry names carry the other file's prefix;
    every offset and size is this file's) and this file's own prefix. Else None."""
    for template in _templates.get(size, ()):
        prefix = template.prefix(windows)
        if prefix is not None:
            return template, prefix
    return None


def remember(size: int, windows: tuple[Window, ...], directory: ZipDirectory,
             meta: FileMeta) -> None:
    """Make a template of a sound torch zip file's layout and its FileMeta `meta` (at most
    MAX_TEMPLATES in all)."""
    global _count
    same_size = _templates.setdefault(size, [])
    if _count >= MAX_TEMPLATES or len(same_size) >= MAX_PER_SIZE or not directory.entries:
        return
    template = _build(size, windows, directory)
    if template is not None:
        template.learn(template.record_bytes(windows), meta)
        same_size.append(template)
        _count += 1


class _Outside(Exception):
    """A structural byte lies outside the windows: no template."""


def _bytes_at(windows: tuple[Window, ...], start: int, n: int) -> bytes:
    for at, data in windows:
        if at <= start and start + n <= at + len(data):
            return data[start - at : start - at + n]
    raise _Outside


def _build(size: int, windows: tuple[Window, ...], directory: ZipDirectory) -> Template | None:
    try:
        return _make(size, windows, directory)
    except (_Outside, struct.error):
        return None


def _make(size: int, windows: tuple[Window, ...], directory: ZipDirectory) -> Template | None:
    first = directory.entries[0].name
    slash = first.find("/")
    if slash <= 0 or not first[:slash].isascii():
        return None  # (a non-ASCII stem: its byte length is not its length in characters)
    if not all(e.name.startswith(first[: slash + 1]) for e in directory.entries):
        return None
    prefix_len = slash  # the stem; the "/" after it stays literal
    holes: list[tuple[int, int, str]] = []  # (start, end, kind): kind "prefix" or "any"
    for e in directory.entries:
        holes.append((e.header_offset + LOCAL.size, e.header_offset + LOCAL.size + prefix_len,
                      "prefix"))
        holes.append((e.header_offset + 14, e.header_offset + 18, "any"))  # local CRC
        end = e.data_offset + e.compressed_size
        holes.append((e.data_offset, end, "any"))  # the payload
        # a data descriptor follows when flag bit 3 is set: [signature] CRC sizes
        flags = struct.unpack("<H", _bytes_at(windows, e.header_offset + 6, 2))[0]
        if flags & 0x08:
            at = end + 4 if _bytes_at(windows, end, 4) == DESCRIPTOR_SIG else end
            holes.append((at, at + 4, "any"))
    pos = directory.cd_offset
    for _ in directory.entries:
        if _bytes_at(windows, pos, 4) != b"PK\x01\x02":
            return None
        nlen, xlen, clen = struct.unpack("<HHH", _bytes_at(windows, pos + 28, 6))
        holes.append((pos + 16, pos + 20, "any"))  # CRC
        holes.append((pos + CD_FIXED, pos + CD_FIXED + prefix_len, "prefix"))
        pos += CD_FIXED + nlen + xlen + clen
    holes.sort()
    cursor = 0
    for start, end, _kind in holes:
        if start < cursor or end > size:
            return None  # overlapping or out of range: not a layout to template
        cursor = end
    patterns = []
    named = False
    covered = 0  # every byte before this is in a window or a payload hole
    for at, data in windows:
        if not _payload_only(holes, covered, at):
            return None
        end_at = at + len(data)
        parts, cursor = [], at
        for start, end, kind in holes:
            if end <= at or start >= end_at:
                continue
            if kind == "prefix" and (start < at or end > end_at):
                return None
            start, end = max(start, at), min(end, end_at)
            parts.append(re.escape(data[cursor - at : start - at]))
            if kind == "prefix":
                parts.append(b"(?P=prefix)" if named else b"(?P<prefix>[^/]{%d})" % prefix_len)
                named = True
            elif end > start:
                parts.append(b".{%d}" % (end - start))
            cursor = end
        parts.append(re.escape(data[cursor - at :]))
        patterns.append((at, len(data), re.compile(b"".join(parts), re.DOTALL)))
        named = False  # each window's pattern names the prefix again; prefix() compares them
        covered = end_at
    if not _payload_only(holes, covered, size):
        return None
    cut = slash + 1
    records = []
    for e in directory.entries:
        if e.name[cut:] in READ_RECORDS:
            start, end = e.data_offset, e.data_offset + e.compressed_size
            index = next((i for i, (at, data) in enumerate(windows)
                          if at <= start and end <= at + len(data)), None)
            if index is None:
                return None
            at = windows[index][0]
            records.append((index, start - at, end - at))
    return Template(tuple(patterns), directory, tuple(records))


def _payload_only(holes: list[tuple[int, int, str]], start: int, end: int) -> bool:
    """Whether every byte of [start, end) lies in a payload or CRC hole (sorted, disjoint)."""
    for h_start, h_end, kind in holes:
        if start >= end:
            break
        if h_end <= start or kind != "any":
            continue
        if h_start > start:
            return False
        start = h_end
    return start >= end
