"""Sharded preflight: two ranks in a gloo group on the CPU split the files, and agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachedoctor.fixtures import BUILDERS, clean

pytest.importorskip("torch.distributed")
RANK_SCRIPT = Path(__file__).with_name("preflight_rank.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Run the two ranks once; both tests read what they saw."""
    root = tmp_path_factory.mktemp("sharded")
    cache = root / "cache"
    clean.build(cache, n=4)
    # one GPU-tagged file among CPU ones: only a rule that sees every rank's files finds CD502
    BUILDERS["CD502"](cache / "bucket", across_files=True, n=5)
    BUILDERS["CD102"](cache)
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), "2", str(root / "store"),
                               str(cache), str(root / f"rank{rank}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output
    return cache, [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_both_ranks_raise_with_the_same_findings_each_reading_half(ranks) -> None:
    cache, (rank0, rank1) = ranks
    assert rank0["verdict"] == rank1["verdict"] == "raised"
    assert rank0["message"] == rank1["message"]
    assert rank0["findings"] == rank1["findings"]
    found = {(code, Path(path).relative_to(cache).as_posix()) for code, path, _ in rank0["findings"]}
    # CD502 compares the files of one folder of a bare tree: its path is that folder
    assert found == {("CD102", "empty_file.pt"), ("CD501", "bucket/mixed_devices.pt"),
                     ("CD502", "bucket")}
    # each rank holds part of the folder: only the merged tallies count all five latents
    (cd502,) = [message for code, _, message in rank0["findings"] if code == "CD502"]
    assert cd502 == "files saved from different devices: cpu: 4 files, cuda:0: 1 file"
    everything = {str(p) for p in cache.rglob("*") if p.is_file() and ".cachedoctor" not in p.parts}
    assert rank0["files"] == len(everything) == 10
    assert set(rank0["read"]) | set(rank1["read"]) == everything
    assert not set(rank0["read"]) & set(rank1["read"])
    # the split is by a hash of each path (no rank holds a sorted listing): even on average only
    assert rank0["read"] and rank1["read"]


def test_a_rank_that_fails_makes_every_rank_raise_its_error(ranks) -> None:
    _, (rank0, rank1) = ranks
    assert rank0["failure"] == rank1["failure"]
    name, message, notes = rank0["failure"]
    assert (name, message) == ("OSError", "[Errno 5] Input/output error")
    assert notes == ["cachedoctor.preflight: raised on rank 1 of 2"]


def test_a_reader_bug_on_one_rank_is_a_finding_every_rank_reports(ranks) -> None:
    cache, (rank0, rank1) = ranks
    assert rank0["buggy"] == rank1["buggy"]
    found = {(code, Path(path).relative_to(cache).as_posix()) for code, path, _ in rank0["buggy"]}
    assert found == {("CD002", "empty_file.pt"), ("CD501", "bucket/mixed_devices.pt"),
                     ("CD502", "bucket")}
    [message] = [m for code, _, m in rank0["buggy"] if code == "CD002"]
    assert "OverflowError: int too large to convert" in message


def test_sharded_preflight_of_a_trainer_project_equals_the_local_scan(tmp_path: Path) -> None:
    """Coverage (CD404/CD405/CD406) and config rules (CD403) need every rank's rows."""
    from cachedoctor.fixtures.projects import simpletuner

    from conftest import scan_paths

    project = simpletuner.build(tmp_path / "project", ["CD403", "CD404", "CD405", "CD406"])
    config = project.config
    local = {(f.code, f.path, f.message) for f in scan_paths(config).findings}
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), "2",
                               str(tmp_path / "store"), str(config), str(tmp_path / f"rank{rank}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert {"CD403", "CD404", "CD405", "CD406"} <= {code for code, _, _ in local}
    for rank in seen:
        assert {tuple(f) for f in rank["findings"]} == local
    assert not set(seen[0]["read"]) & set(seen[1]["read"])
