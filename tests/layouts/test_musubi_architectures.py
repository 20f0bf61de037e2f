"""musubi-tuner's newer architectures, cached as kohya-ss/musubi-tuner 30c658c4 caches them.

Each latent is shaped as the architecture's `*_cache_latents.py` hands it to its writer in
`dataset/cache_io.py`; each text-encoder output as its `*_cache_text_encoder_outputs.py` does,
laid out by `utils/safetensors_utils.mem_eff_save_file` (musubi.save_padded):
- Kandinsky 5 (`kandinsky5_cache_latents.py`): images go through the video VAE as one frame,
  so every latent is [16, F, H/8, W/8] (never the writer's 3-D branch), with the first and
  last frame as `latents_image_2x…`; `--nabla_resize` scales the frames up to the next
  multiple of 128 px first. Text: `text_embeds_`, `pooled_embed_`, `attention_mask`.
- HunyuanVideo 1.5 (`hv_1_5_cache_latents.py`): [32, F, H/16, W/16]; for I2V a float32
  `latents_image_` (33 channels) and a float16 `siglip_`, each keyed by its own dtype. Text:
  `varlen_vl_embed_`, `varlen_byt5_embed_` (empty when the caption has no quoted text).
- Z-Image: [16, H/8, W/8] under `latents_1x…`; Ideogram 4: [128, H/16, W/16] bfloat16 under
  `latents_1x…`, text `varlen_i4_llm_features_` in bf16, fp8 or float32
  (`--text_cache_dtype`); Krea 2: [16, 1, H/8, W/8], text [T, layers, D].
- FLUX.2 (`flux_2_cache_latents.py`, one AutoEncoder for dev, Klein 4B and Klein 9B):
  [128, H/16, W/16] under `latents_<H>x<W>_`, controls `latents_control_<i>_<H>x<W>_`.
  FLUX.2, Ideogram 4 and HunyuanVideo 1.5 latents are their bucket / 16 (CD302).
- ERNIE-Image (pull request #935, head d94e2d6, not merged in 30c658c4): `ei`,
  `ernie_image`, [128, H/16, W/16] under `latents_<H>x<W>_`, text `varlen_text_embed_`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import age_all, images, musubi

from conftest import by_code, scan_paths

torch = pytest.importorskip("torch")

SEVERE = 2  # warning and above
BUCKETS = ((128, 128), (160, 96), (96, 160))  # musubi's buckets for resolution 128, step 16
VIDEO = (160, 96)
CONFIG = """[general]
resolution = [128, 128]
caption_extension = ".txt"
enable_bucket = true

[[datasets]]
image_directory = "images"
cache_directory = "cache"
"""
VIDEO_CONFIG = """
[[datasets]]
video_directory = "videos"
cache_directory = "vcache"
target_frames = [1, 9]
"""


def severe(report) -> list:
    return [(f.code, Path(f.path).name, f.message) for f in report.findings
            if f.severity >= SEVERE]


def rand(*shape: int, dtype=None):
    return torch.randn(*shape).to(dtype or torch.bfloat16)


def project(root: Path, arch: str, full: str, latent: Callable, text: Callable,
            video: bool = False, beside: bool = False) -> Path:
    """A musubi project of one architecture: images of three buckets (and, for `video`, two
    clips cached for 1 and 9 frames), latents and padded text outputs. `latent(w, h, frames)`
    gives a latent file's tensors for a bucket; `text(n)` the n-th caption's outputs.
    `beside`: no cache_directory, the caches sit in the image folder."""
    config = CONFIG.replace('cache_directory = "cache"\n', "") if beside else CONFIG
    (root / "dataset.toml").parent.mkdir(parents=True, exist_ok=True)
    (root / "dataset.toml").write_text(config + (VIDEO_CONFIG if video else ""))
    cache = root / ("images" if beside else "cache")
    cache.mkdir(parents=True, exist_ok=True)
    for n, (path, width, height, _) in enumerate(images(root / "images", buckets=BUCKETS)):
        musubi.save_latents(cache / musubi.latent_name(path.stem, width, height, arch),
                            latent(width, height, 1), full, width, height)
        musubi.save_text(cache / f"{path.stem}_{arch}_te.safetensors", text(n), full,
                         path.with_suffix(".txt").read_text().strip(), padded=True)
    if video:
        videos, vcache = root / "videos", root / "vcache"
        videos.mkdir()
        vcache.mkdir()
        for n in range(2):
            stem, width, height = f"clip_{n}", *VIDEO
            (videos / f"{stem}.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom placeholder")
            (videos / f"{stem}.txt").write_text(f"a clip, number {n}\n")
            for count in (1, 9):
                name = musubi.latent_name(stem, width, height, arch, f"_00000-{count:03d}")
                musubi.save_latents(vcache / name, latent(width, height, (count - 1) // 4 + 1),
                                    full, width, height, frame_count=count)
            musubi.save_text(vcache / f"{stem}_{arch}_te.safetensors", text(n), full,
                             f"a clip, number {n}", padded=True)
    age_all(root)
    return root / "dataset.toml"


def kandinsky5(nabla: bool = False) -> Callable:
    """encode_and_save_batch: the VAE's float16 [16, F, h, w]; `latents_image_` the first and
    last latent frame (the first twice for an image). --nabla_resize: h, w rounded up to 16."""
    def latent(width: int, height: int, frames: int) -> dict:
        h, w = height // 8, width // 8
        if nabla:
            h, w = -(-height // 128) * 16, -(-width // 128) * 16
        f16 = torch.float16
        return {f"latents_{frames}x{h}x{w}_float16": rand(16, frames, h, w, dtype=f16),
                f"latents_image_2x{h}x{w}_float16": rand(16, 2, h, w, dtype=f16)}
    return latent


def kandinsky5_text(n: int) -> dict:
    return {"text_embeds_bfloat16": rand(9 + n, 64), "pooled_embed_bfloat16": rand(768),
            "attention_mask": torch.ones(9 + n, dtype=torch.bool)}


def hunyuan_video_1_5(width: int, height: int, frames: int) -> dict:
    h, w = height // 16, width // 16
    return {f"latents_{frames}x{h}x{w}_bfloat16": rand(32, frames, h, w),
            f"latents_image_{frames}x{h}x{w}_float32": rand(33, frames, h, w, dtype=torch.float32),
            "siglip_float16": rand(729, 1152, dtype=torch.float16)}


def hunyuan_video_1_5_text(n: int) -> dict:
    return {"varlen_vl_embed_bfloat16": rand(9 + n, 64),
            "varlen_byt5_embed_bfloat16": rand(3 if n % 2 else 0, 32)}  # no quoted text: empty


IMAGE_ARCHITECTURES = {
    "zi": ("z_image", lambda w, h, f: {f"latents_1x{h // 8}x{w // 8}_bfloat16":
                                       rand(16, h // 8, w // 8)},
           lambda n: {"varlen_llm_embed_bfloat16": rand(9 + n, 64)}),
    "i4": ("ideogram4", lambda w, h, f: {f"latents_1x{h // 16}x{w // 16}_bfloat16":
                                         rand(128, h // 16, w // 16)},
           lambda n: {"varlen_i4_llm_features_float8_e4m3fn":
                      rand(9 + n, 96, dtype=torch.float8_e4m3fn)}),
    "kr2": ("krea2", lambda w, h, f: {f"latents_1x{h // 8}x{w // 8}_bfloat16":
                                      rand(16, 1, h // 8, w // 8)},
            lambda n: {"varlen_krea2_vl_embed_bfloat16": rand(9 + n, 3, 64)}),
    "ei": ("ernie_image", lambda w, h, f: {f"latents_{h // 16}x{w // 16}_bfloat16":
                                           rand(128, h // 16, w // 16)},
           lambda n: {"varlen_text_embed_bfloat16": rand(9 + n, 64)}),
}


def test_kandinsky5_images_and_clips_are_healthy(tmp_path: Path) -> None:
    """Images are one-frame videos to Kandinsky 5's VAE: [16, 1, h, w], not the writer's
    [1, C, H, W] of a 3-D latent, which its caching script never hands it."""
    config = project(tmp_path, "k5", "kandinsky5", kandinsky5(), kandinsky5_text, video=True)
    assert severe(scan_paths(config)) == []
    assert severe(scan_paths(tmp_path / "cache")) == []


def test_kandinsky5_nabla_resized_latents_are_healthy(tmp_path: Path) -> None:
    """--nabla_resize encodes the bucket rounded up to 128 px: 160x96 gives 16x32 latents, not
    12x20. Every latent of a bucket is that size, so training stacks them (CD302 said
    "encoded at another resolution" for each before)."""
    config = project(tmp_path, "k5", "kandinsky5", kandinsky5(nabla=True), kandinsky5_text,
                     video=True)
    assert severe(scan_paths(config)) == []


def test_kandinsky5_latent_of_neither_size_is_still_cd302(tmp_path: Path) -> None:
    config = project(tmp_path, "k5", "kandinsky5", kandinsky5(nabla=True), kandinsky5_text)
    path = tmp_path / "cache" / musubi.latent_name("img_100", 160, 96, "k5")
    musubi.save_latents(path, kandinsky5()(128, 128, 1), "kandinsky5", 160, 96)
    found = [Path(f.path).name for f in by_code(scan_paths(config), "CD302")]
    assert found == [path.name]


def test_kandinsky5_latent_stored_frame_axis_first_is_cd306(tmp_path: Path) -> None:
    """save_latent_cache_kandinsky5 would store a 3-D latent as [1, C, H, W] under
    `latents_1x<H>x<W>_`; the trainer reads every 4-D latent as [C, F, H, W], so such a file
    (no upstream script writes one) is reported, and so is a cast `latents_image_`."""
    cache = tmp_path / "cache"
    cache.mkdir()
    odd = cache / musubi.latent_name("a", 160, 96, "k5")
    musubi.save_latents(odd, {"latents_1x12x20_float16": rand(1, 16, 12, 20,
                                                              dtype=torch.float16)},
                        "kandinsky5", 160, 96)
    cast = cache / musubi.latent_name("b", 160, 96, "k5")
    tensors = kandinsky5()(160, 96, 1)
    tensors["latents_image_2x12x20_float16"] = tensors["latents_image_2x12x20_float16"].float()
    musubi.save_latents(cast, tensors, "kandinsky5", 160, 96)
    found = {Path(f.path).name: f.message for f in by_code(scan_paths(cache), "CD306")}
    assert set(found) == {odd.name, cast.name}
    assert "1x12x20 (F x H x W)" in found[odd.name]
    assert "latents_image_2x12x20_float16" in found[cast.name]


def test_hunyuan_video_1_5_i2v_caches_are_healthy(tmp_path: Path) -> None:
    """A float32 `latents_image_` and a float16 `siglip_` beside a bfloat16 latent, and an
    empty `varlen_byt5_embed_`, as musubi writes them."""
    config = project(tmp_path, "hv15", "hunyuan_video_1_5", hunyuan_video_1_5,
                     hunyuan_video_1_5_text, video=True)
    assert severe(scan_paths(config)) == []
    assert severe(scan_paths(tmp_path / "vcache")) == []


def test_a_cast_hunyuan_video_1_5_image_latent_is_still_cd306(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    tensors = hunyuan_video_1_5(160, 96, 1)
    tensors["latents_image_1x6x10_float32"] = tensors["latents_image_1x6x10_float32"].bfloat16()
    musubi.save_latents(cache / musubi.latent_name("a", 160, 96, "hv15"), tensors,
                        "hunyuan_video_1_5", 160, 96)
    (finding,) = by_code(scan_paths(cache), "CD306")
    assert "latents_image_1x6x10_float32" in finding.message


@pytest.mark.parametrize("arch", sorted(IMAGE_ARCHITECTURES))
def test_image_architectures_are_healthy(tmp_path: Path, arch: str) -> None:
    """Z-Image, Ideogram 4 (fp8 text), Krea 2 and ERNIE-Image, by config and bare; with the
    caches beside the images too (ERNIE-Image's beside its images drew CD107 on every image
    and caption of a bare scan before: `ei` was no architecture cachedoctor knew)."""
    full, latent, text = IMAGE_ARCHITECTURES[arch]
    config = project(tmp_path / "own", arch, full, latent, text)
    assert severe(scan_paths(config)) == []
    assert severe(scan_paths(tmp_path / "own" / "cache")) == []
    config = project(tmp_path / "beside", arch, full, latent, text, beside=True)
    assert severe(scan_paths(config)) == []
    assert severe(scan_paths(tmp_path / "beside" / "images")) == []


def test_an_unknown_architecture_beside_its_images_draws_no_warning(tmp_path: Path) -> None:
    """A newer musubi's architecture cachedoctor does not know: the folder is still musubi's
    (its header says so), not a cache directory with stray images in it (CD107 before)."""
    project(tmp_path, "zz", "future_model",
            lambda w, h, f: {f"latents_{h // 16}x{w // 16}_bfloat16": rand(64, h // 16, w // 16)},
            lambda n: {"varlen_embed_bfloat16": rand(5 + n, 32)}, beside=True)
    assert severe(scan_paths(tmp_path / "images")) == []
    assert severe(scan_paths(tmp_path / "dataset.toml")) == []


def test_ernie_image_and_ideogram4_defects_are_still_cd306(tmp_path: Path) -> None:
    """A `latents_<H>x<W>_` latent of another size, and fp8-keyed text features that are
    bfloat16."""
    cache = tmp_path / "cache"
    cache.mkdir()
    latent = cache / musubi.latent_name("a", 160, 96, "ei")
    musubi.save_latents(latent, {"latents_6x10_bfloat16": rand(128, 8, 8)}, "ernie_image",
                        160, 96)
    text = cache / "b_i4_te.safetensors"
    musubi.save_text(text, {"varlen_i4_llm_features_float8_e4m3fn": rand(9, 96)}, "ideogram4",
                     "b", padded=True)
    found = {Path(f.path).name: f.message for f in by_code(scan_paths(cache), "CD306")}
    assert set(found) == {latent.name, text.name}
    assert "6x10 (H x W, no frame axis)" in found[latent.name]
    assert "float8_e4m3fn" in found[text.name]


def flux_2(width: int, height: int, frames: int) -> dict:
    """flux_2_cache_latents.encode_and_save_batch: AutoEncoder.encode folds the /8 KL latent's
    2x2 patches into channels, [128, H/16, W/16], saved as `latents_<H>x<W>_` (no frame axis),
    with a control of another size (no_resize_control) beside it."""
    return musubi.flux_2_latent(rand(128, height // 16, width // 16), [rand(128, 8, 8)])


# (short name, architecture metadata, latent(w, h, frames), text(n)) as each writer makes them
SIXTEEN = {
    **{arch: (full, flux_2, lambda n: {"ctx_vec_bfloat16": rand(512, 96)})
       for arch, full in (("f2d", "flux_2_dev"), ("f2k4b", "flux_2_klein_4b"),
                          ("f2k9b", "flux_2_klein_9b"))},
    "i4": IMAGE_ARCHITECTURES["i4"],
    "hv15": ("hunyuan_video_1_5", hunyuan_video_1_5, hunyuan_video_1_5_text),
}


@pytest.mark.parametrize("arch", sorted(SIXTEEN))
def test_latents_of_sixteen_pixel_cells_are_healthy(tmp_path: Path, arch: str) -> None:
    """FLUX.2 (every model: one AutoEncoder), Ideogram 4 and HunyuanVideo 1.5 latents are
    their bucket / 16: no CD302 for any of them, images and clips alike."""
    full, latent, text = SIXTEEN[arch]
    config = project(tmp_path, arch, full, latent, text, video=arch == "hv15")
    assert severe(scan_paths(config)) == []


@pytest.mark.parametrize("arch", sorted(SIXTEEN))
def test_a_latent_of_another_bucket_is_cd302(tmp_path: Path, arch: str) -> None:
    """A 160x96 image's latent encoded at 128x128 (the config changed, a file was copied):
    8x8 where the bucket needs 6x10. Before, the factor of these architectures was unknown
    and CD302 never looked at them."""
    full, latent, text = SIXTEEN[arch]
    config = project(tmp_path, arch, full, latent, text)
    path = tmp_path / "cache" / musubi.latent_name("img_100", 160, 96, arch)
    musubi.save_latents(path, latent(128, 128, 1), full, 160, 96)
    (finding,) = by_code(scan_paths(config), "CD302")
    assert Path(finding.path).name == path.name
    assert finding.details["actual"] == [8, 8] and finding.details["expected"] == [6, 10]


def test_a_hunyuan_video_1_5_clip_of_another_size_is_cd302(tmp_path: Path) -> None:
    """A 9-frame clip's latent [32, 3, H, W] encoded at 128x128 for its 160x96 bucket."""
    config = project(tmp_path, "hv15", "hunyuan_video_1_5", hunyuan_video_1_5,
                     hunyuan_video_1_5_text, video=True)
    path = tmp_path / "vcache" / musubi.latent_name("clip_1", 160, 96, "hv15", "_00000-009")
    musubi.save_latents(path, hunyuan_video_1_5(128, 128, 3), "hunyuan_video_1_5", 160, 96,
                        frame_count=9)
    (finding,) = by_code(scan_paths(config), "CD302")
    assert Path(finding.path).name == path.name
