"""Baselines: an old cache's findings are recorded once, and only new ones fail."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from cachedoctor.baseline import fingerprint
from cachedoctor.findings import Finding, Severity

from conftest import invoke


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A project dir (the working dir) with a cache holding an error, a warning and a stale lock."""
    root = tmp_path / "project"
    cache = root / "cache"
    cache.mkdir(parents=True)
    (cache / "empty.pt").write_bytes(b"")
    (cache / "tmpabcd1234").write_bytes(b"x")
    lock = cache / "latent.pt.lock"
    lock.write_bytes(b"4242\n")  # a pid-file lock whose holder is gone
    os.utime(lock, (time.time() - 7200, time.time() - 7200))
    monkeypatch.chdir(root)
    return root


def _findings(result) -> list[tuple[str, str]]:
    return [(f["code"], f["path"]) for f in json.loads(result.stdout)["findings"]]


def test_unchanged_cache_passes_and_a_new_defect_fails(project: Path) -> None:
    assert invoke("scan", "cache", "--isolated").exit_code == 1
    written = invoke("scan", "cache", "--isolated", "--write-baseline", "cd-baseline.json")
    assert written.exit_code == 0
    assert "recorded 3 findings in cd-baseline.json" in written.stderr
    known = invoke("scan", "cache", "--isolated", "--baseline", "cd-baseline.json", "--format", "json",
                   "--fail-on", "info")
    assert known.exit_code == 0, known.stdout
    assert _findings(known) == []
    assert "3 known findings not shown" in known.stderr

    (project / "cache" / "also_empty.pt").write_bytes(b"")
    new = invoke("scan", "cache", "--isolated", "--baseline", "cd-baseline.json", "--format", "json")
    assert new.exit_code == 1
    assert _findings(new) == [("CD102", "cache/also_empty.pt")]


def test_fixed_entries_are_counted_and_a_rewrite_drops_them(project: Path) -> None:
    invoke("scan", "cache", "--isolated", "--write-baseline", "b.json")
    (project / "cache" / "empty.pt").unlink()
    result = invoke("scan", "cache", "--isolated", "--baseline", "b.json")
    assert result.exit_code == 0
    assert "1 of its entries no longer found" in result.stderr
    invoke("scan", "cache", "--isolated", "--write-baseline", "b.json")
    assert len(json.loads(Path("b.json").read_text())["findings"]) == 2


def test_baseline_survives_moving_the_project_and_the_clock(project: Path, tmp_path: Path, monkeypatch) -> None:
    invoke("scan", "cache", "--isolated", "--write-baseline", "ci/baseline.json")
    entries = json.loads(Path("ci/baseline.json").read_text())["findings"]
    assert {e["path"] for e in entries} == {"../cache/empty.pt", "../cache/tmpabcd1234", "../cache/latent.pt.lock"}
    moved = tmp_path / "elsewhere" / "checkout"
    shutil.copytree(project, moved)
    lock = moved / "cache" / "latent.pt.lock"
    os.utime(lock, (time.time() - 90000, time.time() - 90000))  # a day older: a new age, same defect
    monkeypatch.chdir(tmp_path)
    result = invoke("scan", str(moved / "cache"), "--isolated", "--baseline", str(moved / "ci" / "baseline.json"),
                    "--fail-on", "info")
    assert result.exit_code == 0, result.stdout


def test_baseline_from_the_config_file_is_relative_to_it(project: Path, monkeypatch) -> None:
    (project / "cachedoctor.toml").write_text('baseline = "ci/baseline.json"\nfail-on = "warning"\n')
    missing = invoke("scan", "cache")
    assert missing.exit_code == 2
    assert "(write it with --write-baseline)" in missing.stderr
    assert invoke("scan", "cache", "--write-baseline", "ci/baseline.json").exit_code == 0
    (project / "sub").mkdir()
    monkeypatch.chdir(project / "sub")
    assert invoke("scan", "../cache").exit_code == 0
    (project / "cache" / "tmp_new_one").write_bytes(b"")
    assert invoke("scan", "../cache").exit_code == 1


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read baseline"),
    ("{not json", "not a cachedoctor baseline"),
    ("[]", "not a cachedoctor baseline"),
    ('{"version": 9, "findings": []}', "baseline version 9"),
    ('{"version": 1, "findings": [{"code": "CD101"}]}', "not a cachedoctor baseline"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # json recursed past Python's limit
])
def test_bad_baseline_is_a_usage_error(content, message, project: Path) -> None:
    if content is not None:
        Path("b.json").write_text(content)
    result = invoke("scan", "cache", "--isolated", "--baseline", "b.json")
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _finding(path: str, **details) -> Finding:
    return Finding("CD201", "retained-batch-storage", Severity.WARNING, path, f"message {details}",
                   details=details)


def test_fingerprint_is_code_relative_path_and_evidence_without_clock() -> None:
    base = _finding("/a/cache/x.pt", wasted_bytes=10, age_seconds=5, files=["/a/cache/1.pt", "/a/cache/0.pt"])
    assert fingerprint(base, "/a") == fingerprint(
        _finding("/b/cache/x.pt", wasted_bytes=10, age_seconds=99, files=["/b/cache/0.pt", "/b/cache/1.pt"]), "/b")
    assert fingerprint(base, "/a") != fingerprint(_finding("/a/cache/x.pt", wasted_bytes=11, age_seconds=5,
                                                           files=["/a/cache/1.pt", "/a/cache/0.pt"]), "/a")
    assert fingerprint(base, "/a") != fingerprint(_finding("/a/cache/y.pt", wasted_bytes=10), "/a")
    assert fingerprint(_finding("/a/x.pt", shape=[4, 64, 32]), "/a") != fingerprint(
        _finding("/a/x.pt", shape=[4, 32, 64]), "/a")


def test_fingerprint_leaves_out_what_grows_with_the_cache() -> None:
    """A dataset-wide finding keeps its fingerprint when healthy files are added: file lists,
    counts and example files are left out, and a tally counts by its names only."""

    def cd304(**details) -> Finding:
        return Finding("CD304", "mixed-dtypes", Severity.WARNING, "/a/cache", "m", details=details)

    small = cd304(dtypes=["bfloat16", "float32"], counts={"bfloat16": 9, "float32": 1},
                  files=["/a/cache/x.pt"], majority_files=9, examples={"float32": ["/a/cache/x.pt"]})
    grown = cd304(dtypes=["bfloat16", "float32"], counts={"bfloat16": 90, "float32": 1},
                  files=["/a/cache/x.pt", "/a/cache/y.pt"], majority_files=90, examples={})
    assert fingerprint(small, "/a") == fingerprint(grown, "/a")
    other = cd304(dtypes=["bfloat16", "float16"], counts={"bfloat16": 9, "float16": 1})
    assert fingerprint(small, "/a") != fingerprint(other, "/a")
    # a tally of devices: which devices, not how many files each
    assert fingerprint(cd304(locations={"cpu": 3, "cuda:0": 1}), "/a") == fingerprint(
        cd304(locations={"cpu": 30, "cuda:0": 1}), "/a")
    assert fingerprint(cd304(locations={"cpu": 3, "cuda:0": 1}), "/a") != fingerprint(
        cd304(locations={"cpu": 3, "cuda:1": 1}), "/a")
    # top-level numbers are evidence, not a tally
    assert fingerprint(_finding("/a/x.pt", wasted_bytes=10), "/a") != fingerprint(
        _finding("/a/x.pt", wasted_bytes=11), "/a")


def test_a_baseline_past_its_size_is_a_usage_error_read_no_further(project: Path,
                                                                    monkeypatch) -> None:
    """A config may name any file as its baseline (a model checkpoint): past the size a
    baseline has, it is refused from its stat, not loaded into memory."""
    from cachedoctor import baseline

    monkeypatch.setattr(baseline, "MAX_BASELINE_BYTES", 1024)
    Path("b.json").write_text('{"version": 1, "findings": []}' + " " * 2000)
    result = invoke("scan", "cache", "--isolated", "--baseline", "b.json")
    assert result.exit_code == 2 and "more than a baseline holds" in result.stderr
