"""One baseline path: `cachedoctor scan` and the API's scan() and preflight() load a policy's
baseline and split the findings into new and known through the same functions, so they
agree on any tree."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import cachedoctor
import cachedoctor.baseline as baselines

from conftest import invoke


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project (the working dir) whose cache has an error, a warning and a stale lock
    recorded in a baseline, and one error the baseline does not know."""
    root = tmp_path / "project"
    cache = root / "cache"
    cache.mkdir(parents=True)
    (cache / "empty.pt").write_bytes(b"")
    (cache / "tmpabcd1234").write_bytes(b"x")
    lock = cache / "latent.pt.lock"
    lock.write_bytes(b"4242\n")  # a pid-file lock whose holder is gone
    os.utime(lock, (time.time() - 7200, time.time() - 7200))
    monkeypatch.chdir(root)
    written = invoke("scan", "cache", "--isolated", "--write-baseline", "b.json")
    assert written.exit_code == 0 and "recorded 3 findings" in written.stderr
    (cache / "also_empty.pt").write_bytes(b"")  # new since the baseline
    return root


def _cli(*args: str) -> tuple[list[tuple[str, str]], str]:
    result = invoke("scan", "cache", "--format", "json", "--fail-on", "never", "--jobs", "1", *args)
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)["findings"]
    return sorted((f["code"], os.path.realpath(f["path"])) for f in found), result.stderr


def _api(report: cachedoctor.Report) -> list[tuple[str, str]]:
    return sorted((f.code, os.path.realpath(f.path)) for f in report.findings)


def test_cli_and_api_split_new_and_known_alike(project: Path) -> None:
    everything = _api(cachedoctor.scan("cache", isolated=True, jobs=1))
    cli, stderr = _cli("--isolated", "--baseline", "b.json")
    api = _api(cachedoctor.scan("cache", isolated=True, jobs=1, baseline="b.json"))
    checked = _api(cachedoctor.preflight("cache", fail_on="never", isolated=True, jobs=1,
                                         baseline="b.json"))

    assert cli == api == checked == [("CD102", os.path.realpath(project / "cache" / "also_empty.pt"))]
    known = len(everything) - len(api)
    assert known == 3
    assert f"{known} known findings not shown, 0 of its entries no longer found" in stderr


def test_a_baseline_the_config_file_names_splits_alike(project: Path) -> None:
    (project / "cachedoctor.toml").write_text('baseline = "b.json"\n')
    (project / "cache" / "empty.pt").unlink()  # fixed: one baseline entry is no longer found

    cli, stderr = _cli()
    api = _api(cachedoctor.scan("cache", jobs=1))

    assert cli == api == [("CD102", os.path.realpath(project / "cache" / "also_empty.pt"))]
    assert "2 known findings not shown, 1 of its entries no longer found" in stderr


def test_the_cli_and_the_api_go_through_the_same_functions(project: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[str | None] = []
    applied: list[int] = []
    real_named, real_apply = baselines.named, baselines.apply_to

    def named(path):
        loaded.append(path)
        return real_named(path)

    def apply_to(report, baseline):
        applied.append(len(report.findings))
        return real_apply(report, baseline)

    monkeypatch.setattr(baselines, "named", named)
    monkeypatch.setattr(baselines, "apply_to", apply_to)
    _cli("--isolated", "--baseline", "b.json")
    cachedoctor.scan("cache", isolated=True, jobs=1, baseline="b.json")

    assert [os.path.realpath(p) for p in loaded] == [os.path.realpath(project / "b.json")] * 2
    assert applied == [4, 4]


def test_write_baseline_records_everything_without_reading_the_old_one(project: Path) -> None:
    (project / "b.json").write_text("not json")  # a named baseline --write-baseline replaces
    result = invoke("scan", "cache", "--baseline", "b.json", "--write-baseline", "b.json")
    assert result.exit_code == 0, result.output
    assert "recorded 4 findings in b.json" in result.stderr
    (project / "b.json").write_text("[]")
    with pytest.raises(cachedoctor.BaselineError, match="not a cachedoctor baseline"):
        cachedoctor.scan("cache", isolated=True, jobs=1, baseline="b.json")
