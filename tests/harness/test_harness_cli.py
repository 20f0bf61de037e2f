"""`cachedoctor harness` as a user runs it: the list, the JSON result, exit codes, usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cachedoctor.cli import app
from cachedoctor.harness import runner
from cachedoctor.harness.result import Result
from cachedoctor.harness.scenarios import SCENARIOS, load_scenario

from conftest import run_cli

RESULT_KEYS = {"scenario", "mode", "device", "ranks", "reproduced", "failure", "detected", "fixed", "trained",
               "seconds"}


def test_list_names_every_scenario_with_its_codes() -> None:
    result = run_cli("harness", "list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(SCENARIOS)
    for line, name in zip(lines, SCENARIOS, strict=True):
        assert all(code in line for code in load_scenario(name).EXPECTED), line


def test_listing_imports_no_torch() -> None:
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom cachedoctor.cli import app\n"
            "r = CliRunner().invoke(app, ['harness', 'list'])\nassert r.exit_code == 0, r.output\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_reproduce_json_result_shape(tmp_path: Path) -> None:
    result = run_cli("harness", "reproduce", "retained-batch", "--ranks", "2", "--format", "json",
                     "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["command"] == "reproduce" and data["ok"] is True
    (one,) = data["results"]
    assert set(one) >= RESULT_KEYS
    assert (one["scenario"], one["mode"], one["device"], one["ranks"]) == ("retained-batch", "reproduce", "cpu", 2)
    for key in ("reproduced", "detected", "fixed", "trained"):
        assert isinstance(one[key], bool), key
    assert one["reproduced"] and one["detected"] and one["trained"] and not one["fixed"]
    assert "(x4.0)" in one["failure"]
    assert isinstance(one["seconds"], float) and one["seconds"] > 0
    assert one["codes"] == ["CD201"]
    # a given --workdir is kept, with SimpleTuner's project files in it
    project = Path(one["workdir"]) / "project"
    assert (project / "config" / "config.json").exists() and (project / "config" / "multidatabackend.json").exists()


def test_verify_text_output(tmp_path: Path) -> None:
    result = run_cli("harness", "verify", "device-mismatch", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    first, *rest = result.stdout.splitlines()
    assert first.startswith("device-mismatch  verify  cpu x2  OK")
    assert "  fixed    yes" in rest and any(line.startswith("  trained  yes, loss ") for line in rest)
    assert any(line.startswith("  repair   cachedoctor fix (to-cpu 24): tensors bit-identical, scan clean, "
                               "loss ") for line in rest), rest
    assert any(line.startswith("  repair   corrected writer: tensors bit-identical, loss ") for line in rest)
    assert rest[-1] == f"1 of 1 scenarios did what `verify` promises; files in {tmp_path}"


def test_default_workdir_is_removed(tmp_path: Path) -> None:
    result = run_cli("harness", "verify", "retained-batch", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [
    ("harness", "reproduce", "no-such-scenario"),
    ("harness", "verify", "all", "--ranks", "0"),
    ("harness", "verify", "all", "--format", "yaml"),
    ("harness", "verify", "all", "--device", "tpu"),
])
def test_usage_errors_exit_2_with_one_line(args: tuple[str, ...]) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_cuda_asked_for_without_cuda_exits_2_in_one_line() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    result = run_cli("harness", "reproduce", "device-mismatch", "--device", "cuda")
    assert result.returncode == 2
    assert result.stderr.startswith("cachedoctor: error: --device cuda: no CUDA device is available")
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_a_run_dir_not_made_by_the_harness_is_left_alone(tmp_path: Path) -> None:
    mine = tmp_path / "retained-batch-verify"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep me")
    result = run_cli("harness", "verify", "retained-batch", "--workdir", str(tmp_path))
    assert result.returncode == 2
    assert "not made by the harness" in result.stderr
    assert (mine / "precious.txt").read_text() == "keep me"


def _result(name: str, ok: bool) -> Result:
    return Result(scenario=name, mode="verify", device="cpu", ranks=2, reproduced=False, failure=None,
                  detected=False, fixed=ok, trained=ok, seconds=0.1, ok=ok, attempts=1, expected_codes=("CD201",),
                  codes=(), loss=0.5 if ok else None, details={}, workdir=None)


def test_exit_1_when_any_scenario_breaks_its_promise(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    outcomes = {name: name != "dir-overlap" for name in SCENARIOS}
    monkeypatch.setattr(runner, "run_scenario", lambda name, mode, **_: _result(name, outcomes[name]))
    result = CliRunner().invoke(app, ["harness", "verify", "all", "--workdir", str(tmp_path), "--format", "json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["ok"] is False
    assert [r["scenario"] for r in data["results"]] == list(SCENARIOS)
    assert [r["ok"] for r in data["results"]] == list(outcomes.values())
