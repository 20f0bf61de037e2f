"""Trainers' own shipped example configs, reduced to the shape that matters, scan as those
trainers read them: a false alarm on one is a config the trainer accepts that cachedoctor
refused or misread. Each test cites the upstream file and commit it was reduced from."""

from __future__ import annotations

import json
from pathlib import Path

from cachedoctor.fixtures.projects import onetrainer, simpletuner
from cachedoctor.layouts import resolve

from conftest import by_code, scan_paths


def alarms(report) -> list:
    return [(f.code, f.path, f.message) for f in report.findings if f.severity >= 2]


def _preset(**changes: object) -> dict:
    """Reduced from Nerogar/OneTrainer 23df3832 training_presets/Chroma/#chroma LoRA 8GB.json:
    a shipped preset holds only what it changes (no __version, cache_dir, concepts), and
    scripts/train.py loads it over TrainConfig.default_values(). Resolution as the fixture's."""
    preset = {"base_model_name": "stabilityai/stable-diffusion-xl-base-1.0", "batch_size": 2,
              "model_type": "STABLE_DIFFUSION_XL_10_BASE", "resolution": "128",
              "output_model_format": "SAFETENSORS", "training_method": "LORA",
              "text_encoder": {"train": False}, "vae": {"weight_dtype": "FLOAT_32"}}
    preset.update(changes)
    return preset


def test_a_sparse_onetrainer_preset_is_a_onetrainer_config(tmp_path: Path) -> None:
    """Before: `#chroma LoRA 8GB.json` was no trainer's config, a bare scan of one JSON file:
    CD107 "a JSON file that no trainer keeps in a cache dir", and its cache went unjudged."""
    project = onetrainer.build(tmp_path / "ot")
    folder = project.root / "training_presets" / "SDXL"  # presets in <Model>/ since 2025
    folder.mkdir()
    preset = folder / "#sdxl LoRA 8GB.json"
    preset.write_text(json.dumps(_preset(clear_cache_before_training=False), indent=4))

    (layout,) = resolve([str(preset)])
    assert layout.trainer == "onetrainer"
    cache = str(project.root / "workspace-cache" / "run")
    assert layout.datasets and all(c.startswith(cache) for d in layout.datasets
                                   for c in d.cache_dirs)
    report = scan_paths(preset)
    assert not by_code(report, "CD107")
    assert not alarms(report)


def test_a_json_without_the_preset_keys_stays_unclaimed(tmp_path: Path) -> None:
    loose = tmp_path / "settings.json"
    loose.write_text(json.dumps({"model_type": "STABLE_DIFFUSION_XL_10_BASE", "batch_size": 2}))
    (layout,) = resolve([str(loose)])
    assert layout.trainer != "onetrainer"


def test_shipped_presets_beside_each_other_do_not_share_a_cache(tmp_path: Path) -> None:
    """Nerogar/OneTrainer 23df3832 training_presets/Chroma/ ships six `#chroma *.json` presets,
    none with a cache_dir: all take the default workspace-cache/run with the default
    clear_cache_before_training. They are templates the UI loads, not runs: no CD403 among
    them; a config the user saved (no `#`) on that cache dir still is one."""
    project = onetrainer.build(tmp_path / "ot")
    project.config.unlink()  # the fixture's own saved config: only the shipped presets remain
    folder = project.root / "training_presets" / "SDXL"
    folder.mkdir()
    for name in ("#sdxl LoRA 8GB.json", "#sdxl LoRA 16GB.json", "#sdxl Finetune 24GB.json"):
        (folder / name).write_text(json.dumps(_preset(), indent=4))
    assert not by_code(scan_paths(folder / "#sdxl LoRA 8GB.json"), "CD403")

    (folder / "my lora.json").write_text(json.dumps(_preset(), indent=4))
    (found,) = by_code(scan_paths(folder / "#sdxl LoRA 8GB.json"), "CD403")
    assert "my lora.json" in found.message and "#sdxl LoRA 16GB" not in found.message


def test_a_simpletuner_example_finds_its_backend_in_the_packaged_examples(tmp_path: Path) -> None:
    """bghira/SimpleTuner bc8e6ab7 simpletuner/examples/flux.peft-lora/config.json names
    "data_backend_config": "config/examples/multidatabackend-small-dreambooth-512px.json",
    which helpers/configuration/json_file.py _resolve_example_path (since e2096b30d) reads as
    the package's simpletuner/examples/multidatabackend-small-dreambooth-512px.json. Before:
    CD408 data_backend_config does not exist (looked for under the example's own folder)."""
    examples = tmp_path / "site-packages" / "simpletuner" / "examples"
    example = examples / "flux.peft-lora"
    example.mkdir(parents=True)
    (examples / "multidatabackend-small-dreambooth-512px.json").write_text(json.dumps([
        {"id": "dreambooth-512", "type": "local", "instance_data_dir": "datasets/domokun",
         "cache_dir_vae": "cache/vae/flux/dreambooth-512", "resolution": 512},
        {"id": "alt-embed-cache", "dataset_type": "text_embeds", "default": True,
         "type": "local", "cache_dir": "cache/text/flux"}]))
    config = example / "config.json"
    config.write_text(json.dumps({
        "data_backend_config": "config/examples/multidatabackend-small-dreambooth-512px.json",
        "model_family": "flux", "model_type": "lora", "output_dir": "output/models-flux"}))
    (example / "datasets" / "domokun").mkdir(parents=True)

    report = scan_paths(config)
    assert not [f for f in by_code(report, "CD408") if "data_backend_config" in f.message]
    (layout,) = resolve([str(config)])
    assert "dreambooth-512" in {d.id for d in layout.datasets}


def test_a_simpletuner_example_naming_its_backend_from_the_checkout_root(tmp_path: Path) -> None:
    """bghira/SimpleTuner bc8e6ab7 simpletuner/examples/infinitetalk-14b-480p-24gb.peft-lora/
    config.json (since c6c8f94ef) names "data_backend_config":
    "simpletuner/examples/multidatabackend-infinitetalk-480p+17f.json", a path from the
    checkout's root. Before: CD408, looked for under the example's own folder."""
    checkout = tmp_path / "SimpleTuner"
    examples = checkout / "simpletuner" / "examples"
    example = examples / "infinitetalk-14b-480p-24gb.peft-lora"
    example.mkdir(parents=True)
    (examples / "multidatabackend-infinitetalk-480p+17f.json").write_text(json.dumps([
        {"id": "talk", "type": "local", "dataset_type": "video",
         "instance_data_dir": "datasets/talk", "cache_dir_vae": "cache/vae/talk"},
        {"id": "text", "dataset_type": "text_embeds", "default": True, "type": "local",
         "cache_dir": "cache/text"}]))
    config = example / "config.json"
    config.write_text(json.dumps({
        "data_backend_config": "simpletuner/examples/multidatabackend-infinitetalk-480p+17f.json",
        "model_family": "wan", "model_type": "lora", "output_dir": "output/models"}))

    assert not [f for f in by_code(scan_paths(config), "CD408")
                if "data_backend_config" in f.message]
    (layout,) = resolve([str(config)])
    assert "talk" in {d.id for d in layout.datasets}

    # in a source checkout (its pyproject.toml) the run starts at the checkout's root, which
    # the backend's datasets/ and cache/ paths are relative to too
    (checkout / "pyproject.toml").write_text('[project]\nname = "simpletuner"\n')
    (found,) = by_code(scan_paths(config), "CD408")
    assert f"({checkout / 'datasets' / 'talk'})" in found.message
    (checkout / "datasets" / "talk").mkdir(parents=True)
    assert not by_code(scan_paths(config), "CD408")


def test_a_config_examples_path_outside_the_package_is_still_missing(tmp_path: Path) -> None:
    """The same value in a config of one's own project, where no config/examples/ file
    exists, is still the CD408 SimpleTuner would stop on."""
    project = simpletuner.build(tmp_path / "st")
    data = json.loads(project.config.read_text())
    data["data_backend_config"] = "config/examples/multidatabackend-small-dreambooth-512px.json"
    project.config.write_text(json.dumps(data))
    (found,) = [f for f in by_code(scan_paths(project.config), "CD408")
                if "data_backend_config" in f.message]
    assert "does not exist" in found.message


def _env_project(tmp_path: Path, lines: str):
    project = simpletuner.build(tmp_path / "st", config_format="env")
    text = project.config.read_text().replace(
        'export DATALOADER_CONFIG="config/multidatabackend.json"\n', lines)
    project.config.write_text(text)
    return project


def test_a_2024_config_env_names_its_backend_through_an_earlier_variable(tmp_path: Path) -> None:
    """bghira/SimpleTuner b084ceedd config/config.env.example (lines 72-73, as shipped until
    1f396c22b, 2024-08-31): `export BASE_DIR="/notebooks/datasets"` then
    `export DATALOADER_CONFIG="${BASE_DIR}/multidatabackend.json"`, which train.sh's `source
    config/config.env` expanded. Before: CD408 for a literal "${BASE_DIR}/multidatabackend.json"
    under the working dir."""
    project = _env_project(tmp_path, f'export BASE_DIR="{tmp_path}/st/config"\n'
                                     'export DATALOADER_CONFIG="${BASE_DIR}/multidatabackend.json"\n')
    assert not by_code(scan_paths(project.config), "CD408")
    (layout,) = resolve([str(project.config)])
    assert layout.datasets

    # single quotes keep the reference literal in bash: the file is then really not there
    quoted = _env_project(tmp_path / "q", "export BASE_DIR=config\n"
                                          "export DATALOADER_CONFIG='${BASE_DIR}/multidatabackend.json'\n")
    (found,) = by_code(scan_paths(quoted.config), "CD408")
    assert '"${BASE_DIR}/multidatabackend.json"' in found.message


def test_env_references_that_double_at_every_line_stay_bounded(tmp_path: Path) -> None:
    """A hostile config.env: `A=$A$A` 64 times would be 2**64 characters expanded."""
    from cachedoctor.layouts.sources import EXPANDED_MAX, load

    env = tmp_path / "config.env"
    env.write_text("export A=xxxxxxxx\n" + "export A=$A$A\n" * 64)
    assert len(load(str(env), "env").data["A"]) <= EXPANDED_MAX


def test_one_line_of_many_references_is_not_expanded_into_memory(tmp_path: Path) -> None:
    """A hostile config.env line of 200,000 `$B`s, B a 4,000-character value: 800 MB once
    expanded, 765 MiB at its peak when the expansion was built before its length was checked."""
    import tracemalloc

    from cachedoctor.layouts.sources import PARSERS

    text = "export B=" + "x" * 4000 + "\nexport A=" + "$B" * 200_000 + "\n"
    tracemalloc.start()  # (the parse alone: reading a config allocates its size cap at once)
    try:
        data, _ = PARSERS["env"](text, str(tmp_path / "config.env"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data["A"] == "$B" * 200_000  # left as written, as any over-long expansion is
    assert peak < 32 * 2**20
