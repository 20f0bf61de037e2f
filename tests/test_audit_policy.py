"""A config file that comes with a cache (or sits in a parent directory) must not quietly
silence the guard rules (CD105, CD002): every way it can is warned about."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import invoke, run_cli


def _poisoned(tmp_path: Path) -> Path:
    from fixtures import BUILDERS

    cache = tmp_path / "cache"
    BUILDERS["CD105"](cache, marker=tmp_path / "PAYLOAD_RAN")
    return cache


def test_a_config_that_lowers_cd105_below_error_warns(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    _poisoned(tmp_path)
    config = tmp_path / "cachedoctor.toml"
    config.write_text('severity = { CD105 = "info" }\n')

    text = invoke("scan", "cache", "-j", "1")

    assert text.exit_code == 0  # the run no longer fails on the hostile pickle ...
    assert (f"cachedoctor: warning: CD105 (unsafe-pickle) is lowered to info by {config}"
            in text.stderr)  # ... and says so
    report = json.loads(invoke("scan", "cache", "-j", "1", "--format", "json").stdout)
    assert [w.split(" ", 1)[0] for w in report["policy"]["warnings"]] == ["CD105"]


def test_a_guard_left_at_error_does_not_warn(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cachedoctor.toml").write_text('severity = { CD105 = "error", CD201 = "info" }\n')
    result = invoke("scan", "cache", "-j", "1")
    assert "cachedoctor.toml" in result.stderr and "warning:" not in result.stderr


def test_files_a_config_excludes_are_named_on_the_config_line(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    _poisoned(tmp_path)
    config = tmp_path / "cachedoctor.toml"
    config.write_text('exclude = ["unsafe*"]\n')

    text = invoke("scan", "cache", "-j", "1")

    assert "CD105" not in text.stdout  # the config hid the file ...
    assert f"cachedoctor: config: {config}; not checked: unsafe*" in text.stderr  # ... and says so
    flag = invoke("scan", "cache", "-j", "1", "--isolated", "--exclude", "unsafe*")
    assert flag.stderr == ""  # whoever typed the flag knows


def test_a_baseline_a_config_names_that_hides_cd105_warns(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    _poisoned(tmp_path)
    assert invoke("scan", "cache", "-j", "1", "--write-baseline", "known.json").exit_code == 0
    (tmp_path / "cachedoctor.toml").write_text('baseline = "known.json"\n')

    text = invoke("scan", "cache", "-j", "1")

    assert text.exit_code == 0 and "CD105" not in text.stdout  # the baseline hid it ...
    assert (f"cachedoctor: warning: CD105 (unsafe-pickle): 1 finding(s) hidden by the baseline "
            f"{tmp_path / 'known.json'}, named in a config file" in text.stderr)  # ... and says so
    typed = invoke("scan", "cache", "-j", "1", "--isolated", "--baseline", "known.json")
    assert typed.exit_code == 0 and "warning:" not in typed.stderr  # whoever typed it knows


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_baseline_that_is_no_regular_file_is_one_line_not_a_hang(kind: str, tmp_path: Path,
                                                                   monkeypatch) -> None:
    import os

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache").mkdir()
    if kind == "fifo":
        os.mkfifo(tmp_path / "known.json")  # no writer: reading it would wait for ever
    else:
        (tmp_path / "known.json").symlink_to("/dev/zero")  # endless: would fill memory
    (tmp_path / "cachedoctor.toml").write_text('baseline = "known.json"\n')

    result = run_cli("scan", "cache", "-j", "1", cwd=tmp_path, timeout=60)

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"cachedoctor: error: cannot read baseline {tmp_path / 'known.json'}: not a regular file"]
