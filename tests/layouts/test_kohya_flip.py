"""kohya sd-scripts with flip_aug: a cached npz holds a flipped latent beside each latent
(`latents_flipped_<h>x<w>` in multi-resolution files, `latents_flipped` in SD/SDXL and legacy
`<stem>.npz` ones), written by strategy_base.py `save_latents_to_disk` (kohya-ss/sd-scripts
48d368fa). A file without it is encoded again, unless `skip_cache_check`: then
`_default_load_latents_from_disk` gives None for it and train_util.py's BaseDataset.__getitem__
stops with TypeError at the first sample it flips. CD302 reports such a file.

The project is fixtures/projects/kohya.py's (resolution 256, images the size of their bucket)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cachedoctor.fixtures.clean import kohya_arrays
from cachedoctor.fixtures.projects import encode, kohya

from conftest import by_code, scan_paths

FLIPPED = "img_101"  # its npz lacks the flipped latent


def alarms(config: Path, **options) -> list:
    return [f for f in scan_paths(config, **options).findings if f.severity >= 2]


def project(tmp_path: Path, arch: str = "flux", flip_aug: str | None = "subset",
            skip: str | None = "skip_cache_check", lacking: tuple[str, ...] = (FLIPPED,),
            network: bool = True) -> tuple[Path, Path]:
    """The kohya project with one npz per image as sd-scripts writes it with flip_aug: FLUX's
    size-keyed (`_flux.npz`), SDXL's unsuffixed (`_sdxl.npz`) or the legacy `<stem>.npz`
    ("legacy"); the images in `lacking` without the flipped latent. `flip_aug`: where the
    config sets it ("subset", "general", "argument"; None: nowhere); `skip`: the argument that
    is set (skip_cache_check, skip_latents_validity_check; None: neither); `network`: a LoRA
    config (network_module set)."""
    built = kohya.build(tmp_path / "k")
    folder = built.root / "train" / kohya.DATASET
    for old in folder.glob("*_sdxl.npz"):
        old.unlink()
    config = built.config.read_text()
    arguments = "".join(f"{key} = true\n" for key in (skip, flip_aug == "argument" and "flip_aug")
                        if key)
    config = config.replace("[dataset_arguments]\n", "[dataset_arguments]\n" + arguments)
    if not network:
        config = "".join(line for line in config.splitlines(keepends=True)
                         if not line.startswith("network_module"))
    built.config.write_text(config)
    toml = built.root / "dataset.toml"
    text = toml.read_text()
    if flip_aug == "subset":
        text = text.replace('class_tokens = "person"\n', 'class_tokens = "person"\n  flip_aug = true\n')
    elif flip_aug == "general":
        text = text.replace("[general]\n", "[general]\nflip_aug = true\n")
    toml.write_text(text)
    for seed, image in enumerate(sorted(folder.glob("*.png"))):
        width, height = Image.open(image).size
        flip = image.stem not in lacking
        if arch == "flux":
            target = folder / kohya.npz_name(image, width, height, "flux")
            kohya.add_resolution(target, image, width, height, seed, (width, height))
            if flip:  # what save_latents_to_disk adds with flip_aug: the mirrored image's encode
                with np.load(target) as npz:
                    arrays = {key: npz[key] for key in npz.files}
                latent = _flipped(image, width, height, seed, channels=16)
                arrays[f"latents_flipped_{height // 8}x{width // 8}"] = latent
                np.savez(target, **arrays)
            continue
        arrays = kohya_arrays(encode(image, width, height, seed, dtype="float32"))
        if flip:
            arrays["latents_flipped"] = _flipped(image, width, height, seed, channels=4)
        name = f"{image.stem}.npz" if arch == "legacy" else kohya.npz_name(image, width, height)
        np.savez(folder / name, **arrays)
    return built.config, folder


def _flipped(image: Path, width: int, height: int, seed: int, channels: int) -> np.ndarray:
    """A float32 latent standing for the encode of the mirrored image (its own values)."""
    return encode(image, width, height, seed + 1000, channels=channels, dtype="float32").numpy()


def npz_of(folder: Path, stem: str) -> Path:
    return next(p for p in folder.glob(f"{stem}*.npz") if not p.name.endswith("_te_outputs.npz"))


def test_sd_scripts_fails_on_the_first_flipped_sample_of_such_a_file(tmp_path: Path) -> None:
    """What the finding says, as the trainer's own calls do it on the file: np.load, the flipped
    key looked up and None taken for it (`_default_load_latents_from_disk`), then
    torch.FloatTensor of the latent a flipped sample uses (BaseDataset.__getitem__)."""
    _, folder = project(tmp_path)
    with np.load(npz_of(folder, FLIPPED)) as npz:
        key = "latents_flipped_24x40"
        flipped = npz.get(key)  # a Mapping: None for a missing key
        assert "latents_24x40" in npz
    with pytest.raises(TypeError, match=r"must be a sequence \(got NoneType\)"):
        torch.FloatTensor(flipped)


@pytest.mark.parametrize("where", ["subset", "general", "argument"])
def test_with_flip_aug_and_skip_cache_check_a_missing_flipped_latent_is_cd302(
        where: str, tmp_path: Path) -> None:
    config, folder = project(tmp_path, flip_aug=where)
    found = alarms(config)
    assert [(f.code, Path(f.path).name) for f in found] == \
        [("CD302", npz_of(folder, FLIPPED).name)], found
    assert found[0].message.startswith(
        "no latents_flipped_24x40 for bucket 320x192: with flip_aug and skip_cache_check, "
        "sd-scripts does not encode it again"), found[0].message
    assert found[0].details["missing"] == "latents_flipped_24x40"


@pytest.mark.parametrize("arch", ["sdxl", "legacy"])
def test_an_unsuffixed_npz_without_latents_flipped_is_cd302(arch: str, tmp_path: Path) -> None:
    """SD/SDXL npz (and the legacy `<stem>.npz` SD/SDXL read first) keep `latents_flipped`."""
    config, folder = project(tmp_path, arch)
    found = by_code(scan_paths(config), "CD302")
    assert [Path(f.path).name for f in found] == [npz_of(folder, FLIPPED).name]
    assert found[0].message.startswith("no latents_flipped for bucket 320x192: "), found[0].message


def test_the_deprecated_flag_of_flux_fine_tuning_counts_too(tmp_path: Path) -> None:
    """flux_train.py maps --skip_latents_validity_check onto skip_cache_check; a LoRA config
    (network_module) ignores it and encodes the image again."""
    config, folder = project(tmp_path, skip="skip_latents_validity_check")
    assert alarms(config) == []
    config, folder = project(tmp_path / "full", skip="skip_latents_validity_check", network=False)
    assert [Path(f.path).name for f in by_code(scan_paths(config), "CD302")] == \
        [npz_of(folder, FLIPPED).name]


@pytest.mark.parametrize("arch", ["flux", "sdxl", "legacy"])
@pytest.mark.parametrize("case", ["without-skip_cache_check", "without-flip_aug", "every-key"])
def test_clean_cases_do_not_fire(case: str, arch: str, tmp_path: Path) -> None:
    """Without skip_cache_check the image is encoded again and the key added; without flip_aug
    no flipped latent is read; with every flipped latent nothing is missing."""
    options = {"without-skip_cache_check": {"skip": None}, "without-flip_aug": {"flip_aug": None},
               "every-key": {"lacking": ()}}[case]
    config, _ = project(tmp_path, arch, **options)
    assert alarms(config) == []


def test_a_flip_aug_that_is_no_bool_is_cd409(tmp_path: Path) -> None:
    config, _ = project(tmp_path, flip_aug=None)
    toml = config.parent / "dataset.toml"
    toml.write_text(toml.read_text().replace("[general]\n", '[general]\nflip_aug = "yes"\n'))
    found = by_code(scan_paths(config), "CD409")
    assert len(found) == 1 and "flip_aug is" in found[0].message, found
    assert not by_code(scan_paths(config), "CD302")


def test_the_index_keeps_the_missing_key(tmp_path: Path) -> None:
    """A rescan takes the file's summary from the index: the finding stands."""
    config, _ = project(tmp_path)
    past = time.time() - 3600
    for path in config.parent.rglob("*"):
        if path.is_file():
            os.utime(path, (past, past))
    first = scan_paths(config, index=True)
    again = scan_paths(config, index=True)
    assert again.index["reused"] > 0
    assert [(f.path, f.message) for f in by_code(again, "CD302")] == \
        [(f.path, f.message) for f in by_code(first, "CD302")] != []
