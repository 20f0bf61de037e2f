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

The schema's fields (and a file footer's copy of them) are walked for pyarrow's pickled
extension type, whose pickle old pyarrow runs on reading (CVE-2023-47248, below); the Parquet
reader hands the Arrow schema it finds in a footer to the same walk.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from cachedoctor.formats.meta import ARROW, FileMeta
from cachedoctor.formats.source import Source
from cachedoctor.formats.unpickler import MAX_PICKLE_BYTES, UnpickleError, load_restricted

FILE_MAGIC = b"ARROW1"
CONTINUATION = b"\xff\xff\xff\xff"
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3
HEADERS = {1: "schema", 2: "dictionary batch", 3: "record batch", 4: "tensor", 5: "sparse tensor"}
MAX_MESSAGES = 1_000_000  # a hostile file of empty messages must not take minutes
_I32, _U32, _U16 = struct.Struct("<i"), struct.Struct("<I"), struct.Struct("<H")


class ArrowError(ValueError):
    """What is wrong, in words."""


def sniff(head: bytes) -> bool:
    """An Arrow file, or a stream that opens with a continuation and a sane metadata length."""
    if head.startswith(FILE_MAGIC):
        return True
    return head[:4] == CONTINUATION and len(head) >= 8 and 8 <= _I32.unpack_from(head, 4)[0] < 1 << 26


def read(src: Source, path: str, deep: bool = False) -> FileMeta:
    found = Extensions()
    try:
        facts, errors = _walk(src, found), ()
    except ArrowError as exc:
        facts, errors = {}, (str(exc),)
    # a pickled extension type first: it is what a reader with an old pyarrow runs
    return FileMeta(path, src.size, ARROW, root=None if errors else "table", metadata=facts,
                    globals=tuple(found.globals), unsafe_globals=tuple(found.unsafe),
                    errors=(*found.errors, *errors))


def _walk(src: Source, found: Extensions) -> dict[str, str]:
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
        _check_footer(src.pread(end, footer), end, found)
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
        metadata = src.pread(start, length)
        kind, body, count = _message(metadata, at)
        if kind == SCHEMA:
            _check_schema_at(metadata, at, found)
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


def _check_schema_at(buf: bytes, at: int, found: Extensions) -> None:
    """check_schema for the Schema of the Message flatbuffer `buf` (the message at byte `at`)."""
    try:
        schema = _offset_field(buf, _table(buf, _U32.unpack_from(buf)[0]), 2)
        if schema is not None:
            check_schema(buf, schema, found)
    except (struct.error, IndexError) as exc:
        raise ArrowError(f"Arrow schema at byte {at:,} has damaged metadata ({exc})") from None


def _check_footer(buf: bytes, at: int, found: Extensions) -> None:
    """check_schema for the schema in an Arrow file's footer (File.fbs Footer: 1 schema), the
    one pyarrow's file reader takes, whatever the stream's own schema message says."""
    try:
        footer = _table(buf, _U32.unpack_from(buf)[0])
        schema = _offset_field(buf, footer, 1)
        if schema is not None:
            check_schema(buf, schema, found)
    except (struct.error, IndexError) as exc:
        raise ArrowError(f"Arrow file footer at byte {at:,} is damaged ({exc})") from None


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


# ---- pyarrow's pickled extension type (CVE-2023-47248) ------------------------------------------
#
# A field whose custom_metadata names the extension `arrow.py_extension_type` (the name pyarrow
# gave its PyExtensionType from 0.14 on: python/pyarrow/types.pxi, cpp extension_type.cc
# kExtensionName) is rebuilt by PyExtensionType.__arrow_ext_deserialize__, which through
# pyarrow 14.0.0 calls pickle.loads on the field's `ARROW:extension:metadata` as the schema is
# read (cpp/src/arrow/ipc/metadata_internal.cc FieldFromFlatbuffer, at any depth: children are
# read first, dictionary-encoded fields too). 14.0.1 (apache/arrow c73cb13b, GH-38607) stopped
# unpickling by default and reads the column as an UnknownExtensionType; 21.0 (26170b47)
# removed the type. The file loads on those, so a reader with an older pyarrow is the victim.
PY_EXTENSION_TYPE = b"arrow.py_extension_type"
_NAME_KEY, _METADATA_KEY = b"ARROW:extension:name", b"ARROW:extension:metadata"
MAX_SCHEMA_ITEMS = 200_000  # fields and key/value pairs walked in a file (shared tables recur)
MAX_FIELD_DEPTH = 64  # nested fields: arrow ipc/options.h kMaxNestingDepth; its verifier: 128 tables
MAX_EXTENSION_PICKLES = 1_000  # distinct pickles of such fields read in one file
_SHOWN = 8  # fields named one by one in the errors


@dataclass
class Extensions:
    """What the schemas of one file hold of pyarrow's pickled extension type: the globals its
    pickles name, and an error for each such field that names none outside the allow-list or
    cannot be read. Readers fill one per file (its schemas share its budgets) and copy it into
    the FileMeta."""

    globals: dict[str, None] = field(default_factory=dict)
    unsafe: dict[str, None] = field(default_factory=dict)
    errors: dict[str, None] = field(default_factory=dict)  # a file's footer repeats its schema
    items_left: int = MAX_SCHEMA_ITEMS
    pickle_bytes: int = 0  # read so far, against MAX_PICKLE_BYTES
    _seen: dict[bytes, str | None] = field(default_factory=dict)  # pickle -> its problem, if any

    def check(self, where: str, pickled: bytes) -> None:
        """Judge the pickle of the PyExtensionType field at `where` (a dotted path)."""
        if pickled in self._seen:
            problem = self._seen[pickled]
        elif len(self._seen) >= MAX_EXTENSION_PICKLES or \
                self.pickle_bytes + len(pickled) > MAX_PICKLE_BYTES:
            problem = (f"its pickle was not read (past {MAX_EXTENSION_PICKLES:,} pickles or "
                       f"{MAX_PICKLE_BYTES // 2**20} MiB of them in this file)")
        else:
            self.pickle_bytes += len(pickled)
            problem = self._seen[pickled] = self._read(pickled)
        if problem is None:
            return
        if len(self.errors) == _SHOWN:
            self.errors["more fields of pyarrow's pickled extension type follow"] = None
        elif len(self.errors) < _SHOWN:
            self.errors[
                f"field '{where}' has pyarrow's pickled extension type (arrow.py_extension_type),"
                f" which pyarrow before 14.0.1 unpickles as it reads the file (CVE-2023-47248): "
                f"{problem}"] = None

    def _read(self, pickled: bytes) -> str | None:
        """None if the pickle names a global outside the allow-list (CD105 says so); else why
        the field is reported anyway."""
        try:
            found = load_restricted(pickled)
        except UnpickleError as exc:
            self._record(exc.globals, exc.unsafe_globals)
            return f"its pickle cannot be checked ({exc})"
        self._record(found.globals, found.unsafe_globals)
        if found.unsafe_globals:
            return None
        # pyarrow pickles the PyExtensionType subclass itself, so its class is always named: a
        # pickle naming none was not written by pyarrow (crafted or damaged). Reported though it
        # runs nothing harmful: pyarrow < 14.0.1 unpickles it and then fails on the column
        # (the object has no storage_type), and a file that holds one is a payload's carrier.
        return ("its pickle names no extension type class, so pyarrow did not write it (pyarrow "
                "< 14.0.1 unpickles it and then fails)")

    def _record(self, names: list[str], unsafe: list[str]) -> None:
        self.globals.update(dict.fromkeys(names))
        self.unsafe.update(dict.fromkeys(unsafe))


def check_schema(buf: bytes, schema: int, found: Extensions) -> None:
    """Find the fields of the flatbuffer Schema table at `schema` (Schema.fbs: 1 fields) that
    have pyarrow's pickled extension type, at any depth, and judge their pickles. Raises
    IndexError (damaged) or ArrowError (past a budget)."""
    _table(buf, schema)
    # (field table, depth, parent's entry): names are read only for a field that is reported
    stack: list[tuple[int, int, tuple | None]] = [
        (table, 0, None) for table in reversed(_tables(buf, schema, 1, found))]
    seen: set[int] = set()  # vectors may share a table: a few KiB could nest 100**4 fields
    while stack:
        entry = stack.pop()
        table, depth, _ = entry
        if table in seen:
            continue  # (offsets only point forward: no cycles, and each table is read once)
        seen.add(table)
        if depth > MAX_FIELD_DEPTH:
            raise ArrowError(f"Arrow schema nests fields more than {MAX_FIELD_DEPTH} deep: "
                             "not checked")
        children, pairs = _field_vectors(buf, table, found)
        py_extension, pickles = False, []
        for pair in pairs:
            _table(buf, pair)
            key = _string(buf, pair, 0)
            if key == _NAME_KEY:
                py_extension = py_extension or _string(buf, pair, 1) == PY_EXTENSION_TYPE
            elif key == _METADATA_KEY:
                pickles.append(_string(buf, pair, 1) or b"")
        if py_extension:  # pyarrow unpickles the first metadata value; a payload may sit in any
            where = _path(buf, entry)
            for pickled in pickles or [b""]:
                found.check(where, pickled)
        stack.extend((child, depth + 1, entry) for child in reversed(children))


def _field_vectors(buf: bytes, table: int, found: Extensions) -> tuple[list[int], list[int]]:
    """The children and the custom_metadata (KeyValue tables: 0 key, 1 value) of the Field at
    `table` (Schema.fbs Field: 0 name, 1 nullable, 2 type_type, 3 type, 4 dictionary,
    5 children, 6 custom_metadata), its vtable read once: a wide schema has many fields."""
    _table(buf, table)
    vtable = table - _I32.unpack_from(buf, table)[0]
    slots = min(7, (_U16.unpack_from(buf, vtable)[0] - 4) // 2)
    present = struct.unpack_from(f"<{max(slots, 0)}H", buf, vtable + 4) + (0,) * 7
    out = []
    for slot in present[5:7]:
        if not slot:
            out.append([])
            continue
        at = table + slot
        first = at + _U32.unpack_from(buf, at)[0] + 4
        count = _U32.unpack_from(buf, first - 4)[0]
        if count > (len(buf) - first) // 4:
            raise IndexError(f"a vector of {count:,} tables does not fit in the metadata")
        _spend(found, count)
        out.append([first + 4 * i + o
                    for i, o in enumerate(struct.unpack_from(f"<{count}I", buf, first))])
    return out[0], out[1]


def _spend(found: Extensions, count: int) -> None:
    found.items_left -= count
    if found.items_left < 0:
        raise ArrowError(f"Arrow schemas with more than {MAX_SCHEMA_ITEMS:,} fields and "
                         "key/value pairs in all: not checked")


def _path(buf: bytes, entry: tuple | None) -> str:
    """The dotted names of a field and its parents (each cut to 40 characters)."""
    names = []
    while entry is not None:
        names.append((_string(buf, entry[0], 0) or b"")[:40].decode("utf-8", "replace"))
        entry = entry[2]
    return ".".join(reversed(names))[:160]


def check_schema_message(data: bytes, found: Extensions) -> None:
    """check_schema for an encapsulated IPC message holding a Schema (what pyarrow's
    ipc::SerializeSchema writes: continuation, int32 length, flatbuffer; before Arrow 0.15
    without the continuation). Raises ArrowError if it is none."""
    if len(data) < 8:
        raise ArrowError(f"its schema message is {len(data)} bytes long: cut short")
    try:
        if data[:4] == CONTINUATION:
            length, start = _I32.unpack_from(data, 4)[0], 8
        else:
            length, start = _I32.unpack_from(data)[0], 4
        if length <= 0 or start + length > len(data):
            raise ArrowError(f"its message declares {length:,} metadata bytes; "
                             f"{len(data) - start:,} remain: cut short")
        buf = data[start:start + length]
        table = _table(buf, _U32.unpack_from(buf)[0])
        if _field(buf, table, 1, "<B", 0) != SCHEMA:
            raise ArrowError("its message holds no schema")
        schema = _offset_field(buf, table, 2)
        if schema is None:
            raise ArrowError("its schema message is empty")
        check_schema(buf, schema, found)
    except (struct.error, IndexError) as exc:
        raise ArrowError(f"damaged flatbuffer ({exc})") from None


def _vector(buf: bytes, table: int, index: int) -> tuple[int, int]:
    """(position of the first element, count) of the vector in field `index`; (0, 0) if absent."""
    at = _offset_field(buf, table, index)
    if at is None:
        return 0, 0
    return at + 4, _U32.unpack_from(buf, at)[0]


def _tables(buf: bytes, table: int, index: int, found: Extensions) -> list[int]:
    """The tables a vector of tables in field `index` points to (unchecked), counted against
    the file's budget."""
    first, count = _vector(buf, table, index)
    if count > (len(buf) - first) // 4:
        raise IndexError(f"a vector of {count:,} tables does not fit in the metadata")
    _spend(found, count)
    return [first + 4 * i + _U32.unpack_from(buf, first + 4 * i)[0] for i in range(count)]


def _string(buf: bytes, table: int, index: int) -> bytes | None:
    first, count = _vector(buf, table, index)
    if first + count > len(buf):
        raise IndexError(f"a {count:,}-byte string past the metadata's end")
    return buf[first:first + count] if first else None
