"""Healthy trees a user really has must scan clean: no false warnings."""

from __future__ import annotations

from pathlib import Path

from fixtures import clean

from conftest import scan_paths


def test_a_cachedoctor_toml_in_the_cache_is_no_foreign_file(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    clean.build(cache, n=2)
    (cache / "cachedoctor.toml").write_text('ignore = ["CD201"]\n')
    (cache / "notes.toml").write_text('x = 1\n')

    report = scan_paths(cache, jobs=1)

    assert [Path(f.path).name for f in report.findings if f.code == "CD107"] == ["notes.toml"]
