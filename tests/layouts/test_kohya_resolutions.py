"""kohya sd-scripts' multi-resolution npz: FLUX, SD3, Lumina, Anima and HunyuanImage key each
latent by its size (`latents_<h>x<w>`), and a later run at another resolution adds its keys to
the same file (strategy_base.py `save_latents_to_disk`, kohya-ss/sd-scripts 48d368fa). The
trainer reads the key of the image's bucket: a file without it is encoded again, unless
`skip_cache_check`, where loading it raises ValueError mid-training.

The project is fixtures/projects/kohya.py's (resolution 256, images the size of their bucket),
its SDXL latents replaced by FLUX ones written by passes at resolution 192 and/or 256."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cachedoctor.fixtures.clean import kohya_arrays
from cachedoctor.fixtures.projects import encode, kohya
from cachedoctor.layouts import resolve
from cachedoctor.layouts.kohya import Buckets

from conftest import by_code, scan_paths

# the dataset's bucket settings at resolution 192 and 128: earlier runs' buckets
AT_192 = Buckets.make(True, (192, 192), 128, 512, 64, False)
EARLIER = {192: AT_192, 128: Buckets.make(True, (128, 128), 128, 512, 64, False)}


def alarms(config: Path) -> list:
    return [f for f in scan_paths(config).findings if f.severity >= 2]


def project(tmp_path: Path, passes: Iterable[int] | dict[str, Iterable[int]],
            skip_cache_check: bool = False, flag: str = "skip_cache_check",
            second: int | None = None) -> tuple[Path, Path]:
    """The kohya project with a `_flux.npz` per image holding the caching passes' resolutions
    (128, 192, 256) in that order; `passes` maps an image stem to its own, the others get "*"'s.
    `flag`: the argument that sets skip_cache_check; `second`: the resolution of a second
    [[datasets]] on the same image dir (training one set of images at two resolutions)."""
    built = kohya.build(tmp_path / "k")
    folder = built.root / "train" / kohya.DATASET
    for old in folder.glob("*_sdxl.npz"):
        old.unlink()
    if skip_cache_check:
        config = built.config.read_text()
        built.config.write_text(config.replace("[dataset_arguments]\n",
                                               f"[dataset_arguments]\n{flag} = true\n"))
    if second is not None:
        toml = built.root / "dataset.toml"
        text = toml.read_text()
        first = text[text.index("[[datasets]]"):]
        toml.write_text(text + "\n" + first.replace("resolution = 256",
                                                     f"resolution = {second}"))
    plan = passes if isinstance(passes, dict) else {"*": passes}
    for seed, image in enumerate(sorted(folder.glob("*.png"))):
        width, height = Image.open(image).size
        target = folder / kohya.npz_name(image, width, height, "flux")
        for resolution in plan.get(image.stem, plan["*"]):
            bucket = (width, height) if resolution == 256 else \
                EARLIER[resolution].select(width, height)
            kohya.add_resolution(target, image, width, height, seed, bucket)
    return built.config, folder


def test_an_npz_of_another_resolution_is_encoded_again_so_no_finding(tmp_path: Path) -> None:
    """Every npz holds only the 192 run's keys: sd-scripts finds no `latents_<h>x<w>` of the 256
    buckets, encodes each image again and adds the keys. Before, CD302 fired on each file."""
    config, _ = project(tmp_path, (192,))
    assert alarms(config) == []


def test_with_skip_cache_check_an_npz_without_its_bucket_s_key_is_cd302(tmp_path: Path) -> None:
    """Told skip_cache_check, sd-scripts trusts any npz that exists: one lacking its bucket's
    key (whatever other sizes it holds) stops training when it is loaded."""
    lacking = {"img_000": (192,), "img_101": (192,), "img_202": (128, 192)}
    config, folder = project(tmp_path, {**lacking, "*": (192, 256)}, skip_cache_check=True)
    report = scan_paths(config)
    found = {Path(f.path).name: f for f in by_code(report, "CD302")}
    assert set(found) == {next(folder.glob(f"{stem}_*_flux.npz")).name for stem in lacking}
    first = found["img_000_0256x0256_flux.npz"]
    assert first.message.startswith("no latents_32x32 for bucket 256x256 (it holds a 24x24 "
                                    "latent): with skip_cache_check"), first.message
    assert first.details["expected"] == [32, 32]
    assert "no latents_24x40 for bucket 320x192" in found["img_101_0320x0192_flux.npz"].message
    assert "no latents_40x24 for bucket 192x320" in found["img_202_0192x0320_flux.npz"].message
    # CD301 says the same of the bucket's odd ones out; nothing else is raised
    assert {f.code for f in report.findings if f.severity >= 2} <= {"CD301", "CD302"}


@pytest.mark.parametrize("skip_cache_check", [False, True])
@pytest.mark.parametrize("passes", [(256,), (192, 256), (256, 192)],
                         ids=["one-resolution", "192-then-256", "256-then-192"])
def test_an_npz_holding_its_bucket_s_key_is_clean(passes: tuple[int, ...], skip_cache_check: bool,
                                                   tmp_path: Path) -> None:
    config, _ = project(tmp_path, passes, skip_cache_check)
    assert alarms(config) == []


@pytest.mark.parametrize("skip_cache_check", [False, True])
def test_sdxl_npz_with_pr_2269_keys_are_judged_by_their_bucket_s_key(skip_cache_check: bool,
                                                                     tmp_path: Path) -> None:
    """SD/SDXL npz with suffixed keys come from sd-scripts with PR #2269 (refs/pull/2269/head
    58f7b4cd): it reads `latents_<h>x<w>` and keeps the unsuffixed `latents` of an older run,
    whatever its size. An npz of 48d368fa's (its one `latents` read unchecked) of the 192 run is
    still CD302."""
    config, folder = project(tmp_path, (), skip_cache_check)
    for n, image in enumerate(sorted(folder.glob("*.png"))):
        width, height = Image.open(image).size
        target = folder / kohya.npz_name(image, width, height)
        old = encode(image, *AT_192.select(width, height), n, dtype="float32")
        np.savez(target, **kohya_arrays(old))
        if n:
            kohya.add_resolution(target, image, width, height, n, (width, height), channels=4)
    report = scan_paths(config)
    assert [Path(f.path).name for f in report.findings if f.severity >= 2 and f.code != "CD301"] \
        == ["img_000_0256x0256_sdxl.npz"]
    (only,) = by_code(report, "CD302")
    assert only.message.startswith("latent is 24x24 (h x w); bucket 256x256 needs 32x32")


# -- two datasets on one image dir (FLUX at two resolutions), --skip_latents_validity_check ------


def test_two_datasets_on_one_dir_each_judge_the_npz_under_skip_cache_check(tmp_path: Path) -> None:
    """Datasets at 256 and 192 on one image dir share its npz files (kohya names them by the
    image's size): sd-scripts loads each for both datasets, so under skip_cache_check one that
    lacks the 192 dataset's key stops training even when it holds the 256 one's. The datasets
    get ids of their own."""
    lacking = {"img_000": (256,), "img_101": (256,)}
    config, folder = project(tmp_path, {**lacking, "*": (192, 256)}, skip_cache_check=True,
                             second=192)
    report = scan_paths(config)
    assert [d.id for d in resolve([str(config)])[0].datasets] == ["10_person", "10_person (2)"]
    found = {Path(f.path).name: f for f in by_code(report, "CD302")}
    assert set(found) == {next(folder.glob(f"{stem}_*_flux.npz")).name for stem in lacking}
    first = found["img_000_0256x0256_flux.npz"]
    assert first.message.startswith("no latents_24x24 for bucket 192x192 (it holds a 32x32 "
                                    "latent): with skip_cache_check"), first.message
    assert {f.code for f in report.findings if f.severity >= 2} <= {"CD301", "CD302"}


@pytest.mark.parametrize("skip_cache_check", [False, True])
@pytest.mark.parametrize("passes", [(192, 256), (256, 192)], ids=["192-then-256", "256-then-192"])
def test_two_datasets_on_one_dir_with_every_key_are_clean(passes: tuple[int, ...],
                                                          skip_cache_check: bool,
                                                          tmp_path: Path) -> None:
    config, _ = project(tmp_path, passes, skip_cache_check, second=192)
    assert alarms(config) == []


def test_two_datasets_on_one_dir_without_skip_cache_check_are_encoded_again(tmp_path: Path) -> None:
    """Without skip_cache_check sd-scripts encodes the image again for the dataset whose key
    is missing and adds it to the file: nothing to report."""
    config, _ = project(tmp_path, (256,), second=192)
    assert alarms(config) == []


def test_skip_latents_validity_check_is_skip_cache_check_for_flux(tmp_path: Path) -> None:
    """flux_train.py (and sd3_, lumina_, anima_train.py, flux_train_control_net.py) map the
    deprecated --skip_latents_validity_check onto skip_cache_check at 48d368fa; the LoRA
    scripts do not."""
    config, folder = project(tmp_path, {"img_000": (192,), "*": (256,)}, skip_cache_check=True,
                             flag="skip_latents_validity_check")
    # a LoRA config (network_module: a *_train_network.py script) keeps the key unread, and
    # encodes the npz again
    assert "network_module" in config.read_text() and not by_code(scan_paths(config), "CD302")
    # flux_train.py's config (a full fine-tune: no network_module) is trusted as it is
    config.write_text("".join(line for line in config.read_text().splitlines(keepends=True)
                              if not line.startswith("network_module")))
    assert [Path(f.path).name for f in by_code(scan_paths(config), "CD302")] \
        == [next(folder.glob("img_000_*_flux.npz")).name]
