"""Config findings are never changed by fix: the plan shows the edit that fixes them."""

from __future__ import annotations

from pathlib import Path

from cachedoctor.fixtures.projects import simpletuner

from conftest import invoke


def test_plan_shows_the_config_edits(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "project", ["CD401", "CD403"])
    before = project.config.parent.joinpath("multidatabackend.json").read_bytes()
    result = invoke("fix", str(project.config), "--dry-run")
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert any(line.startswith("edit ") and '"vae_cache_clear_each_epoch": false' in line
               for line in lines), result.stdout
    assert any(line.startswith("edit ") and '"cache_dir_vae":' in line for line in lines)
    assert project.config.parent.joinpath("multidatabackend.json").read_bytes() == before
