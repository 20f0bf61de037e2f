"""Healthy trees a user really has must scan clean: no false warnings."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures import clean

from conftest import scan_paths


def test_a_cachedoctor_toml_in_the_cache_is_no_foreign_file(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    clean.build(cache, n=2)
    (cache / "cachedoctor.toml").write_text('ignore = ["CD201"]\n')
    (cache / "notes.toml").write_text('x = 1\n')

    report = scan_paths(cache, jobs=1)

    assert [Path(f.path).name for f in report.findings if f.code == "CD107"] == ["notes.toml"]


def _kohya_subset(folder: Path) -> None:
    """A kohya `<repeats>_<name>` image dir: images, captions, and the npz kohya writes."""
    import numpy as np

    from fixtures.images import write_png
    from fixtures.projects.kohya import npz_name

    folder.mkdir(parents=True)
    for i in range(3):
        image = write_png(folder / f"img{i}.png", 64, 64, i)
        (folder / f"img{i}.txt").write_text("a photo\n")
        np.savez(folder / npz_name(image, 64, 64), latents=np.zeros((4, 8, 8), np.float32),
                 original_size=np.array([64, 64]), crop_ltrb=np.array([0, 0, 64, 64]))


def _aitoolkit_folder(folder: Path) -> None:
    """An ai-toolkit image folder holding its `_latent_cache/`."""
    import torch

    from fixtures.images import write_png
    from fixtures.projects.aitoolkit import latent_path, save

    (folder / "_latent_cache").mkdir(parents=True)
    for i in range(3):
        image = write_png(folder / f"p{i}.png", 64, 64, i)
        save(latent_path(folder, image, (64, 64)), torch.zeros(4, 8, 8), image.name, (64, 64))


def test_caches_beside_images_deep_in_a_tree_make_no_foreign_files(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    tree = tmp_path / "models"
    _kohya_subset(tree / "kohya" / "train" / "10_person")
    _aitoolkit_folder(tree / "aitk" / "datasets" / "person")
    clean.build(tree / "simpletuner" / "cache" / "vae", n=2)
    stray = tree / "simpletuner" / "cache" / "vae" / "photo.png"  # incident 5: still reported
    stray.write_bytes((tree / "aitk" / "datasets" / "person" / "p0.png").read_bytes())

    for target in (tree, tree / "kohya", tree / "aitk"):
        report = scan_paths(target, jobs=1)

        assert {f.path for f in report.findings} == ({str(stray)} if target == tree else set()), \
            [(f.code, f.path) for f in report.findings]


def test_two_model_families_trained_on_one_image_dir_see_their_images(tmp_path: Path) -> None:
    """SimpleTuner environments for sdxl and flux share `datasets/closeups` and its bucket
    files; each caches into `cache/vae/{model_family}/closeups`. Each dataset must see the
    images, or every entry of the second is an orphan and every listed image 'gone' (CD405)."""
    pytest.importorskip("torch")
    from fixtures import corpus

    tree = corpus.build("simpletuner", tmp_path / "st")
    project = tree.root.parents[1]
    assert (project / "config" / "flux" / "config.json").is_file()  # the second environment

    report = scan_paths(project, jobs=1)

    assert report.findings == (), [(f.code, f.path) for f in report.findings]
