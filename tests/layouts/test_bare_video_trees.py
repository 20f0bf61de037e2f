"""Trainer folders scanned bare (`cachedoctor scan DIR`, no config): a diffusion-pipe
`[[directory]]` folder keeps its caches in `cache/<model>/` inside the image dir, by design
(tdrussell/diffusion-pipe 8f83dbf2, utils/dataset.py `DirectoryDataset.cache_dir`), so its
images, videos and captions are the dataset's media, not stray files of a cache (CD107)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import diffusion_pipe as dp
from cachedoctor.layouts import resolve

from conftest import scan_paths

SEVERE = 2

pytest.importorskip("torch")


def severe(report) -> list:
    return [(f.code, f.path, f.message) for f in report.findings if f.severity >= SEVERE]


def test_a_directory_folder_scanned_bare_holds_media_and_each_models_cache(
        tmp_path: Path) -> None:
    project = dp.build(tmp_path / "p")
    folder = project.root / "dataset"
    (folder / "clip_0.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom placeholder")
    (folder / "clip_0.txt").write_text("a clip\n")
    # a second model's cache of the same folder (another training config), side by side
    shutil.copytree(dp.cache_of(project), folder / "cache" / "sdxl")
    (layout,) = resolve([str(folder)])
    assert sorted(d.id for d in layout.datasets) == ["dataset (flux)", "dataset (sdxl)"]
    assert all(d.image_dirs == (str(folder),) and d.caches_beside_images
               for d in layout.datasets)
    assert severe(scan_paths(folder)) == []


def test_a_folder_without_diffusion_pipe_metadata_is_left_as_it_was(tmp_path: Path) -> None:
    """Only `cache/<model>/metadata/grouping_keys.json` makes a folder diffusion-pipe's."""
    folder = tmp_path / "photos"
    (folder / "cache" / "flux").mkdir(parents=True)
    (folder / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (layout,) = resolve([str(folder)])
    assert [d.id for d in layout.datasets] == ["photos"]
    assert not layout.datasets[0].caches_beside_images
