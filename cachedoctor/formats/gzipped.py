"""gzip around a torch.save stream: SimpleTuner's default cache container since late 2025.

The whole stream must be inflated to reach the zip central directory at its end; that also
checks the gzip CRC32 and length, so a flipped byte or a cut-off file is found without --deep.
Small streams stay in memory; big ones spill to an anonymous temp file so a worker's memory
stays bounded, and a gzip bomb stops at MAX_EXPANDED.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib
from collections.abc import Iterator

from cachedoctor.formats.source import BytesSource, FileSource, Source

IN_MEMORY_LIMIT = 256 * 1024 * 1024
MAX_EXPANDED = 64 * 1024**3
CHUNK = 1024 * 1024


@contextlib.contextmanager
def inflated(src: Source) -> Iterator[tuple[Source | None, str | None]]:
    """Yield (inner source, None), or (None, what is wrong with the gzip stream)."""
    spool = None
    try:
        out = bytearray()
        total = 0
        for piece in _inflate(src):
            if isinstance(piece, str):
                yield None, piece
                return
            total += len(piece)
            if total > MAX_EXPANDED:
                yield None, f"gzip stream expands past {MAX_EXPANDED:,} bytes: not a cache file"
                return
            if spool is None and total > IN_MEMORY_LIMIT:
                spool = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in the finally below
                spool.write(out)
                out = bytearray()
            if spool is not None:
                spool.write(piece)
            else:
                out += piece
        if spool is None:
            yield BytesSource(out), None
        else:
            spool.flush()
            yield FileSource(spool.fileno(), os.fstat(spool.fileno()).st_size), None
    finally:
        if spool is not None:
            spool.close()


def _inflate(src: Source) -> Iterator[bytes | str]:
    """Inflated chunks, then a message (a str) if the stream is broken."""
    pos = 0
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
                data = inflater.unconsumed_tail
                if inflater.eof:
                    break
        except zlib.error as exc:
            yield f"gzip stream is damaged at or before byte {pos:,}: {_explain(exc)}"
            return
        if inflater.eof:
            rest = inflater.unused_data + src.pread(pos, 2)
            if rest.startswith(b"\x1f\x8b"):  # concatenated gzip members are legal
                pos -= len(inflater.unused_data)
                inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                continue
            return


def _explain(exc: zlib.error) -> str:
    text = str(exc)
    if "incorrect data check" in text:
        return "CRC32 mismatch (bytes changed after writing)"
    if "incorrect length check" in text:
        return "length mismatch"
    return text.removeprefix("Error -3 while decompressing data: ")
