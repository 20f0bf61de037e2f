"""The dataset and config rules on realistic projects of every trainer: a clean project scans
with no finding at warning or above; each defect fires its rules on the right path and
dataset, and nothing else at warning or above; scanning the config and the project folder
gives the same findings."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachedoctor.findings import Severity
from cachedoctor.fixtures.projects import aitoolkit, kohya, onetrainer, simpletuner

from conftest import scan_paths

TRAINERS = {"simpletuner": simpletuner, "onetrainer": onetrainer, "kohya": kohya,
            "ai-toolkit": aitoolkit}
CASES = [(name, defect) for name, module in TRAINERS.items() for defect in module.DEFECTS]


def serious(report) -> list:
    return [f for f in report.findings if f.severity >= Severity.WARNING]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_clean_project_has_no_finding_at_warning_or_above(trainer: str, tmp_path: Path) -> None:
    project = TRAINERS[trainer].build(tmp_path / "project")
    report = scan_paths(project.config)
    assert serious(report) == [], report.findings
    assert report.trainers == (project.trainer,)
    assert report.files > 0


@pytest.mark.parametrize(("trainer", "defect"), CASES, ids=[f"{t}-{d}" for t, d in CASES])
def test_each_defect_fires_on_its_path_and_dataset(trainer: str, defect: str,
                                                   tmp_path: Path) -> None:
    project = TRAINERS[trainer].build(tmp_path / "project", defects=[defect])
    report = scan_paths(project.config)
    expected = project.expected
    assert expected, f"the {defect} defect must expect a finding"
    for code, places in expected.items():
        found = sorted((f.path, f.dataset) for f in report.findings if f.code == code)
        assert found == sorted(places), (code, report.findings)
    unexpected = [f for f in serious(report) if f.code not in expected]
    assert unexpected == [], unexpected


@pytest.mark.parametrize("trainer", TRAINERS)
def test_scan_config_equals_scan_project(trainer: str, tmp_path: Path) -> None:
    module = TRAINERS[trainer]
    project = module.build(tmp_path / "project", defects=module.DEFECTS[:6])
    by_config = scan_paths(project.config)
    by_folder = scan_paths(project.root)
    assert by_config.findings == by_folder.findings
    assert by_config.findings  # the comparison is of something
    assert (by_config.files, by_config.datasets) == (by_folder.files, by_folder.datasets)


def test_config_findings_point_at_file_line_and_key(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "project", defects=["CD403"])
    (finding,) = [f for f in scan_paths(project.config).findings if f.code == "CD403"]
    backend = project.root / "config" / "multidatabackend.json"
    line = next(n for n, text in enumerate(backend.read_text().splitlines(), 1)
                if "vae_cache_clear_each_epoch" in text)
    assert (finding.path, finding.dataset) == (str(backend), "photos")
    assert finding.details["line"] == line
    assert finding.details["key"] == "vae_cache_clear_each_epoch"
    assert finding.details["change"] == '"vae_cache_clear_each_epoch": false'
    assert "8 processes" in finding.message
    assert "config.env:1" in finding.message


def test_json_findings_carry_dataset_and_key(tmp_path: Path) -> None:
    from cachedoctor.reporters.json import as_dict

    project = simpletuner.build(tmp_path / "project", defects=["CD401", "CD404"])
    report = as_dict(scan_paths(project.config), cwd=str(project.root))
    by_code = {f["code"]: f for f in report["findings"]}
    assert by_code["CD401"]["dataset"] == "photos"
    assert by_code["CD401"]["path"] == "config/multidatabackend.json"
    assert by_code["CD401"]["details"]["key"] == "cache_dir_vae"
    assert isinstance(by_code["CD401"]["details"]["line"], int)
    assert by_code["CD404"]["dataset"] == "photos"
    assert by_code["CD404"]["path"].startswith("datasets/photos/")


def test_text_report_groups_by_dataset_and_shows_file_line(tmp_path: Path) -> None:
    import io

    from cachedoctor.reporters import text

    project = simpletuner.build(tmp_path / "project", defects=["CD403", "CD305"])
    out = io.StringIO()
    text.render(scan_paths(project.config), out, cwd=str(project.root))
    lines = out.getvalue().splitlines()
    assert any(line.startswith("config/multidatabackend.json:") and " CD403 warning [photos] "
               in line for line in lines), lines
    assert any(" CD305 error [text-embeds] " in line for line in lines), lines


def test_onetrainer_cache_cleared_at_start_skips_coverage(tmp_path: Path) -> None:
    """With clear_cache_before_training (OneTrainer's default) the cache is rebuilt at each
    start: missing, orphan and stale entries do not matter."""
    project = onetrainer.build(tmp_path / "project", defects=["CD404", "CD405", "CD406"])
    config = project.config.read_text().replace('"clear_cache_before_training": false',
                                                '"clear_cache_before_training": true')
    project.config.write_text(config)
    codes = {f.code for f in scan_paths(project.config).findings}
    assert not codes & {"CD404", "CD405", "CD406"}


def test_onetrainer_gpu_locations_are_expected_on_any_train_device(tmp_path: Path) -> None:
    """mgds loads with map_location=train_device: a cuda:0 sample is fine on a CPU trainer."""
    project = onetrainer.build(tmp_path / "project")
    assert not [f for f in scan_paths(project.config).findings if f.code == "CD501"]
    config = project.config.read_text().replace('"train_device": "cuda"', '"train_device": "cpu"')
    project.config.write_text(config)
    assert not [f for f in scan_paths(project.config).findings if f.code in ("CD501", "CD502")]


def test_simpletuner_ondemand_cache_expects_no_entries(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "project", defects=["CD404"])
    backend = project.root / "config" / "multidatabackend.json"
    backend.write_text(backend.read_text().replace('"repeats": 0', '"repeats": 0, '
                                                   '"vae_cache_ondemand": true'))
    assert not [f for f in scan_paths(project.config).findings if f.code == "CD404"]


def test_simpletuner_config_formats_agree(tmp_path: Path) -> None:
    """config.json, config.toml and config.env name the same layout."""
    reports = []
    for fmt in ("json", "toml", "env"):
        project = simpletuner.build(tmp_path / fmt, defects=["CD404"], config_format=fmt)
        report = scan_paths(project.config)
        reports.append([(f.code, f.path.replace(str(project.root), ""), f.dataset)
                        for f in report.findings])
    assert reports[0] == reports[1] == reports[2]
    assert reports[0]


def test_a_pool_of_workers_gives_the_same_findings(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "project", defects=["CD301", "CD404", "CD407"])
    assert scan_paths(project.config, jobs=2).findings == scan_paths(project.config).findings


def test_demo_project_shows_the_dataset_and_config_rules(tmp_path: Path) -> None:
    from cachedoctor.fixtures import write_demo_project

    found = write_demo_project(tmp_path / "demo")
    assert set(found) >= {"CD301", "CD302", "CD303", "CD304", "CD305", "CD401", "CD402",
                          "CD403", "CD404", "CD405", "CD406", "CD407", "CD408", "CD409"}
    report = scan_paths(tmp_path / "demo")
    for code, paths in found.items():
        fired = {f.path for f in report.findings if f.code == code}
        assert {str(p) for p in paths} <= fired, code
