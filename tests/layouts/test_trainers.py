"""OneTrainer, kohya and ai-toolkit configs read as each trainer reads them, and bare cache dirs
that get a trainer's bucket semantics from their files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cachedoctor.fixtures import clean
from cachedoctor.fixtures.latents import latent_batch, save_latent
from cachedoctor.fixtures.projects import aitoolkit, kohya, onetrainer, simpletuner
from cachedoctor.layouts import resolve
from cachedoctor.layouts.kohya import Buckets

from conftest import by_code, codes, scan_paths

# -- OneTrainer ---------------------------------------------------------------------------------


def test_onetrainer_layout(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path / "ot")
    (layout,) = resolve([str(project.config)])
    (dataset,) = layout.datasets
    root = project.root
    assert layout.base == str(root)  # the parent of training_presets/
    assert dataset.id == "my_lora"
    assert dataset.image_dirs == (str(root / "datasets" / "person"),)
    assert dataset.latent_cache_dir == str(root / "workspace-cache" / "run" / "image")
    assert dataset.options["train_device"] == "cuda" and not dataset.cache_rebuilt_at_start
    assert dataset.expected_device == "any"  # mgds loads with map_location=train_device
    (entries,) = dataset.naming.aggregates.values()
    assert entries[0] == (str(root / "datasets" / "person" / "img_000.png"), (128, 128))
    assert str(root / "training_concepts" / "concepts.json") in layout.files


def test_onetrainer_session_config_is_discovered_and_shipped_presets_are_not(tmp_path: Path) -> None:
    """The UI keeps its last session in training_presets/#.json (TopBarController): a project
    whose only config it is, is that OneTrainer project, not a bare dir of the checkout's files.
    Other `#<name>.json` files are OneTrainer's shipped presets and are not read."""
    project = onetrainer.build(tmp_path / "ot", defects=["CD404"])
    session = project.root / "training_presets" / "#.json"
    project.config.rename(session)
    preset = json.loads(session.read_text()) | {"cache_dir": "elsewhere"}
    (project.root / "training_presets" / "#sdxl 1.0 LoRA.json").write_text(json.dumps(preset))
    (layout,) = resolve([str(project.root)])
    assert (layout.trainer, layout.source) == ("onetrainer", str(session))
    report = scan_paths(project.root)
    assert report.trainers == ("onetrainer",) and "CD107" not in codes(report)
    (missing,) = by_code(report, "CD404")
    assert missing.path == str(project.expected["CD404"][0][0])


def test_onetrainer_inline_concepts(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path / "ot")
    concepts = json.loads((project.root / "training_concepts" / "concepts.json").read_text())
    config = json.loads(project.config.read_text())
    config.update(concepts=concepts, concept_file_name="nowhere.json")
    project.config.write_text(json.dumps(config, indent=4))
    assert [f for f in scan_paths(project.config).findings if f.severity >= 2] == []


def test_onetrainer_missing_concept_file_is_cd408(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path / "ot")
    (project.root / "training_concepts" / "concepts.json").unlink()
    (finding,) = by_code(scan_paths(project.config), "CD408")
    assert finding.details["key"] == "concept_file_name"
    assert "OneTrainer's working dir" in finding.message


def test_onetrainer_bare_cache_gets_crop_buckets(tmp_path: Path) -> None:
    """A variation folder mixes crop sizes: with aggregate.pt, no CD301; a wrong one, CD302."""
    project = onetrainer.build(tmp_path / "ot", defects=["CD302"])
    cache = project.root / "workspace-cache" / "run"
    report = scan_paths(cache)
    assert report.trainers == ("bare",)
    assert "CD301" not in codes(report)
    wrong = sorted(f.path for f in by_code(report, "CD302"))
    assert len(wrong) == 3
    # the same from its image/ folder, a group folder, a variation folder
    group = next(p for p in sorted((cache / "image").iterdir()) if any(w.startswith(str(p)) for w in wrong))
    for folder in (cache / "image", group, group / "variation-0"):
        report = scan_paths(folder)
        assert "CD301" not in codes(report), folder
        assert sorted(f.path for f in by_code(report, "CD302")) == [
            w for w in wrong if w.startswith(str(folder) + os.sep)], folder


def test_onetrainer_bare_cache_on_its_train_device_is_clean(tmp_path: Path) -> None:
    """mgds saves from the train_device and loads with map_location=train_device: cuda:0
    files are no CD501, and a cache with one sample saved from the CPU is no CD502 either
    (every tensor lands on the train device), config or not."""
    project = onetrainer.build(tmp_path / "ot")
    report = scan_paths(project.root / "workspace-cache" / "run")
    assert report.trainers == ("bare",) and report.findings == ()
    mixed = onetrainer.build(tmp_path / "mixed", cpu_sample=True)
    for target in (mixed.root / "workspace-cache" / "run", mixed.config):
        assert not {"CD501", "CD502"} & codes(scan_paths(target)), target


def test_device_tags_are_judged_by_the_loader_the_layout_implies(tmp_path: Path) -> None:
    """SimpleTuner loads its caches with map_location="cpu": a latent saved from cuda:0 among
    CPU ones is harmless there. The same folder scanned bare (loader unknown) is a CD501
    warning, and CD502 across the cache, as a plain torch.load would mix them."""
    project = simpletuner.build(tmp_path / "st", cuda_latent=True)
    assert not {"CD501", "CD502"} & codes(scan_paths(project.config))
    cache = project.root / "output" / "models" / "cache" / "vae" / "sdxl" / "photos"
    bare = scan_paths(cache)
    assert bare.trainers == ("bare",)
    (tagged,) = by_code(bare, "CD501")
    assert tagged.severity == 2 and "cuda:0" in tagged.message  # a warning
    assert by_code(bare, "CD502")


# -- kohya --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "size", "bucket"), [
    # enable_bucket, resolution, min, max, steps, no_upscale; image (w, h) -> bucket (w, h)
    ((True, (256, 256), 128, 512, 64, False), (256, 256), (256, 256)),
    ((True, (256, 256), 128, 512, 64, False), (320, 192), (320, 192)),
    ((True, (256, 256), 128, 512, 64, False), (1000, 600), (320, 192)),  # nearest aspect
    ((True, (256, 256), 128, 512, 64, False), (600, 1000), (192, 320)),
    ((False, (512, 384), 256, 1024, 64, False), (300, 900), (512, 384)),  # one fixed bucket
    ((True, (256, 256), 128, 512, 64, True), (200, 130), (192, 128)),  # no upscale: cut to steps
    ((True, (256, 256), 128, 512, 64, True), (1000, 500), (256, 128)),  # shrunk to the area
])
def test_kohya_bucket_selection(settings: tuple, size: tuple, bucket: tuple) -> None:
    assert Buckets.make(*settings).select(*size) == bucket


def test_kohya_predefined_buckets_for_256() -> None:
    assert Buckets.make(True, (256, 256), 128, 512, 64, False).predefined == (
        (128, 384), (128, 448), (128, 512), (192, 320), (256, 256), (320, 192), (384, 128),
        (448, 128), (512, 128))


def test_kohya_dataset_toml_scans_like_its_config_file(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "k", defects=["CD302", "CD404"])
    dataset_toml = project.root / "dataset.toml"
    assert scan_paths(dataset_toml).findings == scan_paths(project.config).findings
    (layout,) = resolve([str(dataset_toml)])
    assert layout.source == str(project.config)


def test_kohya_train_data_dir_folders(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "k", defects=["CD404"])
    (project.root / "config.toml").write_text(
        '[dataset_arguments]\ntrain_data_dir = "train"\nresolution = "256,256"\n'
        'enable_bucket = true\nmin_bucket_reso = 128\nmax_bucket_reso = 512\n')
    (project.root / "dataset.toml").unlink()
    (project.root / "train" / "no_repeats").mkdir()  # kohya ignores it
    report = scan_paths(project.config)
    assert report.datasets == ("10_person",)
    assert [f.path for f in by_code(report, "CD404")] == [p for p, _ in project.expected["CD404"]]


def test_kohya_caches_beside_images_are_by_design(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "k")
    report = scan_paths(project.config)
    assert not codes(report) & {"CD401", "CD107"}
    bare = scan_paths(project.root / "train" / "10_person")  # the image dir given alone
    assert bare.findings == ()
    # the train_data_dir given alone: its <repeats>_<name> sub-folders are kohya image dirs
    assert scan_paths(project.root / "train").findings == ()
    # sub-folders of images without kohya's caches, in a cache, are still strays
    other = tmp_path / "other" / "10_person"
    other.mkdir(parents=True)
    shutil.copyfile(project.root / "train" / "10_person" / "img_000.png", other / "img_000.png")
    save_latent(other.parent / "0000.pt", latent_batch(1)[0])
    assert codes(scan_paths(other.parent)) == {"CD107"}
    # but a folder of images beside the caches in a folder of projects is an image folder
    (other.parent / "0000.pt").unlink()
    assert codes(scan_paths(other.parent)) == set()


@pytest.mark.parametrize("defects", [(), ("CD301",), ("CD302",)])
def test_kohya_legacy_npz_names_get_their_bucket_from_the_image(defects: tuple, tmp_path: Path) -> None:
    """A legacy `<stem>.npz` (still used when present, strategy_sd.py) names no size: the
    bucket comes from the image's header, as kohya's imagesize.get reads it."""
    project = kohya.build(tmp_path / "k", defects=defects)
    for npz in (project.root / "train" / "10_person").glob("*_sdxl.npz"):
        npz.rename(npz.with_name(npz.name.split("_")[0] + "_" + npz.name.split("_")[1] + ".npz"))
    expected = sorted((code, str(Path(p).with_name("_".join(Path(p).name.split("_")[:2]) + ".npz")))
                      for code, paths in project.expected.items() for p, _ in paths)
    found = sorted((f.code, f.path) for f in scan_paths(project.config).findings)
    assert found == expected


def test_kohya_subfolders_of_an_image_dir_are_not_read(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "k")
    folder = project.root / "train" / "10_person"
    (folder / "old").mkdir()
    shutil.copyfile(folder / "img_000.png", folder / "old" / "extra.png")
    assert by_code(scan_paths(project.config), "CD404") == []


# -- ai-toolkit ---------------------------------------------------------------------------------


def test_aitoolkit_json_config_and_hidden_folders(tmp_path: Path) -> None:
    import yaml

    project = aitoolkit.build(tmp_path / "a")
    folder = project.root / "datasets" / "person"
    (folder / ".thumbs").mkdir()
    shutil.copyfile(folder / "img_000.png", folder / ".thumbs" / "img_000.png")  # skipped
    data = yaml.safe_load(project.config.read_text())
    as_json = project.root / "config" / "person_lora.json"
    as_json.write_text(json.dumps(data, indent=2))
    project.config.unlink()
    report = scan_paths(as_json)
    assert report.trainers == ("ai-toolkit",)
    assert report.findings == ()


def test_aitoolkit_image_folder_scanned_bare_keeps_its_images(tmp_path: Path) -> None:
    """ai-toolkit keeps `_latent_cache/` inside the image folder: given that folder (or the
    folder of image folders) with no config, its images belong; its caches are still read."""
    project = aitoolkit.build(tmp_path / "a", defects=["CD302"])
    for target in (project.root / "datasets" / "person", project.root / "datasets"):
        report = scan_paths(target)
        assert report.trainers == ("bare",)
        assert "CD107" not in codes(report) and len(by_code(report, "CD302")) == 3, target


def test_aitoolkit_without_disk_cache_expects_none(tmp_path: Path) -> None:
    project = aitoolkit.build(tmp_path / "a", defects=["CD404"])
    project.config.write_text(project.config.read_text().replace(
        "cache_latents_to_disk: true", "cache_latents_to_disk: false"))
    assert by_code(scan_paths(project.config), "CD404") == []


# -- bare directories ---------------------------------------------------------------------------


def test_flat_simpletuner_cache_mixes_buckets_legitimately(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "st")
    cache = project.root / "output" / "models" / "cache" / "vae" / "sdxl" / "photos"
    report = scan_paths(cache)
    assert report.trainers == ("bare",) and report.findings == ()


def test_bare_subfolders_are_buckets(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    clean.build(cache / "1024x1024", n=3)
    odd = save_latent(cache / "1024x1024" / "odd.pt", latent_batch(1, (4, 64, 48))[0])
    (finding,) = scan_paths(cache).findings
    assert (finding.code, finding.path, finding.details["bucket"]) == ("CD301", str(odd),
                                                                       "1024x1024")
    assert "[4, 64, 64]" in finding.message  # names the majority shape


def test_bare_aitoolkit_latent_cache_gets_header_buckets(tmp_path: Path) -> None:
    project = aitoolkit.build(tmp_path / "a", defects=["CD302"])
    report = scan_paths(project.root / "datasets" / "person" / "_latent_cache")
    assert "CD301" not in codes(report)
    assert len(by_code(report, "CD302")) == 3


def test_folder_without_configs_is_a_bare_cache(tmp_path: Path) -> None:
    clean.build(tmp_path / "cache", n=2)
    (tmp_path / "cache" / "notes.json").write_text('{"not": "a trainer config"}')
    (layout,) = resolve([str(tmp_path / "cache")])
    assert layout.trainer == "bare"


def test_a_flat_cache_dir_is_listed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trainer looks for its configs in a target folder and the bare layout looks for
    kohya, ai-toolkit and OneTrainer files: one listing of the folder serves them all, and its
    files are never tried as OneTrainer group folders (200,000 files took 2.1 s to resolve)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for i in range(50):
        (cache / f"{i:064x}.pt").write_bytes(b"")
    (cache / ("f" * 64)).mkdir()  # a OneTrainer group folder's name: looked into
    listed: list[str] = []
    real = os.scandir, os.listdir

    def counting(path: str) -> object:
        listed.append(os.fspath(path))
        return real[0](path)

    def counting_names(path: str) -> list[str]:
        listed.append(os.fspath(path))
        return real[1](path)

    monkeypatch.setattr(os, "scandir", counting)
    monkeypatch.setattr(os, "listdir", counting_names)
    for _ in range(2):  # a second resolve lists again (no stale listings between scans)
        listed.clear()
        (layout,) = resolve([str(cache)])
        assert layout.trainer == "bare"
        assert listed.count(str(cache)) == 1
        assert str(cache / ("f" * 64)) in listed
        assert len(listed) < 10, listed


@pytest.mark.parametrize(("trainer", "file", "old", "new", "key"), [
    ("kohya", "dataset.toml", "enable_bucket = true", 'enable_bucket = "yes"', "enable_bucket"),
    ("onetrainer", "training_presets/my_lora.json", '"train_device": "cuda"',
     '"train_device": 0', "train_device"),
    ("onetrainer", "training_concepts/concepts.json", '"include_subdirectories": false',
     '"include_subdirectories": []', "include_subdirectories"),
    ("ai-toolkit", "config/person_lora.yaml", 'folder_path: "datasets/person"',
     "folder_path: [1, 2]", "folder_path"),
])
def test_keys_of_the_wrong_type_are_cd409(trainer: str, file: str, old: str, new: str, key: str,
                                         tmp_path: Path) -> None:
    module = {"kohya": kohya, "onetrainer": onetrainer, "ai-toolkit": aitoolkit}[trainer]
    project = module.build(tmp_path / "p")
    path = project.root / file
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    found = by_code(scan_paths(project.config), "CD409")
    assert [(f.path, f.details["key"].split(".")[-1]) for f in found] == [(str(path), key)]
    assert f"{key} is " in found[0].message and "expected" in found[0].message


def test_kohya_datasets_that_are_no_tables_are_cd409(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "k")
    path = project.root / "dataset.toml"
    path.write_text("datasets = 3\n[general]\nenable_bucket = true\n")
    (finding,) = scan_paths(path).findings
    assert (finding.code, finding.details["key"], finding.details["line"]) == ("CD409",
                                                                               "datasets", 1)


@pytest.mark.parametrize("trainer", ["simpletuner", "onetrainer", "kohya", "ai-toolkit"])
def test_layouts_pickle_for_spawned_workers(trainer: str, tmp_path: Path) -> None:
    import pickle

    module = {"simpletuner": simpletuner, "onetrainer": onetrainer, "kohya": kohya,
              "ai-toolkit": aitoolkit}[trainer]
    layouts = resolve([str(module.build(tmp_path / "p", defects=["CD404"]).config)])
    assert pickle.loads(pickle.dumps(layouts)) == layouts
