"""A scan with a progress bar walks the tree once: the bar's total is what that walk has
listed so far, and it ends at the number of files checked."""

from __future__ import annotations

from pathlib import Path

import pytest

import cachedoctor.engine as engine
from cachedoctor.fixtures import clean
from cachedoctor.options import ScanOptions

pytest.importorskip("torch")


def test_a_scan_with_progress_walks_each_root_once(cache: Path, monkeypatch) -> None:
    clean.build(cache, n=12)
    walks: list[str] = []
    real = engine.batches

    def batches(root, **kwargs):
        walks.append(root)
        return real(root, **kwargs)

    monkeypatch.setattr(engine, "batches", batches)
    monkeypatch.setattr(engine, "BATCH", 4)  # several batches: the total grows as they are listed
    listed: list[int] = []
    checked: list[int] = []
    report = engine.scan([str(cache)], ScanOptions(jobs=1), on_start=listed.append,
                         on_progress=checked.append)
    assert walks == [str(cache)]
    assert report.files == sum(checked) >= 12
    assert listed == sorted(listed) and len(listed) > 1 and listed[-1] == report.files


def test_the_bar_shows_once_enough_files_are_listed_and_keeps_what_was_checked() -> None:
    from cachedoctor.cli import PROGRESS_MIN_FILES, _Progress

    progress = _Progress()
    try:
        progress.start(10)
        progress.advance(7)
        assert progress._bar is None  # too few files so far for a bar
        progress.start(PROGRESS_MIN_FILES)
        assert progress._bar is not None
        [task] = progress._bar.tasks
        assert (task.completed, task.total) == (7, PROGRESS_MIN_FILES)
        progress.start(PROGRESS_MIN_FILES + 100)  # the walk listed more
        progress.advance(3)
        assert (task.completed, task.total) == (10, PROGRESS_MIN_FILES + 100)
    finally:
        progress.stop()
