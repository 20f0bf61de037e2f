"""`cachedoctor fix` and `cachedoctor undo` as a user runs them: the plan, dry runs, pipes,
exit codes, --select, --list-runs, and no torch where none is needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repair_helpers import MARKER, every_fixable_defect, isolated_state, tree_digest  # noqa: F401

from cachedoctor.fixtures import BUILDERS, clean, empty_file, retained_batch, unsafe_pickle
from cachedoctor.fixtures.latents import latent_batch, to_bytes

from conftest import run_cli, scan_paths

RUN_ID = re.compile(r"Applying run (\S+) ")


def fix(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachedoctor", "fix", *args], capture_output=True,
                          text=True, input=stdin, timeout=120)


def test_dry_run_shows_the_plan_and_changes_nothing(cache: Path) -> None:
    every_fixable_defect(cache, cache.parent / MARKER)
    before = tree_digest(cache)

    result = run_cli("fix", str(cache), "--dry-run", "--deep")

    assert result.returncode == 0, result.stderr
    assert "Plan: 14 actions in 1 cache" in result.stdout
    for line in ("quarantine  9 files", "compact     3 files", "to-cpu      2 files", "Dry run: nothing changed."):
        assert line in result.stdout
    assert tree_digest(cache) == before
    assert not (cache / ".cachedoctor").exists(), "a dry run creates nothing"


def test_a_reader_that_goes_away_gets_no_error_line(cache: Path) -> None:
    """`fix --dry-run | head -2`: the plan meets a closed pipe; it stops quietly and changes
    nothing (it said `error: : Broken pipe`, exit 2)."""
    every_fixable_defect(cache, cache.parent / MARKER)
    before = tree_digest(cache)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        result = subprocess.run([sys.executable, "-m", "cachedoctor", "fix", str(cache),
                                 "--dry-run", "-v"], stdout=write, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    finally:
        os.close(write)
    assert "error" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1  # click's status for a closed stdout
    assert tree_digest(cache) == before


def test_without_yes_in_a_pipe_it_refuses_with_one_line(cache: Path) -> None:
    empty_file.build(cache)
    before = tree_digest(cache)

    result = fix(str(cache), stdin="y\n")

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "cachedoctor: error: not changing files without --yes when stdin is not a terminal "
        "(--dry-run shows the plan)"
    ]
    assert tree_digest(cache) == before and not (cache / ".cachedoctor").exists()


def test_yes_applies_then_undo_restores_and_runs_are_listed(cache: Path) -> None:
    every_fixable_defect(cache, cache.parent / MARKER)
    before = tree_digest(cache)

    result = run_cli("fix", str(cache), "--yes", "--deep")

    assert result.returncode == 0, result.stdout + result.stderr
    run_id = RUN_ID.search(result.stdout).group(1)
    assert f"Undo with: cachedoctor undo {run_id}" in result.stdout
    assert "quarantine 9/9; compact 3/3; to-cpu 2/2." in result.stdout
    assert not scan_paths(cache, deep=True).findings

    for listing in (run_cli("fix", "--list-runs", str(cache)), run_cli("fix", "--list-runs")):
        assert listing.returncode == 0
        assert re.search(rf"{run_id} .* done +quarantine 9, compact 3, to-cpu 2 ", listing.stdout), listing.stdout

    undone = run_cli("undo")
    assert undone.returncode == 0, undone.stderr
    assert undone.stdout.startswith(f"Undid run {run_id} in {cache}: 14 file(s) put back.")
    assert tree_digest(cache) == before
    assert run_cli("undo").stdout.strip() == "Nothing to undo: every run is undone."
    assert re.search(rf"{run_id} .* undone ", run_cli("fix", "--list-runs").stdout)
    assert not (cache.parent / MARKER).exists()


def test_nothing_to_fix_exits_0(cache: Path) -> None:
    clean.build(cache, n=2)
    result = run_cli("fix", str(cache), "--yes")
    assert result.returncode == 0 and "Nothing to fix." in result.stdout


def test_select_limits_the_plan_to_those_rules(cache: Path) -> None:
    [view] = retained_batch.build(cache, rows=[0])
    empty_file.build(cache)
    before = tree_digest(cache)

    result = run_cli("fix", str(cache), "--yes", "--select", "CD201")

    assert result.returncode == 0, result.stderr
    after = tree_digest(cache)
    assert {k for k in before if before[k] != after.get(k)} == {view.name}
    assert (cache / "empty_file.pt").exists()


def test_a_failed_action_exits_1_and_is_rolled_back(cache: Path) -> None:
    row = latent_batch(4)[1]
    row.meta = unsafe_pickle.Payload(cache.parent / MARKER)
    (cache / "hostile_view.pt").write_bytes(to_bytes(row))
    before = tree_digest(cache)

    result = run_cli("fix", str(cache), "--yes", "--select", "CD201")

    assert result.returncode == 1
    assert "failed  compact" in result.stdout and "never loaded" in result.stdout
    assert "Failed actions were rolled back" in result.stdout
    assert tree_digest(cache) == before and not (cache.parent / MARKER).exists()


def test_undo_leaves_a_file_changed_since_the_run_alone_and_exits_1(cache: Path) -> None:
    [view] = retained_batch.build(cache, rows=[0])
    assert run_cli("fix", str(cache), "--yes").returncode == 0
    view.write_bytes(b"written by a trainer since")

    result = run_cli("undo", "--cache", str(cache))

    assert result.returncode == 1
    assert "left alone" in result.stdout and "has changed since the run" in result.stdout
    assert view.read_bytes() == b"written by a trainer since"
    assert len(list((cache / ".cachedoctor" / "quarantine").rglob("*.pt.quarantined"))) == 1, \
        "the original stays kept"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "fix needs a TARGET"),
        (("{cache}", "--encoder", "reference"), "--encoder is for --reencode"),
        (("{cache}", "--reencode"), "--reencode needs --encoder"),
        (("{cache}", "--reencode", "--encoder", "nonsense"), "unknown --encoder 'nonsense'"),
        (("{cache}", "--reencode", "--encoder", "no_such_module_x:f"), "cannot import no_such_module_x"),
        (("{cache}", "--reencode", "--encoder", "os.path:nope"), "os.path has no attribute nope"),
        (("{cache}", "--reencode", "--encoder", "os:sep"), "sep is not callable"),
        (("{cache}", "--reencode", "--encoder", "diffusers:/nowhere"), "needs the diffusers package"),
        (("/definitely/not/here",), "/definitely/not/here: no such file or directory"),
        (("{cache}", "-j", "0"), "--jobs must be at least 1"),
        (("{cache}/.cachedoctor",), "inside cachedoctor's own .cachedoctor/ dir"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args: tuple[str, ...], message: str, cache: Path) -> None:
    pytest.importorskip("torch")
    if "diffusers:/nowhere" in args and _has_diffusers():
        pytest.skip("diffusers is installed")
    (cache / ".cachedoctor").mkdir()
    result = run_cli("fix", *(a.format(cache=cache) for a in args))
    assert result.returncode == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_a_temp_file_written_minutes_ago_is_left_to_its_writer(cache: Path) -> None:
    [recent] = BUILDERS["CD104"](cache, age=30)
    result = run_cli("fix", str(cache), "--yes")
    assert result.returncode == 0 and recent.exists()
    assert "its writer may still be running" in result.stdout


def test_undo_of_an_unknown_run_exits_2(cache: Path) -> None:
    result = run_cli("undo", "20990101T000000Z-0000", "--cache", str(cache))
    assert result.returncode == 2
    assert result.stderr.strip() == f"cachedoctor: error: no run 20990101T000000Z-0000 in {cache}"


def test_undo_and_a_quarantine_only_fix_never_import_torch(cache: Path) -> None:
    BUILDERS["CD102"](cache)
    BUILDERS["CD104"](cache)
    probe = (
        "import sys\n"
        "from cachedoctor.cli import app\n"
        "for args in (['fix', sys.argv[1], '--yes'], ['undo', '--cache', sys.argv[1]]):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "assert 'torch' not in sys.modules, 'imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(cache)], capture_output=True, text=True,
                            env=os.environ, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "quarantine 2/2" in result.stdout and "2 file(s) put back" in result.stdout


def _has_diffusers() -> bool:
    import importlib.util

    return importlib.util.find_spec("diffusers") is not None
