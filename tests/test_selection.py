"""One selection mechanism: --select/--extend-select/--ignore, the config file's keys, `--config`
overrides and the API's keywords are resolved once (options.resolve_selection, run by
config.policy) into the set of enabled rules, ScanOptions.selected, which scan, fix and preflight
all obey."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import cachedoctor
import cachedoctor.config as config
import cachedoctor.engine as engine
from cachedoctor.checks import RULES
from cachedoctor.options import ScanOptions

from conftest import invoke

# select CD10, ignore CD107: CD102 (the empty file) and CD104 (the temp file) stay on
CHOSEN = frozenset(code for code in RULES if code.startswith("CD10") and code != "CD107")


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working dir, with a cache holding an error (CD102), a warning (CD104) and an
    info finding (CD107) that the selection leaves out."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "empty.pt").write_bytes(b"")
    (cache / "tmpabcd1234").write_bytes(b"x")
    (cache / "caption.txt").write_text("a photo")
    monkeypatch.chdir(tmp_path)
    assert {f.code for f in cachedoctor.scan("cache", isolated=True, jobs=1).findings} == \
        {"CD102", "CD104", "CD107"}
    return tmp_path


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[frozenset[str] | None]:
    """The enabled rules of every scan the engine runs, whoever asked for it."""
    seen: list[frozenset[str] | None] = []
    real = engine.scan

    def recorded(targets, options=None, **kwargs):
        seen.append(options.selected if options is not None else None)
        return real(targets, options, **kwargs)

    monkeypatch.setattr(engine, "scan", recorded)
    return seen


def _cli_codes(*args: str) -> set[str]:
    result = invoke("scan", "cache", "--format", "json", "--fail-on", "never", "--jobs", "1", *args)
    assert result.exit_code == 0, result.output
    return {f["code"] for f in json.loads(result.stdout)["findings"]}


def _fix_plans(*args: str) -> str:
    result = invoke("fix", "cache", "--dry-run", "--jobs", "1", *args)
    assert result.exit_code == 0, result.output
    return result.stdout


def _api_codes(report: cachedoctor.Report) -> set[str]:
    return {f.code for f in report.findings}


def test_flags_a_config_file_overrides_and_keywords_enable_the_same_rules(
        tree: Path, scans: list) -> None:
    found = [
        _cli_codes("--isolated", "--select", "CD10", "--ignore", "CD107"),
        _cli_codes("--isolated", "--config", 'select = ["CD10"]', "--config", 'ignore = ["CD107"]'),
        _api_codes(cachedoctor.scan("cache", select="CD10", ignore=["CD107"], isolated=True, jobs=1)),
        _api_codes(cachedoctor.preflight("cache", fail_on="never", select=["CD10"], ignore="CD107",
                                         isolated=True, jobs=1)),
    ]
    _fix_plans("--select", "CD10", "--ignore", "CD107")
    (tree / "cachedoctor.toml").write_text('select = ["CD10"]\nignore = ["CD107"]\n')
    found += [_cli_codes(), _api_codes(cachedoctor.scan("cache", jobs=1))]
    _fix_plans()

    assert found == [{"CD102", "CD104"}] * 6
    assert scans == [CHOSEN] * 8


def test_what_the_one_resolver_decides_is_what_every_path_runs(
        tree: Path, scans: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the resolver made to drop CD102, no path reports it, though each selects it."""
    real = config.resolve_selection
    monkeypatch.setattr(config, "resolve_selection",
                        lambda layers, codes: [c for c in real(layers, codes) if c != "CD102"])
    assert "Nothing to fix." in _fix_plans("--select", "CD102")
    assert _cli_codes("--isolated", "--select", "CD102", "--extend-select", "CD104") == {"CD104"}
    assert _api_codes(cachedoctor.scan("cache", select="CD102", isolated=True, jobs=1)) == set()
    assert _api_codes(cachedoctor.preflight("cache", select="CD102", isolated=True, jobs=1)) == set()
    (tree / "cachedoctor.toml").write_text('select = ["CD102", "CD107"]\n')
    assert _cli_codes() == {"CD107"}
    assert scans[:4] == [frozenset(), frozenset({"CD104"}), frozenset(), frozenset()]
    assert scans[4] == frozenset({"CD107"})


def test_the_enabled_rules_cross_into_worker_processes() -> None:
    options = ScanOptions(jobs=2, selected=CHOSEN)
    again = pickle.loads(pickle.dumps(options))
    assert again.selected == CHOSEN
    assert [c for c in RULES if again.enabled(c)] == [c for c in RULES if c in CHOSEN]
    assert all(ScanOptions().enabled(c) for c in RULES)  # no selection: every rule
    assert not any(ScanOptions(selected=frozenset()).enabled(c) for c in RULES)
