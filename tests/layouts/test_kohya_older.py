"""Caches written by older kohya sd-scripts, scanned with and without the config.

Before v0.9.0 (kohya-ss/sd-scripts v0.8.7 bfb352bc, train_util.py `save_latents_to_disk`) the
latent npz was `<stem>.npz` beside the image: float32 `latents`, `original_size`, `crop_ltrb`,
`latents_flipped` with flip_aug. 48d368fa still reads it first (strategy_sd.py
`get_latents_npz_path`). SDXL text encoder outputs are `<stem>_te_outputs.npz` since 516f64f4
(2023-07), cached to disk with or without the latents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cachedoctor.fixtures.clean import kohya_arrays
from cachedoctor.fixtures.projects import age_all, encode, kohya

from conftest import by_code, scan_paths


def alarms(target: Path) -> list:
    return [f for f in scan_paths(target).findings if f.severity >= 2]


def legacy_project(tmp_path: Path, flip: bool = False, latents: bool = True) -> tuple[Path, Path]:
    """The kohya project with v0.8.7's `<stem>.npz` in place of its `_sdxl.npz` (none when
    not `latents`: text encoder outputs alone)."""
    built = kohya.build(tmp_path / "k")
    folder = built.root / "train" / kohya.DATASET
    for new in folder.glob("*_sdxl.npz"):
        new.unlink()
    for seed, image in enumerate(sorted(folder.glob("*.png")) if latents else ()):
        width, height = Image.open(image).size
        arrays = kohya_arrays(encode(image, width, height, seed, dtype="float32"))
        if flip:
            arrays["latents_flipped"] = arrays["latents"][:, :, ::-1].copy()
        np.savez(folder / f"{image.stem}.npz", **arrays)
    age_all(built.root)
    return built.config, folder


@pytest.mark.parametrize("flip", [False, True])
def test_legacy_stem_npz_is_clean_by_config_and_bare(tmp_path: Path, flip: bool) -> None:
    """Before, a bare scan of the image dir took it for a cache dir: CD107 on every image and
    caption (only `_<W>x<H>_<arch>.npz` names marked a kohya image dir)."""
    config, folder = legacy_project(tmp_path, flip)
    assert alarms(config) == []
    assert alarms(folder) == []
    assert alarms(folder.parent) == []


def test_text_encoder_outputs_alone_are_clean_bare(tmp_path: Path) -> None:
    config, folder = legacy_project(tmp_path, latents=False)
    assert alarms(config) == []
    assert alarms(folder) == []


def test_legacy_npz_of_another_size_is_still_cd302(tmp_path: Path) -> None:
    """A real defect in the old format still fires: an npz encoded 64 px short of its bucket
    (sd-scripts reads a legacy npz first and checks its size)."""
    config, folder = legacy_project(tmp_path)
    image = folder / "img_000.png"
    width, height = Image.open(image).size
    np.savez(folder / "img_000.npz",
             **kohya_arrays(encode(image, width - 64, height, 0, dtype="float32")))
    age_all(folder.parent.parent)
    assert [Path(f.path).name for f in by_code(scan_paths(config), "CD302")] == ["img_000.npz"]


def test_a_stray_image_in_a_cache_dir_is_still_cd107(tmp_path: Path) -> None:
    """An npz named for no image there does not make a folder an image dir."""
    folder = tmp_path / "cache"
    folder.mkdir()
    Image.new("RGB", (64, 64)).save(folder / "a.png")
    np.savez(folder / "b.npz", **kohya_arrays(encode(folder / "a.png", 64, 64, 0, dtype="float32")))
    assert "CD107" in {f.code for f in alarms(folder)}
