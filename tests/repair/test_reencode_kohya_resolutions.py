"""`cachedoctor fix --reencode` of kohya's multi-resolution npz: a FLUX npz holds a latent per
resolution it was cached at (`latents_<h>x<w>`, `original_size_<h>x<w>`, `crop_ltrb_<h>x<w>`,
with flip_aug `latents_flipped_<h>x<w>`), and sd-scripts' strategy_base.py
`save_latents_to_disk` (kohya-ss/sd-scripts 48d368fa) loads the file it writes to and adds its
keys. The re-encoded file must do the same: the bucket's keys written, every other key as it
was; `undo` puts the tree back byte for byte.

The project is fixtures/projects/kohya.py's (resolution 256, images the size of their bucket)
with `skip_cache_check`: an npz without its bucket's key is CD302 (layouts/kohya.loaded_shape)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from repair_helpers import isolated_state, tree_digest  # noqa: F401

from cachedoctor.fixtures.projects import encode, kohya
from cachedoctor.layouts.kohya import Buckets
from cachedoctor.repair.encoders import ReferenceEncoder
from cachedoctor.repair.reencode import pixels

from conftest import by_code, invoke, run_cli, scan_paths

EARLIER = {128: Buckets.make(True, (128, 128), 128, 512, 64, False),
           192: Buckets.make(True, (192, 192), 128, 512, 64, False)}
LACKING = "img_000"  # cached at 128 and 192 only: no latents_32x32 for its 256x256 bucket
RUN_ID = re.compile(r"Applying run (\S+) ")


def project(tmp_path: Path, flip_aug: bool = False) -> tuple[Path, Path]:
    """Every image's `_flux.npz` as sd-scripts leaves it after caching passes at 128, 192 and
    256, but LACKING's, which missed the 256 pass."""
    built = kohya.build(tmp_path / "k")
    folder = built.root / "train" / kohya.DATASET
    for old in folder.glob("*_sdxl.npz"):
        old.unlink()
    built.config.write_text(built.config.read_text().replace(
        "[dataset_arguments]\n", "[dataset_arguments]\nskip_cache_check = true\n"))
    if flip_aug:
        toml = built.root / "dataset.toml"
        toml.write_text(toml.read_text().replace("[general]\n", "[general]\nflip_aug = true\n"))
    for seed, image in enumerate(sorted(folder.glob("*.png"))):
        width, height = Image.open(image).size
        target = folder / kohya.npz_name(image, width, height, "flux")
        for resolution in (128, 192) if image.stem == LACKING else (128, 192, 256):
            bucket = EARLIER[resolution].select(width, height) if resolution in EARLIER \
                else (width, height)
            kohya.add_resolution(target, image, width, height, seed, bucket)
            if flip_aug:  # save_latents_to_disk's flipped latent, written in the same pass
                with np.load(target) as npz:
                    arrays = {key: npz[key] for key in npz.files}
                flipped = encode(image, *bucket, seed + 1000, channels=16, dtype="float32")
                arrays[f"latents_flipped_{bucket[1] // 8}x{bucket[0] // 8}"] = flipped.numpy()
                np.savez(target, **arrays)
    return built.config, folder


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


@pytest.mark.parametrize("flip_aug", [False, True], ids=["plain", "flip_aug"])
def test_reencode_keeps_the_other_resolutions(flip_aug: bool, tmp_path: Path) -> None:
    config, folder = project(tmp_path, flip_aug)
    target = next(folder.glob(f"{LACKING}_*_flux.npz"))
    before_tree = tree_digest(config.parent)
    before = arrays_of(target)
    assert [Path(f.path) for f in by_code(scan_paths(config), "CD302")] == [target]

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    after = arrays_of(target)
    made = {"latents_32x32", "original_size_32x32", "crop_ltrb_32x32"} | \
        ({"latents_flipped_32x32"} if flip_aug else set())
    assert set(after) == set(before) | made, sorted(after)
    for key, value in before.items():  # the 128 and 192 passes' keys, bit for bit
        assert after[key].dtype == value.dtype and after[key].tobytes() == value.tobytes(), key
    rgb = pixels(str(next(folder.glob(f"{LACKING}.png"))), None)
    reference = ReferenceEncoder()
    assert np.array_equal(after["latents_32x32"], reference.encode(rgb, 16).numpy())
    if flip_aug:  # the cropped image mirrored left to right (strategy_base.py torch.flip dims=[3])
        assert np.array_equal(after["latents_flipped_32x32"],
                              reference.encode(rgb.flip(-1), 16).numpy())
        assert not np.array_equal(after["latents_flipped_32x32"], after["latents_32x32"])
    assert after["original_size_32x32"].tolist() == [256, 256]
    assert after["crop_ltrb_32x32"].tolist() == [0, 0, 256, 256]
    assert [f for f in scan_paths(config).findings if f.severity >= 2] == []

    assert invoke("undo").exit_code == 0
    assert tree_digest(config.parent) == before_tree


def test_the_real_command_keeps_them_and_undo_restores(tmp_path: Path) -> None:
    config, folder = project(tmp_path)
    target = next(folder.glob(f"{LACKING}_*_flux.npz"))
    before_tree = tree_digest(config.parent)

    result = run_cli("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.returncode == 0, result.stderr
    assert "reencode 1/1" in result.stdout, result.stdout
    assert {"latents_16x16", "latents_24x24", "latents_32x32"} <= set(arrays_of(target))
    assert run_cli("undo", RUN_ID.search(result.stdout)[1]).returncode == 0
    assert tree_digest(config.parent) == before_tree


def test_a_latent_s_own_alpha_mask_is_a_plan_note(tmp_path: Path) -> None:
    """cachedoctor makes no alpha mask: an npz holding one for the latent it would write is
    left as it is (quarantined), with the reason."""
    config, folder = project(tmp_path)
    target = next(folder.glob(f"{LACKING}_*_flux.npz"))
    arrays = arrays_of(target)
    arrays["alpha_mask_32x32"] = np.ones((256, 256), dtype=np.float32)
    np.savez(target, **arrays)

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert "alpha_mask_32x32, which cachedoctor does not make" in result.output, result.output
    assert not target.exists()


def test_a_missing_image_s_entry_is_written_from_multi_resolution_neighbours(
        tmp_path: Path) -> None:
    """Every neighbour holds three resolutions: their format is that of each (a file of several
    resolutions was no neighbour before)."""
    config, folder = project(tmp_path)
    gone = next(folder.glob("img_101_*_flux.npz"))
    gone.unlink()
    target = next(folder.glob(f"{LACKING}_*_flux.npz"))
    target.unlink()

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert set(arrays_of(gone)) == {"latents_24x40", "original_size_24x40", "crop_ltrb_24x40"}
    assert torch.from_numpy(arrays_of(gone)["latents_24x40"]).shape == (16, 24, 40)


def test_a_file_lacking_its_flipped_latent_gets_one_and_keeps_the_rest(tmp_path: Path) -> None:
    """CD302 for a missing `latents_flipped_<h>x<w>` (flip_aug, skip_cache_check): the fix
    encodes that resolution again with its flipped latent; the other resolutions stay."""
    config, folder = project(tmp_path, flip_aug=True)
    target = next(folder.glob("img_101_*_flux.npz"))
    arrays = arrays_of(target)
    del arrays["latents_flipped_24x40"]
    np.savez(target, **arrays)
    found = {Path(f.path): f.message for f in by_code(scan_paths(config), "CD302")}
    assert set(found) == {target, next(folder.glob(f"{LACKING}_*_flux.npz"))}
    assert found[target].startswith("no latents_flipped_24x40 for bucket 320x192"), found

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    after = arrays_of(target)
    assert set(after) == set(arrays) | {"latents_flipped_24x40"}
    for key in (k for k in arrays if not k.endswith("_24x40")):
        assert after[key].tobytes() == arrays[key].tobytes(), key
    assert [f for f in scan_paths(config).findings if f.severity >= 2] == []
