"""Caches written by older versions of the trainers scan with no warning or error.

- musubi-tuner format_version "1.0.0" (kohya-ss/musubi-tuner 1e85379, 2024-12-31,
  dataset/image_video_dataset.py save_latent_cache / save_text_encoder_output_cache):
  HunyuanVideo only, `_hv` names, text keys `llm_<dtype>`, `llm_mask`, `clipL_<dtype>`.
  f1c23b1 (2025-03-05, Wan 2.1) moved to "1.0.1" with the same names and keys.
- ai-toolkit video latents before ff14cd63 (2025-10-21): no `num_frames` in the latent info
  (so neither in the header nor the hash), and before 7f3309b2 (2026-03-24) no 0-d
  `num_frames` tensor; video datasets held only clips until 8c1a4082 (2026-08-08).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import aitoolkit
from cachedoctor.layouts.musubi import select_bucket

from conftest import by_code, scan_paths

torch = pytest.importorskip("torch")
SEVERE = 2


def alarms(report) -> list:
    return [(f.code, Path(f.path).name, f.message) for f in report.findings
            if f.severity >= SEVERE]


MUSUBI_TOML = """[general]
resolution = [960, 544]
caption_extension = ".txt"
batch_size = 1
enable_bucket = true

[[datasets]]
{media} = "{folder}"
cache_directory = "cache"
{extra}"""


def _musubi_v100(root: Path, sizes=((1024, 768), (768, 1024), (1024, 768))) -> dict[str, Path]:
    """A HunyuanVideo image dataset cached by musubi 1e85379 (format_version 1.0.0)."""
    from PIL import Image
    from safetensors.torch import save_file

    images, cache = root / "images", root / "cache"
    images.mkdir(parents=True)
    cache.mkdir()
    (root / "dataset.toml").write_text(MUSUBI_TOML.format(media="image_directory",
                                                          folder="images", extra=""))
    latents = {}
    for i, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), (40 * i, 0, 0)).save(images / f"p{i}.png")
        (images / f"p{i}.txt").write_text(f"caption {i}")
        bw, bh = select_bucket((w, h), (960, 544), True, False, 16)
        path = cache / f"p{i}_{w:04d}x{h:04d}_hv.safetensors"
        save_file({f"latents_1x{bh // 8}x{bw // 8}_float16": torch.randn(16, 1, bh // 8, bw // 8)
                   .half()}, str(path), metadata={"architecture": "hunyuan_video", "width": str(w),
                                                  "height": str(h), "format_version": "1.0.0"})
        latents[f"p{i}"] = path
        save_file({"llm_bfloat16": torch.randn(256, 4096).bfloat16(),
                   "llm_mask": torch.ones(256, dtype=torch.int64),
                   "clipL_bfloat16": torch.randn(768).bfloat16()},
                  str(cache / f"p{i}_hv_te.safetensors"),
                  metadata={"architecture": "hunyuan_video", "caption1": f"caption {i}",
                            "format_version": "1.0.0"})
    return latents


def test_musubi_format_1_0_0_hunyuan_video_is_healthy(tmp_path: Path) -> None:
    _musubi_v100(tmp_path)
    assert alarms(scan_paths(tmp_path / "dataset.toml")) == []
    assert alarms(scan_paths(tmp_path / "cache")) == []


def test_musubi_format_1_0_0_latent_of_another_bucket_is_still_cd302(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    latents = _musubi_v100(tmp_path)
    save_file({"latents_1x48x48_float16": torch.randn(16, 1, 48, 48).half()},
              str(latents["p0"]), metadata={"architecture": "hunyuan_video", "width": "1024",
                                            "height": "768", "format_version": "1.0.0"})
    (found,) = by_code(scan_paths(tmp_path / "dataset.toml"), "CD302")
    assert found.path == str(latents["p0"])


def _aitoolkit_old_clips(root: Path, in_info: bool) -> tuple[Path, Path, dict[str, Path]]:
    """The video dataset of the fixtures as ai-toolkit wrote it before 7f3309b2 (no
    `num_frames` tensor) and, without `in_info`, before ff14cd63 (no `num_frames` in the info):
    clips only, each entry a `latent` [16, F, h, w]."""
    from safetensors import safe_open

    project, folder, entries = aitoolkit.video_dataset(root)
    clips = {}
    for name, path in entries.items():
        source = folder / name
        if not name.endswith(".mp4"):  # images were no items of a video dataset then
            path.unlink()
            source.unlink()
            source.with_suffix(".txt").unlink(missing_ok=True)
            continue
        with safe_open(str(path), "pt") as f:
            latent, metadata = f.get_tensor("latent"), f.metadata()
        path.unlink()
        crop = (int(metadata["crop_width"]), int(metadata["crop_height"]))
        clips[name] = aitoolkit.write_video_entry(folder, source, crop, {"latent": latent},
                                                  {"num_frames": 33} if in_info else {})
    aitoolkit.age_all(project.root)
    return project.config, folder, clips


@pytest.mark.parametrize("in_info", [False, True], ids=["before_ff14cd63", "before_7f3309b2"])
def test_aitoolkit_older_video_latents_are_healthy(tmp_path: Path, in_info: bool) -> None:
    config, folder, clips = _aitoolkit_old_clips(tmp_path / "wan", in_info)
    assert len(clips) == 3
    assert alarms(scan_paths(config)) == []
    assert alarms(scan_paths(folder)) == []


def test_aitoolkit_older_video_latent_missing_is_still_cd404(tmp_path: Path) -> None:
    config, folder, clips = _aitoolkit_old_clips(tmp_path / "wan", False)
    clips["clip_0.mp4"].unlink()
    assert [f.path for f in by_code(scan_paths(config), "CD404")] == [str(folder / "clip_0.mp4")]
