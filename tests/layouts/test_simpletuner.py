"""SimpleTuner configs read as SimpleTuner reads them: main config keys, config.env, placeholders,
defaults, relative paths against the folder that holds config/, bucket files, naming."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import simpletuner
from cachedoctor.layouts import resolve
from cachedoctor.layouts.simpletuner import SimpleTunerNaming, vae_key

from conftest import by_code, scan_paths


def write(root: Path, backends: list, main: dict | None = None, env: str | None = None) -> Path:
    (root / "config").mkdir(parents=True, exist_ok=True)
    (root / "config" / "multidatabackend.json").write_text(json.dumps(backends, indent=2))
    if env is not None:
        (root / "config" / "config.env").write_text(env)
    if main is None:
        return root / "config" / "multidatabackend.json"
    (root / "config" / "config.json").write_text(json.dumps(main, indent=2))
    return root / "config" / "config.json"


MAIN = {"--model_family": "flux", "--output_dir": "out",
        "--data_backend_config": "config/multidatabackend.json"}


def test_defaults_placeholders_and_relative_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DATA_ROOT", str(tmp_path / "data"))
    (tmp_path / "data" / "photos").mkdir(parents=True)
    config = write(tmp_path, [
        {"id": "photos", "type": "local", "instance_data_dir": "{env:DATA_ROOT}/photos/"},
        {"id": "art", "type": "local", "instance_data_dir": "data/photos",
         "cache_dir_vae": "{output_dir}/vae/{model_family}/{id}"},
        {"id": "remote", "type": "csv", "csv_file": "x.csv"},
        {"id": "off", "type": "local", "instance_data_dir": "gone", "disabled": True},
    ], MAIN, env="export TRAINING_NUM_PROCESSES=4\n")
    (layout,) = resolve([str(config)])
    ids = {d.id: d for d in layout.datasets}
    assert set(ids) == {"photos", "art", "text-embeds"}  # remote and disabled skipped
    photos, art, text = ids["photos"], ids["art"], ids["text-embeds"]
    assert photos.image_dirs == (str(tmp_path / "data" / "photos"),)
    assert photos.latent_cache_dir == str(tmp_path / "out" / "cache" / "vae" / "flux" / "photos")
    assert art.latent_cache_dir == str(tmp_path / "out" / "vae" / "flux" / "art")
    assert text.text_cache_dir == str(tmp_path / "out" / "cache" / "text" / "flux")
    assert photos.processes == 4 and photos.origin("processes").line == 1
    assert layout.base == str(tmp_path) and layout.problems == ()


def test_backend_config_scans_like_its_main_config(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "p", defects=["CD403", "CD404"])
    backend = project.root / "config" / "multidatabackend.json"
    assert scan_paths(backend).findings == scan_paths(project.config).findings
    assert by_code(scan_paths(backend), "CD403")  # the process count came from config.env


def test_environment_configs_are_found(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    write(tmp_path, [{"id": "a", "type": "local", "instance_data_dir": "data"}])
    env_dir = tmp_path / "config" / "prod"
    env_dir.mkdir()
    (env_dir / "config.toml").write_text('"--data_backend_config" = "config/multidatabackend.json"\n'
                                         '"--num_processes" = 2\n')
    (layout,) = resolve([str(tmp_path)])
    assert layout.source == str(env_dir / "config.toml")
    assert layout.datasets[0].processes == 2


@pytest.mark.parametrize(("entry", "key", "words"), [
    ({"id": "a", "type": "local"}, "instance_data_dir", "has no instance_data_dir"),
    ({"id": "a", "type": "local", "instance_data_dir": 5}, "instance_data_dir", "expected the path"),
    ({"id": "a", "type": "local", "instance_data_dir": "data",
      "vae_cache_clear_each_epoch": "yes"}, "vae_cache_clear_each_epoch", "expected true or false"),
    ({"id": "a", "type": "local", "instance_data_dir": "{env:CD_TEST_UNSET}/x"},
     "instance_data_dir", "{env:CD_TEST_UNSET} in instance_data_dir is not set"),
])
def test_bad_entries_are_cd409_naming_key_and_line(entry: dict, key: str, words: str,
                                                   tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CD_TEST_UNSET", raising=False)
    (tmp_path / "data").mkdir()
    config = write(tmp_path, [{"id": "ok", "type": "local", "instance_data_dir": "data"}, entry],
                   MAIN)
    (finding,) = by_code(scan_paths(config), "CD409")
    assert finding.path == str(tmp_path / "config" / "multidatabackend.json")
    assert finding.dataset == "a" and finding.details["line"] >= 6
    assert finding.details["key"] == key and words in finding.message


def test_missing_backend_config_and_instance_dir_are_cd408(tmp_path: Path) -> None:
    main = write(tmp_path, [{"id": "a", "type": "local", "instance_data_dir": "nowhere"}], MAIN)
    (finding,) = by_code(scan_paths(main), "CD408")
    assert "nowhere" in finding.message and "SimpleTuner's working dir" in finding.message
    (tmp_path / "config" / "config.json").write_text(json.dumps(
        {**MAIN, "--data_backend_config": "config/other.json"}))
    (finding,) = scan_paths(main).findings
    assert (finding.code, finding.details["key"]) == ("CD408", "--data_backend_config")


def test_wrong_top_level_type_is_cd409(tmp_path: Path) -> None:
    main = write(tmp_path, [], MAIN)
    (tmp_path / "config" / "multidatabackend.json").write_text('{"id": "a"}')
    (finding,) = scan_paths(main).findings
    assert finding.code == "CD409" and "expected a JSON list of datasets" in finding.message


def test_vae_key_follows_simpletuner_str_replace() -> None:
    sha = hashlib.sha256(b"a").hexdigest()
    assert vae_key("/data/photos", "/data/photos/a.png") == sha
    assert vae_key("/data/photos", "/data/photos/sub/a.jpg") == f"sub/{sha}"
    # a relative instance_data_dir leaves a fragment of the absolute path, as in SimpleTuner
    assert vae_key("data/photos", "/work/proj/data/photos/a.png") == f"work/proj/{sha}"


def test_missing_entry_names_the_sub_folder_a_relative_instance_dir_leaves() -> None:
    """CD404's message names the whole expected entry, not only its file name: with a relative
    instance_data_dir, SimpleTuner nests it under the rest of the image's absolute folder."""
    naming = SimpleTunerNaming("data/photos", "/work/proj/data/photos", "/c", {}, None, True)
    sha = hashlib.sha256(b"a").hexdigest()
    text = naming.missing_text("/work/proj/data/photos/a.png", "cache/vae")
    assert text.startswith(f"expected work/proj/{sha}.pt in cache/vae (SimpleTuner removes the "
                           'relative instance_data_dir "data/photos"')
    absolute = SimpleTunerNaming("/d/photos", "/d/photos", "/c", {}, None, True)
    assert absolute.missing_text("/d/photos/a.png", "cache/vae") == f"expected {sha}.pt in cache/vae"


def test_cache_subfolders_mirror_image_subfolders(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "p")
    photos, cache = project.root / "datasets" / "photos", \
        project.root / "output" / "models" / "cache" / "vae" / "sdxl" / "photos"
    (photos / "sub").mkdir()
    (cache / "sub").mkdir()
    for name in ("img_000.png", "img_000.txt"):
        os.rename(photos / name, photos / "sub" / name)
    os.rename(cache / simpletuner.vae_name(Path("img_000.png")),
              cache / "sub" / simpletuner.vae_name(Path("img_000.png")))
    codes = {f.code for f in scan_paths(project.config).findings}
    assert "CD404" not in codes and "CD406" not in codes  # found in its sub-folder


def test_bucket_file_that_is_not_json_is_cd409(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "p")
    indices = project.root / "datasets" / "photos" / "aspect_ratio_bucket_indices_photos.json"
    indices.write_text("{broken")
    (finding,) = by_code(scan_paths(project.config), "CD409")
    assert finding.path == str(indices) and "not valid JSON" in finding.message


def test_overlaps_are_seen_through_symlinks_dotdot_and_case(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "data" / "Photos").mkdir(parents=True)
    (tmp_path / "data" / "art").mkdir()
    os.symlink(tmp_path / "cache" / "shared", tmp_path / "alias")
    (tmp_path / "cache" / "shared").mkdir(parents=True)
    config = write(tmp_path, [
        {"id": "photos", "type": "local", "instance_data_dir": "data/Photos",
         "cache_dir_vae": "data/photos/cache/"},  # other case, trailing slash
        {"id": "art", "type": "local", "instance_data_dir": "data/art",
         "cache_dir_vae": "cache/shared"},
        {"id": "more", "type": "local", "instance_data_dir": "data/art/../art",
         "cache_dir_vae": "alias"},  # the same dir as art's, through a symlink
    ], MAIN)
    monkeypatch.setenv("CACHEDOCTOR_CASE_INSENSITIVE", "1")
    report = scan_paths(config)
    assert [(f.dataset, f.details["relation"]) for f in by_code(report, "CD401")] == [
        ("photos", "inside")]
    assert [(f.dataset, f.details["relation"]) for f in by_code(report, "CD402")] == [
        ("more", "same")]
    monkeypatch.setenv("CACHEDOCTOR_CASE_INSENSITIVE", "0")
    assert by_code(scan_paths(config), "CD401") == []
