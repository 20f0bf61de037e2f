"""kohya sd-scripts fine-tuning subsets (`metadata_file`): kohya-ss/sd-scripts 48d368fa
library/config_util.py `FineTuningSubsetParams` makes image_dir optional, and train_util.py
`FineTuningDataset` takes the images from the metadata (a JSON object keyed by image path, or
`.jsonl` lines with `image_path`): an absolute key is the image itself, a relative one is joined
to image_dir (which it then asserts is set). The npz files sit beside the images
(`get_latents_npz_path(abs_path, ...)`), looked up in image_dir and every absolute key's folder.

A dataset TOML whose subset had only `metadata_file` was CD409 "has no image_dir" (an error on
a config sd-scripts trains with) and its caches went unchecked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cachedoctor.fixtures.clean import kohya_arrays
from cachedoctor.fixtures.projects import encode, kohya

from conftest import by_code, scan_paths


def fine_tuning(tmp_path: Path, metadata: str, image_dir: bool = False,
                relative: bool = False) -> tuple[Path, Path]:
    """The kohya project with its subset's image_dir swapped for a metadata file (`metadata`:
    its name) keyed by the images' absolute paths (relative to the folder with `relative`),
    image_dir kept with `image_dir`."""
    built = kohya.build(tmp_path / "k")
    folder = built.root / "train" / kohya.DATASET
    images = sorted(folder.glob("*.png"))
    keys = [image.name if relative else str(image) for image in images]
    path = built.root / metadata
    if metadata.endswith(".jsonl"):
        path.write_text("".join(json.dumps({"image_path": k, "caption": "a person"}) + "\n"
                                for k in keys))
    else:
        path.write_text(json.dumps({k: {"caption": "a person"} for k in keys}))
    toml = built.root / "dataset.toml"
    text = toml.read_text()
    line = next(x for x in text.splitlines() if x.strip().startswith("image_dir"))
    toml.write_text(text.replace(line, (line + "\n" if image_dir else "")
                                 + f'  metadata_file = "{metadata}"'))
    return built.config, folder


def alarms(target: Path) -> list:
    return [(f.code, f.message) for f in scan_paths(target).findings if f.severity >= 2]


@pytest.mark.parametrize("metadata", ["meta_lat.json", "meta.jsonl"])
@pytest.mark.parametrize("image_dir", [False, True])
def test_a_fine_tuning_subset_is_clean_and_its_caches_are_checked(
        tmp_path: Path, metadata: str, image_dir: bool) -> None:
    config, folder = fine_tuning(tmp_path, metadata, image_dir)
    report = scan_paths(config)
    assert [(f.code, f.message) for f in report.findings if f.severity >= 2] == []
    assert report.files >= len(list(folder.glob("*.npz"))) > 0  # before: 0, nothing scanned


def test_its_npz_of_another_size_is_still_cd302(tmp_path: Path) -> None:
    config, folder = fine_tuning(tmp_path, "meta_lat.json")
    image = sorted(folder.glob("*.png"))[0]
    width, height = Image.open(image).size
    target = folder / kohya.npz_name(image, width, height)
    np.savez(target, **kohya_arrays(encode(image, width + 64, height, 0, dtype="float32")))
    assert [Path(f.path).name for f in by_code(scan_paths(config), "CD302")] == [target.name]


def test_relative_keys_without_image_dir_are_cd409(tmp_path: Path) -> None:
    """sd-scripts: `assert subset.image_dir is not None, "image_dir is required when image
    paths are relative"`."""
    config, _ = fine_tuning(tmp_path, "meta_lat.json", relative=True)
    found = alarms(config)
    assert [code for code, _ in found] == ["CD409"]
    assert "needs image_dir" in found[0][1]
    config, _ = fine_tuning(tmp_path / "2", "meta_lat.json", image_dir=True, relative=True)
    assert alarms(config) == []


def test_a_missing_metadata_file_is_cd408(tmp_path: Path) -> None:
    config, _ = fine_tuning(tmp_path, "meta_lat.json")
    (config.parent / "meta_lat.json").unlink()
    assert [code for code, _ in alarms(config)] == ["CD408"]
