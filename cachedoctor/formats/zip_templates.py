"""Zip layouts seen before: a fast, exact check that a torch file is laid out like another.

The files of one cache are mostly byte-for-byte alike outside their payloads: the same entries
at the same offsets, differing only in the archive prefix (torch names it after the file's
stem), the CRC32 fields and the stored bytes. After a file's central directory has been parsed
and found sound, its layout becomes a template: one regular expression that spells out every
structural byte literally (local headers, data descriptors, central directory, zip64 and end
records) and leaves as wildcards only the prefix (the same one everywhere, by backreference),
the CRC fields and the payloads. A later file of the same size that matches it has exactly that
directory, so parsing it again is skipped: the match runs in C over the whole file. Payloads
(data.pkl, the version record) are still read and checked by the torch reader as usual, and
--deep never uses templates, since CRCs are what it checks.
"""

from __future__ import annotations

import re
import struct

from cachedoctor.formats.zipdir import LOCAL, ZipDirectory

MAX_TEMPLATES = 256
MAX_PER_SIZE = 8
DESCRIPTOR_SIG = b"PK\x07\x08"
CD_FIXED = 46  # central-directory entry header size; its name follows


class Template:
    __slots__ = ("directory", "pattern")

    def __init__(self, pattern: re.Pattern[bytes], directory: ZipDirectory) -> None:
        self.pattern = pattern
        self.directory = directory



_templates: dict[int, list[Template]] = {}
_count = 0


def match(buffer: bytes) -> tuple[ZipDirectory, str] | None:
    """If `buffer` is laid out like a file seen before: that file's directory (whose entry
    names carry the other file's prefix; every offset and size is this file's) and this
    file's own prefix. Else None."""
    for template in _templates.get(len(buffer), ()):
        found = template.pattern.fullmatch(buffer)
        if found is not None:
            return template.directory, found.group("prefix").decode("utf-8", "replace")
    return None


def remember(buffer: bytes, directory: ZipDirectory) -> None:
    """Make a template of a sound torch zip file's layout (at most MAX_TEMPLATES in all)."""
    global _count
    same_size = _templates.setdefault(len(buffer), [])
    if _count >= MAX_TEMPLATES or len(same_size) >= MAX_PER_SIZE or not directory.entries:
        return
    template = _build(buffer, directory)
    if template is not None:
        same_size.append(template)
        _count += 1


def _build(buffer: bytes, directory: ZipDirectory) -> Template | None:
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
        flags = struct.unpack_from("<H", buffer, e.header_offset + 6)[0]
        if flags & 0x08:
            at = end + 4 if buffer[end : end + 4] == DESCRIPTOR_SIG else end
            holes.append((at, at + 4, "any"))
    pos = directory.cd_offset
    for _ in directory.entries:
        if buffer[pos : pos + 4] != b"PK\x01\x02":
            return None
        nlen, xlen, clen = struct.unpack_from("<HHH", buffer, pos + 28)
        holes.append((pos + 16, pos + 20, "any"))  # CRC
        holes.append((pos + CD_FIXED, pos + CD_FIXED + prefix_len, "prefix"))
        pos += CD_FIXED + nlen + xlen + clen
    holes.sort()
    parts, cursor, named = [], 0, False
    for start, end, kind in holes:
        if start < cursor or end > len(buffer):
            return None  # overlapping or out of range: not a layout to template
        parts.append(re.escape(buffer[cursor:start]))
        if kind == "prefix":
            parts.append(b"(?P=prefix)" if named else b"(?P<prefix>[^/]{%d})" % prefix_len)
            named = True
        elif end > start:
            parts.append(b".{%d}" % (end - start))
        cursor = end
    parts.append(re.escape(buffer[cursor:]))
    return Template(re.compile(b"".join(parts), re.DOTALL), directory)
