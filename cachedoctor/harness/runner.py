"""Run scenarios: a fresh project per attempt, the ranks, the scan, the verdict. No torch here."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from cachedoctor.findings import Report
from cachedoctor.harness.detection import scan_project
from cachedoctor.harness.launcher import Launch, launch
from cachedoctor.harness.result import Observation, Result, verdict
from cachedoctor.harness.scenarios import load_scenario

MARKER = ".cachedoctor-harness"  # only directories carrying it are ever deleted
LAUNCH_TIMEOUT = 120.0


class WorkdirError(Exception):
    """A run directory exists and is not ours to replace."""


def run_scenario(name: str, mode: str, *, ranks: int, device: str, workdir: Path, keep: bool,
                 timeout: float = LAUNCH_TIMEOUT) -> Result:
    """One scenario in one mode. A race scenario that did not reproduce is launched again on a
    fresh project, up to its ATTEMPTS; verify runs once."""
    scenario = load_scenario(name)
    run_dir = workdir / f"{name}-{mode}"
    started = time.monotonic()
    missed: list[str | None] = []  # what each attempt that did not reproduce saw instead
    while True:
        fresh_dir(run_dir)
        project = scenario.prepare(run_dir / "project", ranks, mode)
        project.save(run_dir / "project.json")
        spec = {"scenario": name, "mode": mode, "device": device, "project": str(run_dir / "project.json")}
        ranks_launch = launch(spec, ranks, run_dir / "ranks", timeout)
        observation = _observed(scenario.observe(mode, ranks_launch), ranks_launch, timeout)
        if mode == "verify" or observation.reproduced or len(missed) + 1 >= scenario.ATTEMPTS:
            break
        missed.append(observation.failure)
    report = scan_project(project)
    codes = tuple(sorted({f.code for f in report.findings}))
    expected = tuple(scenario.EXPECTED)
    detected = set(expected) <= set(codes)
    clean = not set(expected) & set(codes)
    details = {**observation.details, "scan": scan_summary(report)}
    if missed:
        details["missed_attempts"] = missed
    return Result(
        scenario=name, mode=mode, device=device, ranks=ranks,
        reproduced=observation.reproduced, failure=observation.failure, detected=detected,
        fixed=observation.fixed, trained=observation.trained,
        seconds=time.monotonic() - started,
        ok=verdict(mode, observation, detected, clean),
        attempts=observation.attempts or len(missed) + 1,
        expected_codes=expected, codes=codes, loss=observation.loss, details=details,
        workdir=str(run_dir) if keep else None,
    )


def _observed(observation: Observation, ranks_launch: Launch, timeout: float) -> Observation:
    """The scenario's observation, with the group's backend, the rank that failed first and any
    timeout."""
    details = {"backend": next(iter(ranks_launch.notes("backend")), None), **observation.details}
    first = ranks_launch.first_error
    if first is not None:
        details["failed_rank"] = first.rank
    if ranks_launch.timed_out:
        details["timed_out"] = f"the ranks did not finish in {timeout:.0f} s"
    return replace(observation, details=details)


def scan_summary(report: Report) -> dict[str, Any]:
    """Per code: how many findings, and the first one's message."""
    counts = Counter(f.code for f in report.findings)
    first = {}
    for finding in report.findings:
        first.setdefault(finding.code, f"{finding.path}: {finding.message}")
    return {code: {"count": counts[code], "first": first[code]} for code in sorted(counts)}


def fresh_dir(path: Path) -> None:
    """Create `path` empty; an existing one is replaced only if an earlier run marked it ours."""
    if path.exists():
        if not (path / MARKER).exists():
            raise WorkdirError(f"{path} exists and was not made by the harness; choose another --workdir")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text("a cachedoctor harness run; safe to delete\n")
