"""An ai-toolkit image folder (`dataset/` with its `_latent_cache/`) or its `_latent_cache/` scanned
with no job config: the trainer's own folder name tells the layout, the header of each entry
names its image (`filename`), so coverage (CD404, CD405) is counted as with the config. Which
resolutions the dataset trains is in the config only: a bare scan takes an image's buckets from
images of the same size (ai-toolkit's bucket depends on the image size and the dataset's
settings only) and says so in the finding."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import aitoolkit

from conftest import by_code, invoke, scan_paths


def targets(folder: Path) -> tuple[Path, Path]:
    return folder, folder / "_latent_cache"


def worse_than_info(report) -> list:
    return [(f.code, f.path, f.message) for f in report.findings if f.severity >= 2]


@pytest.mark.parametrize("cache", [False, True], ids=["dataset", "latent_cache"])
def test_a_healthy_cache_scans_clean(tmp_path: Path, cache: bool) -> None:
    project = aitoolkit.build(tmp_path / "one")
    folder = project.root / "datasets" / aitoolkit.DATASET
    report = scan_paths(targets(folder)[cache])
    assert report.trainers == ("bare",)
    assert report.findings == (), worse_than_info(report)


@pytest.mark.parametrize("cache", [False, True], ids=["dataset", "latent_cache"])
def test_a_healthy_multi_resolution_cache_scans_clean(tmp_path: Path, cache: bool) -> None:
    """Two entries (two hashes) for the 192x128 and 128x192 images, one for the square ones."""
    _, folder, entries = aitoolkit.multi_resolution(tmp_path / "multi")
    assert sorted(len(e) for e in entries.values()) == [1, 1, 1, 2, 2, 2, 2, 2, 2]
    report = scan_paths(targets(folder)[cache])
    assert report.findings == (), [(f.code, f.path, f.message) for f in report.findings]


@pytest.mark.parametrize("cache", [False, True], ids=["dataset", "latent_cache"])
def test_a_deleted_entry_and_an_orphan_are_reported(tmp_path: Path, cache: bool) -> None:
    project = aitoolkit.build(tmp_path / "p", defects=["CD404", "CD405"])
    folder = project.root / "datasets" / aitoolkit.DATASET
    report = scan_paths(targets(folder)[cache])
    for code in ("CD404", "CD405"):
        assert [f.path for f in by_code(report, code)] == [p for p, _ in project.expected[code]]
    (missing,) = by_code(report, "CD404")
    assert "_latent_cache/img_002_<hash>.safetensors" in missing.message
    assert "job config" in missing.message  # how many entries (one per resolution) it cannot tell
    assert missing.dataset == aitoolkit.DATASET
    assert {f.code for f in report.findings} == {"CD404", "CD405"}


def test_a_latent_cache_copied_away_from_its_images_has_no_orphans(tmp_path: Path) -> None:
    """A `_latent_cache` whose folder holds no image (copied elsewhere to be checked) is judged
    file by file: its entries are not the orphans of images it never had."""
    import shutil

    project = aitoolkit.build(tmp_path / "p", defects=["CD302"])
    copy = tmp_path / "copy" / "_latent_cache"
    shutil.copytree(project.root / "datasets" / aitoolkit.DATASET / "_latent_cache", copy)
    report = scan_paths(copy)
    assert {f.code for f in report.findings} == {"CD302"}  # the header's crop is still read
    assert len(by_code(report, "CD302")) == len(project.expected["CD302"])


def test_a_folder_of_image_folders_counts_each_folder(tmp_path: Path) -> None:
    """`datasets/` holding `person/` (cached) and `style/` (no `_latent_cache`: a dataset without
    cache_latents_to_disk): only person's images need entries."""
    project = aitoolkit.build(tmp_path / "p", defects=["CD404"])
    datasets = project.root / "datasets"
    aitoolkit.images(datasets / "style")
    report = scan_paths(datasets)
    assert [f.path for f in by_code(report, "CD404")] == [p for p, _ in project.expected["CD404"]]
    assert {f.code for f in report.findings} == {"CD404"}


@pytest.mark.parametrize("cache", [False, True], ids=["dataset", "latent_cache"])
def test_one_resolution_s_entry_gone_is_cd404_from_same_size_images(tmp_path: Path,
                                                                     cache: bool) -> None:
    _, folder, entries = aitoolkit.multi_resolution(tmp_path / "multi")
    small, _ = entries["img_100.png"]  # a 192x128 image: 128x128 and 192x128 buckets
    small.unlink()
    report = scan_paths(targets(folder)[cache])
    (missing,) = by_code(report, "CD404")
    assert missing.path == str(folder / "img_100.png")
    assert "128x128 bucket" in missing.message and "same size" in missing.message, missing.message
    assert "job config" in missing.message
    assert not by_code(report, "CD405")  # its 192x128 entry is no orphan
    assert {f.code for f in report.findings} == {"CD404"}


def test_reencode_on_the_bare_folder_writes_the_missing_resolution(tmp_path: Path) -> None:
    _, folder, entries = aitoolkit.multi_resolution(tmp_path / "multi")
    small, large = entries["img_101.png"]
    small.unlink()
    result = invoke("fix", str(folder), "--reencode", "--encoder", "reference", "--yes")
    assert result.exit_code == 0, result.output
    assert small.exists() and large.exists()  # ai-toolkit's own name: the hash of its info
    assert scan_paths(folder).findings == ()


def test_an_emptied_entry_is_encoded_again_at_the_resolution_its_name_gives(tmp_path: Path) -> None:
    """The empty 128x128 entry of a 192x128 image has no header: the bucket is the one whose
    info, taken from an image of the same size, hashes to the name."""
    from safetensors import safe_open

    _, folder, entries = aitoolkit.multi_resolution(tmp_path / "multi")
    small, _ = entries["img_102.png"]
    small.write_bytes(b"")
    result = invoke("fix", str(folder / "_latent_cache"), "--reencode", "--encoder", "reference",
                    "--yes")
    assert result.exit_code == 0, result.output
    with safe_open(str(small), "pt") as f:
        assert f.metadata()["crop_width"] == "128" and f.get_tensor("latent").shape == (4, 16, 16)
    assert scan_paths(folder).findings == ()


def listing(folder: Path) -> list[str]:
    """The folder's entries, less the index a scan keeps there (.cachedoctor/)."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".cachedoctor")


@pytest.mark.parametrize("cache", [False, True], ids=["dataset", "latent_cache"])
def test_fix_plans_only_what_the_scan_reported(tmp_path: Path, cache: bool) -> None:
    from cachedoctor.layouts import resolve
    from cachedoctor.repair import build_plan
    from cachedoctor.repair.caches import cache_roots
    from cachedoctor.repair.encoders import resolve as encoder
    from cachedoctor.repair.plan import Reencode

    project = aitoolkit.build(tmp_path / "p", defects=["CD404", "CD405"])
    folder = project.root / "datasets" / aitoolkit.DATASET
    target = targets(folder)[cache]
    before = listing(folder / "_latent_cache")
    (image, _), (orphan, _) = project.expected["CD404"][0], project.expected["CD405"][0]
    report = scan_paths(target)
    layouts = resolve([str(target)])
    roots = cache_roots(layouts)

    assert build_plan(report, roots).actions == ()  # an error to re-encode, an info orphan
    everything = build_plan(report, roots, Reencode.of(encoder("reference"), layouts),
                            include_info=True)
    assert sorted((a.kind, a.target.image if a.target else a.path, a.codes)
                  for a in everything.actions) == [("quarantine", orphan, ("CD405",)),
                                                   ("reencode", image, ("CD404",))]
    (written,) = everything.of_kind("reencode")
    assert written.path.startswith(str(folder / "_latent_cache" / "img_002_"))

    result = invoke("fix", str(target), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "Nothing to fix." in result.output and "--include-info" in result.output
    assert listing(folder / "_latent_cache") == before
