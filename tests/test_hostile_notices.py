"""The lines around a report: the index's notices, the config and baseline lines, `undo`'s
"no runs" and `verify`'s progress and text report. Each can hold a cache's folder name, a
config's glob or path, or a dataset id, and each must stay one line of inert text: a newline or
a bidi control in those names shows as an escape, never raw. (click strips ANSI sequences off a
pipe, so the tests plant what it does not strip: line breaks and U+202E.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from cachedoctor.fixtures.projects import kohya, musubi

from conftest import invoke

HOSTILE = "c\u202eevil\nFAKE"


def _one_line_each(text: str) -> None:
    assert "\u202e" not in text, text
    assert not any(line.startswith("FAKE") for line in text.splitlines()), text


def _cache(tmp_path: Path, name: str = HOSTILE) -> Path:
    project = musubi.build(tmp_path / "m")
    cache = tmp_path / name
    shutil.copytree(project.root / "cache" / "qwen", cache)
    return cache


def test_an_index_notice_shows_the_cache_name_escaped(tmp_path: Path) -> None:
    """An index.sqlite that is no database is rebuilt, with a notice naming it."""
    cache = _cache(tmp_path)
    (cache / ".cachedoctor").mkdir()
    (cache / ".cachedoctor" / "index.sqlite").write_text("not a database")
    result = invoke("scan", "--isolated", "-j", "1", str(cache))
    assert "was unreadable" in result.stderr and "\\u202eevil\\x0aFAKE" in result.stderr
    _one_line_each(result.stderr)


def test_config_and_baseline_lines_show_their_text_escaped(tmp_path: Path) -> None:
    """A config file (which may come with the cache) names an exclude glob and a baseline whose
    names hold a line break: the policy summary and the baseline lines escape them."""
    cache = _cache(tmp_path, "cache")
    (cache / "broken.pt").write_bytes(b"not a tensor")
    baseline = tmp_path / "base\u202eline\nFAKE.json"
    assert invoke("scan", "--isolated", "-j", "1", str(cache), "--write-baseline",
                  str(baseline)).exit_code == 0
    config = tmp_path / "cachedoctor.toml"
    config.write_text('exclude = ["x\\u202e\\nFAKE/*"]\n'
                      'baseline = "base\\u202eline\\nFAKE.json"\n'
                      'severity = { CD002 = "off" }\n')
    result = invoke("scan", "--config", str(config), "-j", "1", str(cache))
    assert "not checked:" in result.stderr and "known findings not shown" in result.stderr
    assert "x\\u202e\\x0aFAKE/*" in result.stderr and "base\\u202eline\\x0aFAKE.json" in result.stderr
    _one_line_each(result.stderr)


def test_undo_names_a_cache_without_runs_escaped(tmp_path: Path) -> None:
    cache = tmp_path / HOSTILE
    cache.mkdir()
    result = invoke("undo", "--cache", str(cache))
    assert result.exit_code == 0 and "No runs to undo in" in result.stdout
    _one_line_each(result.stdout)


def test_verify_shows_a_dataset_id_escaped(tmp_path: Path) -> None:
    """A kohya subset's image_dir is the dataset's id: in the progress lines and the report."""
    project = kohya.build(tmp_path / "k")
    (project.root / "train" / "10_person").rename(project.root / "train" / f"10_{HOSTILE}")
    dataset = project.root / "dataset.toml"
    dataset.write_text(dataset.read_text().replace(
        '"train/10_person"', '"train/10_c\\u202eevil\\nFAKE"'))
    result = invoke("verify", str(project.config), "--encoder", "reference")
    assert result.exit_code == 0, result.stderr
    assert "entries encoded" in result.stderr and "entries sampled" in result.stdout
    _one_line_each(result.stdout)
    _one_line_each(result.stderr)
