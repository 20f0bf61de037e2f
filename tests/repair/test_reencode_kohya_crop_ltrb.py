"""`cachedoctor fix --reencode` writes kohya's `crop_ltrb` as sd-scripts computes and stores it.

kohya-ss/sd-scripts 48d368fa, library/train_util.py `BucketManager.get_crop_ltrb` places the
image as if fitted into its bucket with float quotients (a 500x333 image in the 320x192 bucket:
15.0, 0, 303.288..., 192), and strategy_base.py `save_latents_to_disk` stores
`np.array(crop_ltrb)`: float64. `_default_load_latents_from_disk` reads it back with
`.tolist()`, and train_util.py's `__getitem__` takes a flipped sample's crop as
`int(target_size[0] - crop_ltrb[2])`: 16 for 303.288, 17 for a 303 cut to an integer dtype.

The project fixture's npz files hold integral int64 crop_ltrb (images the size of their bucket);
the new entry of an odd-sized image beside them must keep kohya's fractions, not be cast to
int64. Where the neighbours store crop_ltrb as kohya does (float64), so does the new entry."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from repair_helpers import isolated_state, tree_digest  # noqa: F401

from cachedoctor.fixtures.images import write_png
from cachedoctor.fixtures.projects import kohya

from conftest import invoke, scan_paths

RUN_ID = re.compile(r"Applying run (\S+) ")
ODD = (500, 333)  # no bucket of its size: 320x192 (resized to 320x213, cropped)
# get_crop_ltrb((320, 192), (500, 333)): the bucket is wider, so the height fits: 192 * ar wide
KOHYA_CROP = [15.0, 0.0, 15.0 + 192 * (500 / 333), 192.0]


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:  # as sd-scripts' loader reads it
        return {k: npz[k] for k in npz.files}


@pytest.mark.parametrize("neighbours", ["int64", "float64"])
def test_the_crop_of_an_odd_sized_image_is_kohya_s_own(neighbours: str, tmp_path: Path) -> None:
    project = kohya.build(tmp_path)
    folder = project.root / "train" / kohya.DATASET
    if neighbours == "float64":  # as save_latents_to_disk writes np.array(get_crop_ltrb(...))
        for npz in folder.glob("*_sdxl.npz"):
            arrays = _npz(npz)
            arrays["crop_ltrb"] = arrays["crop_ltrb"].astype(np.float64)
            np.savez(npz, **arrays)
    write_png(folder / "odd.png", *ODD, seed=5)
    (folder / "odd.txt").write_text("person")
    before = tree_digest(project.root)

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    written = _npz(folder / "odd_0500x0333_sdxl.npz")
    assert written["crop_ltrb"].dtype == np.float64
    assert written["crop_ltrb"].tolist() == KOHYA_CROP
    assert int(320 - written["crop_ltrb"].tolist()[2]) == 16  # the flipped crop sd-scripts takes
    assert written["original_size"].tolist() == list(ODD)
    assert written["original_size"].dtype == np.int64  # the neighbours' (and numpy's) dtype
    assert written["latents"].shape == (4, 192 // 8, 320 // 8)
    assert not scan_paths(project.config).findings

    invoke("undo", RUN_ID.search(result.output)[1])
    assert tree_digest(project.root) == before


def test_an_image_of_its_bucket_s_size_keeps_the_neighbours_int64(tmp_path: Path) -> None:
    """The clean case: integral values stay in the neighbours' dtype."""
    project = kohya.build(tmp_path, {"CD404"})
    folder = project.root / "train" / kohya.DATASET

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    written = _npz(folder / "img_002_0256x0256_sdxl.npz")
    assert written["crop_ltrb"].dtype == np.int64
    assert written["crop_ltrb"].tolist() == [0, 0, 256, 256]
