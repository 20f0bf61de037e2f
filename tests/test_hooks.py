"""The pre-commit hook, run as pre-commit runs it; the README's GitHub Actions job."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO

README = (REPO / "README.md").read_text()


def _hook() -> dict:
    (hook,) = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    return hook


def _run_hook(repo: Path, args: list[str], staged: list[str]) -> subprocess.CompletedProcess:
    """What pre-commit does for a `language: python` hook: the entry, split like a shell would,
    then the hook's args, then the staged files unless pass_filenames is false; run from the
    repository root with the hook environment's bin/ first on PATH."""
    hook = _hook()
    command = [*shlex.split(hook["entry"]), *args]
    if hook.get("pass_filenames", True):
        command += staged
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=120)


def test_hook_definition_is_what_pre_commit_needs() -> None:
    hook = _hook()
    assert hook["id"] == "cachedoctor-scan"
    assert hook["language"] == "python"
    assert hook["entry"].split()[0] == "cachedoctor"  # the console script pip installs
    assert hook["pass_filenames"] is False and hook["always_run"] is True


def test_hook_entry_fails_a_broken_cache_and_passes_a_clean_one(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "data" / "cache").mkdir(parents=True)
    (repo / "train.py").write_text("print('training')\n")
    (repo / "pyproject.toml").write_text('[tool.cachedoctor]\nignore = ["CD107"]\n')
    (repo / "data" / "cache" / "notes.txt").write_text("ignored by the project's config\n")
    clean = _run_hook(repo, ["data/cache"], staged=["train.py"])
    assert clean.returncode == 0, clean.stdout + clean.stderr
    (repo / "data" / "cache" / "latent.pt").write_bytes(b"")
    broken = _run_hook(repo, ["data/cache"], staged=["train.py"])
    assert broken.returncode == 1
    assert "data/cache/latent.pt: CD102 error" in broken.stdout


def test_readme_github_actions_job_uploads_the_sarif_it_writes() -> None:
    block = re.search(r"```yaml\n(# \.github/workflows/.*?)```", README, re.S)
    assert block is not None, "the README's GitHub Actions job"
    workflow = yaml.safe_load(block.group(1))
    (job,) = workflow["jobs"].values()
    assert job["permissions"]["security-events"] == "write"
    runs = " ".join(step.get("run", "") for step in job["steps"])
    assert "pip install" in runs and "cachedoctor" in runs
    scan = next(s["run"] for s in job["steps"] if "cachedoctor scan" in s.get("run", ""))
    args = shlex.split(scan)
    assert args[args.index("--format") + 1] == "sarif"
    output = args[args.index("--output") + 1]
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("github/codeql-action/upload-sarif"))
    assert upload["with"]["sarif_file"] == output
    assert "failure()" in upload["if"]  # the findings that failed the scan are uploaded too
