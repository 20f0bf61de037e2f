"""The Python API: scan() returns data, preflight() raises CacheProblems; import stays cheap."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import cachedoctor
from cachedoctor.findings import Report


@pytest.fixture
def broken(cache: Path, monkeypatch) -> Path:
    monkeypatch.chdir(cache.parent)
    (cache / "empty.pt").write_bytes(b"")
    (cache / "tmpabcd1234").write_bytes(b"x")
    return cache


def test_import_is_cheap_and_never_imports_torch(broken: Path) -> None:
    probe = (
        "import sys, cachedoctor\n"
        "assert not any(m.startswith(('cachedoctor.', 'torch', 'rich')) for m in sys.modules), sorted(sys.modules)\n"
        f"report = cachedoctor.scan({str(broken)!r}, jobs=1, isolated=True)\n"
        "assert [f.code for f in report.findings] == ['CD102', 'CD104'], report\n"
        "try:\n"
        f"    cachedoctor.preflight({str(broken)!r}, jobs=1, isolated=True)\n"
        "except cachedoctor.CacheProblems:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_scan_returns_frozen_data(broken: Path) -> None:
    report = cachedoctor.scan(broken, jobs=1, isolated=True)
    assert isinstance(report, Report)
    assert [(f.code, str(f.severity)) for f in report.findings] == [("CD102", "error"), ("CD104", "warning")]
    with pytest.raises(AttributeError):
        report.findings[0].code = "CD999"  # type: ignore[misc]
    assert cachedoctor.scan([broken], select="CD104", isolated=True).counts == {"error": 0, "warning": 1, "info": 0}


def test_preflight_raises_with_the_human_summary(broken: Path) -> None:
    with pytest.raises(cachedoctor.CacheProblems) as raised:
        cachedoctor.preflight(broken, jobs=1, isolated=True)
    message = str(raised.value)
    assert message.splitlines()[0] == f"cachedoctor found problems at or above 'error' in {broken}:"
    assert "cache/empty.pt: CD102 error [cache] empty file" in message
    assert "2 files, 1 B · 1 error, 1 warning, 0 info" in message
    assert "cachedoctor explain CD102" in message
    assert raised.value.report.counts["error"] == 1
    copy = pickle.loads(pickle.dumps(raised.value))
    assert str(copy) == message and copy.report == raised.value.report


def test_preflight_returns_the_report_below_fail_on(broken: Path) -> None:
    report = cachedoctor.preflight(broken, ignore=["CD102"], jobs=1, isolated=True)
    assert [f.code for f in report.findings] == ["CD104"]
    with pytest.raises(cachedoctor.CacheProblems, match="at or above 'warning'"):
        cachedoctor.preflight(broken, fail_on="warning", ignore="CD102", jobs=1, isolated=True)
    assert cachedoctor.preflight(broken, fail_on="never", jobs=1, isolated=True).counts["error"] == 1


def test_preflight_takes_policy_from_the_config_file(broken: Path) -> None:
    (broken.parent / "cachedoctor.toml").write_text('fail-on = "never"\nseverity = { CD102 = "info" }\n')
    report = cachedoctor.preflight(broken, jobs=1)
    assert [str(f.severity) for f in report.findings] == ["info", "warning"]
    with pytest.raises(cachedoctor.CacheProblems):
        cachedoctor.preflight(broken, fail_on="info", jobs=1)
    with pytest.raises(cachedoctor.CacheProblems):
        cachedoctor.preflight(broken, isolated=True, jobs=1)


def test_bad_options_raise_clear_errors(broken: Path) -> None:
    with pytest.raises(cachedoctor.ConfigError, match="select: 'CD9' is no rule"):
        cachedoctor.scan(broken, select=["CD9"], isolated=True)
    with pytest.raises(cachedoctor.ConfigError, match="fail-on: expected one of"):
        cachedoctor.preflight(broken, fail_on="sometimes", isolated=True)
    with pytest.raises(cachedoctor.ConfigError, match=r"rules\.CD201\.min-ratio: expected float"):
        cachedoctor.scan(broken, rules={"CD201": {"min-ratio": "high"}}, isolated=True)
    with pytest.raises(cachedoctor.ConfigError, match=r"rules\.CD201 must be a mapping"):
        cachedoctor.scan(broken, rules={"CD201": 5}, isolated=True)  # (was a TypeError)
    with pytest.raises(cachedoctor.ConfigError, match="severity must be a mapping"):
        cachedoctor.scan(broken, severity=5, isolated=True)  # (was an AttributeError)
    with pytest.raises(TypeError):
        cachedoctor.scan(broken, selct=["CD1"])
    with pytest.raises(cachedoctor.TargetError):
        cachedoctor.scan(broken / "missing", isolated=True)
    with pytest.raises(cachedoctor.TargetError, match="holds a NUL byte"):  # os.lstat: ValueError
        cachedoctor.scan(f"{broken}/a\0b", isolated=True)


def test_baseline_and_settings_through_the_api(broken: Path, tmp_path: Path) -> None:
    from cachedoctor.baseline import write

    write(cachedoctor.scan(broken, isolated=True, jobs=1), str(tmp_path / "b.json"))
    (broken / "also_empty.pt").write_bytes(b"")
    report = cachedoctor.scan(broken, baseline=tmp_path / "b.json", isolated=True, jobs=1)
    assert [Path(f.path).name for f in report.findings] == ["also_empty.pt"]
