"""safetensors files as other tools write them, read the way a scan reads them (the format is
sniffed first, then the header judged), each verdict the `safetensors` package's own."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from cachedoctor.formats import read_bytes

TENSOR = {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
DATA = struct.pack("<4f", 1, 2, 3, 4)


def _file(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + DATA


def _library_ok(path: Path) -> bool:
    try:
        with safe_open(str(path), "np") as f:
            return list(f.keys()) == ["t"]
    except Exception:
        return False


BODY = json.dumps(TENSOR).encode()
CASES = {
    "leading spaces": b"  " + BODY,
    "leading newline and tab": b"\n\t" + BODY,
    "trailing space padding (alignment)": BODY + b" " * 5,
    "trailing NUL padding": BODY + b"\0" * 5,
    "BOM": b"\xef\xbb\xbf" + BODY,
    "duplicate __metadata__ key, the last kept": b'{"__metadata__":{"a":"1","a":"2"},' + BODY[1:],
    "__metadata__ with a number": b'{"__metadata__":{"a":1},' + BODY[1:],
    "__metadata__ nested 100,000 deep": b'{"__metadata__":{"a":' + b"[" * 100_000 + b"]" * 100_000
                                        + b"}," + BODY[1:],
    "header length 0": b"",
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_scan_gives_the_librarys_verdict(tmp_path: Path, name: str) -> None:
    blob = _file(CASES[name])
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    meta = read_bytes(blob, str(path))
    assert meta.ok == _library_ok(path), meta.errors
    assert meta.format == "safetensors"
    if meta.ok:
        assert [t.storage_key for t in meta.tensors] == ["t"]
        if b"__metadata__" in CASES[name]:
            assert dict(meta.metadata) == {"a": "2"}  # serde keeps the last of duplicate keys
