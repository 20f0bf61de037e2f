"""gzip around a torch.save stream: SimpleTuner's default cache container since late 2025.

The whole stream must be inflated to reach the zip central directory at its end; that also
checks the gzip CRC32 and length, so a flipped byte or a cut-off file is found without --deep.
What is inflated stays in memory and is capped: SimpleTuner's loader gunzips the whole file
before torch.load, so a stream that inflates past the budget (a gzip bomb: 8 MB of gzip can
hold 8 GiB of zeros) is reported, never spooled to disk. Real caches inflate to a few MB.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

from cachedoctor.formats.source import BytesSource, Source

MAX_INFLATED = 64 * 1024 * 1024  # bytes inflated per file without --deep (~0.1 s of zlib)
DEEP_MAX_INFLATED = 256 * 1024 * 1024  # with --deep
CHUNK = 1024 * 1024


@contextlib.contextmanager
def inflated(src: Source, limit: int = MAX_INFLATED) -> Iterator[tuple[Source | None, str | None]]:
    """Yield (inner source, None), or (None, what is wrong with the gzip stream); at most
    `limit` bytes are inflated."""
    out = bytearray()
    for piece in _inflate(src, limit + 1):
        if isinstance(piece, str):
            yield None, piece
            return
        out += piece
        if len(out) > limit:
            yield None, (f"gzip stream inflates past {limit // 2**20} MiB from "
                         f"{src.size:,} bytes, the budget of a scan (a gzip bomb? a cache "
                         "file is a few MB): not checked")
            return
    yield BytesSource(out), None


def _inflate(src: Source, most: int) -> Iterator[bytes | str]:
    """Inflated chunks (`most` bytes or a little more), then a message (a str) if the stream
    is broken."""
    pos = done = 0
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    while True:
        chunk = src.pread(pos, CHUNK)
        if not chunk:
            if not inflater.eof:
                yield (
                    f"gzip stream ends at {src.size:,} bytes before its end marker "
                    "(truncated or half-written)"
                )
            return
        pos += len(chunk)
        data = chunk
        try:
            while data:
                piece = inflater.decompress(data, CHUNK)
                if piece:
                    yield piece
                    done += len(piece)
                    if done >= most:
                        return
                data = inflater.unconsumed_tail
                if inflater.eof:
                    break
        except zlib.error as exc:
            yield f"gzip stream is damaged at or before byte {pos:,}: {_explain(exc)}"
            return
        if inflater.eof:
            # as Python's gzip reads on (gzip.decompress, GzipFile): zero bytes after a member
            # are padding, a member may follow them, and anything else makes it refuse the file
            pos = _past_zeros(src, pos - len(inflater.unused_data))
            magic = src.pread(pos, 2)
            if not magic:
                return
            if magic != b"\x1f\x8b":
                yield (f"{src.size - pos:,} bytes at byte {pos:,}, after a gzip member, start "
                       "no gzip member (gzip.decompress: Not a gzipped file)")
                return
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # concatenated members are legal


def _past_zeros(src: Source, pos: int) -> int:
    """The offset of the first non-zero byte at or after `pos` (the file's size if none)."""
    while True:
        chunk = src.pread(pos, CHUNK)
        rest = chunk.lstrip(b"\0")
        if rest or not chunk:
            return pos + len(chunk) - len(rest)
        pos += len(chunk)


def _explain(exc: zlib.error) -> str:
    text = str(exc)
    if "incorrect data check" in text:
        return "CRC32 mismatch (bytes changed after writing)"
    if "incorrect length check" in text:
        return "length mismatch"
    return text.removeprefix("Error -3 while decompressing data: ")
