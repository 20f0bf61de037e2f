"""Exit policy and configuration: --fail-on, selection, severity, thresholds, config files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachedoctor import config as configuration
from cachedoctor.options import Selection, resolve_selection

from conftest import invoke

CODES = ["CD101", "CD102", "CD104", "CD201", "CD501", "CD502"]


def _cache(root: Path, *defects: str) -> Path:
    """A cache holding an error (empty file), a warning (temp file) and/or a foreign .txt
    file (a warning made info by the severity override the tests pass)."""
    cache = root / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    if "error" in defects:
        (cache / "empty.pt").write_bytes(b"")
    if "warning" in defects:
        (cache / "tmpabcd1234").write_bytes(b"x")
    if "info" in defects:
        (cache / "caption.txt").write_text("a photo\n")
    return cache


def _scan(*args: str):
    return invoke("scan", *args, "-j", "1", "--config", 'severity.CD107 = "info"')


@pytest.mark.parametrize(
    ("worst", "fail_on", "code"),
    [
        (worst, fail_on, int(rank[worst] >= rank[fail_on]))
        for rank in [{"info": 1, "warning": 2, "error": 3, "never": 4}]
        for worst in ("error", "warning", "info")
        for fail_on in ("error", "warning", "info", "never")
    ],
)
def test_exit_code_for_every_fail_on_level(worst: str, fail_on: str, code: int, tmp_path: Path,
                                           monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path, worst)
    result = _scan("cache", "--fail-on", fail_on, "--format", "json")
    assert result.exit_code == code, result.stdout
    assert [f["severity"] for f in json.loads(result.stdout)["findings"]] == [worst]


def test_default_fail_on_is_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path, "warning")
    assert _scan("cache").exit_code == 0
    _cache(tmp_path, "error")
    assert _scan("cache").exit_code == 1


def test_clean_cache_passes_even_at_info(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path)
    assert _scan("cache", "--fail-on", "info").exit_code == 0


@pytest.mark.parametrize(
    ("layers", "enabled"),
    [
        ([], CODES),
        ([Selection(select=("CD1",))], ["CD101", "CD102", "CD104"]),
        ([Selection(select=("CD1",), ignore=("CD10",), extend_select=("CD104",))], ["CD104"]),
        ([Selection(ignore=("CD5",))], ["CD101", "CD102", "CD104", "CD201"]),
        # a flag's --select starts afresh: the file's ignore no longer applies
        ([Selection(ignore=("CD201",)), Selection(select=("CD2",))], ["CD201"]),
        # a flag's --extend-select beats the file's ignore, and its --ignore the file's select
        ([Selection(ignore=("CD2",)), Selection(extend_select=("CD201",))], [c for c in CODES]),
        ([Selection(select=("CD201",)), Selection(ignore=("CD2",))], []),
        ([Selection(select=("CD5",), ignore=("CD502",)), Selection(extend_select=("CD1",))],
         ["CD101", "CD102", "CD104", "CD501"]),
    ],
)
def test_selection_layers_resolve_like_ruff(layers, enabled) -> None:
    assert resolve_selection(layers, CODES) == enabled


def test_select_and_ignore_flags(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path, "error", "warning", "info")
    codes = lambda *a: {f["code"] for f in json.loads(_scan("cache", "--format", "json", *a).stdout)["findings"]}  # noqa: E731
    assert codes() == {"CD102", "CD104", "CD107"}
    assert codes("--select", "CD10", "--ignore", "CD107") == {"CD102", "CD104"}
    assert codes("--select", "cd102,CD107") == {"CD102", "CD107"}
    assert codes("--ignore", "CD1", "--extend-select", "CD104") == {"CD104"}
    assert codes("--ignore", "CD") == set()


def _pyproject(directory: Path, body: str) -> Path:
    path = directory / "pyproject.toml"
    path.write_text(f'[project]\nname = "x"\n\n[tool.cachedoctor]\n{body}\n')
    return path


def test_pyproject_is_found_from_a_subdirectory(tmp_path: Path, monkeypatch) -> None:
    _cache(tmp_path, "warning")
    _pyproject(tmp_path, 'fail-on = "warning"')
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "sub" / "deeper")
    assert invoke("scan", str(tmp_path / "cache")).exit_code == 1
    assert invoke("scan", str(tmp_path / "cache"), "--isolated").exit_code == 0


def test_flags_win_over_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path, "error", "warning")
    _pyproject(tmp_path, 'fail-on = "warning"\nignore = ["CD102"]\nseverity = { CD104 = "error" }')
    result = invoke("scan", "cache", "--format", "json")
    assert result.exit_code == 1
    assert [(f["code"], f["severity"]) for f in json.loads(result.stdout)["findings"]] == [("CD104", "error")]
    assert invoke("scan", "cache", "--fail-on", "never").exit_code == 0
    flagged = invoke("scan", "cache", "--format", "json", "--select", "CD102",
                     "--config", 'severity.CD102 = "warning"', "--fail-on", "error")
    assert [(f["code"], f["severity"]) for f in json.loads(flagged.stdout)["findings"]] == [("CD102", "warning")]
    assert flagged.exit_code == 0


def test_cachedoctor_toml_wins_over_pyproject_in_one_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path, "warning")
    _pyproject(tmp_path, 'fail-on = "never"')
    (tmp_path / "cachedoctor.toml").write_text('fail-on = "warning"\n')
    assert configuration.find() == tmp_path / "cachedoctor.toml"
    assert invoke("scan", "cache").exit_code == 1


def test_pyproject_without_the_table_is_passed_over(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "cachedoctor.toml").write_text('fail-on = "warning"\n')
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "pyproject.toml").write_text('[tool.ruff]\nline-length = 99\n')
    monkeypatch.chdir(tmp_path / "project")
    assert configuration.find() == tmp_path / "cachedoctor.toml"


def test_config_flag_names_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path, "warning")
    (tmp_path / "strict.toml").write_text('fail-on = "warning"\n')
    assert invoke("scan", "cache").exit_code == 0
    assert invoke("scan", "cache", "--config", "strict.toml").exit_code == 1
    assert invoke("scan", "cache", "--config", 'fail-on = "info"').exit_code == 1


def test_rule_thresholds_from_the_file(cache: Path, tmp_path: Path, monkeypatch) -> None:
    from cachedoctor.fixtures import BUILDERS

    monkeypatch.chdir(tmp_path)
    BUILDERS["CD201"](cache, batch_size=4)
    count = lambda: len(json.loads(invoke("scan", "cache", "--format", "json", "-j", "1").stdout)["findings"])  # noqa: E731
    found = count()
    assert found > 0
    _pyproject(tmp_path, "[tool.cachedoctor.rules.CD201]\nmin-ratio = 5")
    assert count() == 0
    _pyproject(tmp_path, "[tool.cachedoctor.rules.CD201]\nmin-wasted-bytes = 100_000_000")
    assert count() == 0
    (tmp_path / "pyproject.toml").unlink()
    assert count() == found


def test_exclude_globs_are_relative_to_the_file(tmp_path: Path, monkeypatch) -> None:
    _cache(tmp_path, "error", "warning")
    (tmp_path / "cachedoctor.toml").write_text('exclude = ["cache/tmp*"]\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = invoke("scan", str(tmp_path / "cache"), "--format", "json")
    assert [f["code"] for f in json.loads(result.stdout)["findings"]] == ["CD102"]
    result = invoke("scan", str(tmp_path / "cache"), "--format", "json", "--exclude", "*.pt")
    assert json.loads(result.stdout)["findings"] == []


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('fail_on = "warning"', "tool.cachedoctor.fail_on: unknown key"),
        ('fail-on = "sometimes"', "tool.cachedoctor.fail-on: expected one of"),
        ('select = "CD1"', "tool.cachedoctor.select: expected a list of strings"),
        ('ignore = ["CD9"]', "tool.cachedoctor.ignore: 'CD9' is no rule code, prefix or name"),
        ("deep = 1", "tool.cachedoctor.deep: expected true or false"),
        ('severity = { CD201 = "fatal" }', "tool.cachedoctor.severity.CD201: expected error, warning, info or off"),
        ('severity = { CD999 = "error" }', "tool.cachedoctor.severity.CD999: no rule 'CD999'"),
        ('rules.CD201.min-ratio = "2"', "tool.cachedoctor.rules.CD201.min-ratio: expected float"),
        ("rules.CD201.ratio = 2.0", "tool.cachedoctor.rules.CD201.ratio: CD201 has no such setting"),
        ("rules.CD104.stale-lock-seconds = -1", "tool.cachedoctor.rules.CD104.stale-lock-seconds: must not be"),
        ("fail-on = ", "invalid TOML"),
        # what tomllib raises besides TOMLDecodeError (the file may have come with a cache)
        ("x = " + "[" * 100_000 + "]" * 100_000, "invalid TOML: nested too deeply"),
        ("x = " + "9" * 5000, "invalid TOML: Exceeds the limit (4300 digits)"),
    ],
)
def test_bad_config_is_one_line_naming_file_and_key(body: str, key: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = _pyproject(tmp_path, body)
    result = invoke("scan", ".")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"cachedoctor: error: {path}: ")
    assert key in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_inline_override_and_two_config_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text("")
    (tmp_path / "b.toml").write_text("")
    assert "neither a file nor a TOML" in invoke("scan", ".", "--config", "missing.toml").stderr
    assert "one config file at most" in invoke("scan", ".", "--config", "a.toml", "--config", "b.toml").stderr
    assert "exclude each other" in invoke("scan", ".", "--config", "a.toml", "--isolated").stderr


# --- the policy is visible: which config applied, and what it switched off ---------------------

def _poisoned(tmp_path: Path) -> Path:
    from fixtures import BUILDERS

    cache = tmp_path / "cache"
    BUILDERS["CD105"](cache, marker=tmp_path / "PAYLOAD_RAN")
    return cache


def _policy(*args: str) -> tuple[dict, str]:
    result = invoke("scan", "cache", "-j", "1", "--format", "json", *args)
    return json.loads(result.stdout), result.stderr


def test_a_discovered_config_that_hides_cd105_is_named_and_warned_about(tmp_path: Path,
                                                                         monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    _poisoned(tmp_path)
    (tmp_path / "cachedoctor.toml").write_text('ignore = ["CD1"]\n')
    text = invoke("scan", "cache", "-j", "1")
    assert text.exit_code == 0 and "CD105" not in text.stdout  # the config hid it ...
    config = str(tmp_path / "cachedoctor.toml")
    assert f"cachedoctor: config: {config}; switched off: CD101, CD102" in text.stderr
    assert (f"cachedoctor: warning: CD105 (unsafe-pickle) is switched off by {config}"
            in text.stderr)  # ... and says so
    report, _ = _policy()
    assert report["version"] == 1 and report["findings"] == []
    assert report["policy"]["configs"] == [config] and report["policy"]["isolated"] is False
    assert {"code": "CD105", "by": config} in report["policy"]["disabled"]
    assert [w.split(" ", 1)[0] for w in report["policy"]["warnings"]] == ["CD105"]
    sarif = json.loads(invoke("scan", "cache", "-j", "1", "--format", "sarif").stdout)
    [invocation] = sarif["runs"][0]["invocations"]
    assert invocation["executionSuccessful"] is True
    [note] = invocation["toolConfigurationNotifications"]
    assert note["level"] == "warning" and note["associatedRule"] == {"id": "CD105"}
    assert invocation["properties"]["configs"] == [config]
    github = invoke("scan", "cache", "-j", "1", "--format", "github").stdout
    assert github.startswith("::warning title=cachedoctor config::CD105 (unsafe-pickle)")
    junit = invoke("scan", "cache", "-j", "1", "--format", "junit").stdout
    assert 'name="cachedoctor.warning" value="CD105 (unsafe-pickle)' in junit
    isolated, stderr = _policy("--isolated")  # what the README recommends for foreign caches
    assert [f["code"] for f in isolated["findings"]] == ["CD105"] and stderr == ""
    assert isolated["policy"] == {"configs": [], "isolated": True, "disabled": [],
                                  "warnings": []}


@pytest.mark.parametrize(("args", "by"), [
    (("--config", 'ignore = ["CD"]'), "--config 'ignore = [\"CD\"]'"),
    (("--config", 'severity.CD105 = "off"'), "--config 'severity.CD105 = \"off\"'"),
    (("--config", 'select = ["CD2"]'), "--config 'select = [\"CD2\"]'"),
])
def test_every_way_a_config_switches_cd105_off_warns(args: tuple[str, ...], by: str,
                                                     tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path)
    report, stderr = _policy("--isolated", *args)
    assert {"code": "CD105", "by": by} in report["policy"]["disabled"]
    assert f"cachedoctor: warning: CD105 (unsafe-pickle) is switched off by {by}" in stderr
    assert report["policy"]["configs"] == [by]


def test_a_flag_that_switches_cd105_off_is_recorded_not_warned_about(tmp_path: Path,
                                                                     monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path)
    report, stderr = _policy("--isolated", "--ignore", "CD10")
    assert {"code": "CD105", "by": "the command line"} in report["policy"]["disabled"]
    assert report["policy"]["warnings"] == [] and stderr == ""


def test_a_named_config_file_is_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path)
    (tmp_path / "ci.toml").write_text('select = ["CD2"]\n')
    report, _ = _policy("--config", "ci.toml")
    path = str(tmp_path / "ci.toml")
    assert report["policy"]["configs"] == [path]
    assert [w.split(" ", 1)[0] for w in report["policy"]["warnings"]] == ["CD002", "CD105"]
    assert f"cachedoctor: config: {path}; switched off: CD001, CD002" in invoke(
        "scan", "cache", "-j", "1", "--config", "ci.toml").stderr


def test_a_rule_switched_back_on_is_not_reported_off(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path)
    path = _pyproject(tmp_path, 'ignore = ["CD1"]')
    report, stderr = _policy("--extend-select", "CD105")
    assert report["policy"]["configs"] == [f"{path} [tool.cachedoctor]"]
    disabled = [d["code"] for d in report["policy"]["disabled"]]
    assert "CD105" not in disabled and "CD101" in disabled
    assert "warning" not in stderr and report["policy"]["warnings"] == []


def test_the_api_report_carries_the_policy(tmp_path: Path, monkeypatch) -> None:
    import cachedoctor

    monkeypatch.chdir(tmp_path)
    cache = _cache(tmp_path, "error")
    (tmp_path / "cachedoctor.toml").write_text('severity = { CD002 = "off" }\n')
    report = cachedoctor.scan(cache, jobs=1)
    assert report.policy.configs == (str(tmp_path / "cachedoctor.toml"),)
    assert report.policy.disabled == (("CD002", str(tmp_path / "cachedoctor.toml")),)
    assert report.policy.warnings[0].startswith("CD002 (checker-error) is switched off")
    assert cachedoctor.scan(cache, jobs=1, isolated=True).policy.disabled == ()


def test_fix_prints_the_policy_it_runs_under(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _cache(tmp_path, "error")
    (tmp_path / "cachedoctor.toml").write_text('ignore = ["CD105"]\n')
    result = invoke("fix", "cache", "--dry-run")
    assert "cachedoctor: warning: CD105 (unsafe-pickle) is switched off by" in result.stderr


def test_a_config_that_is_no_regular_file_or_too_big_is_a_config_error(tmp_path: Path) -> None:
    """The API reads the config file it is given: a FIFO there neither hangs it nor is read,
    and a file past a config's size is refused from its stat."""
    import os

    import cachedoctor
    from cachedoctor import config

    fifo = tmp_path / "cachedoctor.toml"
    os.mkfifo(fifo)
    with pytest.raises(cachedoctor.ConfigError, match="not a regular file"):
        cachedoctor.scan(tmp_path, config=fifo)
    big = tmp_path / "big.toml"
    big.write_text("select = ['CD1']\n" + "#" * (config.MAX_CONFIG_BYTES + 1))
    with pytest.raises(cachedoctor.ConfigError, match="more than a cachedoctor config holds"):
        cachedoctor.scan(tmp_path, config=big)
