"""Caches written by older versions of the trainers scan with no warning or error.

- musubi-tuner format_version "1.0.0" (kohya-ss/musubi-tuner 1e85379, 2024-12-31,
  dataset/image_video_dataset.py save_latent_cache / save_text_encoder_output_cache):
  HunyuanVideo only, `_hv` names, text keys `llm_<dtype>`, `llm_mask`, `clipL_<dtype>`.
  f1c23b1 (2025-03-05, Wan 2.1) moved to "1.0.1" with the same names and keys.
- ai-toolkit video latents before ff14cd63 (2025-10-21): no `num_frames` in the latent info
  (so neither in the header nor the hash), and before 7f3309b2 (2026-03-24) no 0-d
  `num_frames` tensor; video datasets held only clips until 8c1a4082 (2026-08-08).
- OneTrainer before 474dd2c6 (2024-07-14; mgds 0ab2f97, before 5ea389a cloned what it caches):
  an image sample's `latent_image_distribution` is the VAE's output as it came, a diffusers
  `DiagonalGaussianDistribution` of `[1, 2C, h, w]` parameters (`mean` a view of them), saved
  from the train device (modules/dataLoader/StableDiffusionXLBaseDataLoader.py `_cache_modules`,
  mgds pipelineModules/EncodeVAE.py and DiskCache.py); text samples hold squeezed views
  (pipelineModules/Tokenize.py, EncodeClipText.py).
- OneTrainer before 49e3ad38 (2023-12-17; mgds before a8e7480, 2023-12-16, "replace epochs
  with variations"): mgds GenericDataLoaderModules.py `DiskCache` wrote the same samples and
  `aggregate.pt` to `<cache_dir>/image/epoch-<n>/` and `text/epoch-<n>/` (n: the epoch modulo
  `latent_caching_epochs`), no group folder; the config (TrainArgs.to_dict, OneTrainer 5dcccc59)
  has no `__version` and its concepts no `seed`, `image` or `text`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from cachedoctor.fixtures.devices import stored_as
from cachedoctor.fixtures.projects import aitoolkit, onetrainer
from cachedoctor.layouts.musubi import select_bucket

from conftest import by_code, invoke, scan_paths

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


# diffusers' module of DiagonalGaussianDistribution at OneTrainer's pin then (dd4b731, 0.29 dev)
VAE_MODULE = "diffusers.models.autoencoders.vae"


class DiagonalGaussianDistribution:
    """What diffusers' AutoencoderKL.encode(...).latent_dist holds: the parameters, the mean as
    a view of them, and the clamped log variance with its std and variance."""

    def __init__(self, parameters: torch.Tensor) -> None:
        self.parameters = parameters
        self.mean, self.logvar = torch.chunk(parameters, 2, dim=1)
        self.logvar = torch.clamp(self.logvar, -30.0, 20.0)
        self.deterministic = False
        self.std = torch.exp(0.5 * self.logvar)
        self.var = torch.exp(self.logvar)


DiagonalGaussianDistribution.__module__ = VAE_MODULE


@pytest.fixture
def diffusers_vae(monkeypatch: pytest.MonkeyPatch) -> type:
    """The class importable under diffusers' name while torch.save pickles it (as the global
    `diffusers.models.autoencoders.vae.DiagonalGaussianDistribution`), removed afterwards."""
    for name in ("diffusers", "diffusers.models", "diffusers.models.autoencoders", VAE_MODULE):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules[VAE_MODULE], "DiagonalGaussianDistribution",
                        DiagonalGaussianDistribution, raising=False)
    return DiagonalGaussianDistribution


def _onetrainer_before_474dd2c6(root: Path, defects: tuple[str, ...] = (),
                                old: Callable[[int], bool] = lambda i: True,
                                ) -> tuple[Path, list[Path]]:
    """onetrainer.build's project (with its `defects`), its samples as OneTrainer cached them
    before 2024-07-14; `old(i)`: whether sample i is rewritten so (else it stays as now)."""
    project = onetrainer.build(root, defects)
    cache = project.root / "workspace-cache" / "run"
    samples = sorted((cache / "image").glob("*/variation-0/[0-9]*.pt"))
    for path in samples:
        if not old(int(path.stem)):
            continue
        sample = torch.load(path, map_location="cpu", weights_only=True)
        latent = sample.pop("latent_image")
        moments = torch.cat([latent, torch.randn_like(latent) - 8]).unsqueeze(0)  # vae.encode(image.unsqueeze(0))
        with stored_as("cuda:0"):
            torch.save({"latent_image_distribution": DiagonalGaussianDistribution(moments),
                        "original_resolution": sample["original_resolution"],
                        "crop_offset": sample["crop_offset"]}, path)
    for path in sorted((cache / "text").glob("*/variation-0/[0-9]*.pt")):
        sample = torch.load(path, map_location="cpu", weights_only=True)
        # Tokenize and EncodeClipText squeeze the batch of one away: views, not clones
        with stored_as("cuda:0"):
            torch.save({k: v.unsqueeze(0).squeeze() for k, v in sample.items()}, path)
    return project.config, samples


def test_onetrainer_vae_distribution_samples_are_healthy(tmp_path: Path, diffusers_vae) -> None:
    config, samples = _onetrainer_before_474dd2c6(tmp_path / "ot")
    assert len(samples) == 9
    assert alarms(scan_paths(config)) == []
    assert alarms(scan_paths(tmp_path / "ot" / "workspace-cache")) == []
    assert alarms(scan_paths(tmp_path / "ot")) == []


def test_onetrainer_vae_distribution_is_still_cd105_beside_another_global(
        tmp_path: Path, diffusers_vae) -> None:
    """The class is by design in a mgds sample alone: beside another global, or in a file of
    another trainer, it is CD105 as any other class."""
    import argparse

    config, samples = _onetrainer_before_474dd2c6(tmp_path / "ot")
    sample = torch.load(samples[0], map_location="cpu", weights_only=False)
    sample["args"] = argparse.Namespace(resolution=128)  # a class torch refuses too
    with stored_as("cuda:0"):
        torch.save(sample, samples[0])
    (found,) = by_code(scan_paths(config), "CD105")
    assert found.path == str(samples[0])
    assert set(found.details["globals"]) == {"argparse.Namespace",
                                             f"{VAE_MODULE}.DiagonalGaussianDistribution"}
    elsewhere = tmp_path / "bare" / "latents" / "img.pt"
    elsewhere.parent.mkdir(parents=True)
    torch.save({"latent": DiagonalGaussianDistribution(torch.randn(1, 8, 16, 16))}, elsewhere)
    assert [f.path for f in by_code(scan_paths(tmp_path / "bare"), "CD105")] == [str(elsewhere)]


def _relative(report, root: Path) -> list[tuple[str, str]]:
    return sorted((f.code, str(Path(f.path).relative_to(root))) for f in report.findings
                  if f.severity >= SEVERE)


def test_onetrainer_vae_distribution_of_another_size_is_cd302(
        tmp_path: Path, diffusers_vae) -> None:
    """A crop bucket encoded at its old size, stored as `latent_image_distribution`: the loader
    of that time trained on its mean (mgds 0ab2f97 SampleVAEDistribution, mode "mean":
    `distribution.mode().squeeze()`), so it is judged as a `latent_image` is. It passed before:
    such a sample had no latent CD302 could pick."""
    new = onetrainer.build(tmp_path / "new", ("CD302",))
    config, _ = _onetrainer_before_474dd2c6(tmp_path / "old", ("CD302",))
    expected = _relative(scan_paths(new.config), tmp_path / "new")
    assert expected and {code for code, _ in expected} == {"CD302"}
    assert _relative(scan_paths(config), tmp_path / "old") == expected
    (finding, *_) = by_code(scan_paths(config), "CD302")
    assert len(finding.details["shape"]) == 3  # [C, h, w], as the loader hands it on


def test_onetrainer_one_vae_distribution_of_another_size_is_cd301_and_cd302(
        tmp_path: Path, diffusers_vae) -> None:
    """One sample encoded at another crop than aggregate.pt says, among right-sized ones."""
    new = onetrainer.build(tmp_path / "new", ("CD301",))
    config, _ = _onetrainer_before_474dd2c6(tmp_path / "old", ("CD301",))
    expected = _relative(scan_paths(new.config), tmp_path / "new")
    assert {code for code, _ in expected} == {"CD301", "CD302"}
    assert _relative(scan_paths(config), tmp_path / "old") == expected


def test_onetrainer_distribution_and_latent_samples_agree_in_shape(
        tmp_path: Path, diffusers_vae) -> None:
    """Samples of both writers side by side in one bucket: the mean the old loader squeezed and
    the `latent_image` the new one reads are both [C, h, w], so no shape rule tells them apart
    (the distribution's [1, C, h, w] as stored would have been CD301 against the others).
    No one OneTrainer loads both, though: mgds DiskCache.get_item reads its own key of every
    sample (KeyError on the other), which these rules do not judge."""
    config, samples = _onetrainer_before_474dd2c6(tmp_path / "ot", old=lambda i: i % 2 == 0)
    stored = {len(torch.load(p, map_location="cpu", weights_only=False)) for p in samples}
    assert stored == {3}  # both kinds are there: 3 keys each, latent_image or the distribution
    report = scan_paths(config)
    assert [f for f in report.findings if f.code in ("CD301", "CD302", "CD303")] == []


def test_onetrainer_vae_distribution_of_another_size_is_never_reencoded_as_latent_image(
        tmp_path: Path, diffusers_vae) -> None:
    """The OneTrainer of such a cache reads `latent_image_distribution`: a `latent_image` sample
    written among its samples would stop it with KeyError. So `--reencode` writes none; the
    samples go to the quarantine with their aggregate.pt, and OneTrainer caches the folder
    again, in the format of whichever version runs."""
    config, samples = _onetrainer_before_474dd2c6(tmp_path / "ot", ("CD302",))
    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")
    assert result.exit_code == 0, result.output
    folder = samples[0].parent
    assert not (folder / "aggregate.pt").exists()
    left = [torch.load(p, map_location="cpu", weights_only=False) for p in folder.glob("*.pt")]
    assert left and all("latent_image" not in s for s in left)


def _onetrainer_before_a8e7480(root: Path, defects: tuple[str, ...] = (), epochs: int = 1,
                               ) -> tuple[Path, Path, dict]:
    """The 474dd2c6-era project as OneTrainer 5dcccc59 (mgds before a8e7480) laid it out: the
    samples of `<sha256>/variation-0` in `epoch-0` ... `epoch-<epochs - 1>` (mgds caches every
    epoch folder the same way), a TrainArgs config without `__version` that keeps its cache
    (clear_cache_before_training false), ConceptParams concepts. The config, the cache_dir and
    the expected findings with their paths moved along."""
    _onetrainer_before_474dd2c6(root, defects)
    cache = root / "workspace-cache" / "run"
    moved = {}
    for area in ("image", "text"):
        (group,) = (cache / area).iterdir()
        for epoch in range(epochs):
            shutil.copytree(group / "variation-0", cache / area / f"epoch-{epoch}")
        shutil.rmtree(group)
        moved[str(group / "variation-0")] = str(cache / area / "epoch-0")
    config = root / "training_presets" / f"{onetrainer.DATASET}.json"
    data = json.loads(config.read_text())
    for key in ("__version", "concepts", "multi_gpu", "device_indexes"):
        data.pop(key)
    data.update(clear_cache_before_training=False, latent_caching_epochs=epochs)
    config.write_text(json.dumps(data, indent=4))
    concepts = root / "training_concepts" / "concepts.json"
    concepts.write_text(json.dumps([
        {"name": c["name"], "path": c["path"], "prompt_source": "sample", "prompt_path": "",
         "enable_crop_jitter": True, "enable_random_flip": True, "include_subdirectories": False,
         "enable_tag_shuffling": False, "tag_delimiter": ",", "keep_tags_count": 1}
        for c in json.loads(concepts.read_text())], indent=4))
    return config, cache, moved


@pytest.mark.parametrize("epochs", [1, 2])
def test_onetrainer_epoch_folders_are_healthy(tmp_path: Path, diffusers_vae, epochs: int) -> None:
    """Before a8e7480 the samples lie in `image/epoch-<n>/`: their VAE distributions are by
    design (no CD105), their tensors load onto the train device (no CD501, bare either), and
    aggregate.pt maps them to their images (no CD404 for images it lists)."""
    config, cache, _ = _onetrainer_before_a8e7480(tmp_path / "ot", epochs=epochs)
    assert sorted(p.name for p in (cache / "image").iterdir()) == [
        f"epoch-{n}" for n in range(epochs)]
    assert alarms(scan_paths(config)) == []
    for bare in (tmp_path / "ot" / "workspace-cache", cache / "image", cache / "text",
                 cache / "image" / "epoch-0"):
        assert alarms(scan_paths(bare)) == [], bare


@pytest.mark.parametrize("defect", ["CD302", "CD404"])
def test_onetrainer_epoch_folders_keep_their_findings(tmp_path: Path, diffusers_vae,
                                                      defect: str) -> None:
    """Read through its aggregate.pt, an epoch folder's sample of another size is CD302, and
    an image added after it was cached (mgds caches no folder again while its aggregate.pt
    exists) is CD404."""
    root = tmp_path / "ot"
    project = onetrainer.build(tmp_path / "reference", (defect,))
    config, _, moved = _onetrainer_before_a8e7480(root, (defect,))
    expected = set()
    for code, hits in project.expected.items():
        for path, _ in hits:
            path = str(path).replace(str(tmp_path / "reference"), str(root))
            for old, new in moved.items():
                path = path.replace(old, new)
            expected.add((code, path))
    found = {(f.code, f.path) for f in scan_paths(config).findings if f.severity >= SEVERE}
    assert found == expected


def test_onetrainer_epoch_folder_truncated_sample_is_cd101(tmp_path: Path,
                                                           diffusers_vae) -> None:
    config, cache, _ = _onetrainer_before_a8e7480(tmp_path / "ot")
    sample = cache / "image" / "epoch-0" / "2.pt"
    os.truncate(sample, sample.stat().st_size // 2)
    assert [(c, n) for c, n, _ in alarms(scan_paths(config))] == [("CD101", "2.pt")]
    assert [(c, n) for c, n, _ in alarms(scan_paths(cache))] == [("CD101", "2.pt")]


def test_onetrainer_epoch_folder_distribution_beside_another_global_is_cd105(
        tmp_path: Path, diffusers_vae) -> None:
    config, cache, _ = _onetrainer_before_a8e7480(tmp_path / "ot")
    sample = cache / "image" / "epoch-0" / "1.pt"
    item = torch.load(sample, map_location="cpu", weights_only=False)
    item["extra"] = types.SimpleNamespace(note="not a tensor")
    torch.save(item, sample)
    assert [(c, n) for c, n, _ in alarms(scan_paths(config))] == [("CD105", "1.pt")]
