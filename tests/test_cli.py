"""The command line as a user meets it: exit codes, one-line errors, no torch on scan."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from cachedoctor.checks import RULES

from conftest import REPO, invoke, run_cli


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


def test_rules_lists_every_code_under_a_header() -> None:
    result = run_cli("rules")
    assert result.returncode == 0
    header, *rows = result.stdout.splitlines()
    assert header.split()[:4] == ["code", "name", "severity", "fix"]
    assert [line.split()[0] for line in rows] == list(RULES)
    for line, rule in zip(rows, RULES.values(), strict=True):
        assert line.count("--deep") == (1 if rule.deep else 0), line


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


@pytest.mark.parametrize("args", [("scan",), ("explain",), ("demo",), ("harness", "verify")])
def test_a_missing_argument_is_one_line_on_stderr(args: tuple[str, ...], tmp_path: Path) -> None:
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("cachedoctor: error: Missing argument '")
    assert line.endswith(f"{' '.join(args)} --help`"), line


def test_an_unknown_flag_is_one_line_on_stderr(tmp_path: Path) -> None:
    result = run_cli("scan", ".", "--no-such-flag", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "--no-such-flag" in line


COMMANDS = [("scan",), ("fix",), ("undo",), ("rules",), ("explain",), ("demo",),
            ("harness", "list"), ("harness", "reproduce"), ("harness", "verify")]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_metavars_not_types(command: tuple[str, ...]) -> None:
    """Usage lines read as the README writes them: `TARGET...`, `--format FORMAT`, never
    typer's `{targets}...` or `<str>`."""
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert not re.search(r"<\w+>|\{\w+\}", result.stdout), result.stdout
    assert not re.search(r"--[A-Z]", result.stdout), result.stdout  # a metavar never renames an option
    usage = result.stdout.splitlines()[0]
    assert re.fullmatch(r"Usage: \S+ [a-z ]+ \[OPTIONS\]( \[?[A-Z_|a-z.]+\]?)*", usage), usage


def test_scan_help_names_its_targets() -> None:
    usage = invoke("scan", "--help").stdout.splitlines()[0]
    assert usage.split(" ", 2)[2] == "scan [OPTIONS] TARGET..."  # after `Usage: <prog>`


def test_fix_takes_what_scan_takes_and_help_and_readme_say_so(tmp_path: Path, monkeypatch) -> None:
    """fix resolves its targets as scan does: a trainer config (or project folder) works, and
    both its --help and the README's usage line say so."""
    from cachedoctor.fixtures.projects import simpletuner

    project = simpletuner.build(tmp_path, {"CD405"})
    monkeypatch.chdir(tmp_path)
    for target in (project.config, project.root):
        result = invoke("fix", str(target), "--dry-run")
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "CD405" in result.stdout
    helped = " ".join(invoke("fix", "--help").stdout.split())
    assert "cache dirs, cache files, trainer configs or project folders" in helped
    readme = (REPO / "README.md").read_text()
    usages = [line for line in readme.splitlines() if line.startswith("cachedoctor fix TARGET...  ")]
    assert usages
    for usage in usages:
        assert "trainer configs" in usage and "project folders" in usage, usage


def test_the_missing_encoder_error_puts_the_stand_in_last(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    missing = invoke("fix", str(tmp_path / "cache"), "--reencode", "--dry-run").stderr
    unknown = invoke("fix", str(tmp_path / "cache"), "--reencode", "--encoder", "nope", "--dry-run").stderr
    for message in (missing, unknown):
        kinds = [message.index(k) for k in ("diffusers:PATH", "module:callable", "reference")]
        assert kinds == sorted(kinds), message
        assert "never on a real cache" in message


@pytest.mark.parametrize("flag", ["--select", "--ignore", "--extend-select"])
def test_rule_names_select_and_ignore(flag: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "empty.pt").write_bytes(b"")
    (tmp_path / "cache" / "tmpabcd1234").write_bytes(b"x")
    by_name = invoke("scan", "cache", "--isolated", "--format", "json", flag, "empty-file")
    by_code = invoke("scan", "cache", "--isolated", "--format", "json", flag, "CD102")
    assert by_name.exit_code == by_code.exit_code
    assert json.loads(by_name.stdout)["findings"] == json.loads(by_code.stdout)["findings"]
    codes = {f["code"] for f in json.loads(by_name.stdout)["findings"]}
    assert codes == ({"CD104"} if flag == "--ignore" else {"CD102"} if flag == "--select" else {"CD102", "CD104"})


def test_rule_names_in_a_config_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "empty.pt").write_bytes(b"")
    (tmp_path / "cache" / "tmpabcd1234").write_bytes(b"x")
    (tmp_path / "cache" / "caption.txt").write_text("a photo")
    (tmp_path / "cachedoctor.toml").write_text(
        'select = ["empty-file", "interrupted-write", "foreign-file"]\n'
        'ignore = ["foreign-file"]\n'
        '[severity]\ninterrupted-write = "error"\n'
        '[rules.interrupted-write]\nstale-lock-seconds = 10\n')
    result = invoke("scan", "cache", "--format", "json")
    found = {f["code"]: f["severity"] for f in json.loads(result.stdout)["findings"]}
    assert found == {"CD102": "error", "CD104": "error"}


def test_an_unknown_rule_name_is_named_as_given(tmp_path: Path) -> None:
    result = run_cli("scan", str(tmp_path), "--isolated", "--select", "retained-batch-stor")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "'retained-batch-stor' is no rule code, prefix or name" in line
