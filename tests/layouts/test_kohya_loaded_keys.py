"""kohya sd-scripts reads `original_size` and `crop_ltrb` with every latent it loads, and never
checks for them: kohya-ss/sd-scripts 48d368fa `library/strategy_base.py`
`_default_is_disk_cached_latents_expected` looks only for `latents<suffix>` (with flip_aug
`latents_flipped<suffix>`, with alpha_mask `alpha_mask<suffix>`), then
`_default_load_latents_from_disk` reads `npz["original_size" + suffix]` and
`npz["crop_ltrb" + suffix]`. Run against caches written by that code (`save_latents_to_disk`
through `_default_cache_batch_latents`, CPU, a stand-in VAE), a file without one of them passed
the check and `load_latents_from_disk` raised `KeyError: 'crop_ltrb is not a file in the
archive'`, with or without skip_cache_check; cachedoctor scanned it clean, with and without
--deep. An npz of the 2023-06/07 `crop_left_top` naming (9e9df2b5 to 0ec71660) is one.
Without skip_cache_check, a flip_aug file lacking its flipped latent is encoded again (and the
key added), whatever else it lacks: no finding.

The project is fixtures/projects/kohya.py's; the npz keys and dtypes are save_latents_to_disk's
(int64 `original_size`, float64 `crop_ltrb` from get_crop_ltrb)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cachedoctor.fixtures.clean import kohya_arrays
from cachedoctor.fixtures.projects import encode, kohya

from conftest import by_code, scan_paths

BROKEN = "img_101"


def project(tmp_path: Path, arch: str, drop: str | None, options: str = "",
            subset: str = "") -> tuple[Path, Path]:
    """The kohya project with one npz per image as save_latents_to_disk writes it for `arch`
    (sdxl: `latents`, flux: `latents_<h>x<w>` and the same suffix on the others); BROKEN's npz
    without `drop` (the key's base name), `options` added to the arguments, `subset` to the
    dataset TOML's subset."""
    built = kohya.build(tmp_path / "k")
    folder = built.root / "train" / kohya.DATASET
    for old in folder.glob("*_sdxl.npz"):
        old.unlink()
    if options:
        built.config.write_text(built.config.read_text().replace(
            "[dataset_arguments]\n", "[dataset_arguments]\n" + options))
    if subset:
        toml = built.root / "dataset.toml"
        toml.write_text(toml.read_text().replace('class_tokens = "person"\n',
                                                 'class_tokens = "person"\n' + subset))
    for seed, image in enumerate(sorted(folder.glob("*.png"))):
        width, height = Image.open(image).size
        channels = 16 if arch == "flux" else 4
        arrays = kohya_arrays(encode(image, width, height, seed, channels=channels,
                                     dtype="float32"))
        arrays["crop_ltrb"] = arrays["crop_ltrb"].astype(np.float64)
        if "flip_aug" in subset:
            arrays["latents_flipped"] = arrays["latents"][:, :, ::-1].copy()
        if image.stem == BROKEN and drop is not None:
            del arrays[drop]
        suffix = f"_{height // 8}x{width // 8}" if arch == "flux" else ""
        np.savez(folder / kohya.npz_name(image, width, height, arch),
                 **{key + suffix: value for key, value in arrays.items()})
    return built.config, folder


def alarms(target: Path, **options) -> list:
    return [f for f in scan_paths(target, **options).findings if f.severity >= 2]


@pytest.mark.parametrize("arch", ["sdxl", "flux"])
@pytest.mark.parametrize("drop", ["original_size", "crop_ltrb"])
@pytest.mark.parametrize("options", ["", "skip_cache_check = true\n"])
def test_an_npz_sd_scripts_loads_without_original_size_or_crop_ltrb_is_cd302(
        tmp_path: Path, arch: str, drop: str, options: str) -> None:
    config, folder = project(tmp_path, arch, drop, options)
    image = folder / f"{BROKEN}.png"
    width, height = Image.open(image).size
    key = drop + (f"_{height // 8}x{width // 8}" if arch == "flux" else "")
    for deep in (False, True):
        report = scan_paths(config, deep=deep)
        found = by_code(report, "CD302")
        assert [Path(f.path).name for f in found] == [kohya.npz_name(image, width, height, arch)]
        assert found[0].details["missing"] == key
        assert f"KeyError: '{key} is not a file in the archive'" in found[0].message
        assert [f.code for f in report.findings if f.severity >= 2] == ["CD302"]


@pytest.mark.parametrize("arch", ["sdxl", "flux"])
def test_the_bare_image_dir_reports_it_too(tmp_path: Path, arch: str) -> None:
    """A bare dir has no bucket settings: the SD/SDXL `latents` it loads is known all the same
    (a FLUX file's key needs the bucket, so nothing is judged there)."""
    _, folder = project(tmp_path, arch, "crop_ltrb")
    found = [Path(f.path).name for f in by_code(scan_paths(folder), "CD302")]
    assert found == ([kohya.npz_name(folder / f"{BROKEN}.png",
                                     *Image.open(folder / f"{BROKEN}.png").size, arch)]
                     if arch == "sdxl" else [])


@pytest.mark.parametrize("arch", ["sdxl", "flux"])
def test_every_key_held_is_clean(tmp_path: Path, arch: str) -> None:
    config, folder = project(tmp_path, arch, None)
    assert alarms(config) == []
    assert alarms(config, deep=True) == []
    assert alarms(folder) == []


def test_with_flip_aug_a_file_lacking_its_flipped_latent_is_encoded_again_so_no_finding(
        tmp_path: Path) -> None:
    """is_disk_cached_latents_expected is false for it: save_latents_to_disk rewrites the file
    with every key (it keeps the ones it holds and adds the latent's own)."""
    config, _ = project(tmp_path, "sdxl", "latents_flipped", subset="  flip_aug = true\n")
    assert alarms(config) == []


def test_a_flux_npz_from_before_multi_resolution_keys_is_cd302_under_skip_cache_check(
        tmp_path: Path) -> None:
    """Before 6ab48b09 (2024-08-20) sd-scripts wrote FLUX latents unsuffixed (`latents`,
    `original_size`, `crop_ltrb`). 48d368fa's FluxLatentsCachingStrategy reads only
    `latents_<h>x<w>`: without skip_cache_check the file is encoded again (the key added), with
    it `load_latents_from_disk` raised `ValueError: latents_56x72 not found in <file>` (run on
    such a file). The latent being of the bucket's size, no shape showed it: the scan was clean."""
    config, folder = project(tmp_path, "sdxl", None)
    for old in sorted(folder.glob("*_sdxl.npz")):
        old.rename(old.with_name(old.name.replace("_sdxl.npz", "_flux.npz")))
    assert alarms(config) == []
    config.write_text(config.read_text().replace(
        "[dataset_arguments]\n", "[dataset_arguments]\nskip_cache_check = true\n"))
    found = by_code(scan_paths(config), "CD302")
    assert len(found) == len(list(folder.glob("*_flux.npz"))) > 0
    image = folder / f"{BROKEN}.png"
    width, height = Image.open(image).size
    mine = next(f for f in found if Path(f.path).name == kohya.npz_name(image, width, height,
                                                                        "flux"))
    assert mine.details["missing"] == f"latents_{height // 8}x{width // 8}"
    assert "ValueError" in mine.message


def test_a_size_keyed_latent_of_another_size_is_no_skip_cache_check_message(
        tmp_path: Path) -> None:
    """A FLUX npz whose `latents_<h>x<w>` holds a latent of another size (a damaged or hand-made
    file): the key is there, so sd-scripts loads it, skip_cache_check or not; CD302 said "no
    latents_<h>x<w> ... with skip_cache_check", which the config did not set."""
    config, folder = project(tmp_path, "flux", None)
    image = folder / f"{BROKEN}.png"
    width, height = Image.open(image).size
    target = folder / kohya.npz_name(image, width, height, "flux")
    key = f"latents_{height // 8}x{width // 8}"
    with np.load(target) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays[key] = arrays[key][:, : height // 16]
    np.savez(target, **arrays)
    found = by_code(scan_paths(config), "CD302")
    assert [Path(f.path).name for f in found] == [target.name]
    assert "skip_cache_check" not in found[0].message
    assert found[0].details["actual"] == [height // 16, width // 8]


def test_a_bare_stem_npz_without_crop_ltrb_is_left_alone_but_judged_under_the_config(
        tmp_path: Path) -> None:
    """A `<stem>.npz` beside an image may be any tool's cache when no config says it is
    kohya's; under the config it is the legacy npz SD/SDXL read first (strategy_sd.py
    get_latents_npz_path), e.g. one of the 2023-06/07 `crop_left_top` naming."""
    config, folder = project(tmp_path, "sdxl", None)
    image = folder / f"{BROKEN}.png"
    width, height = Image.open(image).size
    target = folder / kohya.npz_name(image, width, height)
    with np.load(target) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["crop_left_top"] = arrays.pop("crop_ltrb")[:2]
    target.unlink()
    np.savez(folder / f"{BROKEN}.npz", **arrays)
    assert by_code(scan_paths(folder), "CD302") == []
    found = by_code(scan_paths(config), "CD302")
    assert [Path(f.path).name for f in found] == [f"{BROKEN}.npz"]
    assert found[0].details["missing"] == "crop_ltrb"
