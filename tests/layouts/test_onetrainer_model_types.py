"""OneTrainer caches of model types whose latent is not SDXL's [4, h/8, w/8], as their data
loaders write them (Nerogar/OneTrainer 23df3832 modules/dataLoader/*BaseDataLoader.py, one
`<i>.pt` per sample through mgds DiskCache). The latent size follows from the config's
`model_type`: Sana's DC-AE downscales by 32, not 8. Builders in fixtures/projects/onetrainer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachedoctor.fixtures.projects import onetrainer

from conftest import by_code, scan_paths


def alarms(report) -> list:
    return [(f.code, f.path, f.message) for f in report.findings if f.severity >= 2]


@pytest.mark.parametrize("model_type", sorted(onetrainer.MODEL_TYPES))
def test_a_healthy_cache_of_the_model_type_scans_clean(tmp_path: Path, model_type: str) -> None:
    """Before, each Sana sample was CD302 (its 1/32 latent judged against crop / 8)."""
    project = onetrainer.of_model_type(tmp_path / "ot", model_type)
    assert not alarms(scan_paths(project.config))
    assert not alarms(scan_paths(project.root / "workspace-cache"))


def test_a_sana_sample_encoded_at_another_resolution_is_cd302(tmp_path: Path) -> None:
    project = onetrainer.of_model_type(tmp_path / "ot", "SANA")
    (sample_file,) = (project.root / "workspace-cache/run/image").rglob("4.pt")
    sample = torch.load(sample_file, map_location="cpu", weights_only=False)
    h, w = sample["original_resolution"]
    sample["latent_image"] = torch.randn(32, h // 32, w // 32 + 2)  # 64 pixels wider
    torch.save(sample, sample_file)

    (found,) = by_code(scan_paths(project.config), "CD302")
    assert found.path == str(sample_file)
    assert f"needs {h // 32}x{w // 32}" in found.message, found.message


def _bare_targets(project) -> list[Path]:
    """The cache_dir, its image/ folder, a group folder and a variation folder: each a bare
    cache with aggregate.pt files (layouts/bare.py `_aggregates`)."""
    run = project.root / "workspace-cache/run"
    group = sorted((run / "image").iterdir())[0]
    return [run, run / "image", group, group / "variation-0"]


def test_a_sana_cache_scanned_without_its_config_takes_its_factor_from_its_samples(
        tmp_path: Path) -> None:
    """Without the config there is no model_type: mgds (Nerogar/mgds 3a6994ad DiskCache.py)
    stores whatever the VAE made, so the factor is the one the samples show against their
    aggregate.pt crop_resolution. Before, every Sana sample of a bare scan was CD302 (judged
    against crop / 8)."""
    project = onetrainer.of_model_type(tmp_path / "ot", "SANA")
    for target in _bare_targets(project):
        assert not alarms(scan_paths(target)), target


def test_a_sana_sample_of_another_resolution_is_still_cd302_without_the_config(
        tmp_path: Path) -> None:
    project = onetrainer.of_model_type(tmp_path / "ot", "SANA")
    (sample_file,) = (project.root / "workspace-cache/run/image").rglob("4.pt")
    sample = torch.load(sample_file, map_location="cpu", weights_only=False)
    h, w = sample["original_resolution"]
    sample["latent_image"] = torch.randn(32, h // 16, w // 16)  # a 16x VAE's size
    torch.save(sample, sample_file)

    for target in _bare_targets(project)[:2]:
        (found,) = by_code(scan_paths(target), "CD302")
        assert found.path == str(sample_file)
        assert f"needs {h // 32}x{w // 32}" in found.message, found.message
