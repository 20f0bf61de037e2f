"""A repair you can predict: what fix leaves out by default, what a cancelled or interrupted fix
says, one number for what a fix frees (scan, plan, result, the disk after purge), and purge."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repair_helpers import isolated_state, quarantine_of, tree_digest  # noqa: F401

from cachedoctor.fixtures import device_tagged, retained_batch, truncated_archive
from cachedoctor.fixtures.projects import simpletuner
from cachedoctor.inventory import STATE_DIR
from cachedoctor.reclaim import reclaimable
from cachedoctor.repair import build_plan
from cachedoctor.units import human_bytes

from conftest import run_cli, scan_paths

RUN_ID = re.compile(r"Applying run (\S+) ")


def _apparent(root: Path) -> int:
    """Bytes of every file under `root` outside cachedoctor's own dir (`du -b` of the cache)."""
    total = 0
    for parent, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != STATE_DIR]
        total += sum(os.lstat(os.path.join(parent, name)).st_size for name in files)
    return total


def _broken(cache: Path, n: int) -> None:
    for i in range(n):
        truncated_archive.build(cache, seed=i, name=f"broken_{i:03d}")


# --- what fix acts on by default ---------------------------------------------------------

def test_info_findings_are_left_out_unless_asked_for(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "project", ["CD405"])
    orphans = [f.path for f in scan_paths(project.config).findings if f.code == "CD405"]
    assert orphans

    plain = run_cli("fix", str(project.config), "--dry-run")
    asked = run_cli("fix", str(project.config), "--dry-run", "--include-info")

    assert plain.returncode == 0, plain.stderr
    assert f"Left out: {len(orphans)} info finding{'s' * (len(orphans) != 1)} (CD405) not acted on: " \
           "--include-info" in plain.stdout
    assert "quarantine" not in plain.stdout.split("Left out")[0]
    assert "CD405" in asked.stdout and "Left out" not in asked.stdout
    assert f"quarantine  {len(orphans)} file" in asked.stdout


def test_after_a_fix_next_names_what_is_left_and_its_command(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "project", ["CD302", "CD405"])
    result = run_cli("fix", str(project.config), "--yes")

    assert result.returncode == 0, result.stdout + result.stderr
    target = os.path.relpath(project.config) if str(project.config).startswith(os.getcwd()) \
        else str(project.config)
    assert f"not acted on: `cachedoctor fix {target} --include-info`" in result.stdout
    again = re.search(r"(\d+) files? needs? encoding again: `cachedoctor fix (\S+) --reencode "
                      r"--encoder diffusers:PATH`", result.stdout)
    assert again, result.stdout
    quarantined = int(re.search(r"quarantine (\d+)/", result.stdout).group(1))
    assert int(again.group(1)) >= quarantined > 0


# --- cancelled and interrupted -----------------------------------------------------------

def _default_sigint() -> None:
    """Ctrl-C as a user's shell gives it. A test run started in the background by a
    non-interactive shell ignores SIGINT, the children inherit that, and Python then never
    installs its handler: the test would measure how pytest was started, not the CLI."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _on_a_terminal(args: list[str], answer: bytes, until: bytes = b"[y/N]") -> tuple[int, str]:
    """Run the CLI on a pty (its controlling terminal), type `answer` at the prompt; (exit
    status, everything it printed). A ^C typed there reaches it as a real SIGINT."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the pty
        _default_sigint()
        os.execv(sys.executable, [sys.executable, "-m", "cachedoctor", *args])
    out, answered, deadline = b"", False, time.monotonic() + 120
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 1)[0]:
            continue  # nothing yet: the deadline, not a blocking read, ends a child that hangs
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the pty
            break
        if not chunk:
            break
        out += chunk
        if not answered and until in out:
            # typed once the child reads: a line editor that sets the terminal up at its read
            # (readline's TCSAFLUSH) discards what was typed before it
            time.sleep(0.5)
            os.write(fd, answer)
            answered = True
    else:
        os.kill(pid, signal.SIGKILL)  # hung at the prompt: fail with what it printed
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace").replace("\r\n", "\n")


def test_ctrl_c_at_the_prompt_says_nothing_changed_and_exits_130(cache: Path) -> None:
    _broken(cache, 2)
    before = tree_digest(cache)

    code, output = _on_a_terminal(["fix", str(cache)], b"\x03")

    assert code == 130, output
    assert "cancelled: nothing changed" in output
    assert "Aborted" not in output and "Traceback" not in output
    assert tree_digest(cache) == before and not (cache / STATE_DIR / "journal.sqlite").exists()


def test_no_at_the_prompt_changes_nothing_and_exits_0(cache: Path) -> None:
    _broken(cache, 1)
    before = tree_digest(cache)

    code, output = _on_a_terminal(["fix", str(cache)], b"n\n")

    assert code == 0 and "Nothing changed." in output, output
    assert tree_digest(cache) == before


HOOK = """
import os, signal, sys
from cachedoctor.repair import atomic
from cachedoctor.cli import main

moves, after, sig = [0], int(sys.argv[1]), getattr(signal, sys.argv[2])
real = atomic.move_at

def move_at(*args, **kwargs):  # the signal lands after `after` files moved, as the next one starts
    if moves[0] == after:
        os.kill(os.getpid(), sig)
    moves[0] += 1
    return real(*args, **kwargs)

atomic.move_at = move_at
sys.argv = ["cachedoctor", *sys.argv[3:]]
main()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_fix_says_what_it_did_and_how_to_finish_or_undo(cache: Path, sig: str) -> None:
    _broken(cache, 12)
    before = tree_digest(cache)

    result = subprocess.run([sys.executable, "-c", HOOK, "5", sig, "fix", str(cache), "--yes"],
                            capture_output=True, text=True, timeout=120, preexec_fn=_default_sigint)

    assert result.returncode == 130, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    run_id = RUN_ID.search(result.stdout).group(1)
    assert f"Interrupted: run {run_id} stopped after 5 actions done; 1 rolled back; 6 not started." \
           in result.stdout
    assert f"undo it: `cachedoctor undo {run_id}`" in result.stdout
    assert f"Finish it: `cachedoctor fix {cache}`" in result.stdout
    # the journal agrees, and never says "planned" for what finished
    listed = run_cli("fix", "--list-runs", str(cache)).stdout
    assert "quarantine 12 (5 done, 1 rolled back, 6 not started)" in listed, listed
    assert "planned" not in listed and "interrupted" in listed
    assert len([n for n in os.listdir(cache) if n != STATE_DIR]) == 12 - 5
    # finishing it: the next fix plans the rest
    finish = run_cli("fix", str(cache), "--yes")
    assert finish.returncode == 0 and "quarantine 7/7" in finish.stdout, finish.stdout
    # undo both: every file back
    for _ in range(2):
        assert run_cli("undo").returncode == 0
    assert tree_digest(cache) == before


# --- one number for what a fix frees ------------------------------------------------------

def test_scan_plan_result_and_disk_agree_on_what_a_fix_frees(cache: Path) -> None:
    _broken(cache, 3)
    retained_batch.build(cache, rows=[1], seed=8)
    retained_batch.build(cache, container="gzip", key="latents", rows=[2], seed=9, name="retained_gzip")
    device_tagged.build(cache / "bucket", seed=11)
    report = scan_paths(cache)
    plan = build_plan(report, [str(cache)])
    assert {a.kind for a in plan.actions} == {"quarantine", "compact", "to-cpu"}
    scanned = reclaimable(report.findings)
    assert scanned == plan.expected_freed_size > 0

    summary = run_cli("scan", str(cache)).stdout
    dry = run_cli("fix", str(cache), "--dry-run").stdout
    assert f"{human_bytes(scanned)} reclaimable" in summary
    assert f"The cache files shrink by ~{human_bytes(scanned)} once the run's quarantine is purged" in dry
    assert f"moves {human_bytes(plan.quarantined_size)} of originals to the quarantine" in dry

    before = _apparent(cache)
    tagged = cache / "bucket" / "device_tagged.pt"
    tagged_before = tagged.stat().st_size
    fixed = run_cli("fix", str(cache), "--yes")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    run_id = RUN_ID.search(fixed.stdout).group(1)
    shrank = before - _apparent(cache)
    to_cpu = tagged_before - tagged.stat().st_size
    assert to_cpu > 0  # "cuda:0" -> "cpu" in the pickle
    assert f"The cache files shrank by {human_bytes(shrank)} (" in fixed.stdout
    assert f"to-cpu {human_bytes(to_cpu)}" in fixed.stdout
    assert f"`cachedoctor purge {run_id}` frees it" in fixed.stdout
    # quarantine is exact; compact's share is an estimate (records laid out anew, a gzip file's
    # compression): within 1% of it; to-cpu is measured after the rewrite
    compact = sum(a.freed for a in plan.of_kind("compact"))
    assert abs(shrank - scanned - to_cpu) <= 0.01 * compact + 128, (shrank, scanned, to_cpu)

    # the originals are still on disk, in the quarantine, until purged (the journal and lock
    # beside it are cachedoctor's few kB)
    quarantine = quarantine_of(cache, run_id)
    assert _du(quarantine) == plan.quarantined_size
    after_fix = _apparent(cache)
    purged = run_cli("purge", run_id, "--yes")
    assert purged.returncode == 0, purged.stderr
    assert not quarantine.exists() and _apparent(cache) == after_fix
    assert f"{human_bytes(plan.quarantined_size)} freed" in purged.stdout


def _du(root: Path) -> int:
    return sum(os.lstat(os.path.join(p, n)).st_size for p, _, names in os.walk(root) for n in names)


# --- purge -------------------------------------------------------------------------------

def _fixed(cache: Path) -> str:
    _broken(cache, 2)
    result = run_cli("fix", str(cache), "--yes")
    assert result.returncode == 0, result.stderr
    return RUN_ID.search(result.stdout).group(1)


def test_purge_without_yes_in_a_pipe_refuses_in_one_line(cache: Path) -> None:
    run_id = _fixed(cache)

    result = run_cli("purge", run_id)

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "cachedoctor: error: not deleting without --yes when stdin is not a terminal"]
    assert quarantine_of(cache, run_id).exists()


def test_purge_asks_on_a_terminal(cache: Path) -> None:
    run_id = _fixed(cache)

    code, output = _on_a_terminal(["purge", run_id], b"\x03")
    assert code == 130 and "cancelled: nothing changed" in output, output
    assert quarantine_of(cache, run_id).exists()

    code, output = _on_a_terminal(["purge", run_id], b"y\n")
    assert code == 0 and f"Purged run {run_id}" in output, output
    assert not quarantine_of(cache, run_id).exists()


def test_a_purged_run_is_journaled_and_undo_says_so_in_one_line(cache: Path) -> None:
    run_id = _fixed(cache)
    assert run_cli("purge", run_id, "--yes").returncode == 0

    listed = run_cli("fix", "--list-runs", str(cache)).stdout
    assert re.search(rf"{run_id}\s.*done, purged", listed), listed
    for args in (("undo", run_id), ("undo",), ("undo", run_id, "--cache", str(cache))):
        result = run_cli(*args)
        assert result.returncode == 2, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"run {run_id} cannot be undone: its quarantine was purged" in lines[0]
    again = run_cli("purge", run_id, "--yes")
    assert again.returncode == 0 and again.stdout.strip() == "Nothing to purge."


def test_purge_older_than_picks_runs_by_age(cache: Path) -> None:
    run_id = _fixed(cache)

    young = run_cli("purge", "--older-than", "1d", "--yes", "--cache", str(cache))
    assert young.stdout.strip() == "Nothing to purge." and quarantine_of(cache, run_id).exists()
    time.sleep(1.1)
    old = run_cli("purge", "--older-than", "1s", "--yes", "--cache", str(cache))
    assert old.returncode == 0 and f"Purged run {run_id}" in old.stdout
    assert not quarantine_of(cache, run_id).exists()


@pytest.mark.parametrize(("args", "message"), [
    ((), "purge needs a RUN or --older-than DURATION (one of them)"),
    (("--older-than", "3 fortnights"), "--older-than '3 fortnights': expected a number and a unit"),
    (("20000101T000000Z-0000", "--yes"), "no run 20000101T000000Z-0000"),
])
def test_purge_usage_errors_are_one_line(args: tuple[str, ...], message: str, cache: Path) -> None:
    result = run_cli("purge", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
