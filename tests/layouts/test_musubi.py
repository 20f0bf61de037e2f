"""musubi-tuner: its dataset TOML read as musubi reads it, its caches as cache_io.py writes them
(real safetensors.torch.save_file with musubi's keys and header metadata), and the rules its
layout makes possible, each firing on its defect and silent on the clean project."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import kohya, musubi
from cachedoctor.layouts import resolve
from cachedoctor.layouts.musubi import bucket_resolutions, select_bucket

from conftest import by_code, invoke, run_cli, scan_paths

SEVERE = 2  # warning and above


def severe(report) -> list:
    return [(f.code, f.path, f.message) for f in report.findings if f.severity >= SEVERE]


@pytest.fixture(scope="module")
def clean_project(tmp_path_factory: pytest.TempPathFactory) -> musubi.Project:
    return musubi.build(tmp_path_factory.mktemp("musubi") / "m")


def test_layout_reads_image_and_video_datasets(clean_project) -> None:
    root = clean_project.root
    (layout,) = resolve([str(clean_project.config)])
    assert layout.trainer == "musubi" and layout.problems == ()
    images, kontext, videos = layout.datasets
    assert images.image_dirs == (str(root / "images"),)
    assert images.cache_dirs == (str(root / "cache" / "qwen"),)
    assert not images.caches_beside_images
    # no cache_directory: musubi caches beside the images (ImageDataset.__init__)
    assert kontext.cache_dirs == () and kontext.caches_beside_images
    assert kontext.latent_cache_dir == str(root / "kontext")
    assert videos.options["target_frames"] == (1, 9)
    assert images.options["captions"]["img_100"] == "a photo, bucket 1, number 0"


def test_clean_project_scans_clean_every_way(clean_project) -> None:
    root = clean_project.root
    for target in (clean_project.config, root):
        report = scan_paths(target, deep=True)
        assert report.trainers == ("musubi",), target
        assert severe(report) == [], target
    # bare dirs: the caches of several architectures side by side in sub-folders, each cache
    # dir, and a media dir with its caches beside it
    for target in (root / "cache", root / "cache" / "qwen", root / "cache" / "hv",
                   root / "kontext"):
        report = scan_paths(target)
        assert report.trainers == ("bare",), target
        assert severe(report) == [], target


def test_kohya_dataset_tomls_stay_kohya(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "k")
    (layout,) = resolve([str(project.root / "dataset.toml")])
    assert layout.trainer == "kohya"


@pytest.mark.parametrize("defect", musubi.DEFECTS)
def test_each_defect_fires_where_expected(defect: str, tmp_path: Path) -> None:
    project = musubi.build(tmp_path / "m", defects=[defect])
    report = scan_paths(project.config, deep=True)
    found = sorted((f.path, f.dataset) for f in by_code(report, defect))
    assert found == sorted(project.expected[defect])


def test_all_defects_at_once(tmp_path: Path) -> None:
    project = musubi.build(tmp_path / "m", defects=musubi.DEFECTS)
    report = scan_paths(project.config, deep=True)
    for code, expected in project.expected.items():
        assert sorted((f.path, f.dataset) for f in by_code(report, code)) == sorted(expected), code


# -- buckets (bucket.BucketSelector) -------------------------------------------------------------


def test_bucket_resolutions_for_128_step_16() -> None:
    """BucketSelector((128, 128), architecture="qi").bucket_resolutions, worked by hand: widths
    64..128 step 16, each with area // w rounded down to 16."""
    assert bucket_resolutions((128, 128), 16) == (
        (64, 256), (80, 192), (96, 160), (112, 144), (128, 128), (144, 112), (160, 96),
        (192, 80), (256, 64))


@pytest.mark.parametrize(("size", "enabled", "no_upscale", "bucket"), [
    ((192, 128), True, False, (160, 96)),  # aspect 1.5: 160/96 is nearer than 144/112
    ((128, 128), True, False, (128, 128)),
    ((1000, 200), True, False, (256, 64)),  # beyond the widest bucket: the widest
    ((100, 70), True, True, (96, 64)),  # no upscale, smaller than the area: rounded down
    ((192, 128), False, False, (128, 128)),  # buckets off: the resolution
])
def test_select_bucket(size, enabled, no_upscale, bucket) -> None:
    assert select_bucket(size, (128, 128), enabled, no_upscale, 16) == bucket


# -- rules beyond the project fixture -----------------------------------------------------------


def test_video_latent_with_wrong_frame_axis_and_header(tmp_path: Path) -> None:
    """A 9-frame clip whose latent has 2 latent frames (9 frames make 3) and whose header says
    13: CD308 names both; the clean clips beside it stay silent."""
    import torch

    project = musubi.build(tmp_path / "m")
    cache = project.root / "cache" / "hv"
    name = musubi.latent_name("clip_0", 160, 96, "hv", "_00000-009")
    latent = torch.zeros(16, 2, 12, 20, dtype=torch.bfloat16)
    musubi.save_latents(cache / name, {"latents_2x12x20_bfloat16": latent}, "hunyuan_video",
                        160, 96, frame_count=13)
    (finding,) = by_code(scan_paths(project.config), "CD308")
    assert finding.path == str(cache / name)
    assert "frame_count 13" in finding.message and "2 latent frames" in finding.message


def test_two_sizes_of_one_latent_key_are_duplicates(tmp_path: Path) -> None:
    """The loader drops `_<F>x<H>x<W>` as well as the dtype: two latents of one file collide."""
    import torch

    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / musubi.latent_name("a", 128, 128, "qi")
    musubi.save_latents(path, {"latents_1x16x16_bfloat16": torch.zeros(16, 1, 16, 16,
                                                                         dtype=torch.bfloat16),
                               "latents_1x12x12_bfloat16": torch.zeros(16, 1, 12, 12,
                                                                         dtype=torch.bfloat16)},
                        "qwen_image", 128, 128)
    (finding,) = by_code(scan_paths(cache), "CD307")
    assert finding.details["keys"] == {"latents": ["latents_1x12x12_bfloat16",
                                                   "latents_1x16x16_bfloat16"]}


def test_declared_keys_need_musubis_header(tmp_path: Path) -> None:
    """The same lying key in a file without musubi's header metadata is no CD306: the key
    scheme is musubi's, other writers name keys as they like."""
    import torch
    from safetensors.torch import save_file

    cache = tmp_path / "cache"
    cache.mkdir()
    save_file({"latents_1x12x20_bfloat16": torch.zeros(16, 1, 16, 16)}, str(cache / "a.safetensors"))
    assert by_code(scan_paths(cache), "CD306") == []


def test_mixed_architectures_only_within_one_directory(clean_project, tmp_path: Path) -> None:
    """Two architectures in sibling cache dirs: fine; moved into one dir: CD309 on the few."""
    root = tmp_path / "m"
    shutil.copytree(clean_project.root, root)
    assert by_code(scan_paths(root / "cache"), "CD309") == []
    for path in (root / "cache" / "hv").iterdir():
        if path.name != ".cachedoctor":  # the scan's index, not a cache file
            path.rename(root / "cache" / "qwen" / path.name)
    found = by_code(scan_paths(root / "cache" / "qwen"), "CD309")
    assert sorted(Path(f.path).name for f in found) == sorted(
        p.name for p in (root / "cache" / "qwen").iterdir() if "_hv" in p.name)


# -- fix ----------------------------------------------------------------------------------------


def test_fix_plan_quarantines_and_names_musubis_caching_script(tmp_path: Path) -> None:
    project = musubi.build(tmp_path / "m", defects=["CD302", "CD404"])
    result = invoke("fix", str(project.config), "--dry-run", "--reencode", "--encoder",
                    "reference")
    assert result.exit_code == 0, result.output
    assert "quarantine" in result.output
    latent = "img_002_0128x0128_qi.safetensors"
    assert latent in result.output
    assert ("musubi-tuner rebuilds it: python src/musubi_tuner/qwen_image_cache_latents.py "
            f"--dataset_config {project.config} --vae <VAE> --skip_existing") in result.output
    assert (project.root / "cache" / "qwen" / latent).exists()  # a dry run changes nothing


def test_without_reencode_the_plan_names_musubis_command_not_reencode(tmp_path: Path) -> None:
    """--reencode cannot write a musubi entry, so the plan without it must not offer it."""
    project = musubi.build(tmp_path / "m", defects=["CD404"])
    result = invoke("fix", str(project.config), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "--reencode" not in result.output
    assert ("no re-encode: musubi-tuner rebuilds it: python src/musubi_tuner/"
            "qwen_image_cache_latents.py") in result.output


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn",
                                   "float8_e5m2", "complex64"])
def test_count_values_counts_zeros_of_either_sign_and_nonfinite(dtype: str, tmp_path: Path) -> None:
    """count_values_at over the bytes torch writes: 0.0 and -0.0 are zeros, NaN is not."""
    import torch
    from safetensors.torch import save_file

    from cachedoctor.formats import read_path

    values = torch.tensor([1.0, 0.0, -0.0, 2.0, 0.0, -3.0, 0.5, 0.25])
    if not dtype.startswith("float8"):
        values[3] = float("nan")
    tensor = values.to(getattr(torch, dtype))
    save_file({"latents_1x1x8_x": tensor.reshape(1, 1, 1, 8)}, str(tmp_path / "a.safetensors"))
    meta = read_path(str(tmp_path / "a.safetensors"), deep=True)
    assert meta.zeros == ((("latents_1x1x8_x",), 3, 8),)
    assert meta.nonfinite == (() if dtype.startswith("float8") else
                              ((("latents_1x1x8_x",), 1),))


# -- 5-D video latents ([1, C, F, H, W], a video batch of one) ----------------------------------


def test_video_batches_of_one_in_the_shape_rules(tmp_path: Path) -> None:
    """torch.save of a video latent batch sliced to one item: a 4-channel VAE among 16-channel
    ones is CD303, another frame count in the same bucket folder CD301, and the slice of a
    batch that keeps the whole batch's storage CD201."""
    import torch

    from cachedoctor.fixtures.latents import save_latent

    bucket = tmp_path / "cache" / "160x96"
    bucket.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        save_latent(bucket / f"v{i}.pt", torch.randn(1, 16, 3, 12, 20, generator=g))
    save_latent(bucket / "other_vae.pt", torch.randn(1, 4, 3, 12, 20, generator=g))
    save_latent(bucket / "longer.pt", torch.randn(1, 16, 4, 12, 20, generator=g))
    batch = torch.randn(4, 16, 3, 12, 20, generator=g)
    save_latent(bucket / "retained.pt", batch[1:2], clone=False)
    report = scan_paths(tmp_path / "cache")
    assert [Path(f.path).name for f in by_code(report, "CD303")] == ["other_vae.pt"]
    assert sorted(Path(f.path).name for f in by_code(report, "CD301")) == ["longer.pt",
                                                                           "other_vae.pt"]
    assert [Path(f.path).name for f in by_code(report, "CD201")] == ["retained.pt"]


# -- configs --------------------------------------------------------------------------------------


def test_bad_values_are_findings_at_their_line(tmp_path: Path) -> None:
    """[general]'s bad values are reported once (not once per dataset that inherits them)."""
    (tmp_path / "dataset.toml").write_text(
        '[general]\nresolution = [1000000000, 5]\ncaption_extension = 7\n\n'
        '[[datasets]]\nvideo_directory = "v"\ntarget_frames = "many"\n\n'
        '[[datasets]]\nimage_directory = "v"\n\n'
        '[[datasets]]\nimage_jsonl_file = "x.jsonl"\n')
    report = scan_paths(tmp_path)
    assert report.trainers == ("musubi",)
    found = sorted((f.code, f.details["line"], f.details["key"]) for f in report.findings)
    assert found == [("CD408", 6, "datasets[0].video_directory"),
                     ("CD408", 10, "datasets[1].image_directory"),
                     ("CD408", 13, "datasets[2].image_jsonl_file"),
                     ("CD409", 2, "resolution"),
                     ("CD409", 3, "caption_extension"),
                     ("CD409", 7, "target_frames"),
                     ("CD409", 12, "cache_directory")]


def test_jsonl_captions_make_stale_embeddings_visible(tmp_path: Path) -> None:
    """An image_jsonl_file dataset: the caption is the line's "caption" (ImageJsonlDatasource)."""
    import json

    import torch

    cache = tmp_path / "cache"
    cache.mkdir()
    lines = [{"image_path": f"/data/img_{i}.png", "caption": f"caption {i}"} for i in range(2)]
    (tmp_path / "meta.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "dataset.toml").write_text('[[datasets]]\nimage_jsonl_file = "meta.jsonl"\n'
                                           'cache_directory = "cache"\nresolution = 128\n')
    for i in range(2):
        musubi.save_latents(cache / musubi.latent_name(f"img_{i}", 128, 128, "qi"),
                            {"latents_1x16x16_bfloat16": torch.zeros(16, 1, 16, 16,
                                                                     dtype=torch.bfloat16) + i},
                            "qwen_image", 128, 128)
        musubi.save_text(cache / f"img_{i}_qi_te.safetensors",
                         {"varlen_vl_embed_bfloat16": musubi.embed(i, 5, 64)}, "qwen_image",
                         "an old caption" if i else "caption 0")
    report = scan_paths(tmp_path / "dataset.toml")
    assert [(Path(f.path).name, f.code) for f in report.findings] == [
        ("img_1_qi_te.safetensors", "CD410")]
    assert "its jsonl line" in report.findings[0].message


def test_hidream_patch_tokens_are_no_latents(tmp_path: Path) -> None:
    """save_pixel_cache_hidream_o1: [H patches, W patches, D] under latents_1x<H>x<W>_<dtype>.
    Two buckets' tokens in one cache are no channel mismatch, and the key is true to them."""
    import torch

    cache = tmp_path / "cache"
    cache.mkdir()
    for stem, (hp, wp) in (("a", (4, 4)), ("b", (3, 5)), ("c", (4, 4))):
        musubi.save_latents(cache / musubi.latent_name(stem, wp * 32, hp * 32, "ho1"),
                            {f"latents_1x{hp}x{wp}_bfloat16": torch.ones(hp, wp, 3072,
                                                                         dtype=torch.bfloat16)},
                            "hidream_o1_image", wp * 32, hp * 32)
        musubi.save_text(cache / f"{stem}_ho1_te.safetensors",
                         {"varlen_input_ids_int64": torch.arange(7)}, "hidream_o1_image", stem)
    assert severe(scan_paths(cache)) == []


def test_images_without_a_caption_file_are_no_items(tmp_path: Path) -> None:
    """With caption_extension, glob_images keeps only images that have a caption file: an
    uncaptioned image without a latent is no CD404; a captioned one is."""
    project = musubi.build(tmp_path / "m", defects=["CD404"])
    (project.root / "images" / "img_001.txt").unlink()
    report = scan_paths(project.config)
    assert by_code(report, "CD404") == []


def test_an_image_named_like_a_clip_is_an_image(tmp_path: Path) -> None:
    """`take_00001-123.png` caches as take_00001-123_<W>x<H>_qi: no frame count, no video stem."""
    import torch

    cache = tmp_path / "cache"
    cache.mkdir()
    musubi.save_latents(cache / musubi.latent_name("take_00001-123", 128, 128, "qi"),
                        {"latents_1x16x16_bfloat16": torch.ones(16, 1, 16, 16,
                                                                dtype=torch.bfloat16)},
                        "qwen_image", 128, 128)
    musubi.save_text(cache / "take_00001-123_qi_te.safetensors",
                     {"varlen_vl_embed_bfloat16": musubi.embed(0, 5, 64)}, "qwen_image", "x")
    assert severe(scan_paths(cache)) == []


def test_fix_quarantines_and_undo_puts_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(tmp_path / "state"))
    project = musubi.build(tmp_path / "m", defects=["CD306", "CD410"])
    broken = sorted(Path(p) for p, _ in project.expected["CD306"] + project.expected["CD410"])
    before = {p: p.read_bytes() for p in broken}
    result = invoke("fix", str(project.config), "--yes")
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in broken)
    after = scan_paths(project.config)
    assert by_code(after, "CD306") == [] and by_code(after, "CD410") == []
    assert invoke("undo", "--cache", str(project.root / "cache" / "qwen")).exit_code == 0
    assert {p: p.read_bytes() for p in broken} == before


def test_a_fifo_in_a_captions_place_does_not_hang_the_scan(tmp_path: Path) -> None:
    """musubi's captions are read to compare with caption1 (CD410): a FIFO named like a
    caption would block an ordinary open forever. It is no caption; the rest is judged."""
    project = musubi.build(tmp_path / "m", defects=["CD410"])
    caption = project.root / "images" / "img_000.txt"
    caption.unlink()
    os.mkfifo(caption)
    result = run_cli("scan", str(project.config), "--format", "json", timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr  # CD410 warns
    found = {f["path"] for f in json.loads(result.stdout)["findings"] if f["code"] == "CD410"}
    assert {path for path, _ in project.expected["CD410"]} == found != set()


@pytest.mark.parametrize("first", ["good", "bad"])
def test_twins_are_judged_by_their_own_names(tmp_path: Path, first: str) -> None:
    """Clips whose files are byte for byte alike are twins (one header parse, and the second's
    verdict serves the third), but CD308 reads each file's name: the clip named 13 frames whose
    header says 9 is CD308, the ones named 9 are not, whichever twin the scan reads first."""
    import torch

    project = musubi.build(tmp_path / "m")
    cache = project.root / "cache" / "hv"
    names = {"good": "clip_b", "bad": "clip_c"} if first == "good" else \
        {"good": "clip_c", "bad": "clip_b"}
    original = cache / musubi.latent_name("clip_a", 160, 96, "hv", "_00000-009")
    good = cache / musubi.latent_name(names["good"], 160, 96, "hv", "_00000-009")
    bad = cache / musubi.latent_name(names["bad"], 160, 96, "hv", "_00000-013")
    latent = torch.zeros(16, 3, 12, 20, dtype=torch.bfloat16)
    musubi.save_latents(original, {"latents_3x12x20_bfloat16": latent}, "hunyuan_video", 160, 96,
                        frame_count=9)
    for twin in (good, bad):  # (musubi's writer keeps its header's order: the same bytes)
        shutil.copyfile(original, twin)
    assert [f.path for f in by_code(scan_paths(project.config), "CD308")] == [str(bad)]
