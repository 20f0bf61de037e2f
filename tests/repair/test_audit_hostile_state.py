"""Hostile state in a cache's own `.cachedoctor/`: a cache may come from someone else, with a
journal or quarantine folder made to lead `purge` and `undo` out of the cache."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from repair_helpers import isolated_state, quarantine_of  # noqa: F401

from cachedoctor.fixtures import clean, truncated_archive
from cachedoctor.inventory import STATE_DIR
from cachedoctor.repair.caches import JOURNAL

from conftest import run_cli


def _fixed(cache: Path) -> str:
    clean.build(cache, n=2)
    truncated_archive.build(cache)
    result = run_cli("fix", str(cache), "--yes")
    assert result.returncode == 0, result.stderr
    return next(line.split()[-1] for line in result.stdout.splitlines()
                if line.startswith("Undo with: "))


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    return victim


def test_purge_never_follows_a_journal_run_id_out_of_the_cache(tmp_path: Path) -> None:
    cache, victim = tmp_path / "cache", _victim(tmp_path)
    cache.mkdir()
    run_id = _fixed(cache)
    # <cache>/.cachedoctor/quarantine/../../../victim is tmp_path/victim
    conn = sqlite3.connect(cache / STATE_DIR / JOURNAL)
    with conn:
        conn.execute("INSERT INTO runs (run_id, started, finished, state) "
                     "VALUES ('../../../victim', 1000, 1001, 'done')")
    conn.close()

    result = run_cli("purge", "--older-than", "0s", "--yes", "--cache", str(cache))

    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert (victim / "keep.txt").read_text() == "precious"
    assert f"Purged run {run_id}" in result.stdout and "victim" not in result.stdout
    assert not quarantine_of(cache, run_id).exists()


def test_purge_never_deletes_through_a_symlinked_quarantine(tmp_path: Path) -> None:
    cache, victim = tmp_path / "cache", _victim(tmp_path)
    cache.mkdir()
    run_id = _fixed(cache)
    quarantine = quarantine_of(cache, run_id).parent
    # the quarantine folder swapped for a symlink to a folder holding a same-named run folder
    (victim / run_id).mkdir()
    (victim / run_id / "keep.pt").write_text("precious")
    os.rename(quarantine, tmp_path / "moved-quarantine")
    quarantine.symlink_to(victim, target_is_directory=True)

    result = run_cli("purge", run_id, "--yes", "--cache", str(cache))

    assert "Traceback" not in result.stderr, result.stderr
    assert (victim / run_id / "keep.pt").read_text() == "precious"
    assert (victim / "keep.txt").read_text() == "precious"


def _other_database(path: Path) -> bytes:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE mine (x)")
    conn.close()
    return path.read_bytes()


@pytest.mark.parametrize("link", [f"{STATE_DIR}/{JOURNAL}", STATE_DIR])
def test_fix_never_writes_a_journal_through_a_symlink(tmp_path: Path, link: str) -> None:
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    elsewhere.mkdir()
    clean.build(cache, n=2)
    truncated_archive.build(cache)
    other = elsewhere / JOURNAL
    before = _other_database(other)
    if link == STATE_DIR:
        (cache / STATE_DIR).symlink_to(elsewhere, target_is_directory=True)
    else:
        (cache / STATE_DIR).mkdir()
        (cache / link).symlink_to(other)

    result = run_cli("fix", str(cache), "--yes")

    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a symlink" in lines[0], result.stderr
    assert other.read_bytes() == before
    assert sorted(os.listdir(elsewhere)) == [JOURNAL]
    assert (cache / "truncated_archive.pt").exists()


def test_list_runs_names_a_damaged_journal_in_one_line_and_lists_the_others(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    run_id = _fixed(good)
    _fixed(bad)
    (bad / STATE_DIR / JOURNAL).write_bytes(b"not a database, " * 512)  # damaged since

    for args in (("fix", "--list-runs"), ("fix", "--list-runs", str(bad), str(good))):
        result = run_cli(*args)

        assert result.returncode == 2, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(bad / STATE_DIR / JOURNAL) in lines[0], result.stderr
        assert "internal error" not in result.stderr
        assert run_id in result.stdout


def test_one_damaged_journal_does_not_stop_undo_or_purge_of_the_other_caches(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    _fixed(bad)
    run_id = _fixed(good)  # the latest run: what a bare `undo` picks
    (bad / STATE_DIR / JOURNAL).write_bytes(b"not a database, " * 512)  # damaged since

    purged = run_cli("purge", "--older-than", "0s", "--yes")
    assert purged.returncode == 0 and f"Purged run {run_id}" in purged.stdout, purged.stderr
    second = _fixed(good)
    undone = run_cli("undo")
    assert undone.returncode == 0 and f"Undid run {second}" in undone.stdout, undone.stderr
    named = run_cli("undo", "--cache", str(bad))  # named, its error is the answer
    assert named.returncode == 2 and "file is not a database" in named.stderr


def test_recovery_never_deletes_a_file_named_by_a_hostile_run_id(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    _fixed(cache)
    mine = cache / "notes-1.tmp"  # what `.cachedoctor-x/../../notes-1.tmp`'s basename names
    mine.write_text("the user's")
    conn = sqlite3.connect(cache / STATE_DIR / JOURNAL)
    with conn:  # an interrupted run, as the next fix would recover it
        conn.execute("INSERT INTO runs (run_id, started, state) VALUES ('x/../../notes', 1000, "
                     "'running')")
        conn.execute("INSERT INTO actions (run_id, seq, action, relpath, path, codes, state, "
                     "updated) VALUES ('x/../../notes', 1, 'compact', ?, ?, 'CD201', 'started', 1000)",
                     (b"clean_0.pt", b"clean_0.pt"))
    conn.close()

    result = run_cli("undo", "--cache", str(cache))

    assert "Traceback" not in result.stderr, result.stderr
    assert mine.read_text() == "the user's"


def test_a_database_that_is_no_cachedoctor_journal_is_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    clean.build(cache, n=2)
    truncated_archive.build(cache)
    (cache / STATE_DIR).mkdir()
    conn = sqlite3.connect(cache / STATE_DIR / JOURNAL)  # the schema version, not the tables
    with conn:
        conn.execute("CREATE TABLE runs (x)")
        conn.execute("PRAGMA user_version=1")
    conn.close()

    for args in (("fix", str(cache), "--yes"), ("undo", "--cache", str(cache)),
                 ("fix", "--list-runs", str(cache))):
        result = run_cli(*args)

        assert result.returncode == 2, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "is no cachedoctor journal: its table runs lacks" in lines[0], \
            result.stderr
    assert (cache / "truncated_archive.pt").exists()


def test_a_cachedoctor_file_in_place_of_the_folder_is_one_clear_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    clean.build(cache, n=2)
    truncated_archive.build(cache)
    (cache / STATE_DIR).write_text("someone's notes")

    result = run_cli("fix", str(cache), "--yes")

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"cachedoctor: error: {cache / STATE_DIR} is not a folder: cachedoctor keeps its state "
        "there; move that file away"]
    assert (cache / STATE_DIR).read_text() == "someone's notes"
    assert (cache / "truncated_archive.pt").exists()


def test_a_forged_journal_prints_no_control_character(tmp_path: Path) -> None:
    """A journal's run ids, states and paths are text from whoever wrote the cache: listed,
    recovered or undone, none may retitle or clear the terminal or forge an output line."""
    import re

    cache = tmp_path / "cache"
    cache.mkdir()
    _fixed(cache)
    forged = "r\x1b]0;PWN\x07\x1b[2J\nFAKE"
    conn = sqlite3.connect(cache / STATE_DIR / JOURNAL)
    with conn:  # an interrupted run, and a done one whose file has changed since
        for run_id, state, action in ((forged, "running", "started"), (forged + "2", "done", "done")):
            conn.execute("INSERT INTO runs (run_id, started, state) VALUES (?, 1000, ?)",
                         (run_id, state))
            conn.execute("INSERT INTO actions (run_id, seq, action, relpath, path, codes, state, "
                         "sha_after, updated) VALUES (?, 1, 'compact\x1b[31m', ?, ?, 'CD201', ?, "
                         "'0', 1000)", (run_id, b"clean_0.pt", b"clean_0.pt", action))
    conn.close()
    (cache / STATE_DIR / "quarantine" / (forged + "2")).mkdir(parents=True)
    (cache / STATE_DIR / "quarantine" / (forged + "2") / "clean_0.pt").write_bytes(b"kept")

    for args in (("fix", "--list-runs", str(cache)), ("undo", forged + "2", "--cache", str(cache))):
        result = run_cli(*args)
        out = result.stdout + result.stderr
        assert "Traceback" not in out and forged + "2" not in out, out
        assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", out), out
        assert not any(line.startswith("FAKE") for line in out.splitlines()), out
    assert "r\\x1b]0;PWN\\x07\\x1b[2J\\x0aFAKE2" in result.stdout  # undo names the run it undid


@pytest.mark.parametrize("link", ["quarantine", "run folder"])
def test_undo_removes_no_folder_through_a_symlinked_quarantine(tmp_path: Path, link: str) -> None:
    """Undo tidies the run's emptied quarantine folders away: where `quarantine/` (or the run's
    folder in it) was swapped for a symlink since the run, no folder it leads to is removed."""
    cache, victim = tmp_path / "cache", _victim(tmp_path)
    cache.mkdir()
    run_id = _fixed(cache)
    quarantine = cache / STATE_DIR / "quarantine"
    shutil.rmtree(quarantine)
    (victim / run_id / "empty").mkdir(parents=True)  # empty folders: what undo may rmdir
    if link == "quarantine":
        quarantine.symlink_to(victim, target_is_directory=True)
    else:
        quarantine.mkdir()
        (quarantine / run_id).symlink_to(victim / run_id, target_is_directory=True)

    result = run_cli("undo", run_id, "--cache", str(cache))

    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    assert (victim / run_id / "empty").is_dir() and (victim / "keep.txt").read_text() == "precious"


def test_a_plan_names_a_symlinked_folder_s_target_as_inert_text(tmp_path: Path) -> None:
    """A skipped file's reason names where a symlinked folder leads: a name the cache's author
    chose, shown without its escape sequence or newline."""
    import re

    cache, elsewhere = tmp_path / "cache", tmp_path / "out\x1b[2J\nFAKE"
    cache.mkdir()
    elsewhere.mkdir()
    (elsewhere / "a.pt").write_bytes(b"")
    (cache / "sub").symlink_to(elsewhere, target_is_directory=True)

    result = run_cli("fix", str(cache), "--dry-run")

    assert "out\\x1b[2J\\x0aFAKE, outside the cache" in result.stdout, result.stdout
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", result.stdout + result.stderr)


@pytest.mark.parametrize("relpath", ["sub/..", ".", "sub/.", "/sub/x.pt", "sub//x.pt"])
def test_undo_of_a_journal_path_naming_a_folder_is_one_conflict(tmp_path: Path, relpath: str) -> None:
    """A journal's relpath `sub/..` names the folder sub itself (its basename is `..`): undo
    of a re-encode hashed it as a file and died (IsADirectoryError, exit 2), leaving the run
    half undone. Such a path (as an absolute one, or one with an empty part) is no file a run
    records: left alone and reported."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "sub").mkdir()
    (cache / "sub" / "x.pt").write_bytes(b"the user's")
    from cachedoctor.repair.journal import Journal

    Journal.open(str(cache)).close()
    conn = sqlite3.connect(cache / STATE_DIR / JOURNAL)
    with conn:
        conn.execute("INSERT INTO runs (run_id, started, finished, state) "
                     "VALUES ('20260101-000000-abcd', 1000, 1001, 'done')")
        conn.execute("INSERT INTO actions (run_id, seq, action, relpath, path, codes, state, "
                     "sha_after, updated) VALUES ('20260101-000000-abcd', 1, 'reencode', ?, ?, "
                     "'CD101', 'done', 'x', 1000)", (relpath.encode(), relpath.encode()))
    conn.close()

    result = run_cli("undo", "--cache", str(cache))

    assert result.returncode == 1, result.stderr
    assert "left alone" in result.stdout
    assert (cache / "sub" / "x.pt").read_bytes() == b"the user's"


def test_undo_of_a_reencode_whose_file_became_a_folder(tmp_path: Path) -> None:
    """A folder put where a re-encoded file was: its sha256 is no file's, so it stays."""
    from cachedoctor.repair import rollback
    from cachedoctor.repair.journal import ActionRecord

    cache = tmp_path / "cache"
    (cache / "x.pt").mkdir(parents=True)
    record = ActionRecord("20260101-000000-abcd", 1, "reencode", "x.pt", ("CD101",), "done",
                          1, None, "x", None)
    assert rollback.roll_back(record, str(cache)) is None
    assert (cache / "x.pt").is_dir()
