"""musubi-tuner video datasets as VideoDataset.retrieve_latent_cache_batches cuts clips
(kohya-ss/musubi-tuner 30c658c4, src/musubi_tuner/dataset/image_video_dataset.py): each
`frame_extraction` mode over videos of different lengths, target_frames rounded to 4n+1,
`full` capped by max_frames, a control_directory, a video_jsonl_file, and an image dataset in
the same config. Every clip a mode makes is healthy: no warning, with the config or bare."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import musubi
from cachedoctor.layouts.musubi import select_bucket

from conftest import scan_paths

torch = pytest.importorskip("torch")

SIZE = (640, 360)
LENGTHS = {"a": 50, "b": 30, "c": 100}  # frames of each video


def _clips(mode: str, targets: tuple[int, ...], n: int, stride: int = 1, sample: int = 1,
           max_frames: int = 129) -> list[tuple[int, int]]:
    """(start, frames) of each clip of an n-frame video, as retrieve_latent_cache_batches."""
    if mode == "full":
        t = min(n, max_frames)
        return [(0, (t - 1) // 4 * 4 + 1)]
    out = []
    for t in targets:
        if mode == "chunk":
            out += [(i, t) for i in range(0, n, t) if i + t <= n]
        elif n >= t and mode == "slide":
            out += [(i, t) for i in range(0, n - t + 1, stride)]
        elif n >= t and mode == "uniform":
            out += [(int(n - t) * k // (sample - 1), t) for k in range(sample)]
    return out


def _cache(folder: Path, clips: dict[str, list[tuple[int, int]]], control: bool = False) -> None:
    folder.mkdir()
    bw, bh = select_bucket(SIZE, (256, 256), True, False, 16)
    h, w = bh // 8, bw // 8
    for stem, cut in clips.items():
        for start, frames in cut:
            f = (frames - 1) // 4 + 1
            tensors = {f"latents_{f}x{h}x{w}_bfloat16": torch.randn(16, f, h, w).bfloat16()}
            if control:  # save_latent_cache_wan: the control keyed with the latent's F x H x W
                tensors[f"latents_control_{f}x{h}x{w}_bfloat16"] = tensors[
                    f"latents_{f}x{h}x{w}_bfloat16"].clone()
            musubi.save_latents(folder / musubi.latent_name(stem, *SIZE, "wan",
                                                            f"_{start:05d}-{frames:03d}"),
                                tensors, "wan", *SIZE, frame_count=frames)
        musubi.save_text(folder / f"{stem}_wan_te.safetensors",
                         {"varlen_t5_bfloat16": torch.randn(7, 64).bfloat16()}, "wan", f"cap {stem}")


def test_every_frame_extraction_mode_over_clips_of_different_lengths(tmp_path: Path) -> None:
    from PIL import Image

    videos, images = tmp_path / "videos", tmp_path / "images"
    videos.mkdir()
    images.mkdir()
    (tmp_path / "control").mkdir()
    for stem in LENGTHS:
        (videos / f"{stem}.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom")
        (videos / f"{stem}.txt").write_text(f"cap {stem}")
        (tmp_path / "control" / f"{stem}.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom")
    modes = {"chunk": dict(targets=(1, 25, 45)), "full": dict(targets=(), max_frames=81),
             "slide": dict(targets=(9, 17), stride=10), "uniform": dict(targets=(1, 25), sample=3)}
    for mode, kw in modes.items():
        _cache(tmp_path / f"cache_{mode}",
               {s: _clips(mode, n=n, **kw) for s, n in LENGTHS.items()}, control=mode == "slide")
    _cache(tmp_path / "cache_jsonl", {s: [(0, 25)] for s in LENGTHS})
    (tmp_path / "v.jsonl").write_text("".join(
        f'{{"video_path": "videos/{s}.mp4", "caption": "cap {s}"}}\n' for s in LENGTHS))
    (tmp_path / "cache_img").mkdir()
    for stem, (iw, ih) in {"i0": (512, 512), "i1": (600, 400)}.items():
        Image.new("RGB", (iw, ih)).save(images / f"{stem}.png")
        (images / f"{stem}.txt").write_text(f"cap {stem}")
        bw, bh = select_bucket((iw, ih), (256, 256), True, False, 16)
        musubi.save_latents(tmp_path / "cache_img" / musubi.latent_name(stem, iw, ih, "wan"), {
            f"latents_1x{bh // 8}x{bw // 8}_bfloat16": torch.randn(16, 1, bh // 8, bw // 8).bfloat16()},
            "wan", iw, ih)
        musubi.save_text(tmp_path / "cache_img" / f"{stem}_wan_te.safetensors",
                         {"varlen_t5_bfloat16": torch.randn(7, 64).bfloat16()}, "wan", f"cap {stem}")
    (tmp_path / "dataset.toml").write_text("""[general]
resolution = [256, 256]
caption_extension = ".txt"
enable_bucket = true

[[datasets]]
image_directory = "images"
cache_directory = "cache_img"

[[datasets]]
video_directory = "videos"
cache_directory = "cache_chunk"
target_frames = [1, 25, 45]
frame_extraction = "chunk"

[[datasets]]
video_directory = "videos"
cache_directory = "cache_full"
frame_extraction = "full"
max_frames = 81

[[datasets]]
video_directory = "videos"
control_directory = "control"
cache_directory = "cache_slide"
target_frames = [10, 20]  # rounded to [9, 17]
frame_extraction = "slide"
frame_stride = 10

[[datasets]]
video_directory = "videos"
cache_directory = "cache_uniform"
target_frames = [1, 25]
frame_extraction = "uniform"
frame_sample = 3

[[datasets]]
video_jsonl_file = "v.jsonl"
cache_directory = "cache_jsonl"
target_frames = [25]
""")
    for target in (tmp_path, *sorted(tmp_path.glob("cache_*"))):
        report = scan_paths(target, deep=True)
        assert [(f.code, f.path) for f in report.findings if f.severity >= 2] == [], target
