"""SimpleTuner caches of the model families whose latents are not image/8, written as SimpleTuner
writes them (bghira/SimpleTuner bc8e6ab7): `simpletuner/helpers/caching/vae.py` saves, per
sample, the bare tensor its model's `post_vae_encode_transform_sample` and
`process_video_latents` make, one `[C, h, w]` for images and `[C, F, h, w]` for video:

- FLUX.2 (and ERNIE, Ideogram): 32 VAE channels patchified 2x2, `[128, H/16, W/16]`
  (`models/flux2/model.py`, `VAE_SCALE_FACTOR = 16`);
- Sana: DC-AE, `[32, H/32, W/32]`; LTX-Video: `[128, F', H/32, W/32]`;
- HunyuanVideo 1.5: `[32, F', H/16, W/16]`; Wan 2.2 TI2V-5B `[48, F', H/16, W/16]`;
- Qwen-Image and Wan 2.1/2.2-A14B: image/8 (Qwen's frame axis squeezed).

The bucket metadata keeps `target_size` in pixels, so the latent a bucket needs is
target_size / the family's factor, not / 8.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from cachedoctor.fixtures.latents import save_latent
from cachedoctor.fixtures.projects import encode, images, simpletuner
from cachedoctor.layouts.simpletuner import latent_factor

from conftest import by_code, scan_paths


def alarms(*targets: Path) -> list:
    return [f for f in scan_paths(*targets).findings if f.severity >= 2]


def build(root: Path, family: str, channels: int, factor: int, frames: int | None = None,
          flavour: str | None = None) -> tuple[Path, Path]:
    """The fixture project re-cached as `family` writes it; (config, VAE cache dir)."""
    project = simpletuner.build(root)
    main = json.loads(project.config.read_text())
    main["--model_family"] = family
    if flavour:
        main["--model_flavour"] = flavour
    project.config.write_text(json.dumps(main))
    shutil.rmtree(project.root / "output/models/cache/vae/sdxl")
    cache = project.root / f"output/models/cache/vae/{family}/photos"
    cache.mkdir(parents=True)
    text = project.root / f"cache/text/{family}"
    (project.root / "cache/text/sdxl").rename(text)
    for entry in text.iterdir():
        entry.rename(entry.with_name(entry.name.replace("-sdxl.pt", f"-{family}.pt")))
    for n, image in enumerate(sorted((project.root / "datasets/photos").glob("*.png"))):
        width, height = Image.open(image).size
        latent = encode(image, width * 8 // factor, height * 8 // factor, n, channels=channels,
                        dtype="bfloat16")
        if frames:  # a clip: [C, F, h, w]
            latent = torch.stack([latent] * frames, 1).clone()
        save_latent(cache / simpletuner.vae_name(image), latent, "gzip" if n % 2 else "zip")
    return project.config, cache


FAMILIES = [  # family, cached channels, spatial factor, latent frames, flavour
    ("flux2", 128, 16, None, None),
    ("sana", 32, 32, None, None),
    ("qwen_image", 16, 8, None, None),
    ("ltxvideo", 128, 32, 3, None),
    ("hunyuanvideo", 32, 16, 5, None),
    ("wan", 16, 8, 5, "t2v-480p-1.3b-2.1"),
    ("wan", 48, 16, 5, "ti2v-5b-2.2"),
]


@pytest.mark.parametrize(("family", "channels", "factor", "frames", "flavour"), FAMILIES)
def test_healthy_cache_of_each_family_is_clean(family: str, channels: int, factor: int,
                                               frames: int | None, flavour: str | None,
                                               tmp_path: Path) -> None:
    config, cache = build(tmp_path / "p", family, channels, factor, frames, flavour)
    assert not alarms(config)
    assert not alarms(cache)  # bare: no bucket sizes, no expectation


def test_flux2_latent_left_unpatchified_is_still_cd302(tmp_path: Path) -> None:
    config, cache = build(tmp_path / "p", "flux2", 128, 16)
    image = tmp_path / "p/datasets/photos/img_000.png"
    bad = cache / simpletuner.vae_name(image)
    save_latent(bad, encode(image, 128, 128, 0, channels=128, dtype="bfloat16"), "gzip")
    report = scan_paths(config)
    (finding,) = by_code(report, "CD302")
    assert finding.path == str(bad) and "bucket 1.0 needs 8x8" in finding.message
    assert [f.path for f in by_code(report, "CD301")] == [str(bad)]


def test_unknown_family_expects_no_size_but_bucket_majority_still_holds(tmp_path: Path) -> None:
    """cosmos3's cached latents are not known here: no CD302 against target_size / 8, while a
    latent of another shape than its bucket's others is still CD301."""
    config, cache = build(tmp_path / "p", "cosmos3", 16, 16)
    assert not alarms(config)
    image = tmp_path / "p/datasets/photos/img_001.png"
    bad = cache / simpletuner.vae_name(image)
    save_latent(bad, encode(image, 192, 192, 1, channels=16, dtype="bfloat16"), "gzip")
    report = scan_paths(config)
    assert by_code(report, "CD302") == []
    assert [f.path for f in by_code(report, "CD301")] == [str(bad)]


def test_conditioning_dataset_of_an_edit_model_is_clean(tmp_path: Path) -> None:
    """Kontext / Qwen-Image-Edit style: `conditioning_data` names a `dataset_type:
    conditioning` dataset, cached under its own id with its own bucket files."""
    project = simpletuner.build(tmp_path / "p")
    backend_file = project.root / "config/multidatabackend.json"
    backends = json.loads(backend_file.read_text())
    backends[0]["conditioning_data"] = "photos-edit"
    edit = project.root / "datasets/edit"
    written = images(edit, seed=3, caption=False)
    entry = {"id": "photos-edit", "type": "local", "dataset_type": "conditioning",
             "instance_data_dir": str(edit), "conditioning_type": "reference_strict",
             "resolution": 128, "resolution_type": "pixel_area",
             "cache_dir_vae": "output/models/cache/vae/{model_family}/{id}"}
    backends.insert(1, entry)
    backend_file.write_text(json.dumps(backends, indent=2))
    indices: dict[str, list[str]] = {}
    metadata = {}
    for path, width, height, _ in written:
        indices.setdefault(str(round(width / height, 2)), []).append(str(path))
        metadata[str(path)] = {"original_size": [width, height], "crop_coordinates": [0, 0],
                               "target_size": [width, height],
                               "intermediary_size": [width, height],
                               "aspect_ratio": round(width / height, 2)}
    (edit / "aspect_ratio_bucket_indices_photos-edit.json").write_text(
        json.dumps({"config": entry, "aspect_ratio_bucket_indices": indices}))
    (edit / "aspect_ratio_bucket_metadata_photos-edit.json").write_text(json.dumps(metadata))
    cache = project.root / "output/models/cache/vae/sdxl/photos-edit"
    cache.mkdir(parents=True)
    for path, width, height, seed in written:
        save_latent(cache / simpletuner.vae_name(path),
                    encode(path, width, height, seed, dtype="bfloat16"), "gzip")
    assert not alarms(project.config)
    assert not alarms(tmp_path / "p")


def test_latent_factor_by_family_and_flavour() -> None:
    assert latent_factor("sdxl") == latent_factor("unknown_model") == 8
    assert latent_factor("flux2") == latent_factor("hunyuanvideo") == 16
    assert latent_factor("sana") == latent_factor("ltxvideo2") == 32
    assert latent_factor("wan", "i2v-14b-2.2-high") == 8
    assert latent_factor("wan", "ti2v-5b-2.2") == 16
    assert latent_factor("cosmos3") is None
