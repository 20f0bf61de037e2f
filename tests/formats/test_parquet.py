"""Parquet caches: diffusers' Flux quantization research project keeps its text embeddings in
`embeddings.parquet` (huggingface/diffusers
examples/research_projects/flux_lora_quantization/compute_embeddings.py, 3f2f704b:
`df.to_parquet(args.output_path)`, each embedding `x.cpu().numpy().flatten().tolist()`). The
footer is read without pyarrow; the files are written with it, as pandas' to_parquet does."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from cachedoctor.formats import read_bytes
from cachedoctor.formats.meta import PARQUET

from conftest import scan_paths

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def embeddings_table(rows: int, seq: int = 8, dim: int = 16) -> object:
    """compute_embeddings.py's DataFrame as pandas hands it to pyarrow: a string column and
    three list<double> columns (Python floats from .tolist()), pandas' schema metadata."""
    rng = random.Random(rows)
    table = pa.table({
        "image_hash": [hashlib.sha256(str(i).encode()).hexdigest() for i in range(rows)],
        "prompt_embeds": pa.array([[rng.gauss(0, 1) for _ in range(seq * dim)] for _ in range(rows)],
                                  pa.list_(pa.float64())),
        "pooled_prompt_embeds": pa.array([[rng.gauss(0, 1) for _ in range(dim)] for _ in range(rows)],
                                         pa.list_(pa.float64())),
        "text_ids": pa.array([[0.0] * (seq * 3) for _ in range(rows)], pa.list_(pa.float64())),
    })
    return table.replace_schema_metadata({b"pandas": b'{"index_columns": [], "columns": []}'})


def parquet_bytes(table: object, **options: object) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **options)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("options", [
    {}, {"compression": "none"}, {"compression": "zstd", "row_group_size": 2},
    {"use_dictionary": False, "version": "1.0"}, {"data_page_version": "2.0"},
])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_a_healthy_file_reads_as_pyarrow_reads_it(rows: int, options: dict) -> None:
    data = parquet_bytes(embeddings_table(rows), **options)
    meta = read_bytes(data, "embeddings.parquet")
    assert (meta.format, meta.errors) == (PARQUET, ())
    footer = pq.read_metadata(pa.BufferReader(data))
    assert int(meta.metadata["rows"]) == footer.num_rows == rows
    assert int(meta.metadata["row_groups"]) == footer.num_row_groups
    assert meta.metadata["columns"].split(",")[:2] == ["image_hash", "prompt_embeds"]


def test_the_research_project_s_cache_is_no_foreign_file_and_a_cut_one_is_cd101(tmp_path: Path) -> None:
    cache = tmp_path / "flux_lora_quantization"
    cache.mkdir()
    path = cache / "embeddings.parquet"
    data = parquet_bytes(embeddings_table(6))
    path.write_bytes(data)
    assert scan_paths(cache).findings == ()
    assert scan_paths(path).findings == ()
    path.write_bytes(data[: len(data) * 2 // 3])  # a copy or a write that stopped
    with pytest.raises(pa.ArrowInvalid):
        pq.read_table(path)
    (finding,) = scan_paths(cache).findings
    assert (finding.code, finding.path) == ("CD101", str(path))
    assert "closing PAR1 magic" in finding.message


def test_a_damaged_footer_is_an_error_and_garbage_never_raises() -> None:
    data = parquet_bytes(embeddings_table(5), row_group_size=2)
    length = int.from_bytes(data[-8:-4], "little")
    bad_length = data[:-8] + (len(data)).to_bytes(4, "little") + b"PAR1"
    assert "does not fit" in read_bytes(bad_length, "e.parquet").errors[0]
    # the footer's bytes overwritten with zeros: a struct that ends at once, no rows or schema
    zeroed = data[: len(data) - 8 - length] + bytes(length) + data[-8:]
    assert read_bytes(zeroed, "e.parquet").errors
    rng = random.Random(7)
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data) - 8 - length, len(data) - 8)
            mutated[at] = rng.randrange(256)
        meta = read_bytes(bytes(mutated), "e.parquet")  # never raises
        assert meta.format == PARQUET


def test_a_parquet_name_promises_a_cache_file(tmp_path: Path) -> None:
    """`.parquet` is a cache name, as `.arrow` is: an empty one is CD102 and bytes that are no
    Parquet under it are CD101 (not a foreign file, CD107); a healthy one draws nothing."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "embeddings.parquet").write_bytes(parquet_bytes(embeddings_table(3)))
    (cache / "empty.parquet").write_bytes(b"")
    (cache / "text.parquet").write_bytes(b"image_hash,prompt_embeds\n")
    found = {(f.code, Path(f.path).name) for f in scan_paths(cache).findings}
    assert found == {("CD102", "empty.parquet"), ("CD101", "text.parquet")}


def test_a_footer_of_one_long_boolean_list_is_bounded() -> None:
    """A list of booleans was decoded a byte at a time without counting toward MAX_ITEMS: a
    64 MiB footer of one such list took half a minute and half a GiB. Now each counts."""
    import time

    n = 4_000_000
    varint, v = b"", n
    while v >= 0x80:
        varint, v = varint + bytes([v & 0x7F | 0x80]), v >> 7
    footer = b"\x19\xf1" + varint + bytes([v]) + b"\x01" * n + b"\x00"  # field 1: list<bool>
    data = b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1"
    started = time.perf_counter()
    meta = read_bytes(data, "x.parquet")
    assert time.perf_counter() - started < 1
    assert "too many" in meta.errors[0]
