"""A trainer's own cache clearing leaves cachedoctor's repair state (journal, quarantine), and
undo keeps working after it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import pytest
from repair_helpers import isolated_state  # noqa: F401

from cachedoctor.fixtures.projects import Project, onetrainer
from cachedoctor.inventory import STATE_DIR
from cachedoctor.layouts import resolve
from cachedoctor.repair import build_plan
from cachedoctor.repair.caches import JOURNAL, cache_roots, earlier_roots, mgds_cache_dir
from cachedoctor.repair.journal import Journal

from conftest import invoke, scan_paths


def onetrainer_clear(cache_dir: Path) -> None:
    """What OneTrainer does at every start with clear_cache_before_training and latent_caching
    (Nerogar/OneTrainer 23df3832, modules/trainer/GenericTrainer.py, GenericTrainer.__clear_cache):
    every folder of the cache_dir named `epoch-*`, `image` or `text`, shutil.rmtree'd."""
    for name in os.listdir(cache_dir):
        path = cache_dir / name
        if path.is_dir() and (name.startswith("epoch-") or name in ("image", "text")):
            shutil.rmtree(path)


def digests(paths: list[Path]) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def fixed_project(tmp_path: Path) -> tuple[Path, dict[Path, str]]:
    """A OneTrainer project whose fix quarantines an image sample (and its folder's
    aggregate.pt) and a text sample: its cache_dir, and the originals' digests."""
    project = onetrainer.build(tmp_path, {"CD303", "CD305"})
    moved = sorted({Path(p) for found in project.expected.values() for p, _ in found})
    moved.append(next(p.parent / "aggregate.pt" for p in moved if "image" in p.parts))
    before = digests(moved)
    result = invoke("fix", str(project.config), "--yes")
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in moved)
    return project.root / "workspace-cache" / "run", before


def test_undo_puts_files_back_after_onetrainer_cleared_its_cache(tmp_path: Path) -> None:
    cache_dir, before = fixed_project(tmp_path)

    onetrainer_clear(cache_dir)
    assert not (cache_dir / "image").exists() and not (cache_dir / "text").exists()

    result = invoke("undo")  # no arguments: found through the caches fix recorded

    assert result.exit_code == 0, result.output
    assert "3 file(s) put back" in result.output
    assert digests(list(before)) == before


def test_undo_after_the_trainer_cached_again_leaves_its_files_and_keeps_the_originals(
        tmp_path: Path) -> None:
    cache_dir, before = fixed_project(tmp_path)
    onetrainer_clear(cache_dir)
    for path in before:  # OneTrainer's next caching pass writes every sample anew
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"cached again by the trainer")

    result = invoke("undo")

    assert result.exit_code == 1, result.output
    assert result.output.count("  left alone: ") == 3, result.output
    assert all(p.read_bytes() == b"cached again by the trainer" for p in before)
    kept = [Path(parent) / n for parent, _, names in os.walk(cache_dir / STATE_DIR) for n in names
            if n.endswith(".quarantined")]
    assert sorted(hashlib.sha256(k.read_bytes()).hexdigest() for k in kept) == sorted(before.values())


def test_the_state_is_never_in_a_folder_onetrainer_clears(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path, {"CD305"})
    cache_dir = project.root / "workspace-cache" / "run"
    assert cache_roots(resolve([str(project.config)])) == (str(cache_dir),)
    # a OneTrainer cache given without its config: its image/ folder, a group, a variation
    [text] = [Path(p) for p, _ in project.expected["CD305"]]
    for target in (cache_dir / "text", text.parent.parent, text.parent, text):
        assert cache_roots(resolve([str(target)])) == (str(cache_dir),), target


def test_a_folder_merely_named_image_is_its_own_root(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "image"
    (folder / ("a" * 64) / "bucket").mkdir(parents=True)  # a sha256 name without variation-<n>
    assert mgds_cache_dir(str(folder)) is None
    assert mgds_cache_dir(str(folder / ("a" * 64))) is None


def legacy_fix(project: Project, cache_dir: Path) -> None:
    """A fix as earlier versions ran it: the image/ and text/ folders are the cache roots."""
    roots = (str(cache_dir / "image"), str(cache_dir / "text"))
    plan = build_plan(scan_paths(project.config), roots)
    assert plan.actions
    result = plan.execute()
    assert not result.failed
    assert (cache_dir / "image" / STATE_DIR / JOURNAL).is_file()
    assert not (cache_dir / STATE_DIR).exists()


def test_a_run_journaled_in_the_image_folder_is_still_undone(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path, {"CD303", "CD305"})
    cache_dir = project.root / "workspace-cache" / "run"
    moved = sorted({Path(p) for found in project.expected.values() for p, _ in found})
    before = digests(moved)
    legacy_fix(project, cache_dir)

    listed = invoke("fix", str(project.config), "--list-runs")
    assert listed.exit_code == 0 and "image" in listed.output, listed.output

    result = invoke("undo", "--cache", str(cache_dir))

    assert result.exit_code == 0, result.output
    assert digests(moved) == before
    assert str(cache_dir / "image") in result.output and str(cache_dir / "text") in result.output


def test_earlier_state_is_never_read_through_a_symlink(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path / "a", {"CD303", "CD305"})
    cache_dir = project.root / "workspace-cache" / "run"
    legacy_fix(project, cache_dir)
    other = tmp_path / "b"
    other.mkdir()
    (other / "image").symlink_to(cache_dir / "image")
    assert earlier_roots(str(cache_dir)) == [str(cache_dir / "image"), str(cache_dir / "text")]
    assert earlier_roots(str(other)) == []


@pytest.mark.parametrize("how", ["symlink", "file"])
def test_a_cleared_folder_put_back_as_a_symlink_is_left_alone(tmp_path: Path, how: str) -> None:
    cache_dir, before = fixed_project(tmp_path)
    onetrainer_clear(cache_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if how == "symlink":
        (cache_dir / "image").symlink_to(elsewhere)
    else:
        (cache_dir / "image").write_bytes(b"")

    result = invoke("undo")

    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert list(elsewhere.iterdir()) == []
    text = [p for p in before if "text" in p.parts]
    assert digests(text) == {p: before[p] for p in text}  # the text sample is back


def test_undo_says_which_originals_it_cannot_put_back(tmp_path: Path) -> None:
    cache_dir, before = fixed_project(tmp_path)
    onetrainer_clear(cache_dir)
    # the quarantine removed by hand (to free the space without `cachedoctor purge`)
    shutil.rmtree(cache_dir / STATE_DIR / "quarantine")

    result = invoke("undo")

    assert result.exit_code == 1, result.output
    assert "0 file(s) put back" in result.output
    assert result.output.count("cannot be put back") == 3, result.output
    assert not any(p.exists() for p in before)


def test_changed_since_a_fix_run_of_a_onetrainer_config(tmp_path: Path) -> None:
    """scan <config> --changed-since RUN finds the run in the cache_dir's journal, above the
    image/ and text/ folders the scan walks."""
    project = onetrainer.build(tmp_path, {"CD303"})
    result = invoke("fix", str(project.config), "--yes")
    assert result.exit_code == 0, result.output
    with Journal.existing(str(project.root / "workspace-cache" / "run")) as journal:
        (run,) = journal.runs()
    run_id = run.run_id
    scanned = invoke("scan", str(project.config), "--changed-since", run_id, "--fail-on", "never")
    assert scanned.exit_code == 0, scanned.output


def test_fix_uses_the_index_a_scan_made_and_never_makes_one(tmp_path: Path) -> None:
    """fix's scan uses the index where a scan keeps it (for a OneTrainer config: in image/,
    while the repair state is in the cache_dir) and never makes one, not even on a second run,
    when the cache_dir already holds its state."""
    import sqlite3

    project = onetrainer.build(tmp_path, {"CD303"})
    for _ in range(2):
        result = invoke("fix", str(project.config), "--yes")
        assert result.exit_code == 0, result.output
    assert list(project.root.rglob("index.sqlite")) == []
    assert invoke("scan", str(project.config), "--fail-on", "never").exit_code == 0
    (made,) = project.root.rglob("index.sqlite")

    def scans() -> int:
        with contextlib.closing(sqlite3.connect(made)) as db:
            return db.execute("SELECT count(*) FROM scans").fetchone()[0]

    before = scans()
    assert invoke("fix", str(project.config), "--yes").exit_code == 0
    assert scans() == before + 1 and list(project.root.rglob("index.sqlite")) == [made]
