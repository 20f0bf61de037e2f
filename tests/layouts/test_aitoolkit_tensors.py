"""ai-toolkit entries with more than a `latent`, as ostris/ai-toolkit 27a03a91 writes them
(toolkit/dataloader_mixins.py LatentCachingMixin._cache_one_latent, get_latent_info_dict;
toolkit/metadata.py get_meta_for_safetensors): with the dataset's `cache_tensors_to_disk` (since
00a93e38, 2026-08-04) an entry also holds the item's pixels as uint8 `tensor` ([3, H, W], or
[3, F, H, W] for a clip; `_latent_to_uint8`) and its info dict, hashed into the name, gains
`cache_tensors_to_disk: true`; a clip of a `do_audio` dataset holds an `audio_latent`, and with
cache_tensors_to_disk its int16 `waveform` and a 0-d int32 `waveform_sample_rate`.
Written that way by the upstream functions (run on CPU against these fixtures' images), every
such cache scanned clean, with and without --deep; these tests keep it so.

`get_latent` reads `state_dict['latent']` of any entry that exists (no check): an entry without
it stops training with KeyError: 'latent'. cachedoctor took the entry's uint8 `tensor` for its
latent and reported CD302 "latent is 128x128 (h x w); bucket 128x128 needs 16x16: it was
encoded at another resolution"; it now says what the trainer does."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cachedoctor.fixtures.projects import aitoolkit

from conftest import by_code, scan_paths


def alarms(target: Path, **options) -> list:
    return [(f.code, f.message) for f in scan_paths(target, **options).findings
            if f.severity >= 2]


def _pixels(latent: torch.Tensor) -> torch.Tensor:
    """`_latent_to_uint8` of the item's pixels, [-1, 1] -> 0..255 (a stand-in image, 8x the
    latent's size: the crop the latent was encoded from)."""
    frames = latent.shape[1:-2] if latent.dim() == 4 else ()
    pixels = torch.rand(3, *frames, latent.shape[-2] * 8, latent.shape[-1] * 8) * 2 - 1
    return ((pixels.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)


def rewrite(folder: Path, tensors_to_disk: bool, audio: bool) -> None:
    """Each entry of `folder` as ai-toolkit writes it with these options: the info dict of
    its header plus the new keys (re-hashed into its name), `tensor` first, then the latent."""
    for old in sorted((folder / "_latent_cache").glob("*.safetensors")):
        with safe_open(str(old), "pt") as f:
            header = f.metadata()
        info = {k: v for k, v in header.items() if k not in ("software", "format")}
        info = {k: json.loads(v) if k not in ("filename", "latent_space_version") else v
                for k, v in info.items()}
        tensors = load_file(str(old))
        clip = "num_frames" in tensors
        extra, new = {}, {}
        if tensors_to_disk:
            extra["cache_tensors_to_disk"] = True
            new["tensor"] = _pixels(tensors["latent"])
            if audio and clip:
                new["waveform"] = ((torch.rand(2, 16000) * 2 - 1) * 32767.0).round().to(torch.int16)
                new["waveform_sample_rate"] = torch.tensor(16000, dtype=torch.int32)
        if audio and clip:
            info["do_audio"] = True
            tensors["audio_latent"] = torch.randn(8, 25, 16).bfloat16()
        old.unlink()
        source = folder / info["filename"]
        aitoolkit.write_video_entry(folder, source, (info["crop_width"], info["crop_height"]),
                                    {**new, **tensors}, {k: v for k, v in {**info, **extra}.items()
                                                         if k not in _BASE})


_BASE = ("filename", "scale_to_width", "scale_to_height", "crop_x", "crop_y", "crop_width",
         "crop_height", "latent_space_version", "latent_version")


def options(project, tensors_to_disk: bool, audio: bool) -> None:
    text = project.config.read_text()
    if tensors_to_disk:
        text = text.replace("cache_latents_to_disk: true",
                            "cache_latents_to_disk: true\n          cache_tensors_to_disk: true")
    if audio:
        text = text.replace("resolution: [ 128 ]", "resolution: [ 128 ]\n          do_audio: true")
    project.config.write_text(text)


def test_a_video_dataset_with_tensors_and_audio_cached_is_clean(tmp_path: Path) -> None:
    project, folder, _ = aitoolkit.video_dataset(tmp_path / "wan")
    rewrite(folder, tensors_to_disk=True, audio=True)
    options(project, True, True)
    held = {name for p in (folder / "_latent_cache").iterdir() for name in load_file(str(p))}
    assert {"tensor", "waveform", "waveform_sample_rate", "audio_latent"} <= held
    for deep in (False, True):
        assert alarms(project.config, deep=deep) == []
        assert alarms(folder, deep=deep) == []


def test_audio_latents_alone_are_clean(tmp_path: Path) -> None:
    project, folder, _ = aitoolkit.video_dataset(tmp_path / "wan")
    rewrite(folder, tensors_to_disk=False, audio=True)
    options(project, False, True)
    assert alarms(project.config, deep=True) == []
    assert alarms(folder) == []


def test_an_entry_without_its_latent_is_cd302_as_a_keyerror(tmp_path: Path) -> None:
    project, folder, _ = aitoolkit.video_dataset(tmp_path / "wan")
    rewrite(folder, tensors_to_disk=True, audio=False)
    options(project, True, False)
    entry = sorted((folder / "_latent_cache").glob("img_000_*.safetensors"))[0]
    with safe_open(str(entry), "pt") as f:
        header = f.metadata()
    tensors = load_file(str(entry))
    del tensors["latent"]
    save_file(tensors, str(entry), metadata=header)
    for target in (project.config, folder):
        report = scan_paths(target)
        found = by_code(report, "CD302")
        assert [Path(f.path).name for f in found] == [entry.name]
        assert "KeyError: 'latent'" in found[0].message
        assert [f.code for f in report.findings if f.severity >= 2] == ["CD302"]
