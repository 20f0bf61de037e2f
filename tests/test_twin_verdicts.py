"""Files whose facts are a twin's (zip_templates) reuse the twin's verdict: each still gets its
own findings at its own path, and a verdict never outlives the scan's options."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from cachedoctor.checks import RULES
from cachedoctor.fixtures import BUILDERS, clean
from cachedoctor.formats import read_path
from cachedoctor.formats.zip_templates import Templates
from cachedoctor.inventory import LATENT, TEXT, Entry
from cachedoctor.rule import RuleContext

from conftest import by_code, scan_paths

torch = pytest.importorskip("torch")


def retained_twins(cache: Path, batches: int = 3, size: int = 4) -> list[Path]:
    """torch.save(batch[i]) for several batches: the files of one row i hold the same
    data.pkl (same shape, same storage offset), so they are twins of each other."""
    gen = torch.Generator().manual_seed(0)
    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    for b in range(batches):
        batch = torch.randn(size, 4, 16, 16, generator=gen).half()  # 2 KiB a row
        for i in range(size):
            path = cache / f"{b:04d}{i:04d}.pt"
            torch.save(batch[i], path)
            paths.append(path)
    return paths


def test_every_twin_gets_its_own_finding(cache: Path, monkeypatch) -> None:
    import cachedoctor.engine as engine

    paths = retained_twins(cache)
    templates = Templates()  # what one scan learns as it reads
    metas = [read_path(str(p), templates=templates) for p in paths]
    assert sum(m.same_as is not None for m in metas) == len(paths) - 4  # all but a row's first
    report = scan_paths(cache)
    fired = by_code(report, "CD201")
    assert sorted(f.path for f in fired) == sorted(str(p) for p in paths)
    monkeypatch.setattr(engine, "SHARED_ROLES", ())  # every file judged on its own
    assert scan_paths(cache).findings == report.findings


def test_a_verdict_holds_for_one_scan_s_settings(cache: Path) -> None:
    paths = retained_twins(cache)
    assert len(by_code(scan_paths(cache), "CD201")) == len(paths)
    strict = scan_paths(cache, settings={"CD201": {"min-ratio": 1000.0}})
    assert by_code(strict, "CD201") == []
    assert len(by_code(scan_paths(cache), "CD201")) == len(paths)


def _defect_metas(tmp_path: Path):
    """A meta of every file-rule defect the fixtures make (plus clean files)."""
    for code, build in BUILDERS.items():
        folder = tmp_path / code
        clean.build(folder, n=1)
        options = {"marker": tmp_path / "PAYLOAD"} if code == "CD105" else {}
        for path in build(folder, **options):
            yield read_path(str(path), deep=True)
    for path in sorted((tmp_path / "CD101").iterdir()):
        yield read_path(str(path))


def test_file_rules_judge_facts_not_paths(tmp_path: Path) -> None:
    """The contract the engine's verdict reuse rests on (rule.py): for a latent or text
    file, a file rule gives the same finding for the same facts at another path and mtime."""
    file_rules = [r for r in RULES.values() if r.check_file is not None]
    for meta in _defect_metas(tmp_path):
        for role in (LATENT, TEXT):
            here = Entry(meta.path, role, "cache")
            moved = dataclasses.replace(meta, path="/elsewhere/other-name.pt", mtime=1.0)
            there = Entry(moved.path, role, "cache")
            for rule in file_rules:
                a = rule.check_file(meta, RuleContext(meta.deep, "cache", {}, here))
                b = rule.check_file(moved, RuleContext(meta.deep, "cache", {}, there))
                assert (a is None) == (b is None), (rule.code, meta.path)
                if a is not None:
                    assert dataclasses.replace(a, path=b.path) == b, (rule.code, meta.path)


def test_gzip_wrapped_twins_are_judged_as_gzip_files(cache: Path, monkeypatch) -> None:
    """SimpleTuner gzips torch files: the inner archive matches a plain file's template, and
    the verdict of a plain file is never handed to a gzip one (or back)."""
    import gzip

    import cachedoctor.engine as engine

    paths = retained_twins(cache, batches=2)
    for path in paths[::2]:  # every other file gzip-wrapped, as SimpleTuner writes them
        path.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
    templates = Templates()
    metas = [read_path(str(p), templates=templates) for p in paths]
    assert {m.compression for m in metas if m.same_as is not None} == {None, "gzip"}
    report = scan_paths(cache)
    assert len(by_code(report, "CD201")) == len(paths)
    monkeypatch.setattr(engine, "SHARED_ROLES", ())
    assert scan_paths(cache).findings == report.findings


def test_a_twin_gets_its_own_mtime(tmp_path: Path) -> None:
    first, second = tmp_path / "aaaa.pt", tmp_path / "bbbb.pt"
    for path, when in ((first, 1_000_000), (second, 2_000_000)):
        torch.save(torch.ones(4, 8, 8).half(), path)
        os.utime(path, (when, when))
    templates = Templates()
    assert read_path(str(first), templates=templates).mtime == 1_000_000
    twin = read_path(str(second), templates=templates)
    assert twin.same_as is not None and twin.mtime == 2_000_000
    assert twin.same_as.renamed("x").mtime == 0.0


def test_a_pool_of_workers_judges_twins_as_one_process_does(tmp_path: Path) -> None:
    for part in ("a", "b", "c"):  # three dirs: three batches, so the scan starts a pool
        retained_twins(tmp_path / "cache" / part)
    one = scan_paths(tmp_path / "cache")
    assert len(by_code(one, "CD201")) == 36
    assert scan_paths(tmp_path / "cache", jobs=2).findings == one.findings


@pytest.mark.parametrize("admits", [True, False])
def test_a_names_rule_is_skipped_for_twins_only_where_its_applies_says_so(cache: Path, monkeypatch,
                                                                        admits: bool) -> None:
    """A rule that reads a file's name (names=True) runs for every twin unless its `applies`
    says no file with the twin's facts can draw its finding; a file read in full (a row's
    first, no twin) runs every check whatever `applies` says."""
    from cachedoctor.findings import Severity
    from cachedoctor.rule import Rule

    paths = retained_twins(cache)
    seen: list[str] = []

    def check(meta, ctx):
        seen.append(meta.path)
        return RULE.finding(meta.path, "named", ctx) if meta.path.endswith("1.pt") else None

    RULE = Rule(code="CD998", name="names-spy", severity=Severity.INFO, summary="spy", doc="spy",
                check_file=check, names=True, applies=lambda meta, ctx: admits)
    monkeypatch.setitem(RULES, "CD998", RULE)
    report = scan_paths(cache, extend_select=("CD998",))
    fired = sorted(f.path for f in by_code(report, "CD998"))
    if admits:
        assert sorted(seen) == sorted(str(p) for p in paths)
        assert fired == sorted(str(p) for p in paths if p.name.endswith("1.pt"))
    else:  # only the files read in full (the first of each row the walk met) ran it
        assert sorted(p[-4:] for p in seen) == ["0.pt", "1.pt", "2.pt", "3.pt"]
        assert fired == [p for p in seen if p.endswith("1.pt")]
