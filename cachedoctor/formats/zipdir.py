"""A zip central-directory parser built on `struct`, for torch zip files and npz archives.

It reads the end record, the zip64 records torch always writes, and every central-directory
entry; it checks that each entry's local header is where the directory says, under the same
name, and that its data ends before the directory starts. An archive that two readers would
read differently is refused: entries sharing bytes (a zip bomb of many entries on one deflate
stream), bytes before the first listed entry, a directory that does not end where the next
record starts (zipfile shifts offsets by the gap, miniz does not). Bounded work: at most
MAX_ENTRIES entries, no entry recording more than deflate's MAX_RATIO:1 allows, and since no
two entries share bytes, all of them inflate (--deep) to at most MAX_RATIO times the file.
It never decompresses or reads entry data unless asked. Errors come back as ZipError with a
sentence a user can act on.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from cachedoctor.formats import crc
from cachedoctor.formats.source import WINDOW, Source, view

EOCD_SIG = b"PK\x05\x06"
ZIP64_LOCATOR_SIG = b"PK\x06\x07"
ZIP64_EOCD_SIG = b"PK\x06\x06"
CD_SIG = b"PK\x01\x02"
LOCAL_SIG = b"PK\x03\x04"
EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes
ZIP64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes
ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
CD_ENTRY = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
# Just the fields the parser uses: flags, method, crc, sizes, name/extra/comment lengths, offset.
CD_FIELDS = struct.Struct("<4x4xHH4xIIIHHH8xI")
ENCRYPTED = 0x1  # general-purpose flag bit 0: traditional PKWARE encryption
CRYPT_HEADER = 12  # the bytes it puts before an encrypted entry's data
LOCAL_HEAD = struct.Struct("<4s22xHH")  # signature, name and extra lengths
MAX_ENTRIES = 200_000  # per archive: its directory parse stays well under a second
MAX_WHOLE_ENTRY = 1 << 30  # an entry read whole (read_entry) beyond this is refused
MAX_INFLATE = 1 << 34  # --deep streams (entry_chunks) a deflated entry up to this size
MAX_OVERFLOW = 64 << 20  # and up to this many bytes past it (a damaged entry's, for its CRC)
CHUNK = 1 << 20  # bytes per piece of an entry streamed (--deep): bounds a worker's memory
INFLATE_INPUT = 64 * 1024  # compressed bytes per read (zlib copies the unused rest each call)
STORED, DEFLATED = 0, 8
MAX_RATIO = 1032  # deflate's ceiling: no stream inflates to more than this times its size


class ZipError(Exception):
    """The archive cannot be read: the message says what is broken."""


class DamagedEntry(ZipError):
    """An entry's compressed bytes do not inflate."""


class OversizedEntry(ZipError):
    """An entry inflates past the size the directory records, or records more than --deep
    inflates (MAX_INFLATE)."""


class ZipEntry(NamedTuple):  # a NamedTuple: built once per entry per file, so cheap matters
    name: str
    method: int
    crc: int
    compressed_size: int
    size: int
    header_offset: int
    data_offset: int  # where the entry's bytes start (after its local header)


@dataclass(frozen=True, slots=True)
class ZipDirectory:
    """A zip archive's central directory."""

    entries: tuple[ZipEntry, ...]
    cd_offset: int
    trailing_bytes: int  # bytes after the end record (torch ignores them)



def _find_eocd(src: Source) -> tuple[int, bytes]:
    at = src.size - EOCD.size
    raw = src.pread(at, EOCD.size)
    if raw[:4] == EOCD_SIG and raw[20:22] == b"\0\0":
        return at, raw  # no archive comment: the usual case, and the only one torch writes
    tail_len = min(src.size, EOCD.size + 0xFFFF)
    tail = src.pread(src.size - tail_len, tail_len)
    at = tail.rfind(EOCD_SIG)
    while at >= 0:
        if len(tail) - at >= EOCD.size:
            return src.size - tail_len + at, tail[at : at + EOCD.size]
        at = tail.rfind(EOCD_SIG, 0, at)
    raise ZipError(_truncation_message(src))


def _truncation_message(src: Source) -> str:
    """Say where the file ends: a half-written archive has its last local header in view."""
    window = src.pread(max(0, src.size - 256 * 1024), 256 * 1024)
    at = window.rfind(LOCAL_SIG)
    where = ""
    if at >= 0 and len(window) - at >= LOCAL.size:
        nlen = LOCAL.unpack_from(window, at)[9]
        name = window[at + LOCAL.size : at + LOCAL.size + nlen].decode("utf-8", "replace")
        if name:
            where = f" inside entry '{_shown(name)}'"
    return (
        f"no zip central directory: the file ends at {src.size:,} bytes{where}"
        " (truncated or half-written)"
    )


def read_directory(src: Source) -> ZipDirectory:
    """Parse the central directory of the zip in `src`; raise ZipError if it is broken.

    Runs once per file of a scan, so it parses in place: offsets into the whole file when it
    is in memory (small files), else into the window the source holds at the file's end, which
    holds the end records and the directory of most torch files (anything else is read).
    """
    size = src.size
    if size < EOCD.size:
        raise ZipError(_truncation_message(src))
    whole = src.buffer
    base, tail = src.windows[-1]
    if base + len(tail) != size:  # (a file that shrank while read)
        base = max(0, size - WINDOW)
        tail = src.pread(base, size - base)
    at = size - EOCD.size - base
    if tail[at : at + 4] == EOCD_SIG and tail[at + 20 : at + 22] == b"\0\0":
        eocd_at, raw = size - EOCD.size, tail[at : at + EOCD.size]
    else:  # an archive comment, or garbage after the archive
        eocd_at, raw = _find_eocd(src)
    _, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment_len = EOCD.unpack(raw)
    trailing = max(0, size - (eocd_at + EOCD.size + comment_len))
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise ZipError("multi-disk zip archives are not supported")
    # torch always writes zip64 records; when present they hold the real counts and offsets.
    loc_at = eocd_at - ZIP64_LOCATOR.size
    z64_at = None
    loc = tail[loc_at - base : eocd_at - base] if loc_at >= base else src.pread(loc_at, 20)
    if loc_at >= 0 and loc[:4] == ZIP64_LOCATOR_SIG and len(loc) == ZIP64_LOCATOR.size:
        z64_at = ZIP64_LOCATOR.unpack(loc)[2]
        rec = (tail[z64_at - base : z64_at - base + ZIP64_EOCD.size] if z64_at >= base
               else src.pread(z64_at, ZIP64_EOCD.size))
        if len(rec) < ZIP64_EOCD.size or rec[:4] != ZIP64_EOCD_SIG:
            raise ZipError(f"zip64 end record missing at offset {z64_at:,}")
        _, _, _, _, _, _, _, n_total, cd_size, cd_offset = ZIP64_EOCD.unpack(rec)
    if n_total > MAX_ENTRIES or n_total * CD_ENTRY.size > cd_size:
        raise ZipError(f"central directory claims {n_total:,} entries in {cd_size:,} bytes "
                       f"(cachedoctor reads at most {MAX_ENTRIES:,}): a zip bomb, or damaged")
    if cd_offset + cd_size > size:
        raise ZipError(
            f"central directory at offset {cd_offset:,} (+{cd_size:,} bytes) runs past the end "
            f"of the file at {size:,} bytes"
        )
    # zipfile (np.load) shifts every offset by the gap between the directory's recorded end
    # and the record after it, miniz (torch.load) does not: with a gap they read other bytes
    follows = z64_at if z64_at is not None else eocd_at
    if cd_offset + cd_size != follows:
        raise ZipError(
            f"the central directory is recorded at offset {cd_offset:,} (+{cd_size:,} bytes) "
            f"but the record after it starts at {follows:,}: zipfile and torch would read "
            "different entries (data prepended to the archive, or a crafted file)")
    if cd_offset >= base:
        cd, pos = tail, cd_offset - base
    else:
        cd, pos = src.pread(cd_offset, cd_size), 0
    end = pos + cd_size
    entries = []
    for index in range(n_total):
        if cd[pos : pos + 4] != CD_SIG or pos + CD_ENTRY.size > end:
            raise ZipError(f"central directory entry {index} is damaged (bad signature)")
        flags, method, crc, csize, usize, nlen, xlen, clen, lho = CD_FIELDS.unpack_from(cd, pos)
        at = pos + CD_ENTRY.size
        name = cd[at : at + nlen].decode("utf-8", "replace")
        if 0xFFFFFFFF in (usize, csize, lho):
            usize, csize, lho = _zip64_sizes(cd[at + nlen : at + nlen + xlen], usize, csize, lho)
        pos = at + nlen + xlen + clen
        if whole is not None and lho + LOCAL.size + nlen <= size:
            sig, lnlen, lxlen = LOCAL_HEAD.unpack_from(whole, lho)
            lname = whole[lho + LOCAL.size : lho + LOCAL.size + nlen]
        else:
            head = src.pread(lho, LOCAL.size + nlen)
            sig, lnlen, lxlen = (LOCAL_HEAD.unpack_from(head) if len(head) >= LOCAL.size
                                 else (b"", 0, 0))
            lname = head[LOCAL.size :]
        if sig != LOCAL_SIG:
            raise ZipError(f"entry '{_shown(name)}': no local header at offset {lho:,}")
        if lnlen != nlen or lname != cd[at : at + nlen]:
            # zipfile refuses such an entry, miniz (torch) reads it: two readings of one file
            raise ZipError(
                f"entry '{_shown(name)}' has another name in its local header at offset "
                f"{lho:,} (zipfile: File name in directory and header differ)")
        data_at = lho + LOCAL.size + lnlen + lxlen
        if data_at + csize > cd_offset:
            raise ZipError(
                f"entry '{_shown(name)}' ({csize:,} bytes at offset {data_at:,}) runs past the "
                f"start of the central directory at {cd_offset:,}"
            )
        # (an encrypted stored entry holds its 12-byte encryption header besides the data; a
        # flag that lies, over plain bytes, is read as the plain bytes it is)
        sizes_differ = csize != usize and not (flags & ENCRYPTED and csize == usize + CRYPT_HEADER)
        if (method == STORED and sizes_differ) or (
                method == DEFLATED and usize > MAX_RATIO * csize + MAX_OVERFLOW):
            raise ZipError(
                f"entry '{_shown(name)}' records {usize:,} bytes from {csize:,} "
                + ("stored bytes" if method == STORED else
                   f"deflated bytes, more than deflate's {MAX_RATIO:,}:1 ceiling")
                + " (a zip bomb, or a damaged directory)")
        entries.append(ZipEntry(name, method, crc, csize, usize, lho, data_at))
    _check_layout(entries)
    return ZipDirectory(tuple(entries), cd_offset, trailing)


def _shown(name: str) -> str:
    """A name as messages show it: a crafted one can be 65,535 characters long."""
    return name if len(name) <= 80 else f"{name[:60]}... ({len(name):,} characters)"


def _check_layout(entries: list[ZipEntry]) -> None:
    """Every byte of the archive before the directory belongs to at most one entry, and the
    first entry starts the file: entries that share bytes are a zip bomb (many entries, one
    deflate stream) or two files in one; bytes before the first entry are a second archive or
    a payload that a reader shifting offsets (zipfile does) would take for entries."""
    if not entries:
        return
    spans = sorted((e.header_offset, e.data_offset + e.compressed_size, e.name) for e in entries)
    if spans[0][0] != 0:
        raise ZipError(f"{spans[0][0]:,} bytes before the first entry that the central "
                       "directory lists (a hidden entry, or data prepended to the archive)")
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ZipError(
                f"entries '{_shown(name)}' and '{_shown(other)}' overlap (the second starts "
                f"at offset {start:,}, inside the first): a zip bomb, or two readings of one "
                f"file ({len(entries):,} entries)")


def _zip64_sizes(extra: bytes, usize: int, csize: int, lho: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if tag == 0x0001:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if lho == 0xFFFFFFFF and values:
                lho = values.pop(0)
        pos += 4 + size
    return usize, csize, lho


def read_entry(src: Source, entry: ZipEntry, limit: int | None = None) -> bytes:
    """The entry's uncompressed bytes (at most `limit` of them when given; an entry that
    inflates past its recorded size is cut there, as zipfile and torch read it)."""
    want = entry.size if limit is None else min(limit, entry.size)
    if want > MAX_WHOLE_ENTRY:
        raise ZipError(f"entry '{entry.name}' is {entry.size:,} bytes, too large to read whole")
    if entry.method == STORED:
        return src.pread(entry.data_offset, want)
    pieces = list(entry_chunks(src, entry, stop=want))
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def entry_chunks(src: Source, entry: ZipEntry, stop: int | None = None
                 ) -> Iterator[bytes | memoryview]:
    """The entry's uncompressed bytes in CHUNK-sized pieces (the last one shorter): what
    --deep streams, so that no entry is ever whole in memory. Every piece starts at a
    multiple of CHUNK, so it holds whole elements of any dtype.

    With `stop` None the whole stream is read, as a CRC32 check needs it: bytes a damaged
    entry inflates past its recorded size come too, up to MAX_OVERFLOW of them, then
    OversizedEntry (a zip bomb: never inflated further); OversizedEntry also for an entry
    that records more than MAX_INFLATE. A stream that ends early just yields less. With
    `stop`, the bytes up to `stop` (and the recorded size) are read and nothing past them,
    as zipfile and torch read an entry.
    DamagedEntry if the deflate stream is broken, ZipError for a method other than
    stored/deflate.
    """
    strict = stop is None
    stop = entry.size if stop is None else max(0, min(stop, entry.size))
    pos = 0
    if entry.method == STORED:
        while pos < stop:  # (slices of the file's buffer when it is in memory: no copies)
            chunk = view(src, entry.data_offset + pos, min(CHUNK, stop - pos))
            if not chunk:
                return
            yield chunk
            pos += len(chunk)
        return
    if entry.method != DEFLATED:
        raise ZipError(f"entry '{entry.name}' uses compression method {entry.method}, not stored/deflate")
    if stop > MAX_INFLATE:
        raise OversizedEntry(
            f"entry '{entry.name}' inflates to {entry.size:,} bytes, more than the "
            f"{MAX_INFLATE:,} --deep inflates: its CRC32 and values are not checked")
    if strict:
        stop += MAX_OVERFLOW
    elif stop == 0:
        return
    yield from _inflate_chunks(src, entry, stop, strict)


def _inflate_chunks(src: Source, entry: ZipEntry, stop: int, strict: bool) -> Iterator[bytes]:
    inflater = zlib.decompressobj(-15)
    pos, end = entry.data_offset, entry.data_offset + entry.compressed_size
    data = b""  # compressed bytes not yet given to the inflater
    buf = bytearray()  # inflated bytes of the next piece, when they came in several parts
    done = 0  # bytes inflated so far
    try:
        while not inflater.eof:
            if not data and pos < end:
                data = view(src, pos, min(INFLATE_INPUT, end - pos))
                pos += len(data)
            if not data:  # all the input is in: what zlib may still hold (a match's tail)
                piece = inflater.decompress(b"", CHUNK - len(buf))
                if not piece:
                    break
            else:
                piece = inflater.decompress(data, CHUNK - len(buf))
                data = inflater.unconsumed_tail
            if not piece:
                continue
            if done + len(piece) > stop:
                if strict:
                    raise OversizedEntry(
                        f"entry '{entry.name}' inflates to more than {stop:,} bytes, where the "
                        f"zip directory records {entry.size:,} (a zip bomb, or a damaged "
                        "directory): its CRC32 and values are not checked")
                piece = piece[: stop - done]
            done += len(piece)
            if not buf and len(piece) == CHUNK:
                yield piece  # the usual case: no copy
            else:
                buf += piece
                if len(buf) == CHUNK:
                    yield bytes(buf)
                    buf.clear()
            if done >= stop and not strict:
                break
    except zlib.error as exc:
        raise DamagedEntry(f"deflate stream of '{entry.name}' is damaged ({exc})") from None
    if buf:
        yield bytes(buf)


def entry_crc(src: Source, entry: ZipEntry) -> int:
    """CRC32 of the entry's uncompressed bytes, read in chunks (never whole in memory);
    OversizedEntry as entry_chunks."""
    if entry.method == STORED and src.buffer is not None:  # in memory: one call, no copy
        return crc.crc32(view(src, entry.data_offset, entry.size))
    value = 0
    for chunk in entry_chunks(src, entry):
        value = crc.crc32(chunk, value)
    return value


def crc_mismatch(name: str, recorded: int, actual: int) -> str:
    """CD103's wording, shared by every zip-based reader."""
    return f"CRC32 mismatch in '{name}' (recorded 0x{recorded:08x}, actual 0x{actual:08x})"
