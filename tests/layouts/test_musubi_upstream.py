"""musubi-tuner caches as its own writers make them, kohya-ss/musubi-tuner 30c658c4.

Each cache is written the way `src/musubi_tuner/dataset/cache_io.py` writes it (key names,
dtypes, header metadata, file names of `image_video_dataset.py`), with the tensor shapes the
architecture's caching script hands it. The writers ran on CPU with stand-in encoders when
these tests were made; here the calls are reproduced, since musubi-tuner is no test
dependency. A healthy cache of each must scan with no warning or error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import musubi
from cachedoctor.layouts.common import unique

from conftest import by_code, scan_paths

SEVERE = 2  # warning and above

torch = pytest.importorskip("torch")


def severe(report) -> list:
    return [(f.code, Path(f.path).name, f.message) for f in report.findings
            if f.severity >= SEVERE]


def _text(cache: Path, stem: str, arch: str, full: str, tensors: dict,
          caption: str | None = None) -> None:
    musubi.save_text(cache / f"{stem}_{arch}_te.safetensors", tensors, full,
                     caption or f"caption {stem}")


def framepack_sections(cache: Path, stem: str, width: int, height: int, frames: int,
                       window: int = 9) -> list[Path]:
    """fpack_cache_latents.encode_and_save_batch: one file per section,
    `<stem>_00000-<frames>-<section:04d>_...` (append_section_idx_to_latent_cache_path).
    save_latent_cache_framepack names every clean latent `latents_clean*_<F>x<H>x<W>` with the
    target's F (the window), whatever frames it holds: 2, 2 and 16."""
    h, w = height // 8, width // 8
    sections = ((frames - 1) // 4 + 1 - 1) // window
    written = []
    for section in range(sections):
        name = musubi.latent_name(stem, width, height, "fp", f"_00000-{frames:03d}-{section:04d}")
        f16 = torch.float16
        tensors = {
            f"latents_{window}x{h}x{w}_float16": torch.randn(16, window, h, w).to(f16),
            "image_embeddings_float16": torch.randn(729, 1152).to(f16),
            "latent_indices_int64": torch.arange(1, 1 + window),
            "clean_latent_indices_int64": torch.tensor([0, 1 + window]),
            f"latents_clean_{window}x{h}x{w}_float16": torch.randn(16, 2, h, w).to(f16),
            "clean_latent_2x_indices_int64": torch.arange(2 + window, 4 + window),
            f"latents_clean_2x_{window}x{h}x{w}_float16": torch.randn(16, 2, h, w).to(f16),
            "clean_latent_4x_indices_int64": torch.arange(4 + window, 20 + window),
            f"latents_clean_4x_{window}x{h}x{w}_float16": torch.randn(16, 16, h, w).to(f16),
        }
        musubi.save_latents(cache / name, tensors, "framepack", width, height, frame_count=frames)
        written.append(cache / name)
    return written


def test_framepack_sections_and_one_frame_latents_are_healthy(tmp_path: Path) -> None:
    """A FramePack clip's sections hold one window of latent frames each, and their clean
    latents another frame count than their keys' F: no CD306, no CD308."""
    cache = tmp_path / "fp"
    cache.mkdir()
    framepack_sections(cache, "clip_0", 336, 192, 41)
    framepack_sections(cache, "clip_1", 256, 256, 45)
    for stem in ("clip_0", "clip_1"):
        _text(cache, stem, "fp", "framepack", {
            "llama_vec_float16": torch.randn(9, 64).half(),
            "llama_attention_mask": torch.ones(9, dtype=torch.bool),
            "clip_l_pooler_float16": torch.randn(768).half()})
    # one-frame training (encode_and_save_batch_one_frame): the target is 1 frame, the clean
    # latents the control frames plus a zero post frame, the 2x / 4x latents not saved
    one = tmp_path / "fp1f"
    one.mkdir()
    for stem, (width, height) in (("im_0", (300, 200)), ("im_1", (256, 256))):
        h, w = (26, 38) if stem == "im_0" else (32, 32)
        musubi.save_latents(one / musubi.latent_name(stem, width, height, "fp"), {
            f"latents_1x{h}x{w}_float16": torch.randn(16, 1, h, w).half(),
            "image_embeddings_float16": torch.randn(729, 1152).half(),
            "latent_indices_int64": torch.tensor([9]),
            "clean_latent_indices_int64": torch.tensor([0, 10]),
            f"latents_clean_1x{h}x{w}_float16": torch.randn(16, 2, h, w).half(),
            "clean_latent_2x_indices_int64": torch.arange(11, 13),
            "clean_latent_4x_indices_int64": torch.arange(13, 29)}, "framepack", width, height)
        _text(one, stem, "fp", "framepack", {"llama_vec_float16": torch.randn(9, 64).half(),
                                             "llama_attention_mask": torch.ones(9, dtype=torch.bool),
                                             "clip_l_pooler_float16": torch.randn(768).half()})
    assert severe(scan_paths(cache)) == []
    assert severe(scan_paths(one)) == []


def test_framepack_clean_latent_of_another_size_is_still_cd306(tmp_path: Path) -> None:
    """Only F comes from the target latent: a clean latent of another height is reported."""
    cache = tmp_path / "fp"
    cache.mkdir()
    (path,) = framepack_sections(cache, "clip_0", 256, 256, 41)
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors["latents_clean_9x32x32_float16"] = torch.randn(16, 2, 24, 32).half()
    save_file(tensors, str(path), metadata={"architecture": "framepack", "width": "256",
                                            "height": "256", "format_version": "1.0.1",
                                            "frame_count": "41"})
    found = by_code(scan_paths(cache), "CD306")
    assert [Path(f.path).name for f in found] == [path.name]
    assert "latents_clean_9x32x32_float16" in found[0].message


def test_wan_i2v_clip_output_is_float16_under_the_latent_dtype(tmp_path: Path) -> None:
    """wan_cache_latents.encode_and_save_batch: the CLIP output is cast to float16 and
    save_latent_cache_wan keys it `clip_<latent dtype>` (bfloat16). Also `latents_image_`
    (mask + VAE channels) and, for one-frame training, `f_indices_int32`."""
    cache = tmp_path / "wan"
    cache.mkdir()
    for stem, count in (("clip_0", 17), ("clip_1", 33)):
        f = (count - 1) // 4 + 1
        name = musubi.latent_name(stem, 336, 192, "wan", f"_00000-{count:03d}")
        musubi.save_latents(cache / name, {
            f"latents_{f}x24x42_bfloat16": torch.randn(16, f, 24, 42).bfloat16(),
            "clip_bfloat16": torch.randn(257, 1280).half(),
            f"latents_image_{f}x24x42_bfloat16": torch.randn(20, f, 24, 42).bfloat16()},
            "wan", 336, 192, frame_count=count)
        _text(cache, stem, "wan", "wan", {"varlen_t5_bfloat16": torch.randn(7, 64).bfloat16()})
    one = tmp_path / "wan1f"
    one.mkdir()
    musubi.save_latents(one / musubi.latent_name("im_0", 256, 256, "wan"), {
        "latents_2x32x32_bfloat16": torch.randn(16, 2, 32, 32).bfloat16(),
        "clip_bfloat16": torch.randn(1, 257, 1280).half(),
        "latents_image_2x32x32_bfloat16": torch.randn(20, 2, 32, 32).bfloat16(),
        "f_indices_int32": torch.tensor([0, 1], dtype=torch.int32)}, "wan", 256, 256)
    _text(one, "im_0", "wan", "wan", {"varlen_t5_bfloat16": torch.randn(7, 64).bfloat16()})
    assert severe(scan_paths(cache)) == []
    assert severe(scan_paths(one)) == []


def test_a_cast_wan_latent_is_still_cd306(tmp_path: Path) -> None:
    cache = tmp_path / "wan"
    cache.mkdir()
    musubi.save_latents(cache / musubi.latent_name("im_0", 256, 256, "wan"), {
        "latents_1x32x32_bfloat16": torch.randn(16, 1, 32, 32),
        "clip_bfloat16": torch.randn(257, 1280).half()}, "wan", 256, 256)
    _text(cache, "im_0", "wan", "wan", {"varlen_t5_bfloat16": torch.randn(7, 64).bfloat16()})
    (finding,) = by_code(scan_paths(cache), "CD306")
    assert "latents_1x32x32_bfloat16" in finding.message and "clip_" not in finding.message


def test_other_architectures_as_their_writers_key_them(tmp_path: Path) -> None:
    """FLUX.2 (`latents_<H>x<W>`, numbered controls), Qwen-Image-Edit (controls of their own
    size), Kandinsky 5 (`latents_image_` of first and last frame, `vae_scaling_factor`),
    HunyuanVideo 1.5 (float32 `latents_image_`, `siglip_`), Krea 2 (3-D text stack), FLUX
    Kontext (an unresized control), Z-Image, Ideogram 4: side by side in one bare tree."""
    root = tmp_path / "cache"
    bf = torch.bfloat16
    specs = {
        "f2d": ("flux_2_dev", {"latents_12x20_bfloat16": torch.randn(128, 12, 20).to(bf),
                               "latents_control_0_8x8_bfloat16": torch.randn(128, 8, 8).to(bf),
                               "latents_control_1_12x20_bfloat16": torch.randn(128, 12, 20).to(bf)},
                {"ctx_vec_bfloat16": torch.randn(512, 96).to(bf)}),
        "qie": ("qwen_image_edit", {
            "latents_1x24x40_bfloat16": torch.randn(16, 1, 24, 40).to(bf),
            "latents_control_0_1x24x40_bfloat16": torch.randn(16, 1, 24, 40).to(bf),
            "latents_control_1_1x40x24_bfloat16": torch.randn(16, 1, 40, 24).to(bf)},
            {"varlen_vl_embed_bfloat16": torch.randn(9, 64).to(bf)}),
        "k5": ("kandinsky5", {"latents_1x24x40_bfloat16": torch.randn(16, 1, 24, 40).to(bf),
                              "latents_image_2x24x40_bfloat16": torch.randn(16, 2, 24, 40).to(bf),
                              "vae_scaling_factor": torch.tensor(0.476986)},
               {"text_embeds_bfloat16": torch.randn(9, 64).to(bf),
                "pooled_embed_bfloat16": torch.randn(768).to(bf),
                "attention_mask": torch.ones(9, dtype=torch.bool)}),
        "hv15": ("hunyuan_video_1_5", {
            "latents_1x12x20_float16": torch.randn(32, 1, 12, 20).half(),
            "latents_image_1x12x20_float32": torch.randn(33, 1, 12, 20),
            "siglip_float16": torch.randn(729, 1152).half()},
            {"varlen_vl_embed_bfloat16": torch.randn(9, 64).to(bf),
             "varlen_byt5_embed_bfloat16": torch.randn(3, 32).to(bf)}),
        "kr2": ("krea2", {"latents_1x24x40_bfloat16": torch.randn(16, 1, 24, 40).to(bf)},
                {"varlen_krea2_vl_embed_bfloat16": torch.randn(9, 3, 64).to(bf)}),
        "fk": ("flux_kontext", {"latents_1x24x40_bfloat16": torch.randn(16, 24, 40).to(bf),
                                "latents_control_1x30x36_bfloat16": torch.randn(16, 30, 36).to(bf)},
               {"t5_vec_bfloat16": torch.randn(512, 64).to(bf),
                "clip_l_pooler_bfloat16": torch.randn(768).to(bf)}),
        "zi": ("z_image", {"latents_1x24x40_bfloat16": torch.randn(16, 24, 40).to(bf)},
               {"varlen_llm_embed_bfloat16": torch.randn(9, 64).to(bf)}),
        "i4": ("ideogram4", {"latents_1x12x20_bfloat16": torch.randn(128, 12, 20).to(bf)},
               {"varlen_i4_llm_features_bfloat16": torch.randn(9, 64).to(bf)}),
    }
    for arch, (full, latents, text) in specs.items():
        cache = root / arch
        cache.mkdir(parents=True)
        for stem in ("a", "b"):
            musubi.save_latents(cache / musubi.latent_name(stem, 320, 192, arch), latents, full,
                                320, 192)
            _text(cache, stem, arch, full, text)
    assert severe(scan_paths(root)) == []


def test_ids_made_unique_per_config_stay_unique_across_configs() -> None:
    """Two musubi dataset TOMLs in one project, the second with three datasets on one video
    dir (ids videos, videos (2), videos (3)): the first's second `videos` must not take the
    id `videos (2)` of another dataset, whose target_frames its clips would be checked by."""
    ids = unique(["videos", "videos", "videos", "videos (2)", "videos (3)"])
    assert len(set(ids)) == len(ids)
    assert ids[3:] == ["videos (2)", "videos (3)"]
    assert unique(["photos", "photos", "x"]) == ["photos", "photos (2)", "x"]


def test_project_with_a_config_per_architecture(tmp_path: Path) -> None:
    """A project folder holding a dataset TOML per architecture, two of whose datasets share
    the video dir: each clip is checked against its own dataset's target_frames."""
    root = tmp_path / "p"
    videos = root / "videos"
    videos.mkdir(parents=True)
    (videos / "clip_0.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom placeholder")
    (videos / "clip_0.txt").write_text("a clip\n")
    (root / "a_hv.toml").write_text(
        '[general]\nresolution = [256, 256]\ncaption_extension = ".txt"\n\n'
        '[[datasets]]\nvideo_directory = "videos"\ncache_directory = "cache/hv"\n'
        'target_frames = [1, 25]\n\n'
        '[[datasets]]\nvideo_directory = "videos"\ncache_directory = "cache/hv_long"\n'
        'target_frames = [45]\n')
    (root / "b_wan.toml").write_text(
        '[general]\nresolution = [256, 256]\ncaption_extension = ".txt"\n\n'
        '[[datasets]]\nvideo_directory = "videos"\ncache_directory = "cache/wan_a"\n'
        'target_frames = [9]\n\n'
        '[[datasets]]\nvideo_directory = "videos"\ncache_directory = "cache/wan_b"\n'
        'target_frames = [13]\n')
    for sub, arch, full, counts in (("hv", "hv", "hunyuan_video", (1, 25)),
                                    ("hv_long", "hv", "hunyuan_video", (45,)),
                                    ("wan_a", "wan", "wan", (9,)), ("wan_b", "wan", "wan", (13,))):
        cache = root / "cache" / sub
        cache.mkdir(parents=True)
        for count in counts:
            f = (count - 1) // 4 + 1
            musubi.save_latents(
                cache / musubi.latent_name("clip_0", 336, 192, arch, f"_00000-{count:03d}"),
                {f"latents_{f}x24x42_bfloat16": torch.randn(16, f, 24, 42).bfloat16()},
                full, 336, 192, frame_count=count)
        _text(cache, "clip_0", arch, full, {"varlen_t5_bfloat16": torch.randn(5, 64).bfloat16()},
              "a clip")
    assert severe(scan_paths(root)) == []


FLUX_2 = (("f2d", "flux_2_dev"), ("f2k4b", "flux_2_klein_4b"), ("f2k9b", "flux_2_klein_9b"))


def flux_2_item(cache: Path, stem: str, arch: str, full: str, width: int, height: int,
                controls: tuple[tuple[int, int], ...] = (), **swap) -> Path:
    """flux_2_cache_latents.encode_and_save_batch: the AE's [128, H/16, W/16] latent and one of
    each control image's own size (no_resize_control), saved by save_latent_cache_flux_2; `swap`
    replaces a key's tensor with another (a cache some other tool rewrote)."""
    bf = torch.bfloat16
    latent = torch.randn(128, height // 16, width // 16).to(bf)
    tensors = musubi.flux_2_latent(latent, [torch.randn(128, h // 16, w // 16).to(bf)
                                            for w, h in controls])
    for key, tensor in swap.items():
        assert key in tensors
        tensors[key] = tensor
    path = cache / musubi.latent_name(stem, width, height, arch)
    musubi.save_latents(path, tensors, full, width, height)
    _text(cache, stem, arch, full, {"ctx_vec_bfloat16": torch.randn(512, 96).to(bf)})
    return path


def test_flux_2_caches_as_the_writer_keys_them_are_healthy(tmp_path: Path) -> None:
    """`latents_<H>x<W>_<dtype>` [C, H, W] for every FLUX.2 model, with no control, one, or two
    of other sizes than the target: no CD306, nothing severe."""
    for arch, full in FLUX_2:
        cache = tmp_path / arch
        cache.mkdir()
        flux_2_item(cache, "plain", arch, full, 320, 192)
        flux_2_item(cache, "edit", arch, full, 320, 192, controls=((320, 192),))
        flux_2_item(cache, "refs", arch, full, 320, 192, controls=((256, 256), (192, 320)))
    report = scan_paths(tmp_path)
    assert by_code(report, "CD306") == []
    assert severe(report) == []


@pytest.mark.parametrize(("key", "tensor", "declares"), [
    ("latents_12x20_bfloat16", torch.randn(128, 16, 16).bfloat16(), "12x20 (H x W, no frame axis)"),
    ("latents_12x20_bfloat16", torch.randn(128, 1, 12, 20).bfloat16(), "12x20 (H x W, no frame axis)"),
    ("latents_12x20_bfloat16", torch.randn(128, 12, 20), "bfloat16"),
    ("latents_control_1_20x12_bfloat16", torch.randn(128, 12, 20).bfloat16(),
     "20x12 (H x W, no frame axis)"),
], ids=["another-size", "a-frame-axis", "cast", "control-of-another-size"])
def test_a_flux_2_latent_unlike_its_key_is_cd306(tmp_path: Path, key: str, tensor,
                                                  declares: str) -> None:
    cache = tmp_path / "f2k4b"
    cache.mkdir()
    flux_2_item(cache, "good", "f2k4b", "flux_2_klein_4b", 320, 192,
                controls=((320, 192), (192, 320)))
    bad = flux_2_item(cache, "bad", "f2k4b", "flux_2_klein_4b", 320, 192,
                      controls=((320, 192), (192, 320)), **{key: tensor})
    (finding,) = by_code(scan_paths(cache), "CD306")
    assert finding.path == str(bad)
    assert finding.message.startswith(f"{key} is ") and finding.message.endswith(declares)


def test_two_sizes_of_one_flux_2_latent_key_are_duplicates(tmp_path: Path) -> None:
    """The loader drops `_<H>x<W>` as it drops `_<F>x<H>x<W>`: two FLUX.2 latents collide."""
    cache = tmp_path / "f2d"
    cache.mkdir()
    bf = torch.bfloat16
    path = flux_2_item(cache, "a", "f2d", "flux_2_dev", 320, 192)
    musubi.save_latents(path, {"latents_12x20_bfloat16": torch.randn(128, 12, 20).to(bf),
                               "latents_16x16_bfloat16": torch.randn(128, 16, 16).to(bf)},
                        "flux_2_dev", 320, 192)
    (finding,) = by_code(scan_paths(cache), "CD307")
    assert finding.details["keys"] == {"latents": ["latents_12x20_bfloat16",
                                                   "latents_16x16_bfloat16"]}


def test_hidream_controls_are_keyed_by_their_patch_grid(tmp_path: Path) -> None:
    """save_pixel_cache_hidream_o1 keys each control `latents_control_<i>_<H>x<W>_<dtype>` over
    [H patches, W patches, D]: true to it, no CD306; another grid under the key is one."""
    cache = tmp_path / "ho1"
    cache.mkdir()
    bf = torch.bfloat16
    for stem, grid in (("a", (3, 5)), ("b", (5, 3))):
        musubi.save_latents(cache / musubi.latent_name(stem, 160, 128, "ho1"), {
            "latents_1x4x5_bfloat16": torch.randn(4, 5, 3072).to(bf),
            f"latents_control_0_{grid[0]}x{grid[1]}_bfloat16": torch.randn(*grid, 3072).to(bf)},
            "hidream_o1_image", 160, 128)
        _text(cache, stem, "ho1", "hidream_o1_image", {"varlen_input_ids_int64": torch.arange(7)})
    assert severe(scan_paths(cache)) == []
    musubi.save_latents(cache / musubi.latent_name("b", 160, 128, "ho1"), {
        "latents_1x4x5_bfloat16": torch.randn(4, 5, 3072).to(bf),
        "latents_control_0_5x3_bfloat16": torch.randn(3, 5, 3072).to(bf)},
        "hidream_o1_image", 160, 128)
    (finding,) = by_code(scan_paths(cache), "CD306")
    assert "latents_control_0_5x3_bfloat16 is [3, 5, 3072]" in finding.message
