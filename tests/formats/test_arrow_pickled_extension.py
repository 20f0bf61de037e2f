"""Arrow and Parquet files with a field of pyarrow's pickled extension type (CVE-2023-47248).

pyarrow 0.14 to 14.0.0 rebuild a field whose metadata says `ARROW:extension:name` =
`arrow.py_extension_type` by `pickle.loads` of its `ARROW:extension:metadata`, as the schema is
read (apache/arrow python/pyarrow/types.pxi, PyExtensionType.__arrow_ext_deserialize__). The
files here are written by the installed pyarrow with that field metadata, as an attacker
would; none is ever read back with pyarrow (an old one would run the payload).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from cachedoctor.formats import read_bytes

from conftest import invoke, scan_paths

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SYSTEM = f"{os.system.__module__}.system"  # posix.system, nt.system on Windows


class _Payload:
    """Pickles as a call of os.system: what a hostile PyExtensionType field holds."""

    def __init__(self, command: str = "echo cachedoctor-test") -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def hostile(payload: bytes | None = None) -> dict[bytes, bytes]:
    """Field metadata of pyarrow's pickled extension type; without `payload`, an os.system
    call. (pickle.dumps never runs what it pickles.)"""
    return {b"ARROW:extension:name": b"arrow.py_extension_type",
            b"ARROW:extension:metadata": pickle.dumps(_Payload()) if payload is None else payload}


def arrow_stream(table: object) -> bytes:
    """As 🤗 datasets' ArrowWriter writes its caches: an IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def arrow_file(table: object) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def parquet(table: object) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)  # store_schema: the Arrow schema goes into ARROW:schema
    return sink.getvalue().to_pybytes()


WRITERS = {"stream.arrow": arrow_stream, "file.arrow": arrow_file, "e.parquet": parquet}


def top_level(metadata: dict[bytes, bytes]) -> object:
    return pa.table({"x": [1, 2]}, schema=pa.schema([pa.field("x", pa.int64(), metadata=metadata)]))


def struct_child(metadata: dict[bytes, bytes]) -> object:
    inner = pa.field("latent_scale", pa.float32(), metadata=metadata)
    kind = pa.struct([pa.field("name", pa.string()), inner])
    return pa.table({"meta": pa.array([{"name": "a", "latent_scale": 1.0}], kind)})


def list_value(metadata: dict[bytes, bytes]) -> object:
    kind = pa.list_(pa.field("item", pa.float32(), metadata=metadata))
    return pa.table({"prompt_embeds": pa.array([[1.0, 2.0]], kind)})


def dictionary_encoded(metadata: dict[bytes, bytes]) -> object:
    field = pa.field("caption", pa.dictionary(pa.int32(), pa.string()), metadata=metadata)
    return pa.table({"caption": pa.array(["a", "b", "a"]).dictionary_encode()},
                    schema=pa.schema([field]))


def scan_json(folder: Path) -> dict:
    result = invoke("scan", str(folder), "--isolated", "--format", "json")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_an_os_system_pickle_is_cd105_through_the_cli(tmp_path: Path, name: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / name).write_bytes(WRITERS[name](top_level(hostile())))
    (finding,) = scan_json(cache)["findings"]
    assert (finding["code"], Path(finding["path"]).name) == ("CD105", name)
    assert finding["details"] == {"globals": [SYSTEM], "executes_code": True}
    assert finding["message"] == f"pickle can run code: {SYSTEM}"


@pytest.mark.parametrize("build", [struct_child, list_value, dictionary_encoded])
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_nested_and_dictionary_fields_are_found(name: str, build) -> None:
    meta = read_bytes(WRITERS[name](build(hostile())), name)
    assert meta.unsafe_globals == (SYSTEM,)
    assert meta.errors == ()


def test_the_file_footer_s_schema_is_read_too() -> None:
    """pyarrow's file reader takes the schema from the footer, not from the stream's schema
    message: a payload only in the footer is found."""
    pickled = pickle.dumps(_Payload())
    data = arrow_file(top_level(hostile(pickled)))
    assert data.count(pickled) == 2  # the stream's schema message, then the footer
    first = data.index(pickled)
    cleaned = data[:first] + bytes(len(pickled)) + data[first + len(pickled):]  # not a pickle
    meta = read_bytes(cleaned, "file.arrow")
    assert meta.unsafe_globals == (SYSTEM,)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_ordinary_extension_types_draw_nothing(tmp_path: Path, name: str) -> None:
    """Only `arrow.py_extension_type` is unpickled by pyarrow: a registered extension type's
    metadata is its own business, even when it happens to look like a pickle."""

    class Label(pa.ExtensionType):
        def __init__(self) -> None:
            super().__init__(pa.string(), "cachedoctor.test.label")

        def __arrow_ext_serialize__(self) -> bytes:
            return pickle.dumps(_Payload())

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type: object, serialized: bytes) -> Label:
            return cls()

    table = pa.table({
        "label": pa.ExtensionArray.from_storage(Label(), pa.array(["a", "b"])),
        "latent": pa.FixedShapeTensorArray.from_numpy_ndarray(np.zeros((2, 4, 8), np.float32)),
        "x": pa.array([1, 2]),
    })
    assert table.schema.field("label").type.extension_name == "cachedoctor.test.label"
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / name).write_bytes(WRITERS[name](table))
    meta = read_bytes((cache / name).read_bytes(), name)
    assert (meta.globals, meta.errors) == ((), ())
    assert scan_paths(cache).findings == ()


@pytest.mark.parametrize("payload, says, codes", [
    (pickle.dumps(_Payload())[:-6], "cannot be checked (pickle data was truncated)",
     {"CD101", "CD105"}),
    (b"\xde\xad\xbe\xef" * 8, "cannot be checked", {"CD101"}),
    (b"", "cannot be checked (there is no pickle data)", {"CD101"}),
    (pickle.dumps({"storage": 5}), "names no extension type class", {"CD101"}),
], ids=["cut", "garbage", "empty", "no-class"])
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_pickle_that_is_damaged_or_names_no_class_is_still_reported(
        tmp_path: Path, name: str, payload: bytes, says: str, codes: set[str]) -> None:
    """pyarrow < 14.0.1 unpickles whatever the field holds: one cachedoctor cannot read, or
    one pyarrow's writer could not have made (it pickles the type's own class), is an error
    (CD101); the globals a cut one names are CD105 as well."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / name).write_bytes(WRITERS[name](struct_child(hostile(payload))))
    findings = scan_json(cache)["findings"]
    by_code = {f["code"]: f for f in findings}
    assert "CD101" in by_code
    message = by_code["CD101"]["message"]
    assert "field 'meta.latent_scale'" in message and "arrow.py_extension_type" in message
    assert "CVE-2023-47248" in message and says in message
    assert by_code["CD101"]["details"]["errors"] == [message]  # once, though a file's footer
    # repeats its schema
    assert set(by_code) == codes


def test_a_field_without_extension_metadata_is_reported() -> None:
    """pyarrow hands an empty pickle to pickle.loads when the metadata key is missing."""
    metadata = {b"ARROW:extension:name": b"arrow.py_extension_type"}
    (error,) = read_bytes(arrow_stream(top_level(metadata)), "x.arrow").errors
    assert "field 'x'" in error and "there is no pickle data" in error


def test_a_damaged_arrow_schema_in_a_parquet_footer_is_an_error() -> None:
    data = parquet(top_level({}))
    value = pq.read_metadata(pa.BufferReader(data)).metadata[b"ARROW:schema"]
    for damaged in (b"!" + value[1:], value[:12].ljust(len(value), b"=")):
        broken = data.replace(value, damaged)
        with pytest.raises(pa.ArrowInvalid):
            pq.read_table(pa.BufferReader(broken))
        (error,) = read_bytes(broken, "e.parquet").errors
        assert error.startswith("Parquet footer's ARROW:schema")


def test_many_fields_are_bounded() -> None:
    """Each distinct pickle is unpickled (restricted); past MAX_EXTENSION_PICKLES they are not
    read, and the file is reported all the same."""
    from cachedoctor.formats.arrow_ipc import MAX_EXTENSION_PICKLES

    fields = [pa.field(f"c{i}", pa.int8(), metadata=hostile(pickle.dumps(_Payload(f"echo {i}"))))
              for i in range(MAX_EXTENSION_PICKLES + 50)]
    data = arrow_stream(pa.table({f.name: [1] for f in fields}, schema=pa.schema(fields)))
    started = time.perf_counter()
    meta = read_bytes(data, "wide.arrow")
    assert time.perf_counter() - started < 5
    assert meta.unsafe_globals == (SYSTEM,)
    assert "was not read" in meta.errors[0] and len(meta.errors) == 9


def _fields_message(width: int, depth: int, shared: bool) -> bytes:
    """A schema message written by hand: a fields vector of `width` offsets, to one field
    (`shared`) or to `width` fields, the first of which holds the next level's vector,
    `depth` levels down. Flatbuffers let tables be shared: 100**4 fields in 2 KiB."""
    buf = bytearray(4)  # the root offset

    def table(slots: list[int], size: int) -> int:
        vtable = len(buf)
        buf.extend(struct.pack(f"<HH{len(slots)}H", 4 + 2 * len(slots), size, *slots))
        buf.extend(bytes(-len(buf) % 4))
        at = len(buf)
        buf.extend(struct.pack("<i", at - vtable) + bytes(size - 4))
        return at

    def point(at: int, target: int) -> None:
        struct.pack_into("<I", buf, at, target - at)

    message = table([0, 4, 8], 12)  # Message: 1 header_type, 2 header
    point(0, message)
    buf[message + 4] = 1  # a Schema
    schema = table([0, 4], 8)  # Schema: 1 fields
    point(message + 8, schema)
    slot = schema + 4
    for _ in range(depth):
        vector = len(buf)
        buf.extend(struct.pack("<I", width) + bytes(4 * width))
        point(slot, vector)
        fields = [table([0, 0, 0, 0, 0, 4], 8)]  # Field: 5 children
        fields += [fields[0] if shared else table([], 4) for _ in range(width - 1)]
        for i, field in enumerate(fields):
            point(vector + 4 + 4 * i, field)
        slot = fields[0] + 4
    vector = len(buf)
    buf.extend(bytes(4))  # the last level's children: none
    point(slot, vector)
    buf.extend(bytes(-len(buf) % 8))
    return b"\xff\xff\xff\xff" + struct.pack("<i", len(buf)) + bytes(buf)


END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def test_a_shared_field_is_walked_once() -> None:
    data = _fields_message(100, 4, shared=True) + END_OF_STREAM
    assert len(data) < 4096
    started = time.perf_counter()
    meta = read_bytes(data, "shared.arrow")
    assert time.perf_counter() - started < 1
    assert meta.errors == () and meta.metadata["record_batches"] == "0"


def test_the_fields_of_a_file_s_schemas_share_one_budget() -> None:
    """Three schema messages of 70,000 fields each: past 200,000 fields and key/value pairs in
    one file its schemas are not checked (each under it, they would all be walked)."""
    data = _fields_message(70_000, 1, shared=False) * 3 + END_OF_STREAM
    started = time.perf_counter()
    meta = read_bytes(data, "wide.arrow")
    assert time.perf_counter() - started < 10
    (error,) = meta.errors
    assert "more than 200,000 fields and key/value pairs in all: not checked" in error


def test_a_parquet_file_with_damaged_row_groups_still_has_its_schema_read() -> None:
    """pyarrow unpickles when it opens the file (pq.read_schema), before any row group is
    read: a footer whose column chunks lie past the data still has its payload found."""
    data = parquet(top_level(hostile()))
    cut = data[:4] + data[20:]  # the column chunks now run into the footer
    meta = read_bytes(cut, "e.parquet")
    assert meta.unsafe_globals == (SYSTEM,)
    (error,) = meta.errors
    assert "outside the data before the footer" in error
