"""Apache Arrow IPC streams and files: the caches 🤗 datasets writes, and so the diffusers
text-to-image scripts, whose `datasets.map` of VAE latents and text embeddings lands in
`cache-<fingerprint>.arrow` (datasets `ArrowWriter`: a `pa.RecordBatchStreamWriter`).

Only message headers are read. A message is `ff ff ff ff` (since Arrow 0.15), an int32
metadata length, a flatbuffer `Message` (Message.fbs: version, header type, header, bodyLength)
and `bodyLength` bytes of body; the stream ends with `ff ff ff ff 00 00 00 00`. The file
format wraps the stream in `ARROW1\\0\\0` ... footer, int32 footer length, `ARROW1`.

pyarrow reads a stream that stops at a message boundary without complaint: a cache cut there
loads with rows missing. The end-of-stream marker that `close()` writes is what tells the two
apart, so a stream without it is an error here.
"""

from __future__ import annotations

import struct

from cachedoctor.formats.meta import ARROW, FileMeta
from cachedoctor.formats.source import Source

FILE_MAGIC = b"ARROW1"
CONTINUATION = b"\xff\xff\xff\xff"
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3
HEADERS = {1: "schema", 2: "dictionary batch", 3: "record batch", 4: "tensor", 5: "sparse tensor"}
MAX_MESSAGES = 1_000_000  # a hostile file of empty messages must not take minutes
_I32, _U32 = struct.Struct("<i"), struct.Struct("<I")


class ArrowError(ValueError):
    """What is wrong, in words."""


def sniff(head: bytes) -> bool:
    """An Arrow file, or a stream that opens with a continuation and a sane metadata length."""
    if head.startswith(FILE_MAGIC):
        return True
    return head[:4] == CONTINUATION and len(head) >= 8 and 8 <= _I32.unpack_from(head, 4)[0] < 1 << 26


def read(src: Source, path: str, deep: bool = False) -> FileMeta:
    try:
        facts = _walk(src)
    except ArrowError as exc:
        return FileMeta(path, src.size, ARROW, errors=(str(exc),))
    return FileMeta(path, src.size, ARROW, root="table", metadata=facts)


def _walk(src: Source) -> dict[str, str]:
    size = src.size
    at, end = 0, size
    if src.pread(0, 6) == FILE_MAGIC:
        if size < 18 or src.pread(size - 6, 6) != FILE_MAGIC:
            raise ArrowError("Arrow file without its closing ARROW1 magic: truncated (the footer "
                             "is written last)")
        footer = _I32.unpack(src.pread(size - 10, 4))[0]
        end = size - 10 - footer
        if footer <= 0 or end < 8:
            raise ArrowError(f"Arrow file footer length {footer:,} does not fit in "
                             f"{size:,} bytes")
        at = 8
    batches = rows = 0
    for messages in range(MAX_MESSAGES):  # the messages read before this one
        if at == end:
            if not messages:
                raise ArrowError(f"empty Arrow {'file' if end != size else 'stream'}: no schema")
            if end != size:
                break  # a file's stream may end at its footer
            raise ArrowError(
                f"Arrow stream without its end-of-stream marker after {batches:,} record "
                f"batches ({rows:,} rows): the writer never closed it, and pyarrow reads the "
                "rows that are there without an error")
        prefix = src.pread(at, 8)
        if len(prefix) < 4:
            raise ArrowError(f"Arrow stream cut {size - at} bytes into a message header at "
                             f"byte {at:,}")
        if prefix[:4] == CONTINUATION:
            if len(prefix) < 8:
                raise ArrowError(f"Arrow stream cut inside a message header at byte {at:,}")
            length, start = _I32.unpack_from(prefix, 4)[0], at + 8
        else:  # the format before Arrow 0.15: no continuation
            length, start = _I32.unpack_from(prefix)[0], at + 4
        if length == 0:
            if not messages:
                raise ArrowError("Arrow stream that ends before its schema")
            break  # end-of-stream
        if length < 0 or start + length > end:
            raise ArrowError(f"Arrow message at byte {at:,} declares {length:,} metadata bytes; "
                             f"{max(0, end - start):,} remain: truncated or damaged")
        kind, body, count = _message(src.pread(start, length), at)
        if not messages and kind != SCHEMA:
            raise ArrowError(f"Arrow stream opens with a {HEADERS.get(kind, kind)} message, "
                             "not its schema")
        if start + length + body > end:
            raise ArrowError(
                f"Arrow message {messages} (a {HEADERS.get(kind, 'message')}) at byte "
                f"{at:,} has a {body:,}-byte body; {max(0, end - start - length):,} "
                "remain: truncated "
                "(pyarrow: 'Expected to be able to read ... bytes for message body')")
        at = start + length + body
        if kind == RECORD_BATCH:
            batches += 1
            rows += count
    else:
        raise ArrowError(f"more than {MAX_MESSAGES:,} Arrow messages")
    return {"record_batches": str(batches), "rows": str(rows)}


def _message(buf: bytes, at: int) -> tuple[int, int, int]:
    """(header type, body length, rows) of a flatbuffer Message; rows of a record batch."""
    try:
        table = _table(buf, _U32.unpack_from(buf)[0])
        kind = _field(buf, table, 1, "<B", 0)
        body = _field(buf, table, 3, "<q", 0)
        rows = 0
        if kind in (RECORD_BATCH, DICTIONARY_BATCH):
            header = _offset_field(buf, table, 2)
            if header is not None:
                batch = _table(buf, header)
                if kind == DICTIONARY_BATCH:  # DictionaryBatch: id, data (a RecordBatch)
                    data = _offset_field(buf, batch, 1)
                    batch = _table(buf, data) if data is not None else None
                if batch is not None:
                    rows = _field(buf, batch, 0, "<q", 0)
                    _check_buffers(buf, batch, body)
    except (struct.error, IndexError) as exc:
        raise ArrowError(f"Arrow message at byte {at:,} has damaged metadata ({exc})") from None
    if body < 0 or rows < 0:
        raise ArrowError(f"Arrow message at byte {at:,} has a negative length")
    return kind, body, rows if kind == RECORD_BATCH else 0


def _table(buf: bytes, pos: int) -> int:
    """`pos`, checked to hold a table whose vtable lies in `buf` (struct's negative offsets
    would count from the end)."""
    if not 0 <= pos <= len(buf) - 4:
        raise IndexError(f"table at {pos} out of range")
    vtable = pos - _I32.unpack_from(buf, pos)[0]
    if not 0 <= vtable <= len(buf) - 4:
        raise IndexError(f"vtable at {vtable} out of range")
    return pos


def _slot(buf: bytes, table: int, index: int) -> int:
    """The offset of field `index` in `table`, 0 when it is absent (its default)."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    vlen = struct.unpack_from("<H", buf, vtable)[0]
    at = 4 + 2 * index
    return struct.unpack_from("<H", buf, vtable + at)[0] if at + 2 <= vlen else 0


def _field(buf: bytes, table: int, index: int, fmt: str, default: int) -> int:
    slot = _slot(buf, table, index)
    return struct.unpack_from(fmt, buf, table + slot)[0] if slot else default


def _offset_field(buf: bytes, table: int, index: int) -> int | None:
    slot = _slot(buf, table, index)
    if not slot:
        return None
    target = table + slot + _U32.unpack_from(buf, table + slot)[0]
    if target > len(buf) - 4:
        raise IndexError(f"offset to {target} out of range")
    return target


def _check_buffers(buf: bytes, batch: int, body: int) -> None:
    """Every buffer of a record batch (struct Buffer: offset, length) lies inside its body."""
    vector = _offset_field(buf, batch, 2)
    if vector is None:
        return
    count = _U32.unpack_from(buf, vector)[0]
    if count > (len(buf) - vector - 4) // 16:
        raise IndexError(f"{count} buffers do not fit in the metadata")
    for i in range(count):
        offset, length = struct.unpack_from("<qq", buf, vector + 4 + 16 * i)
        if offset < 0 or length < 0 or offset + length > body:
            raise ArrowError(f"Arrow record batch buffer {i} ({offset:,}+{length:,}) lies "
                             f"outside its {body:,}-byte body")
