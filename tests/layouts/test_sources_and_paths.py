"""Config readers keep each key's line and fail with one line naming file and place; path
comparisons see through symlinks, `..`, trailing slashes and case-insensitive file systems."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachedoctor.layouts import TargetError, resolve
from cachedoctor.layouts.paths import CASE_SWITCH, case_insensitive, relation
from cachedoctor.layouts.sources import load

from conftest import run_cli


def test_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "multidatabackend.json"
    path.write_text('[\n  {"id": "a",\n   "cache_dir_vae": "x"},\n  {"id": "b"}\n]\n')
    config = load(str(path))
    assert config.line(0, "cache_dir_vae") == 3
    assert config.line(1, "id") == 4
    assert config.line(1, "missing") == 4  # the enclosing item
    assert config.origin(0, "cache_dir_vae").key == "cache_dir_vae"


def test_toml_lines_with_arrays_of_tables(tmp_path: Path) -> None:
    path = tmp_path / "dataset.toml"
    path.write_text('[general]\nenable_bucket = true\n\n[[datasets]]\nresolution = [\n  512,\n'
                    '  512,\n]\n  [[datasets.subsets]]\n  image_dir = "a"\n\n[[datasets]]\n'
                    '  [[datasets.subsets]]\n  image_dir = "b"\n')
    config = load(str(path))
    assert config.line("general", "enable_bucket") == 2
    assert config.line("datasets", 0, "subsets", 0, "image_dir") == 10
    assert config.line("datasets", 1, "subsets", 0, "image_dir") == 14
    assert config.origin("datasets", 1, "subsets", 0, "image_dir").key == \
        "datasets[1].subsets[0].image_dir"


def test_yaml_and_env_lines(tmp_path: Path) -> None:
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text("config:\n  process:\n    - datasets:\n        - folder_path: a\n")
    assert load(str(yaml_path)).line("config", "process", 0, "datasets", 0, "folder_path") == 4
    env = tmp_path / "config.env"
    env.write_text("# comment\nexport TRAINING_NUM_PROCESSES=8\nOUTPUT_DIR='out dir'\n")
    config = load(str(env))
    assert config.data == {"TRAINING_NUM_PROCESSES": "8", "OUTPUT_DIR": "out dir"}
    assert config.line("OUTPUT_DIR") == 3


@pytest.mark.parametrize(("name", "text", "place"), [
    ("multidatabackend.json", '[\n  {"id": "a",}\n]', ":2: not valid JSON"),
    ("dataset.toml", "[[datasets]]\nresolution = \n", ":2: not valid TOML"),
    ("job.yaml", "config:\n  process: [\n", ": not valid YAML"),
])
def test_unparsable_config_is_one_line_target_error(name: str, text: str, place: str,
                                                     tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TargetError) as info:
        resolve([str(path)])
    message = str(info.value)
    assert message.startswith(str(path)) and place in message and "\n" not in message


def test_cli_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "config" / "multidatabackend.json"
    path.parent.mkdir()
    path.write_text('[{"id": "photos", "instance_data_dir": "x"')
    for target in (path, tmp_path):  # the file, and the project folder that holds it
        result = run_cli("scan", str(target))
        assert result.returncode == 2, result
        assert "Traceback" not in result.stderr + result.stdout
        (line,) = result.stderr.strip().splitlines()
        assert f"{path}:1: not valid JSON" in line


def test_relation_sees_symlinks_dotdot_and_trailing_slashes(tmp_path: Path) -> None:
    images = tmp_path / "data" / "photos"
    images.mkdir(parents=True)
    os.symlink(images, tmp_path / "link")
    assert relation(str(tmp_path / "link"), str(images)) == "same"
    assert relation(str(tmp_path / "link") + "/", str(images)) == "same"
    assert relation(str(tmp_path / "data" / ".." / "data" / "photos" / "cache"),
                    str(images)) == "inside"
    assert relation(str(tmp_path / "data"), str(tmp_path / "link")) == "contains"
    assert relation(str(tmp_path / "data" / "photos2"), str(images)) is None


def test_case_insensitive_file_systems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "Photos").mkdir()
    upper, lower = str(tmp_path / "Photos"), str(tmp_path / "photos" / "cache")
    monkeypatch.delenv(CASE_SWITCH, raising=False)
    if not case_insensitive(upper):  # measured: this file system keeps case apart
        assert relation(lower, upper) is None
    monkeypatch.setenv(CASE_SWITCH, "1")
    assert relation(lower, upper) == "inside"
    monkeypatch.setenv(CASE_SWITCH, "0")
    assert relation(lower, upper) is None
