"""Two runs on one cache never overlap: the second fails at once with the holder's pid, or waits
with --wait; a lock dies with its holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repair_helpers import isolated_state, tree_digest  # noqa: F401

from cachedoctor.fixtures import empty_file
from cachedoctor.repair.lock import LockBusy, locked

from conftest import run_cli

HOLDER = (
    "import sys, time\n"
    "from cachedoctor.repair.lock import locked\n"
    "with locked([sys.argv[1]], command='fix'):\n"
    "    print('locked', flush=True)\n"
    "    time.sleep(float(sys.argv[2]))\n"
)


def hold(cache: Path, seconds: float) -> subprocess.Popen:
    """A process that holds the cache's lock for `seconds`, started once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_fix_or_an_undo_fails_at_once_naming_the_holder(cache: Path) -> None:
    empty_file.build(cache, name="fixed_before")
    assert run_cli("fix", str(cache), "--yes").returncode == 0
    empty_file.build(cache)
    before = tree_digest(cache)
    holder = hold(cache, 60)
    try:
        began = time.monotonic()
        result = run_cli("fix", str(cache), "--yes")
        assert time.monotonic() - began < 30
        assert result.returncode == 2
        assert result.stderr.strip() == (
            f"cachedoctor: error: another cachedoctor fix (pid {holder.pid}) is running on {cache}; "
            "wait for it to finish, or pass --wait SECONDS")
        undo = run_cli("undo", "--cache", str(cache))  # undo takes the same lock
        assert undo.returncode == 2 and f"(pid {holder.pid}) is running on {cache}" in undo.stderr
        assert tree_digest(cache) == before
    finally:
        holder.kill()
        holder.wait()


def test_wait_lets_a_second_fix_run_once_the_first_is_done(cache: Path) -> None:
    empty_file.build(cache)
    holder = hold(cache, 1.5)
    try:
        result = run_cli("fix", str(cache), "--yes", "--wait", "60")
    finally:
        holder.wait()
    assert result.returncode == 0, result.stderr
    assert not (cache / "empty_file.pt").exists()


def test_a_lock_dies_with_its_holder(cache: Path) -> None:
    empty_file.build(cache)
    holder = hold(cache, 60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert run_cli("fix", str(cache), "--yes").returncode == 0


def test_locks_are_reentrant_in_a_process_and_exclusive_across(cache: Path) -> None:
    with locked([str(cache)]), locked([str(cache)]):
        pass
    holder = hold(cache, 60)
    try:
        began = time.monotonic()
        with pytest.raises(LockBusy) as busy, locked([str(cache)], wait=0.5):
            pass
        assert time.monotonic() - began >= 0.5
        assert busy.value.holder == f"fix (pid {holder.pid})"
    finally:
        holder.kill()
        holder.wait()
