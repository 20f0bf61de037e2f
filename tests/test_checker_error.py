"""No input aborts a run: a reader or rule that raises, or a worker that dies, costs one file
(or one dataset) a CD002 finding, and every other file is still judged. Every message is
bounded, whatever number a hostile header holds."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
from pathlib import Path

import pytest

from cachedoctor import engine
from cachedoctor.checks import RULES
from cachedoctor.findings import MAX_MESSAGE, Finding, Severity, bounded
from cachedoctor.reporters import json as json_reporter
from cachedoctor.units import digits, number
from fixtures import BUILDERS, clean

from conftest import by_code, run_cli, scan_paths

torch = pytest.importorskip("torch")


def _npy(path: Path, shape: str) -> Path:
    """A real .npy (numpy.save) whose header's shape is replaced by `shape`."""
    import numpy as np

    np.save(path, np.zeros((4, 8, 8), np.float32))
    data = path.read_bytes()
    size = int.from_bytes(data[8:10], "little")
    header = data[10:10 + size].decode("latin1").replace("(4, 8, 8)", shape).rstrip()
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    path.write_bytes(data[:8] + len(header).to_bytes(2, "little") + header.encode("latin1")
                     + data[10 + size:])
    return path


def _evil(cache: Path, tmp_path: Path) -> Path:
    return BUILDERS["CD105"](cache, marker=tmp_path / "PAYLOAD_RAN")[0]


def _raising_on(name: str, exc: BaseException):
    real = engine.read_entry

    def read(entry, deep, *rest):
        if os.path.basename(entry.path) == name:
            raise exc
        return real(entry, deep, *rest)

    return read


def test_a_reader_that_raises_costs_its_file_a_cd002_finding(cache: Path, tmp_path: Path,
                                                             monkeypatch) -> None:
    clean.build(cache, n=4)
    evil = _evil(cache, tmp_path)
    monkeypatch.setattr(engine, "read_entry",
                        _raising_on("latent_001.pt", OverflowError("x" * 10_000)))
    report = scan_paths(cache)
    [crashed] = by_code(report, "CD002")
    assert crashed.path == str(cache / "latent_001.pt")
    assert crashed.severity == Severity.ERROR and crashed.fix is None
    assert "OverflowError" in crashed.message and "cachedoctor bug" in crashed.message
    assert len(crashed.message) < 400  # the exception's text is cut, not the rest
    assert [f.path for f in by_code(report, "CD105")] == [str(evil)]
    assert report.files == 5 and report.exit_code() == 1
    assert {f.code for f in report.findings} == {"CD002", "CD105"}


def test_a_file_rule_that_raises_leaves_the_other_rules_judging_the_file(
        cache: Path, tmp_path: Path, monkeypatch) -> None:
    clean.build(cache, n=3)
    evil = _evil(cache, tmp_path)

    def boom(meta, ctx):
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    monkeypatch.setitem(RULES, "CD201", dataclasses.replace(RULES["CD201"], check_file=boom))
    report = scan_paths(cache)
    crashed = by_code(report, "CD002")
    assert len(crashed) == 4  # every file, each once
    assert all("running CD201" in f.message and "ValueError" in f.message for f in crashed)
    assert [f.path for f in by_code(report, "CD105")] == [str(evil)]


def test_a_dataset_rule_that_raises_costs_that_rule_only(cache: Path, tmp_path: Path,
                                                         monkeypatch) -> None:
    clean.build(cache, n=3)
    evil = _evil(cache, tmp_path)
    dataset_rules = [code for code, rule in RULES.items() if rule.check_dataset is not None]
    ran = []

    def boom(view, ctx):
        ran.append(ctx.dataset)
        yield from ()
        raise KeyError("bucket")

    def spy(code):
        real = RULES[code].check_dataset

        def check(view, ctx):
            ran.append(code)
            return real(view, ctx)
        return check

    monkeypatch.setitem(RULES, dataset_rules[0],
                        dataclasses.replace(RULES[dataset_rules[0]], check_dataset=boom))
    for code in dataset_rules[1:]:
        monkeypatch.setitem(RULES, code, dataclasses.replace(RULES[code], check_dataset=spy(code)))
    report = scan_paths(cache)
    [crashed] = by_code(report, "CD002")
    assert crashed.dataset == "cache" and crashed.path == str(cache)
    assert f"running {dataset_rules[0]} over the dataset" in crashed.message
    assert "KeyError" in crashed.message
    assert ran == ["cache", *dataset_rules[1:]]  # the rules after it still ran
    assert [f.path for f in by_code(report, "CD105")] == [str(evil)]


def _many_batches(cache: Path, monkeypatch, n: int = 12) -> list[Path]:
    """n clean files in batches of 2: enough batches that the scan starts a worker pool.
    Forked (pytest's process runs threads, so a scan would have a helper start them): the tests'
    stand-in readers reach the workers by inheritance."""
    monkeypatch.setattr(engine, "BATCH", 2)
    monkeypatch.setattr(engine, "pool_start", lambda: "fork")
    return clean.build(cache, n=n)


def test_under_jobs_2_a_raising_reader_costs_one_file(cache: Path, tmp_path: Path,
                                                      monkeypatch) -> None:
    _many_batches(cache, monkeypatch)
    evil = _evil(cache, tmp_path)
    monkeypatch.setattr(engine, "read_entry", _raising_on("latent_005.pt", MemoryError()))
    report = scan_paths(cache, jobs=2)
    assert [(f.path, "MemoryError" in f.message) for f in by_code(report, "CD002")] == [
        (str(cache / "latent_005.pt"), True)]
    assert [f.path for f in by_code(report, "CD105")] == [str(evil)]
    assert report.files == 13


def test_a_worker_killed_on_one_file_loses_no_other_verdict(cache: Path, tmp_path: Path,
                                                            monkeypatch) -> None:
    _many_batches(cache, monkeypatch)
    evil = _evil(cache, tmp_path)
    parent = os.getpid()
    real = engine.read_entry

    def read(entry, deep, *rest):  # the out-of-memory killer, in a worker only
        if os.path.basename(entry.path) == "latent_007.pt" and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(entry, deep, *rest)

    monkeypatch.setattr(engine, "read_entry", read)
    report = scan_paths(cache, jobs=2, keep_paths=True)
    [killed] = by_code(report, "CD002")
    assert killed.path == str(cache / "latent_007.pt")
    assert f"killed by signal {signal.SIGKILL}" in killed.message
    assert [f.path for f in by_code(report, "CD105")] == [str(evil)]
    assert report.files == 13 and len(report.checked) == 13  # each file counted once
    assert {f.code for f in report.findings} == {"CD002", "CD105"}


def test_a_finding_is_bounded_where_it_is_made() -> None:
    huge = 10 ** 5000 + 7  # past what str() of an int may print (4,300 digits by default)
    finding = Finding("CD101", "unreadable-archive", Severity.ERROR, "/c/a.npy",
                      f"shape [{'9' * 4000}, {format(10 ** 90, ',')}] " + "x" * 5000,
                      details={"shape": (4, huge), "note": "y" * 100_000, "ok": 2 ** 62,
                               "files": [f"/c/{i}.pt" for i in range(2000)]})
    assert "a 4,000-digit number" in finding.message and "a 91-digit number" in finding.message
    assert len(finding.message) <= MAX_MESSAGE
    assert finding.details["shape"] == (4, "a 5,001-digit number")
    assert finding.details["ok"] == 2 ** 62 and len(finding.details["files"]) == 2000
    assert len(finding.details["note"]) < 10_000
    json.dumps(finding.to_dict())  # a number JSON cannot print is gone
    assert bounded("CD201 wasted 1,234,567 bytes of 12345678") == \
        "CD201 wasted 1,234,567 bytes of 12345678"


def test_digits_counts_without_printing() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(10 ** rng.randrange(1, 4000))
        assert digits(n) == len(str(n)), n
    for k in (1, 30, 64, 400, 5000):
        assert digits(10 ** k) == k + 1 and digits(10 ** k - 1) == k
    assert number(123) == "123" and number(-10 ** 400) == "a negative 401-digit number"


@pytest.mark.parametrize("width", [400, 4000])
def test_a_huge_npy_shape_beside_a_poisoned_file(width: int, cache: Path, tmp_path: Path) -> None:
    """issue #11: a 400-digit shape aborted the run (exit 2), so the CD105 file beside it was
    neither reported nor quarantined."""
    big = _npy(cache / "big.npy", f"({'9' * width}, 4)")
    evil = _evil(cache, tmp_path)
    result = run_cli("scan", "--isolated", "--format", "json", str(cache), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    report = json.loads(result.stdout)
    found = {(f["path"], f["code"]) for f in report["findings"]}
    assert ("cache/unsafe_pickle.pt", "CD105") in found
    assert any(path == "cache/big.npy" for path, _ in found)
    assert all(len(f["message"]) <= MAX_MESSAGE and "9" * 40 not in json.dumps(f)
               for f in report["findings"])
    fixed = run_cli("fix", "--yes", str(cache), cwd=tmp_path)
    assert "Traceback" not in fixed.stderr
    assert not evil.exists(), fixed.stdout + fixed.stderr
    assert not big.exists()  # its CD101 is quarantined too
    assert not (tmp_path / "PAYLOAD_RAN").exists()


def test_json_reports_a_finding_made_elsewhere_with_a_huge_number() -> None:
    from cachedoctor.findings import Report

    finding = Finding("CD101", "unreadable-archive", Severity.ERROR, "/c/a.pt", "bad",
                      details={"stride": 10 ** 400})
    out = json_reporter.as_dict(Report.build(["/c"], [finding], 1, 1))
    assert out["findings"][0]["details"] == {"stride": "a 401-digit number"}


def test_a_stride_of_ten_to_the_400_beside_a_poisoned_file(cache: Path, tmp_path: Path) -> None:
    """issue #11: a real torch.save whose pickled stride is made 10**400 (a LONG1 in place of
    the first BININT1), zipped again with the other entries as they were."""
    import zipfile

    torch.save(torch.zeros(4, 8, 8), tmp_path / "whole.pt")
    with zipfile.ZipFile(tmp_path / "whole.pt") as whole:
        infos = whole.infolist()
        entries = {info.filename: whole.read(info) for info in infos}
    pkl = next(name for name in entries if name.endswith("/data.pkl"))
    big = 10 ** 400
    raw = big.to_bytes((big.bit_length() + 8) // 8, "little", signed=True)
    assert entries[pkl].count(b"K@K\x08K\x01\x87") == 1  # the (64, 8, 1) stride tuple
    entries[pkl] = entries[pkl].replace(b"K@", b"\x8a" + bytes([len(raw)]) + raw, 1)
    with zipfile.ZipFile(cache / "stride.pt", "w") as out:
        for info in infos:
            out.writestr(info, entries[info.filename])
    evil = _evil(cache, tmp_path)
    result = run_cli("scan", "--isolated", "--format", "json", "-j", "1", str(cache), cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    findings = json.loads(result.stdout)["findings"]
    assert {f["path"] for f in findings} == {"cache/stride.pt", "cache/unsafe_pickle.pt"}
    assert all(len(f["message"]) <= MAX_MESSAGE and "0" * 40 not in json.dumps(f)
               for f in findings)
    assert [f["path"] for f in findings if f["code"] == "CD105"] == [f"cache/{evil.name}"]


def test_a_layout_rule_that_raises_costs_that_rule_only(cache: Path, tmp_path: Path,
                                                        monkeypatch) -> None:
    clean.build(cache, n=2)
    evil = _evil(cache, tmp_path)
    layout_rules = [code for code, rule in RULES.items() if rule.check_layouts is not None]

    def boom(layouts, ctx):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(RULES, layout_rules[0],
                        dataclasses.replace(RULES[layout_rules[0]], check_layouts=boom))
    report = scan_paths(cache)
    [crashed] = by_code(report, "CD002")
    assert crashed.path == str(cache) and "RecursionError" in crashed.message
    assert f"running {layout_rules[0]} over the configs" in crashed.message
    assert [f.path for f in by_code(report, "CD105")] == [str(evil)]
