"""Hostile and broken input, end to end through the CLI: a finding or a one-line error,
never a traceback, a hang, or code execution."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import pytest

from conftest import run_cli, scan_paths

torch = pytest.importorskip("torch")


def _json_scan(*args: str, cwd: Path | None = None) -> tuple[int, dict, str]:
    result = run_cli("scan", "--format", "json", *args, cwd=cwd, timeout=120)
    assert "Traceback" not in result.stderr + result.stdout
    return result.returncode, (json.loads(result.stdout) if result.stdout else {}), result.stderr


def test_every_truncation_of_a_real_file_is_cd101_or_cd102(tmp_path: Path) -> None:
    buffer_path = tmp_path / "whole.pt"
    torch.save({"latent": torch.randn(4, 8, 8).half()}, buffer_path)
    data = buffer_path.read_bytes()
    buffer_path.unlink()
    cache = tmp_path / "cache"
    cache.mkdir()
    for end in range(0, len(data), 7):
        (cache / f"cut_{end:05d}.pt").write_bytes(data[:end])
    report = scan_paths(cache)
    by_path = {Path(f.path).name: f.code for f in report.findings}
    assert by_path.pop("cut_00000.pt") == "CD102"
    assert set(by_path.values()) == {"CD101"}
    assert len(by_path) == len(range(7, len(data), 7))


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_hostile_and_pathological_pickles(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    marker = tmp_path / "PAYLOAD_RAN"
    (cache / "evil.pkl").write_bytes(pickle.dumps({"x": Payload(marker)}, protocol=0))
    (cache / "evil4.pt").write_bytes(pickle.dumps([Payload(marker)], protocol=4))
    # 100k nested lists, a self-referencing list, and a memo index asking for gigabytes
    (cache / "nested.pkl").write_bytes(b"\x80\x02" + b"]" * 100_000 + b"e" * 99_999 + b".")
    (cache / "selfref.pkl").write_bytes(pickle.dumps((lambda a: (a.append(a), a)[1])([]), 2))
    (cache / "memo.pkl").write_bytes(b"\x80\x02N" + b"r" + struct.pack("<I", 2**31) + b".")
    (cache / "bytes8.pkl").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"x")
    code, report, _ = _json_scan(str(cache))
    assert code == 1
    found = {Path(f["path"]).name: f["code"] for f in report["findings"]}
    assert found["evil.pkl"] == "CD105" and found["evil4.pt"] == "CD105"
    assert {found.get(n) for n in ("nested.pkl", "memo.pkl", "bytes8.pkl")} <= {"CD101", None}
    assert not marker.exists()


def test_safetensors_with_a_100_gb_header_length(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "huge.safetensors").write_bytes(struct.pack("<Q", 100 * 2**30) + b'{"a":1}')
    code, report, _ = _json_scan(str(cache))
    (finding,) = report["findings"]
    assert (code, finding["code"]) == (1, "CD101")
    assert "header too large" in finding["message"]


def test_garbage_zero_bytes_and_odd_names(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "garbage.pt").write_bytes(os.urandom(5000))
    (cache / "zeros.pt").write_bytes(bytes(34_000))
    (cache / "empty.safetensors").write_bytes(b"")
    (cache / "spaces and ünïcödé.pt").write_bytes(b"PK\x03\x04garbage")
    with open(os.fsencode(str(cache)) + b"/bad\xffname.npz", "wb") as f:
        f.write(b"\x93NUMPY")
    os.symlink("loop", cache / "loop")
    os.symlink(cache, cache / "up")
    code, report, _ = _json_scan(str(cache))
    found = sorted((Path(f["path"]).name, f["code"]) for f in report["findings"])
    assert code == 1
    assert found == [
        ("bad\\xffname.npz", "CD101"),
        ("empty.safetensors", "CD102"),
        ("garbage.pt", "CD101"),
        ("loop", "CD001"),
        ("spaces and ünïcödé.pt", "CD101"),
        ("up", "CD001"),
        ("zeros.pt", "CD101"),
    ]


def test_text_output_survives_undecodable_names(tmp_path: Path) -> None:
    with open(os.fsencode(str(tmp_path)) + b"/\xff.pt", "wb"):
        pass
    result = run_cli("scan", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "\\xff.pt: CD102" in result.stdout


def test_missing_target_is_exit_2(tmp_path: Path) -> None:
    code, report, err = _json_scan(str(tmp_path / "nope"))
    assert code == 2 and report == {} and err.count("\n") == 1
