"""The command line as a user meets it: exit codes, one-line errors, no torch on scan."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cachedoctor.checks import RULES

from conftest import run_cli


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("cachedoctor ")


@pytest.mark.parametrize(
    "args",
    [
        ("scan", "/definitely/not/here"),
        ("scan", ".", "--format", "yaml"),
        ("scan", ".", "--fail-on", "sometimes"),
        ("scan", ".", "-j", "0"),
        ("scan", ".", "--no-such-flag"),
        ("explain", "CD999"),
    ],
)
def test_usage_errors_exit_2_with_one_line_and_no_traceback(args: tuple[str, ...], tmp_path: Path) -> None:
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip()


def test_missing_target_names_it(tmp_path: Path) -> None:
    result = run_cli("scan", str(tmp_path / "gone"))
    assert result.stderr.strip() == f"cachedoctor: error: {tmp_path / 'gone'}: no such file or directory"


def test_rules_lists_every_code() -> None:
    result = run_cli("rules")
    assert result.returncode == 0
    listed = [line.split()[0] for line in result.stdout.splitlines()]
    assert listed == list(RULES)


@pytest.mark.parametrize("code", list(RULES))
def test_explain_has_the_four_sections(code: str) -> None:
    result = run_cli("explain", code.lower())
    assert result.returncode == 0
    for section in ("## What it does", "## Why is this bad?", "## Example", "## Fix"):
        assert section in result.stdout, (code, section)


def test_explain_accepts_the_rule_name() -> None:
    assert run_cli("explain", "retained-batch-storage").stdout.startswith("CD201 retained-batch-storage")


def test_empty_dir_scans_clean(tmp_path: Path) -> None:
    result = run_cli("scan", str(tmp_path), "--format", "json")
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert report["summary"] == {"files": 0, "bytes": 0, "findings": {"error": 0, "warning": 0, "info": 0}}


def test_scan_never_imports_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"latent": torch.zeros(4, 8, 8)[:2]}, tmp_path / "a.pt")
    torch.save(torch.zeros(4, 8, 8), tmp_path / "b.pt", _use_new_zipfile_serialization=False)
    probe = (
        "import sys\n"
        "from cachedoctor.cli import app\n"
        "try:\n"
        f"    app(['scan', {str(tmp_path)!r}, '--format', 'json', '--deep', '-j', '2'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'scan imported torch'\n"
    )
    import subprocess

    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["files"] == 2
