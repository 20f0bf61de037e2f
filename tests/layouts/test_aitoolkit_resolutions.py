"""ai-toolkit datasets with a list of resolutions (`resolution: [128, 192]`, as its example
configs): ai-toolkit splits such a dataset into one per resolution (config_modules.py
preprocess_dataset_raw_config), all caching into one `_latent_cache`, so an image has one entry
per distinct bucket. The geometry below is worked out by hand from toolkit/buckets.py
get_bucket_for_image_size and BucketsMixin.setup_buckets (bucket_tolerance 64, centre crop)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from cachedoctor.fixtures.projects import aitoolkit, encode, images
from cachedoctor.layouts.aitoolkit import Buckets, bucket_for, latent_hash

from conftest import by_code, codes, invoke, scan_paths

# image (w, h) -> (scale_to_w, scale_to_h, crop_x, crop_y, crop_w, crop_h) at 128 and at 192
BY_HAND = {
    (128, 128): ((128, 128, 0, 0, 128, 128), (128, 128, 0, 0, 128, 128)),  # one bucket, one file
    (192, 128): ((192, 128, 32, 0, 128, 128), (192, 128, 0, 0, 192, 128)),
    (128, 192): ((128, 192, 0, 32, 128, 128), (128, 192, 0, 0, 128, 192)),
}


def test_buckets_follow_ai_toolkit() -> None:
    assert bucket_for(192, 128, 128, 64) == (128, 128)  # 128x64, 128x128, 192x64 fit; nearest
    assert bucket_for(1000, 600, 512, 64) == (640, 384)  # the only candidate under 512²
    assert bucket_for(192, 128, 192, 64) == (192, 128)  # under the cap: its own size
    buckets = Buckets((128, 192))
    for size, geometries in BY_HAND.items():
        assert tuple(buckets.geometry(size, r) for r in (128, 192)) == geometries
        assert buckets.crops(size) == list(dict.fromkeys(g[4:] for g in geometries))
    assert Buckets((512,), square=True).geometry((1000, 600), 512) == (854, 512, 171, 0, 512, 512)


def write_entry(folder: Path, image: Path, geometry: tuple, seed: int) -> Path:
    """ai-toolkit's entry for `image` at one bucket: the info dict hashed into the name and kept
    (as strings) in the header, as toolkit/dataloader_mixins.py and metadata.py write them."""
    keys = ("scale_to_width", "scale_to_height", "crop_x", "crop_y", "crop_width", "crop_height")
    info = {"filename": image.name, **dict(zip(keys, geometry, strict=True)),
            "latent_space_version": "sdxl", "latent_version": 1}
    metadata = {k: str(v) for k, v in info.items()}
    metadata["software"] = json.dumps({"name": "ai-toolkit", "url": "https://github.com/ostris/ai-toolkit"})
    metadata["format"] = "pt"
    latent = encode(image, geometry[4], geometry[5], seed, dtype="bfloat16")
    path = folder / "_latent_cache" / f"{image.stem}_{latent_hash(info)}.safetensors"
    save_file({"latent": latent.contiguous()}, str(path), metadata=metadata)
    return path


def project(tmp_path: Path) -> tuple[Path, Path, dict[str, list[Path]]]:
    built = aitoolkit.build(tmp_path / "ait")
    folder = built.root / "datasets" / "person"
    for old in (folder / "_latent_cache").iterdir():
        old.unlink()
    built.config.write_text(built.config.read_text().replace("resolution: [ 128 ]",
                                                            "resolution: [ 128, 192 ]"))
    entries = {}
    for path, width, height, seed in images(folder):  # rewrites the same images
        distinct = dict.fromkeys(BY_HAND[(width, height)])
        entries[path.name] = [write_entry(folder, path, g, seed) for g in distinct]
    return built.config, folder, entries


def test_a_complete_multi_resolution_cache_is_clean(tmp_path: Path) -> None:
    config, _, _ = project(tmp_path)
    assert not [f for f in scan_paths(config).findings if f.severity >= 2]


def test_one_resolution_s_entry_gone_is_cd404_and_reencode_writes_that_one(tmp_path: Path) -> None:
    config, folder, entries = project(tmp_path)
    [small, large] = entries["img_100.png"]  # a 192x128 image: 128x128 and 192x128 buckets
    small.unlink()

    (missing,) = by_code(scan_paths(config), "CD404")
    assert missing.path == str(folder / "img_100.png")
    assert "128x128 bucket" in missing.message, missing.message
    assert not by_code(scan_paths(config), "CD405")  # its 192x128 entry is no orphan

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert small.exists() and large.exists()  # ai-toolkit's own name: the hash of its info
    assert not codes(scan_paths(config))


def test_a_quarantined_entry_is_encoded_again_at_its_own_resolution(tmp_path: Path) -> None:
    """The empty 128x128 entry of a 192x128 image: no header, so the resolution is the one
    whose info gives the hash in its name (not the other resolution of the same image size)."""
    config, _, entries = project(tmp_path)
    small, _ = entries["img_101.png"]
    small.write_bytes(b"")
    assert "CD102" in codes(scan_paths(config))

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert small.stat().st_size > 0

    with safe_open(str(small), "pt") as f:
        assert f.metadata()["crop_width"] == "128" and f.get_tensor("latent").shape == (4, 16, 16)
    assert not codes(scan_paths(config))
