"""Configs with any value of any type in any place: a finding or a one-line TargetError, never a
traceback (a seeded random walk over every trainer's JSON and YAML configs)."""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cachedoctor.fixtures.projects import aitoolkit, musubi, onetrainer, simpletuner
from cachedoctor.layouts import TargetError, resolve

from conftest import scan_paths

VALUES = [None, True, 0, -1, 3.5, "", "{env:CACHEDOCTOR_TEST_UNSET}", "/", "../..", [], [1, "a"],
          {}, {"a": [None]}, "\x00"]
MUTATIONS = 25


def mutate(obj: object, rng: random.Random, depth: int = 0) -> object:
    if isinstance(obj, dict | list) and obj:
        keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
        key = rng.choice(keys)
        if rng.random() < 0.5 or depth > 4:
            obj[key] = rng.choice(VALUES)
        else:
            mutate(obj[key], rng, depth + 1)
    return obj


@pytest.mark.parametrize("trainer", ["simpletuner", "onetrainer", "ai-toolkit"])
def test_random_values_never_raise(trainer: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CACHEDOCTOR_TEST_UNSET", raising=False)
    module = {"simpletuner": simpletuner, "onetrainer": onetrainer, "ai-toolkit": aitoolkit}[trainer]
    project = module.build(tmp_path / "p")
    files = {
        "simpletuner": [project.root / "config" / "multidatabackend.json", project.config],
        "onetrainer": [project.config, project.root / "training_concepts" / "concepts.json"],
        "ai-toolkit": [project.config],
    }[trainer]
    originals = {f: f.read_text() for f in files}
    rng = random.Random(trainer)
    for _ in range(MUTATIONS):
        path = rng.choice(files)
        if path.suffix == ".json":
            path.write_text(json.dumps(mutate(json.loads(originals[path]), rng)))
        else:
            path.write_text(yaml.safe_dump(mutate(yaml.safe_load(originals[path]), rng)))
        try:
            scan_paths(project.config)
        except TargetError as exc:
            assert "\n" not in str(exc)
        for original, text in originals.items():
            original.write_text(text)


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


@pytest.mark.parametrize(("name", "text", "why"), [
    ("laughs.yaml", "config:\n  process: []\n" + LAUGHS, "expand it to more than 100,000 values"),
    ("self.yaml", "config: &x {process: [*x]}\n", "refers to a node that holds it"),
    ("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ("big.toml", "a = " + "9" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
])
def test_hostile_documents_are_one_line_errors(name: str, text: str, why: str, tmp_path: Path) -> None:
    """A 'billion laughs' of aliases (9^9 values from 80 lines), an alias inside its own node,
    and TOML that Python's parser cannot take: a TargetError naming the file, at once."""
    path = tmp_path / "config" / name
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(TargetError) as caught:
        scan_paths(path)
    assert str(caught.value).startswith(str(path)) and why in str(caught.value)
    assert "\n" not in str(caught.value)


def test_aliases_that_share_settings_still_load(tmp_path: Path) -> None:
    """Anchors are how users share dataset settings: a few aliases are fine."""
    project = aitoolkit.build(tmp_path / "p")
    text = yaml.safe_dump(yaml.safe_load(project.config.read_text()))
    text = text.replace("datasets:\n", "datasets: &sets\n", 1) + "extra: *sets\n"
    project.config.write_text(text)
    assert scan_paths(project.config).trainers == ("ai-toolkit",)


def _bounded_cli(*args: str) -> subprocess.CompletedProcess:
    """The command under a 1 GiB address-space limit: an endless read fails it at once instead
    of filling the machine's memory."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run([sys.executable, "-m", "cachedoctor", "scan", "--isolated", "-j", "1",
                           "--format", "json", *args], capture_output=True, text=True,
                          timeout=60, preexec_fn=limit)


@pytest.mark.parametrize("place", ["config", "bucket indices", "musubi jsonl"])
@pytest.mark.parametrize("planted", ["fifo", "/dev/zero"])
def test_a_config_or_metadata_file_that_is_no_regular_file_neither_hangs_nor_fills_memory(
        place: str, planted: str, tmp_path: Path) -> None:
    """A project comes with its configs and its cache's bucket files: a FIFO in one's place
    (no writer: an ordinary open waits for ever) or a symlink to /dev/zero (endless) is a
    finding or a one-line error, and the scan ends."""
    if place == "config":
        target = victim = tmp_path / "config" / "config.json"
        victim.parent.mkdir()
    elif place == "bucket indices":
        project = simpletuner.build(tmp_path / "p")
        target, (victim,) = project.config, project.root.rglob("aspect_ratio_bucket_indices_*.json")
        victim.unlink()
    else:
        project = musubi.build(tmp_path / "m")
        target, victim = project.config, project.root / "meta.jsonl"
        text = project.config.read_text().replace('image_directory = "images"',
                                                  'image_jsonl_file = "meta.jsonl"', 1)
        project.config.write_text(text)
    if planted == "fifo":
        os.mkfifo(victim)
    else:
        victim.symlink_to("/dev/zero")

    result = _bounded_cli(str(target))

    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr
    if place == "config":
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"cachedoctor: error: {victim}: cannot read: not a regular file (a FIFO, a device or "
            "a folder)"]
    else:
        assert result.returncode in (0, 1), result.stderr
        json.loads(result.stdout)


def test_a_fifo_in_a_jsonl_files_place_is_said_to_be_one(tmp_path: Path) -> None:
    """A musubi image_jsonl_file that is a FIFO is there: CD408 says what it is, not that it
    does not exist (which sends the user looking for a typo)."""
    project = musubi.build(tmp_path / "m")
    project.config.write_text(project.config.read_text().replace(
        'image_directory = "images"', 'image_jsonl_file = "meta.jsonl"', 1))
    os.mkfifo(project.root / "meta.jsonl")

    result = _bounded_cli(str(project.config))

    [finding] = [f for f in json.loads(result.stdout)["findings"] if f["code"] == "CD408"]
    assert finding["message"].endswith('"meta.jsonl" (' + str(project.root / "meta.jsonl") +
                                       ") is a FIFO, neither a file nor a folder"), finding


def test_a_configured_path_of_the_other_kind_is_said_to_be_what_it_is(tmp_path: Path) -> None:
    """kohya's image_dir names a file, musubi's image_jsonl_file a folder: CD408 says so."""
    from cachedoctor.fixtures.projects import kohya

    k = kohya.build(tmp_path / "k")
    dataset = k.root / "dataset.toml"
    dataset.write_text(dataset.read_text().replace('"train/10_person"', '"train/planted"'))
    (k.root / "train" / "planted").write_text("")
    m = musubi.build(tmp_path / "m")
    m.config.write_text(m.config.read_text().replace(
        'image_directory = "images"', 'image_jsonl_file = "planted"', 1))
    (m.root / "planted").mkdir()

    [in_kohya] = [f.message for f in scan_paths(k.config).findings if f.code == "CD408"]
    [in_musubi] = [f.message for f in scan_paths(m.config).findings if f.code == "CD408"]
    assert in_kohya.endswith("/train/planted) is a file, not a folder"), in_kohya
    assert in_musubi.endswith("/planted) is a folder, not a file"), in_musubi


def test_a_jsonl_line_nested_past_json_is_skipped_as_a_bad_line(tmp_path: Path) -> None:
    """musubi's jsonl comes with the project: a line of 100,000 nested brackets is skipped as a
    line that is no JSON is (its RecursionError stopped the scan), the other lines still read."""
    project = musubi.build(tmp_path / "m")
    project.config.write_text(project.config.read_text().replace(
        'image_directory = "images"', 'image_jsonl_file = "meta.jsonl"', 1))
    (project.root / "meta.jsonl").write_text(
        "[" * 100_000 + "]" * 100_000 + "\n"
        + json.dumps({"image_path": "/data/img_000.png", "caption": "a photo"}) + "\n")

    [layout] = resolve([str(project.config)])

    assert layout.datasets[0].options["captions"] == {"img_000": "a photo"}


@pytest.mark.parametrize(("trainer", "key"), [("kohya", "image_dir"), ("musubi", "image_directory"),
                                              ("musubi", "video_directory"),
                                              ("musubi", "cache_directory")])
def test_a_path_holding_a_nul_byte_is_a_finding(trainer: str, key: str, tmp_path: Path) -> None:
    """TOML can spell a NUL (\\u0000); os.path.realpath and os.listdir raise ValueError on one,
    which stopped the scan. It is CD409 at its key, and the scan goes on."""
    from cachedoctor.fixtures.projects import kohya

    project = (kohya if trainer == "kohya" else musubi).build(tmp_path / "p")
    config = project.root / "dataset.toml"
    text = config.read_text()
    start = text.index(f"{key} = ")
    end = text.index("\n", start)
    config.write_text(text[:start] + f'{key} = "a/\\u0000/b"' + text[end:])

    report = scan_paths(project.config)

    [finding] = [f for f in report.findings if f.code == "CD409"]
    assert finding.details["key"].endswith(key) and finding.details["line"] == \
        text[:start].count("\n") + 1, finding
