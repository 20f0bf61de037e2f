"""Arrow IPC caches (🤗 datasets, the diffusers text-to-image scripts): the reader against
pyarrow, the files a killed map leaves, and damaged bytes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cachedoctor.fixtures import hf_datasets
from cachedoctor.formats import read_bytes, read_path
from cachedoctor.formats.meta import ARROW

from conftest import codes, scan_paths

pa = pytest.importorskip("pyarrow")


def _pyarrow_rows(data: bytes) -> int:
    return pa.ipc.open_stream(data).read_all().num_rows


@pytest.mark.parametrize("rows", [0, 1, 4, 10])
def test_counts_what_pyarrow_reads(rows: int) -> None:
    data = hf_datasets.stream(rows)
    meta = read_bytes(data, "cache-x.arrow")
    assert (meta.format, meta.errors) == (ARROW, ())
    assert int(meta.metadata["rows"]) == _pyarrow_rows(data) == rows
    assert int(meta.metadata["record_batches"]) == -(-rows // hf_datasets.WRITER_BATCH_SIZE)


def test_arrow_file_format_and_its_truncation() -> None:
    table = pa.table({"x": [[1.0, 2.0]] * 5, "s": pa.array(["a"] * 5).dictionary_encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    data = sink.getvalue().to_pybytes()
    meta = read_bytes(data, "data-00000-of-00001.arrow")
    assert meta.errors == () and meta.metadata["rows"] == "5"
    assert "closing ARROW1 magic" in read_bytes(data[:-1], "a.arrow").errors[0]


def test_a_stream_cut_at_a_message_boundary_is_an_error_pyarrow_does_not_raise() -> None:
    """The silent case: pyarrow loads the rows that are there; only the missing end-of-stream
    marker tells that the writer never finished."""
    data = hf_datasets.stream(10, close=False)
    assert _pyarrow_rows(data) == 10  # no error from pyarrow, whatever was to follow
    (error,) = read_bytes(data, "cache-x.arrow").errors
    assert "without its end-of-stream marker after 3 record batches (10 rows)" in error


def test_a_stream_cut_inside_a_body_names_the_message() -> None:
    data = hf_datasets.stream(10)
    cut = data[: len(data) - 100]
    with pytest.raises(OSError, match="for message body"):
        _pyarrow_rows(cut)
    (error,) = read_bytes(cut, "cache-x.arrow").errors
    assert "(a record batch)" in error and "truncated" in error


def test_a_clean_datasets_cache_dir_has_no_findings(tmp_path: Path) -> None:
    hf_datasets.build_clean(tmp_path / "cache")
    assert scan_paths(tmp_path / "cache").findings == ()


def test_a_killed_map_leaves_a_temp_file_and_a_cut_copy_is_cd101(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    hf_datasets.build_clean(cache)
    temp = hf_datasets.killed_map(cache)
    report = scan_paths(cache)
    assert {(f.code, Path(f.path)) for f in report.findings} == {("CD104", temp)}
    # the same bytes under the cache's own name (a copy or sync that stopped there)
    copied = cache / "cache-77aa01e3b2c4d5f6.arrow"
    temp.rename(copied)
    (finding,) = scan_paths(cache).findings
    assert (finding.code, finding.path) == ("CD101", str(copied))


def test_garbage_and_damaged_arrow_never_raise(tmp_path: Path) -> None:
    rng = random.Random(7)
    base = hf_datasets.stream(10)
    for _ in range(2000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        meta = read_bytes(bytes(data), "cache-x.arrow")
        assert meta.format in (ARROW, "empty")
    (tmp_path / "junk.arrow").write_bytes(b"\xff\xff\xff\xff" + b"\x08\x00\x00\x00" + b"\xff" * 8)
    assert read_path(str(tmp_path / "junk.arrow")).errors
    assert codes(scan_paths(tmp_path)) == {"CD101"}
