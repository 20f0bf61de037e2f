"""Apache Parquet files: the text-embedding cache of diffusers' Flux quantization research project
(examples/research_projects/flux_lora_quantization/compute_embeddings.py writes
`embeddings.parquet` with `DataFrame.to_parquet`: columns `image_hash`, `prompt_embeds`,
`pooled_prompt_embeds`, `text_ids`, each embedding a flattened list of floats per row).

Only the footer is read, without pyarrow: `PAR1`, the column chunks, the file metadata (a
Thrift compact-protocol `FileMetaData`), its int32 length and `PAR1` again. The footer is
written last, so a file cut short has no closing magic; a footer whose row groups point past
its own start, or whose row counts disagree, is damaged. `PARE` closes a file with an
encrypted footer, which is taken as it is. The Arrow schema pyarrow keeps in the footer
(`ARROW:schema`) is checked for pyarrow's pickled extension type (arrow_ipc.check_schema).
"""

from __future__ import annotations

import base64
import binascii
import re
import struct

from cachedoctor.formats.arrow_ipc import ArrowError, Extensions, check_schema_message
from cachedoctor.formats.meta import PARQUET, FileMeta
from cachedoctor.formats.source import Source

MAGIC, ENCRYPTED = b"PAR1", b"PARE"
MAX_FOOTER = 64 * 1024 * 1024  # a footer of millions of columns and row groups, at most
MAX_ITEMS = 1_000_000  # Thrift values decoded in one footer: a hostile one must not take minutes
MAX_DEPTH = 32
# Thrift compact types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class ParquetError(ValueError):
    """What is wrong, in words."""


def sniff(head: bytes) -> bool:
    return head.startswith(MAGIC)


def read(src: Source, path: str, deep: bool = False) -> FileMeta:
    found = Extensions()
    try:
        facts, errors = _footer(src, found), ()
    except ParquetError as exc:
        facts, errors = {}, (str(exc),)
    # a pickled extension type first: it is what a reader with an old pyarrow runs
    return FileMeta(path, src.size, PARQUET, root=None if errors else "table", metadata=facts,
                    globals=tuple(found.globals), unsafe_globals=tuple(found.unsafe),
                    errors=(*found.errors, *errors))


def _footer(src: Source, found: Extensions) -> dict[str, str]:
    size = src.size
    if size < 12:
        raise ParquetError(f"Parquet file of {size} bytes: too short for its footer (truncated)")
    tail = src.pread(size - 8, 8)
    if tail[4:] == ENCRYPTED:
        return {"footer": "encrypted"}
    if tail[4:] != MAGIC:
        raise ParquetError("Parquet file without its closing PAR1 magic: truncated (the footer "
                           "is written last; pyarrow: 'Parquet magic bytes not found in footer')")
    length = struct.unpack("<i", tail[:4])[0]
    start = size - 8 - length
    if length <= 0 or start < 4 or length > MAX_FOOTER:
        raise ParquetError(f"Parquet footer length {length:,} does not fit in {size:,} bytes: "
                           "damaged")
    try:
        meta = _Decoder(src.pread(start, length)).struct(0)
    except (IndexError, struct.error, RecursionError, ValueError) as exc:
        raise ParquetError(f"Parquet footer ({length:,} bytes at {start:,}) is damaged: "
                           f"{exc or type(exc).__name__}") from None
    # the schema first: pyarrow reads it on opening the file (pq.read_schema, ParquetFile),
    # before any row group is looked at, so a damaged one does not keep its fields unread
    _check_arrow_schema(meta, found)
    return _facts(meta, start)


ARROW_SCHEMA = b"ARROW:schema"
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*")


def _check_arrow_schema(meta: dict, found: Extensions) -> None:
    """The Arrow schema pyarrow keeps in the footer's key_value_metadata (FileMetaData 5, a list
    of KeyValue: 1 key, 2 value) under `ARROW:schema`, base64 of an IPC schema message
    (apache/arrow cpp/src/parquet/arrow/writer.cc GetSchemaMetadata), is read back with the
    file (schema.cc GetOriginSchema: ipc::ReadSchema), field metadata and all: a field with
    pyarrow's pickled extension type is unpickled by pyarrow < 14.0.1 from here."""
    pairs = meta.get(5)
    for pair in pairs if isinstance(pairs, list) else ():
        if not isinstance(pair, dict) or pair.get(1) != ARROW_SCHEMA:
            continue
        value = pair.get(2)
        # as arrow's own base64_decode did until 2026 (cpp/src/arrow/vendored/base64.cpp, before
        # GH-49614 made it strict): up to the first byte outside the alphabet or '='; a last
        # group of one character makes no byte. The lenient reading finds what old pyarrow reads.
        text = _BASE64.match(value).group() if isinstance(value, bytes) else b""
        text = text[:len(text) - (len(text) % 4 == 1)]
        try:
            check_schema_message(base64.b64decode(text + b"=" * (-len(text) % 4)), found)
        except (ArrowError, binascii.Error) as exc:
            raise ParquetError(f"Parquet footer's ARROW:schema (the Arrow schema pyarrow reads "
                               f"the file with) is damaged: {exc}") from None


def _facts(meta: dict, footer_start: int) -> dict[str, str]:
    """Check FileMetaData (parquet.thrift: 2 schema, 3 num_rows, 4 row_groups, 6 created_by)."""
    rows = meta.get(3)
    groups = meta.get(4, [])
    schema = meta.get(2, [])
    if not isinstance(rows, int) or not isinstance(groups, list) or not isinstance(schema, list):
        raise ParquetError("Parquet footer without its row count, row groups or schema: damaged")
    grouped = 0
    for g, group in enumerate(groups):
        # RowGroup: 1 columns, 3 num_rows; ColumnChunk: 1 file_path (data in another file),
        # 3 meta_data; ColumnMetaData: 7 total_compressed_size, 9 data_page_offset,
        # 11 dictionary_page_offset
        if not isinstance(group, dict) or not isinstance(group.get(3), int):
            raise ParquetError(f"Parquet row group {g} has no row count: damaged footer")
        grouped += group[3]
        chunks = group.get(1) if group[3] and isinstance(group.get(1), list) else []
        for chunk in chunks:  # (pyarrow gives an empty group's chunks offset 0: no data)
            column = chunk.get(3) if isinstance(chunk, dict) else None
            if not isinstance(column, dict) or chunk.get(1) is not None:
                continue
            first = min(o for o in (column.get(9), column.get(11)) if isinstance(o, int)) \
                if isinstance(column.get(9), int) else None
            stored = column.get(7)
            if first is None or not isinstance(stored, int):
                continue
            if first < 4 or first + stored > footer_start:
                raise ParquetError(
                    f"Parquet row group {g} has a column chunk at {first:,}..{first + stored:,}, "
                    f"outside the data before the footer (4..{footer_start:,}): damaged")
    if grouped != rows:
        raise ParquetError(f"Parquet footer says {rows:,} rows, its row groups hold {grouped:,}: "
                           "damaged")
    names = [e.get(4) for e in schema[1:] if isinstance(e, dict) and isinstance(e.get(4), bytes)]
    facts = {"rows": str(rows), "row_groups": str(len(groups)),
             "columns": ",".join(n.decode("utf-8", "replace") for n in names[:64])}
    if isinstance(meta.get(6), bytes):
        facts["created_by"] = meta[6].decode("utf-8", "replace")
    return facts


class _Decoder:
    """The Thrift compact protocol, as far as a footer needs: structs as {field id: value},
    lists as lists, binary as bytes, integers zigzag-decoded; maps are read and dropped."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.at = 0
        self.items = 0

    def _byte(self) -> int:
        b = self.buf[self.at]
        self.at += 1
        return b

    def _varint(self) -> int:
        shift = out = 0
        while True:
            b = self._byte()
            out |= (b & 0x7F) << shift
            if b < 0x80:
                return out
            shift += 7
            if shift > 70:
                raise ValueError("varint longer than 10 bytes")

    def _zigzag(self) -> int:
        n = self._varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int, depth: int) -> object:
        self.items += 1
        if self.items > MAX_ITEMS or depth > MAX_DEPTH:
            raise ValueError("too many or too deeply nested values")
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self._byte()
        if kind in (_I16, _I32, _I64):
            return self._zigzag()
        if kind == _DOUBLE:
            self.at += 8
            if self.at > len(self.buf):
                raise IndexError("double past the footer's end")
            return None
        if kind == _BINARY:
            n = self._varint()
            if self.at + n > len(self.buf):
                raise IndexError(f"a {n:,}-byte string past the footer's end")
            self.at += n
            return self.buf[self.at - n:self.at]
        if kind in (_LIST, _SET):
            header = self._byte()
            n, element = header >> 4, header & 0x0F
            if n == 15:
                n = self._varint()
            if n > len(self.buf) - self.at:  # every element takes a byte at least
                raise IndexError(f"a list of {n:,} elements past the footer's end")
            if element in (_TRUE, _FALSE):  # in a list, a boolean is one byte
                self.items += n  # (each a value: 64 MiB of them must not take half a minute)
                if self.items > MAX_ITEMS:
                    raise ValueError("too many or too deeply nested values")
                start, self.at = self.at, self.at + n
                return [b == 1 for b in self.buf[start:self.at]]
            return [self.value(element, depth + 1) for _ in range(n)]
        if kind == _MAP:
            n = self._varint()
            if n:
                types = self._byte()
                for _ in range(n):
                    self.value(types >> 4, depth + 1)
                    self.value(types & 0x0F, depth + 1)
            return None
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise ValueError(f"unknown Thrift type {kind}")

    def struct(self, depth: int) -> dict[int, object]:
        out: dict[int, object] = {}
        field = 0
        while True:
            header = self._byte()
            if header == 0:
                return out
            delta, kind = header >> 4, header & 0x0F
            field = field + delta if delta else self._zigzag()
            out[field] = self.value(kind, depth)
