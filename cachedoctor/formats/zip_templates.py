"""Zip layouts seen before: a fast, exact check that a torch file is laid out like another.

The files of one cache are mostly byte-for-byte alike outside their payloads: the same entries
at the same offsets, differing only in the archive prefix (torch names it after the file's
stem), the CRC32 fields and the stored bytes. After a file's central directory has been parsed
and found sound, its layout becomes a template. That is a regular expression per window of the
file in memory. It spells out every structural byte literally (local headers, data
descriptors, central directory, zip64 and end records). Only the prefix (one and the same
everywhere), the CRC fields and the payloads of the records and storages are wildcards; any
other entry's payload (which the reader scans for pickles) is spelt out too, but for a stored
run of digits (torch's serialization_id), matched as digits. A later file of the same size that
matches it has exactly that directory, so parsing it again is skipped: the match runs in C.

A small file is one window. A file too big to read whole is matched on the head and tail
windows the source keeps (source.py), when every byte between them is payload. torch puts
data.pkl and the small records first and the central directory last, so a file of one large
storage qualifies.
A file that matches is still read by the torch reader (data.pkl, the version record), unless it
is a twin (below).

A template also keeps the sound FileMetas of its files, by the bytes of the records the torch
reader reads (torch_zip.READ_RECORDS: data.pkl, version, byteorder). Those and the directory
are all a read without --deep looks at, so a file that matches the layout and holds the same
bytes in them (a cache of one shape and dtype, bare tensors above all) has that same FileMeta
but for its path: the reader is skipped too. (Records it never reads, such as the
serialization_id torch makes unique per save, may differ.)

With --deep a twin's facts stand too, but every entry's CRC32 (this file's own, from its
central directory) and every tensor's values are still read (torch_zip.read_twin); only a
file whose deep read found nothing at all (no CRC error, no NaN/Inf, no note) is kept as a twin
then, and a deep twin serves only deep reads.
"""

from __future__ import annotations

import re
import struct

from cachedoctor.formats import native
from cachedoctor.formats.meta import FileMeta
from cachedoctor.formats.source import Window
from cachedoctor.formats.torch_zip import READ_RECORDS, STORAGE, scanned
from cachedoctor.formats.zip_members import ascii_fold
from cachedoctor.formats.zipdir import LOCAL, STORED, ZipDirectory, ZipEntry

MAX_TEMPLATES = 256
MAX_PER_SIZE = 8
MAX_TWINS = 64  # FileMetas kept per template (distinct data.pkl bytes)
MIN_SKIPPED = 1024  # a payload shorter than this is read with its neighbours, not skipped
DESCRIPTOR_SIG = b"PK\x07\x08"
SERIALIZATION_ID = ".data/serialization_id"  # (A-Z folded, past the prefix)
CD_FIXED = 46  # central-directory entry header size; its name follows


# A span's checks for the compiled matcher (native.py): (the span's bytes with every hole
# zeroed, a mask of 0xff where a byte must be the literal's and 0 in the holes, the offsets in
# the span of the prefix holes, the prefix's length, the (start, end) runs of digits)
SpanMask = tuple[bytes, bytes, tuple[int, ...], int, tuple[tuple[int, int], ...]]


class Template:
    __slots__ = ("_checks", "_compiled", "_crcs", "_records_end", "constant", "crc_offsets",
                 "directory", "patterns", "plans", "records", "spans", "twins")

    def __init__(self, patterns: tuple[tuple[int, int, re.Pattern[bytes]], ...],
                 directory: ZipDirectory, records: tuple[tuple[int, int], ...],
                 crc_offsets: tuple[int, ...] = (),
                 spelt: tuple[tuple[int, int], ...] = (),
                 masks: tuple[SpanMask, ...] | None = None) -> None:
        self.patterns = patterns  # (offset, length, pattern) of each span that decides a layout
        self.spans = tuple((at, n) for at, n, _ in patterns)
        # (and whether each names the prefix: Pattern.groupindex makes a new dict per call)
        self._checks = tuple((at, n, p, "prefix" in p.groupindex) for at, n, p in patterns)
        # the same checks for the compiled matcher (native.py), which does what the patterns
        # do in one pass over each span: (offset, length, SpanMask, whether it names the prefix)
        compiled = native.NATIVE
        self._compiled = None if compiled is None or masks is None else (compiled.span, tuple(
            (at, n, mask, bool(mask[2])) for (at, n, _), mask in zip(patterns, masks, strict=True)))
        self._records_end = max((end for _, end in records), default=0)
        self.directory = directory
        self.records = records  # (start, end) in the file of each record the reader reads
        # (start, end) of every payload the same in each file of the layout: a twin's records
        # (its twins hold the same record bytes) and the payloads the patterns spell out
        self.constant = records + spelt
        self.twins: dict[bytes, FileMeta] = {}  # by record_bytes(): a sound file's FileMeta
        self.crc_offsets = crc_offsets  # where each entry's CRC32 sits in the central directory
        self._crcs = _unpacker(crc_offsets)  # all of them in one unpack from a whole file
        self.plans: dict[bytes, object] = {}  # by record_bytes(): a deep twin's TwinPlan, or None

    def prefix(self, windows: tuple[Window, ...]) -> str | None:
        """This file's archive prefix if the bytes in `windows` match the layout, else None
        (None too when the windows miss a span)."""
        if self._compiled is not None:
            return self._compiled_prefix(windows)
        prefix = None
        for at, n, pattern, named in self._checks:
            data, base = _holding(windows, at, n)
            if data is None:
                return None
            found = pattern.fullmatch(data, at - base, at - base + n)
            if found is None:
                return None
            if named:
                own = found.group("prefix")
                if prefix is not None and own != prefix:
                    return None
                prefix = own
        return None if prefix is None else prefix.decode("utf-8", "replace")

    def _compiled_prefix(self, windows: tuple[Window, ...]) -> str | None:
        span, checks = self._compiled
        prefix = None
        for at, n, (literal, mask, prefixes, length, digits), named in checks:
            data, base = _holding(windows, at, n)
            if data is None:
                return None
            found = span(data, at - base, literal, mask, prefixes, length, digits, prefix)
            if found is None:
                return None
            if named:
                prefix = found
        return None if prefix is None else prefix.decode("utf-8", "replace")

    def record_bytes(self, windows: tuple[Window, ...]) -> bytes:
        """The bytes of the records the reader reads, of a file that matched this layout
        (one fixed length each, so the concatenation is unambiguous; they lie in its spans)."""
        base, data = windows[0]
        if base == 0 and self._records_end <= len(data):  # (the whole file: no search)
            return b"".join([data[start:end] for start, end in self.records])
        parts = []
        for start, end in self.records:
            data, base = _holding(windows, start, end - start)
            parts.append(data[start - base : end - base] if data is not None else b"")
        return b"".join(parts)

    def twin(self, records: bytes, path: str, deep: bool = False) -> FileMeta | None:
        """The FileMeta of the file at `path` if a file with these record bytes was read (with
        `deep`: the deep FileMeta of that file, for torch_zip.read_twin, not renamed)."""
        known = self.twins.get(records)
        if known is None or known.deep != deep:
            return None
        return known if deep else known.renamed(path)

    def learn(self, records: bytes, meta: FileMeta) -> None:
        """Keep the FileMeta of a file of this layout that read sound (with --deep: that had
        nothing at all to say)."""
        if meta.deep and (meta.crc_errors or meta.nonfinite or meta.notes):
            return
        if meta.ok and len(self.twins) < MAX_TWINS:
            self.twins[records] = meta

    def crcs(self, windows: tuple[Window, ...]) -> tuple[int, ...] | None:
        """The CRC32 the central directory records for each entry of a file that matched this
        layout, in directory order; None when the windows miss one."""
        base, data = windows[0]
        offsets = self.crc_offsets
        if base == 0 and self._crcs is not None and offsets[-1] + 4 <= len(data):  # whole file
            return self._crcs.unpack_from(data, offsets[0])
        found = []
        for at in self.crc_offsets:
            data, base = _holding(windows, at, 4)
            if data is None:
                return None
            found.append(int.from_bytes(data[at - base : at - base + 4], "little"))
        return tuple(found)


def _unpacker(offsets: tuple[int, ...]) -> struct.Struct | None:
    """One Struct reading the little-endian u32 at each of `offsets`, from the first on; None
    when there are none, or they are not ascending (the directory's entries in order)."""
    layout, cursor = ["<"], offsets[0] if offsets else 0
    for at in offsets:
        if at < cursor:
            return None
        layout.append(f"{at - cursor}xI")
        cursor = at + 4
    return struct.Struct("".join(layout)) if offsets else None


def _holding(windows: tuple[Window, ...], at: int, n: int) -> tuple[bytes | None, int]:
    """The window holding [at, at + n) and its offset; (None, 0) when none does."""
    for base, data in windows:
        if base <= at and at + n <= base + len(data):
            return data, base
    return None, 0


class Templates:
    """The templates one scan has learnt (at most MAX_TEMPLATES, MAX_PER_SIZE of one size).
    Each scan makes its own and hands it to every read (read_path's `templates`), so two scans
    in one process, in threads or one after the other, never match against each other's files;
    a read given none learns nothing and matches nothing."""

    __slots__ = ("_spans", "by_size", "count", "headers")

    def __init__(self) -> None:
        self.by_size: dict[int, list[Template]] = {}
        self._spans: dict[int, tuple[tuple[int, int], ...]] = {}  # by size: all spans, merged
        self.count = 0
        # safetensors files read sound, by size and header bytes (safetensors_header.Known)
        self.headers: dict[tuple[int, bytes], object] = {}

    def match(self, size: int, windows: tuple[Window, ...]) -> tuple[Template, str] | None:
        """If the file of `size` bytes whose `windows` these are is laid out like a file seen
        before: that file's template (whose directory's entry names carry the other file's
        prefix; every offset and size is this file's) and this file's own prefix. Else None."""
        for template in self.by_size.get(size, ()):
            prefix = template.prefix(windows)
            if prefix is not None:
                return template, prefix
        return None

    def spans(self, size: int) -> tuple[tuple[int, int], ...] | None:
        """The (offset, length) spans that decide whether a file of `size` bytes is laid out
        like one seen before, or None when none of that size was: all a reader needs of it."""
        return self._spans.get(size)

    def remember(self, size: int, windows: tuple[Window, ...], directory: ZipDirectory,
                 meta: FileMeta) -> None:
        """Make a template of a sound torch zip file's layout and its FileMeta `meta`."""
        # (no entry for a size until it has a template: files of a thousand sizes add nothing)
        same_size = self.by_size.get(size, [])
        if self.count >= MAX_TEMPLATES or len(same_size) >= MAX_PER_SIZE or \
                not directory.entries:
            return
        template = _build(size, windows, directory)
        if template is not None:
            template.learn(template.record_bytes(windows), meta)
            same_size = self.by_size.setdefault(size, [])
            same_size.append(template)
            self._spans[size] = _merged([span for t in same_size for span in t.spans])
            self.count += 1


_STANDARD = re.compile(r"[^/]+/(?:data\.pkl|version|\.data/version|byteorder|\.format_version"
                       r"|\.storage_alignment|\.data/serialization_id|data/\d+)\Z")


def standard(directory: ZipDirectory) -> bool:
    """Whether a layout is fit for a template: every name distinct as torch compares them
    (A-Z folded), and every entry one torch.save writes or small enough that the template
    spells its bytes out. Another entry's bytes (another tool's pickle) would be wildcarded,
    so a match, never reading them, could not vouch for them."""
    names = {ascii_fold(e.name) for e in directory.entries}
    return len(names) == len(directory.entries) and all(
        e.compressed_size < MIN_SKIPPED or _STANDARD.match(e.name) for e in directory.entries)


def _merged(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for at, n in sorted(spans):
        if out and at <= out[-1][0] + out[-1][1]:
            last_at, last_n = out[-1]
            out[-1] = (last_at, max(last_at + last_n, at + n) - last_at)
        else:
            out.append((at, n))
    return tuple(out)


def _payload_kind(entry: ZipEntry, rest: str, windows: tuple[Window, ...]) -> str | None:
    """How a template matches an entry's payload. "any" for the records the reader reads (a
    twin's are the same bytes: Template.twin compares them) and the storages (no read but
    --deep's looks at them, and it reads each twin's); the others the reader scans for a
    pickle or an npy array (zip_members), so they are spelt out (None), but for torch's
    serialization_id, a stored run of digits unique per save: "digits" then, as no run of
    digits is either. (.format_version and .storage_alignment are digits too, but the same
    in every file of one torch: spelt out, their CRC32s are worked out once per twin.)"""
    if not scanned(rest):
        return "any"
    if rest == SERIALIZATION_ID and entry.method == STORED and _bytes_at(
            windows, entry.data_offset, entry.compressed_size).isdigit():
        return "digits"
    return None


class _Outside(Exception):
    """A structural byte lies outside the windows: no template."""


def _bytes_at(windows: tuple[Window, ...], start: int, n: int) -> bytes:
    data, base = _holding(windows, start, n)
    if data is None:
        raise _Outside
    return data[start - base : start - base + n]


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
    cut = slash + 1
    holes: list[tuple[int, int, str]] = []  # (start, end, kind): "prefix", "any" or "digits"
    spelt: list[tuple[int, int]] = []  # payloads matched byte for byte
    for e in directory.entries:
        holes.append((e.header_offset + LOCAL.size, e.header_offset + LOCAL.size + prefix_len,
                      "prefix"))
        holes.append((e.header_offset + 14, e.header_offset + 18, "any"))  # local CRC
        end = e.data_offset + e.compressed_size
        kind = _payload_kind(e, ascii_fold(e.name[cut:]), windows)
        if kind is not None:
            holes.append((e.data_offset, end, kind))  # the payload
        else:
            spelt.append((e.data_offset, end))
        # a data descriptor follows when flag bit 3 is set: [signature] CRC sizes
        flags = struct.unpack("<H", _bytes_at(windows, e.header_offset + 6, 2))[0]
        if flags & 0x08:
            at = end + 4 if _bytes_at(windows, end, 4) == DESCRIPTOR_SIG else end
            holes.append((at, at + 4, "any"))
    pos = directory.cd_offset
    crc_offsets = []
    for _ in directory.entries:
        if _bytes_at(windows, pos, 4) != b"PK\x01\x02":
            return None
        nlen, xlen, clen = struct.unpack("<HHH", _bytes_at(windows, pos + 28, 6))
        holes.append((pos + 16, pos + 20, "any"))  # CRC
        crc_offsets.append(pos + 16)
        holes.append((pos + CD_FIXED, pos + CD_FIXED + prefix_len, "prefix"))
        pos += CD_FIXED + nlen + xlen + clen
    holes.sort()
    cursor = 0
    for start, end, _kind in holes:
        if start < cursor or end > size:
            return None  # overlapping or out of range: not a layout to template
        cursor = end
    # The payloads a read never looks at (storages: neither a record nor scanned) are skipped;
    # every other byte decides.
    skipped = sorted((e.data_offset, e.data_offset + e.compressed_size) for e in directory.entries
                     if STORAGE.match(ascii_fold(e.name[cut:])) and e.compressed_size >= MIN_SKIPPED)
    spans, cursor = [], 0
    for start, end in skipped:
        if start > cursor:
            spans.append((cursor, start - cursor))
        cursor = max(cursor, end)
    if cursor < size:
        spans.append((cursor, size - cursor))
    patterns, masks = [], []
    for at, n in spans:
        data = _bytes_at(windows, at, n)  # every byte of a span is known, or no template
        parts, cursor, named = [], at, False
        literal, mask, prefixes, digits = bytearray(data), bytearray(b"\xff" * n), [], []
        for start, end, kind in holes:
            if end <= at or start >= at + n:
                continue
            if kind == "prefix" and (start < at or end > at + n):
                return None
            start, end = max(start, at), min(end, at + n)
            parts.append(re.escape(data[cursor - at : start - at]))
            literal[start - at : end - at] = mask[start - at : end - at] = bytes(end - start)
            if kind == "prefix":
                parts.append(b"(?P=prefix)" if named else b"(?P<prefix>[^/]{%d})" % prefix_len)
                named = True
                prefixes.append(start - at)
            elif end > start:
                parts.append((b"[0-9]{%d}" if kind == "digits" else b".{%d}") % (end - start))
                if kind == "digits":
                    digits.append((start - at, end - at))
            cursor = end
        parts.append(re.escape(data[cursor - at :]))
        patterns.append((at, n, re.compile(b"".join(parts), re.DOTALL)))
        masks.append((bytes(literal), bytes(mask), tuple(prefixes), prefix_len, tuple(digits)))
    # (found as torch and the reader find them: A-Z folded, archive/BYTEORDER is the byteorder)
    records = tuple((e.data_offset, e.data_offset + e.compressed_size) for e in directory.entries
                    if ascii_fold(e.name[cut:]) in READ_RECORDS)
    return Template(tuple(patterns), directory, records, tuple(crc_offsets), tuple(spelt),
                    tuple(masks))
