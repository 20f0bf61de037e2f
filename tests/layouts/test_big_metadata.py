"""A healthy large dataset's trainer-side JSON is read, not refused.

kohya sd-scripts reads a fine-tuning subset's `metadata_file` whole (kohya-ss/sd-scripts
48d368fa library/train_util.py FineTuningDataset.__init__: `json.load`, or a `.jsonl` line at a
time); finetune/merge_*_to_metadata.py and prepare_buckets_latents.py write ~1 KB an image
(json.dumps indent=2 of caption, tags, train_resolution), so 64 MiB is ~65,000 images. A larger
file was a CD409 *error* ("larger than 64 MiB: not a config file") and the subset's folders
went unchecked. SimpleTuner's `aspect_ratio_bucket_metadata_<id>.json` (bghira/SimpleTuner
bc8e6ab7 metadata/backends/discovery.py save_image_metadata, ~250 bytes an image) crossed the
same 64 MiB at ~250,000 images. Past cachedoctor's (much larger) reading limit a file is a CD409
*warning* saying so, and the other datasets are judged as ever.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cachedoctor.findings import Severity
from cachedoctor.fixtures.projects import kohya, simpletuner
from cachedoctor.layouts import kohya as kohya_layout
from cachedoctor.layouts import simpletuner as simpletuner_layout

from conftest import by_code, scan_paths

OLD_LIMIT = 64 * 2**20
TAGS = ", ".join(f"tag_{i}_word" for i in range(60))  # a booru-tagged image's tags


def _entry(key: str) -> str:
    """One image's entry as prepare_buckets_latents.py writes it (json.dumps, indent=2)."""
    body = json.dumps({"caption": "a photo of a person by a window, soft light", "tags": TAGS,
                       "train_resolution": [256, 256]}, indent=2).replace("\n", "\n  ")
    return f"  {json.dumps(key)}: {body}"


def metadata_subset(tmp_path: Path, name: str, pad_to: int = 0,
                    defects: tuple[str, ...] = ()) -> tuple[kohya.Project, Path]:
    """The kohya project (`defects` injected) with its subset's image_dir swapped for a
    metadata file keyed by the images' absolute paths, padded with entries of more images of
    that folder until it holds `pad_to` bytes; (project, metadata file)."""
    project = kohya.build(tmp_path / "k", defects)
    folder = project.root / "train" / kohya.DATASET
    keys = [str(image) for image in sorted(folder.glob("*.png"))]
    path = project.root / name
    with open(path, "w", encoding="utf-8") as f:
        if name.endswith(".jsonl"):
            line = {"caption": "a photo of a person", "tags": TAGS}
            f.writelines(json.dumps({"image_path": k, **line}) + "\n" for k in keys)
            pad = json.dumps({"image_path": str(folder / "pad_0000000.png"), **line}) + "\n"
            f.writelines(pad.replace("0000000", f"{i:07d}")
                         for i in range(max(0, pad_to - f.tell()) // len(pad) + 1 if pad_to else 0))
        else:
            f.write("{\n" + ",\n".join(_entry(k) for k in keys))
            pad = ",\n" + _entry(str(folder / "pad_0000000.png"))
            count = max(0, pad_to - f.tell()) // len(pad) + 1 if pad_to else 0
            f.writelines(pad.replace("0000000", f"{i:07d}") for i in range(count))
            f.write("\n}\n")
    assert path.stat().st_size > pad_to
    toml = project.root / "dataset.toml"
    text = toml.read_text()
    line = next(x for x in text.splitlines() if x.strip().startswith("image_dir"))
    toml.write_text(text.replace(line, f'  metadata_file = "{name}"'))
    return project, path


def alarms(report) -> list[tuple[str, str]]:
    return [(f.code, f.message) for f in report.findings if f.severity >= Severity.WARNING]


@pytest.mark.parametrize("name", ["meta_lat.json", "meta.jsonl"])
def test_a_metadata_file_past_64_mib_is_read_and_its_subset_judged(tmp_path: Path,
                                                                    name: str) -> None:
    """A real 64 MiB+ metadata file (~70,000 images): no CD409, and the npz the subset lacks
    is CD404, as in a small one. Before: CD409 error, and no CD404 (its folder unscanned)."""
    project, path = metadata_subset(tmp_path, name, pad_to=OLD_LIMIT, defects=("CD404",))
    try:
        report = scan_paths(project.config)
        assert [code for code, _ in alarms(report)] == ["CD404"]
        (missing,) = by_code(report, "CD404")
        assert missing.path == str(project.expected["CD404"][0][0])
    finally:
        path.unlink()  # 64 MiB must not stay in the temp dir


@pytest.mark.parametrize("name", ["meta_lat.json", "meta.jsonl"])
def test_a_metadata_file_past_the_reading_limit_is_a_warning_and_the_rest_is_judged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Past MAX_METADATA_BYTES (16 GiB, here 4 KiB): a CD409 warning that the file is beyond
    cachedoctor's reading limit, not an error; another dataset in the same scan is judged."""
    monkeypatch.setattr(kohya_layout, "MAX_METADATA_BYTES", 4096)
    project, _ = metadata_subset(tmp_path / "big", name, pad_to=8192)
    other = kohya.build(tmp_path / "other", ["CD404"])
    report = scan_paths(project.config, other.config)
    (unread,) = by_code(report, "CD409")
    assert unread.severity == Severity.WARNING
    assert f"metadata_file '{name}' was not read" in unread.message
    assert "beyond cachedoctor's reading limit of 4,096 bytes: not checked" in unread.message
    assert unread.details["reading_limit"] == 4096
    assert [f.path for f in by_code(report, "CD404")] == [str(other.expected["CD404"][0][0])]


def test_a_100_gib_metadata_file_is_a_warning_not_read(tmp_path: Path) -> None:
    """Past the real limit (16 GiB): a sparse 100 GiB file, no disk used, refused by its size
    before a byte is read; the scan ends as ever, the other datasets judged."""
    project, path = metadata_subset(tmp_path / "big", "meta_lat.json")
    os.truncate(path, 100 * 2**30)
    other = kohya.build(tmp_path / "other", ["CD404"])
    try:
        report = scan_paths(project.config, other.config)
    finally:
        path.unlink()
    (unread,) = by_code(report, "CD409")
    assert unread.severity == Severity.WARNING
    assert ("holds 107,374,182,400 bytes, beyond cachedoctor's reading limit of 16 GiB: "
            "not checked") in unread.message
    assert [f.path for f in by_code(report, "CD404")] == [str(other.expected["CD404"][0][0])]


def test_invalid_metadata_is_still_an_error_with_its_line(tmp_path: Path) -> None:
    """A file sd-scripts' json.load refuses, 3 MiB in: CD409 error at json's line and column."""
    project, path = metadata_subset(tmp_path, "meta_lat.json", pad_to=3 * 2**20)
    try:
        text = path.read_text()
        at = text.index("pad_0002000")
        text = text[:at] + text[at:].replace('"caption":', '"caption"', 1)
        path.write_text(text)
        with pytest.raises(json.JSONDecodeError) as refused:  # as sd-scripts' json.load
            json.loads(text)
        where = f"(line {refused.value.lineno}, column {refused.value.colno})"
        (finding,) = by_code(scan_paths(project.config), "CD409")
        assert finding.severity == Severity.ERROR
        assert f"not valid JSON: Expecting ':' delimiter {where}" in finding.message
    finally:
        path.unlink()


def _pad_simpletuner_metadata(project, size: int) -> Path:
    """The project's bucket metadata with entries of more images, as save_image_metadata
    writes them, added until it holds `size` bytes."""
    path = project.root / "datasets" / "photos" / "aspect_ratio_bucket_metadata_photos.json"
    data = json.loads(path.read_text())
    assert data and path.read_text().endswith("}")
    pad = (', "/data/more/img_0000000.png": {"original_size": [1920, 1080], '
           '"crop_coordinates": [0, 448], "target_size": [448, 256], '
           '"intermediary_size": [455, 256], "aspect_ratio": 1.75}')
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data)[:-1])
        f.writelines(pad.replace("0000000", f"{i:07d}") for i in range(size // len(pad) + 1))
        f.write("}")
    return path


def test_simpletuner_bucket_metadata_past_the_bucket_file_limit_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SimpleTuner's bucket metadata is streamed, not held to the limit of a file read whole:
    its target sizes still make the latent of the wrong size CD302. Before, both bucket files
    had one 64 MiB limit (~250,000 images of metadata): a CD409 error, and no CD302. The
    limit is 1 MiB here, the metadata 2 MiB, so the test runs fast; the kohya test above
    reads a real 64 MiB file."""
    monkeypatch.setattr(simpletuner_layout, "MAX_BUCKET_FILE", 2**20)
    project = simpletuner.build(tmp_path / "p", defects=["CD302"])
    _pad_simpletuner_metadata(project, 2 * 2**20)
    report = scan_paths(project.config)
    assert by_code(report, "CD409") == []
    assert {f.path for f in by_code(report, "CD302")} == {
        str(p) for p, _ in project.expected["CD302"]}


@pytest.mark.parametrize("which", ["indices", "metadata"])
def test_simpletuner_bucket_files_past_the_reading_limit_are_warnings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    limit = "MAX_BUCKET_FILE" if which == "indices" else "MAX_METADATA_FILE"
    monkeypatch.setattr(simpletuner_layout, limit, 1024)
    project = simpletuner.build(tmp_path / "p", defects=["CD404"])
    path = project.root / "datasets" / "photos" / f"aspect_ratio_bucket_{which}_photos.json"
    path.write_text(path.read_text() + " " * 2048)
    report = scan_paths(project.config)
    (unread,) = by_code(report, "CD409")
    assert unread.path == str(path) and unread.severity == Severity.WARNING
    assert "beyond cachedoctor's reading limit of 1,024 bytes" in unread.message
    assert "not checked" in unread.message
    assert {f.code for f in report.findings if f.severity == Severity.ERROR} == {"CD404"}
    assert by_code(report, "CD404")  # the dataset's other rules still ran


def test_a_musubi_jsonl_past_the_reading_limit_is_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """musubi-tuner's image_jsonl_file past MAX_JSONL_BYTES (1 GiB, here 64 bytes): its
    captions were silently not compared; now a CD409 warning says the file was not read."""
    import torch

    from cachedoctor.fixtures.projects import musubi
    from cachedoctor.layouts import musubi as musubi_layout

    monkeypatch.setattr(musubi_layout, "MAX_JSONL_BYTES", 64)
    cache = tmp_path / "cache"
    cache.mkdir()
    lines = [{"image_path": f"/data/img_{i}.png", "caption": f"caption {i}"} for i in range(2)]
    (tmp_path / "meta.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "dataset.toml").write_text('[[datasets]]\nimage_jsonl_file = "meta.jsonl"\n'
                                           'cache_directory = "cache"\nresolution = 128\n')
    for i in range(2):
        musubi.save_latents(cache / musubi.latent_name(f"img_{i}", 128, 128, "qi"),
                            {"latents_1x16x16_bfloat16": torch.zeros(16, 1, 16, 16,
                                                                     dtype=torch.bfloat16)},
                            "qwen_image", 128, 128)
        musubi.save_text(cache / f"img_{i}_qi_te.safetensors",
                         {"varlen_vl_embed_bfloat16": musubi.embed(i, 5, 64)}, "qwen_image",
                         f"caption {i}")
    report = scan_paths(tmp_path / "dataset.toml")
    assert [(f.code, f.severity) for f in report.findings] == [("CD409", Severity.WARNING)]
    size = (tmp_path / "meta.jsonl").stat().st_size
    assert (f"image_jsonl_file 'meta.jsonl' was not read: the file holds {size} bytes, beyond "
            "cachedoctor's reading limit of 64 bytes: not checked; its captions are not "
            "compared") in report.findings[0].message
