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


def test_locks_are_taken_once_per_command_and_exclusive_across(cache: Path) -> None:
    # A command takes its locks once (session.guarded) and hands them down: a second block on
    # the same cache, even in this process, waits like any other run.
    with locked([str(cache)]), pytest.raises(LockBusy), locked([str(cache)]):
        pass
    with locked([str(cache)]):  # released: free again
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


def test_nested_caches_share_one_lock_across_processes(tmp_path: Path) -> None:
    outer = tmp_path / "cache"
    inner = outer / "sub"
    empty_file.build(inner)
    before = tree_digest(outer)
    for held, fixed in ((outer, inner), (inner, outer)):
        holder = hold(held, 60)
        try:
            result = run_cli("fix", str(fixed), "--yes")
            assert result.returncode == 2
            assert result.stderr.strip() == (
                f"cachedoctor: error: another cachedoctor fix (pid {holder.pid}) is running on "
                f"{held}; wait for it to finish, or pass --wait SECONDS")
            assert tree_digest(outer) == before
        finally:
            holder.kill()
            holder.wait()


def test_a_symlink_to_a_cache_takes_the_cache_s_own_lock(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    empty_file.build(cache)
    alias = tmp_path / "alias"
    alias.symlink_to(cache, target_is_directory=True)
    holder = hold(cache, 60)
    try:
        with pytest.raises(LockBusy) as busy, locked([str(alias)]):
            pass
        assert busy.value.root == str(cache)
    finally:
        holder.kill()
        holder.wait()


def test_sibling_caches_lock_independently(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    holder = hold(tmp_path / "a", 60)
    try:
        with locked([str(tmp_path / "b")]):
            pass
        with pytest.raises(LockBusy), locked([str(tmp_path)]):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_creates_no_folder_in_or_for_the_cache(tmp_path: Path) -> None:
    missing = tmp_path / "not_cached_yet"
    existing = tmp_path / "cache"
    existing.mkdir()
    with locked([str(missing), str(existing)]):
        assert not missing.exists() and os.listdir(existing) == []
    assert not missing.exists() and os.listdir(existing) == []


def test_fix_with_nothing_to_do_or_then_undo_leaves_no_folder_it_made(cache: Path) -> None:
    clean_tree = tree_digest(cache)
    assert run_cli("fix", str(cache), "--yes").returncode == 0
    assert os.listdir(cache) == [] and tree_digest(cache) == clean_tree
    (cache / "deep" / "er").mkdir(parents=True)
    empty_file.build(cache / "deep" / "er")
    assert run_cli("fix", str(cache), "--yes").returncode == 0
    assert run_cli("undo", "--cache", str(cache)).returncode == 0
    # what stays is the journal (the record `fix --list-runs` shows) and its lock file
    assert sorted(os.listdir(cache / ".cachedoctor")) == ["journal.sqlite", "lock"]
    assert sorted(os.listdir(cache)) == [".cachedoctor", "deep"]


def test_a_run_that_starts_on_a_fresh_cache_is_never_recovered_by_a_fix_of_another_state_dir(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fixes that keep their locks in different state dirs (two users, two machines sharing
    the cache) meet only at `<cache>/.cachedoctor/lock`. The second took its state-dir lock
    while the cache had no `.cachedoctor/` yet; by the time it looks for interrupted runs, the
    first has begun its run there. Recovery must take the in-cache lock first (and find it
    busy), never roll back a run that is alive."""
    from cachedoctor.fixtures import retained_batch
    from cachedoctor.repair import lock
    from cachedoctor.repair.journal import DONE, Journal
    from cachedoctor.repair.session import guarded

    retained_batch.build(cache, rows=[1], seed=3)
    before = tree_digest(cache)
    env = {**os.environ, "CACHEDOCTOR_STATE_DIR": str(tmp_path / "other-state")}
    acquire = lock._acquire
    first: list[subprocess.Popen] = []

    def then_the_other_run_begins(root: str, deadline: float, command: str) -> list[int]:
        fds = acquire(root, deadline, command)  # no .cachedoctor/ yet: no in-cache lock
        proc = subprocess.Popen([sys.executable, "-m", "cachedoctor", "fix", "--yes", "-j", "1",
                                 str(cache)], stdout=subprocess.PIPE, text=True, env=env)
        first.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("Applying run"):
                break
        proc.send_signal(signal.SIGSTOP)  # its run is journaled and under way
        return fds

    monkeypatch.setattr(lock, "_acquire", then_the_other_run_begins)
    try:
        with pytest.raises(LockBusy), guarded([str(cache)]):
            pass
    finally:
        monkeypatch.undo()
        for proc in first:
            proc.send_signal(signal.SIGCONT)
            proc.communicate(timeout=120)
    [proc] = first
    assert proc.returncode == 0
    with Journal.open(str(cache)) as journal:
        [run] = journal.runs()
        assert run.state == DONE and {a.state for a in journal.actions(run.run_id)} == {DONE}
    assert run_cli("undo", "--cache", str(cache), env=env).returncode == 0
    assert tree_digest(cache) == before
