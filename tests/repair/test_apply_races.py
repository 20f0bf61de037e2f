"""A repair touches only what it planned: the cache is changed between the plan and the run
(the API's plan/execute split is the hook, as the CLI's confirm prompt is), and the run skips
and reports every changed file, changing nothing outside the cache. Rewrites keep mode, owner,
group and mtime; a full disk or a read-only file system is a failed action naming the path,
rolled back, and the journal stays recoverable."""

from __future__ import annotations

import errno
import io
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from repair_helpers import isolated_state, tree_digest  # noqa: F401

from cachedoctor.fix_kinds import COMPACT, QUARANTINE
from cachedoctor.fixtures import empty_file, retained_batch
from cachedoctor.repair import atomic as atomic_module
from cachedoctor.repair import build_plan, recover_caches, undo_run
from cachedoctor.repair.apply import RunStopped
from cachedoctor.repair.journal import FAILED, INTERRUPTED, READY, SKIPPED, Journal
from cachedoctor.repair.render import render_result

from conftest import invoke, scan_paths


def plan_for(cache: Path):
    return build_plan(scan_paths(cache, deep=False), [str(cache)])


def test_a_cache_changed_between_plan_and_run_is_skipped_and_nothing_outside_changes(
        tmp_path: Path) -> None:
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    for name in ("renamed", "grown", "replaced", "linked"):
        empty_file.build(cache, name=name)
    empty_file.build(cache / "sub", name="in_sub")
    retained_batch.build(cache / "sub", rows=[1], seed=1, name="batch_in_sub")
    retained_batch.build(cache, rows=[2], seed=2, name="batch_linked")
    # outside: a twin of sub/ (what a path-following run would move and rewrite) and victims
    shutil.copytree(cache / "sub", outside / "sub")
    (outside / "victim.pt").write_bytes(b"")
    shutil.copy2(cache / "batch_linked_2.pt", outside / "victim_batch.pt")
    plan = plan_for(cache)
    kinds = {os.path.relpath(a.path, cache): a.kind for a in plan.actions}
    assert kinds == {"renamed.pt": QUARANTINE, "grown.pt": QUARANTINE, "replaced.pt": QUARANTINE,
                     "linked.pt": QUARANTINE, "sub/in_sub.pt": QUARANTINE,
                     "sub/batch_in_sub_1.pt": COMPACT, "batch_linked_2.pt": COMPACT}

    # between the plan and the run
    (cache / "sub").rename(cache / "sub_moved")
    (cache / "sub").symlink_to(outside / "sub", target_is_directory=True)
    (cache / "renamed.pt").rename(cache / "renamed_since.pt")
    with open(cache / "grown.pt", "ab") as f:
        f.write(b"\x00" * 10)
    (cache / "new.tmp").write_bytes(b"")  # same size, another inode
    os.replace(cache / "new.tmp", cache / "replaced.pt")
    (cache / "linked.pt").unlink()
    (cache / "linked.pt").symlink_to(outside / "victim.pt")
    (cache / "batch_linked_2.pt").unlink()
    (cache / "batch_linked_2.pt").symlink_to(outside / "victim_batch.pt")
    outside_before, cache_before = tree_digest(outside), tree_digest(cache)

    result = plan.execute()

    assert tree_digest(outside) == outside_before
    assert tree_digest(cache) == cache_before
    why = {os.path.relpath(o.action.path, cache): o.message for o in result.outcomes}
    assert {o.state for o in result.outcomes} == {SKIPPED}, why
    assert "vanished" in why["renamed.pt"]
    assert "changed size" in why["grown.pt"]
    assert "replaced by another file" in why["replaced.pt"]
    assert "symlink" in why["linked.pt"] and "symlink" in why["batch_linked_2.pt"]
    assert "sub/ is now a symlink" in why["sub/in_sub.pt"]
    assert "sub/ is now a symlink" in why["sub/batch_in_sub_1.pt"]
    with Journal.open(str(cache)) as journal:
        assert {a.state for a in journal.actions(result.run_id)} == {SKIPPED}
    out = io.StringIO()
    render_result(result, out)
    lines = out.getvalue().splitlines()
    assert "quarantine 0/5 (5 skipped)" in lines[0] and "compact 0/2 (2 skipped)" in lines[0]
    assert sum(line.lstrip().startswith("skipped") for line in lines) == 7


def test_a_file_modified_in_place_since_the_plan_is_skipped(cache: Path) -> None:
    [path] = retained_batch.build(cache, rows=[1], seed=3)
    plan = plan_for(cache)
    os.utime(path, ns=(0, 10**18))  # same bytes, same inode: only the mtime says it changed
    result = plan.execute()
    assert [(o.state, o.message) for o in result.outcomes] == [
        (SKIPPED, "since the plan, the file was modified")]


def test_a_rewrite_keeps_mode_owner_group_and_mtime(cache: Path) -> None:
    [path] = retained_batch.build(cache, rows=[1], seed=4)
    os.chmod(path, 0o640)
    os.utime(path, ns=(1_600_000_000_123_456_789, 1_500_000_000_987_654_321))
    if os.geteuid() == 0:  # root can give the file another owner, and must keep it
        os.chown(path, 4321, 8765)
    before = os.stat(path)
    plan = plan_for(cache)
    assert [a.kind for a in plan.actions] == [COMPACT]
    result = plan.execute()
    assert not result.failed and not [o for o in result.outcomes if o.state == SKIPPED]
    after = os.stat(path)
    assert after.st_ino != before.st_ino and after.st_size < before.st_size  # really rewritten
    # the mtime is kept (a trainer comparing image and cache mtimes still sees it fresh); the
    # atime is not promised: reading the file back to verify it is an access
    assert (after.st_mode, after.st_uid, after.st_gid, after.st_mtime_ns) == \
        (before.st_mode, before.st_uid, before.st_gid, before.st_mtime_ns)


def test_a_full_disk_fails_the_action_naming_the_file_and_leaves_it_as_it_was(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [path] = retained_batch.build(cache, rows=[1], seed=5)
    empty_file.build(cache)
    before = tree_digest(cache)
    real_write = os.write

    def full(fd: int, data) -> int:  # only the rewrite's temp file hits the full disk
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".cachedoctor-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(atomic_module.os, "write", full)
    plan = plan_for(cache)
    result = plan.execute()
    monkeypatch.undo()
    states = {o.action.kind: (o.state, o.message) for o in result.outcomes}
    assert states[COMPACT] == (FAILED, f"{path}: No space left on device")
    assert states[QUARANTINE][0] == "done"  # one full-disk failure does not stop the others
    assert not [n for n in os.listdir(cache) if n.startswith(".cachedoctor-")]
    undo_run(result.run_id, [str(cache)])
    assert tree_digest(cache) == before


def test_a_read_only_file_system_fails_the_action_naming_the_file(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [path] = empty_file.build(cache)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), args[0])

    monkeypatch.setattr(atomic_module.os, "rename", read_only)
    plan = plan_for(cache)
    result = plan.execute()
    monkeypatch.undo()
    assert [(o.state, o.message) for o in result.outcomes] == [
        (FAILED, f"{path}: Read-only file system")]
    assert path.exists()


def test_a_journal_on_a_full_disk_stops_the_run_and_the_next_fix_recovers(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [path] = retained_batch.build(cache, rows=[1], seed=6)
    before = tree_digest(cache)
    update = Journal.update

    class FullConnection:
        """SQLite's own error for a full disk, from every write once the disk filled up."""

        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def execute(self, sql: str, *args):
            if sql.lstrip().upper().startswith(("UPDATE", "INSERT")):
                raise sqlite3.OperationalError("database or disk is full")
            return self.conn.execute(sql, *args)

        def close(self) -> None:
            self.conn.close()

        def __enter__(self):
            return self.conn.__enter__()

        def __exit__(self, *exc):
            return self.conn.__exit__(*exc)

    def filling(self: Journal, run_id: str, seq: int, state: str, **fields) -> None:
        if state == READY and not isinstance(self.conn, FullConnection):
            self.conn = FullConnection(self.conn)  # type: ignore[assignment]
        update(self, run_id, seq, state, **fields)

    monkeypatch.setattr(Journal, "update", filling)
    plan = plan_for(cache)
    with pytest.raises(RunStopped, match=r"cannot write the journal .*journal\.sqlite: database or "
                                         r"disk is full"):
        plan.execute()
    monkeypatch.undo()
    assert tree_digest(cache) == before  # rolled back on the spot: the temp file is gone
    notes = recover_caches([str(cache)])
    assert len(notes) == 1 and "had been interrupted" in notes[0]
    with Journal.open(str(cache)) as journal:
        [run] = journal.runs()
        assert run.state == INTERRUPTED
    assert path.exists() and tree_digest(cache) == before


def test_a_read_only_cache_dir_is_one_line_naming_it_and_nothing_changes(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_file.build(cache)
    before = tree_digest(cache)
    mkdir = os.mkdir

    def read_only(path, *args, **kwargs):  # root ignores chmod: the file system says no
        if os.fspath(path).startswith(str(cache)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    result = invoke("fix", str(cache), "--yes")
    monkeypatch.undo()
    assert result.exit_code == 2
    assert result.stderr.strip() == f"cachedoctor: error: {cache}/.cachedoctor: Read-only file system"
    assert tree_digest(cache) == before and os.listdir(cache) == ["empty_file.pt"]


def test_undo_after_a_folder_was_swapped_for_a_symlink_moves_nothing_outside(tmp_path: Path) -> None:
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    [path] = empty_file.build(cache / "sub")
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "other.pt").write_bytes(b"theirs")
    result = plan_for(cache).execute()
    assert [o.state for o in result.outcomes] == ["done"] and not path.exists()
    (cache / "sub").rename(cache / "sub_moved")
    (cache / "sub").symlink_to(outside / "sub", target_is_directory=True)
    outside_before = tree_digest(outside)

    [undone] = undo_run(result.run_id, [str(cache)])

    assert tree_digest(outside) == outside_before
    assert undone.restored == 0
    [conflict] = undone.conflicts
    assert "sub/ is now a symlink" in conflict and "the original is kept at" in conflict
    assert not (cache / "sub_moved" / path.name).exists()


def test_a_folder_swapped_while_the_run_works_in_it_cannot_redirect_a_move_or_rewrite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap lands after the run has opened the folder: what the run does goes through the
    folder's descriptor, so it happens in the (renamed) cache folder, never in the symlink's
    target."""
    from cachedoctor.repair import confined

    cache, outside = tmp_path / "cache", tmp_path / "outside"
    [empty] = empty_file.build(cache / "sub")
    [batch] = retained_batch.build(cache / "sub", rows=[1], seed=7)
    shutil.copytree(cache / "sub", outside / "sub")
    outside_before = tree_digest(outside)
    plan = plan_for(cache)
    assert sorted(a.kind for a in plan.actions) == [COMPACT, QUARANTINE]
    open_dir = confined.open_dir

    def swapping(root_fd: int, reldir: str, **kwargs) -> int:
        if reldir != "sub":
            return open_dir(root_fd, reldir, **kwargs)
        if (cache / "sub").is_symlink():  # put the folder back for the next action to open
            (cache / "sub").unlink()
            (cache / "sub_moved").rename(cache / "sub")
        fd = open_dir(root_fd, reldir, **kwargs)
        (cache / "sub").rename(cache / "sub_moved")  # and swap it once it is open
        (cache / "sub").symlink_to(outside / "sub", target_is_directory=True)
        return fd

    monkeypatch.setattr(confined, "open_dir", swapping)
    result = plan.execute()
    monkeypatch.undo()

    assert {o.state for o in result.outcomes} == {"done"}, [o.message for o in result.outcomes]
    assert tree_digest(outside) == outside_before
    moved = cache / "sub_moved"
    assert not (moved / empty.name).exists()
    assert (moved / batch.name).stat().st_size < batch.stat().st_size  # compacted in the cache


def test_the_cli_reports_each_file_changed_after_its_plan_was_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cachedoctor.repair import render

    cache, outside = tmp_path / "cache", tmp_path / "outside"
    [path] = empty_file.build(cache / "sub")
    shutil.copytree(cache / "sub", outside / "sub")
    outside_before = tree_digest(outside)
    show = render.render_plan

    def shown_then_swapped(*args, **kwargs) -> None:  # the user reads the plan; meanwhile...
        show(*args, **kwargs)
        (cache / "sub").rename(cache / "sub_moved")
        (cache / "sub").symlink_to(outside / "sub", target_is_directory=True)

    monkeypatch.setattr(render, "render_plan", shown_then_swapped)
    result = invoke("fix", str(cache), "--yes")
    assert result.exit_code == 1  # a repair left undone is not a success
    assert "quarantine 0/1 (1 skipped)" in result.stdout
    assert (f"  skipped quarantine {path}: a folder on its path changed since the plan: sub/ is now "
            "a symlink or not a folder: it may lead out of the cache") in result.stdout.splitlines()
    assert tree_digest(outside) == outside_before and (cache / "sub_moved" / path.name).exists()


@pytest.mark.parametrize("container", ["zip", "safetensors", "npz"])
def test_a_reencode_verifies_the_file_it_wrote_through_the_folder_not_a_path_that_now_leads_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, container: str) -> None:
    """The folder is swapped for a symlink once the run has opened it: the new entry is written
    and linked through the folder's descriptor, and read back for verification the same way,
    never through its path (which now leads outside the cache, to a file the scan's reader
    never judged)."""
    from cachedoctor.fixtures.images import write_png
    from cachedoctor.repair import confined
    from cachedoctor.repair.encoders import ReferenceEncoder
    from cachedoctor.repair.plan import Reencode
    from cachedoctor.repair.reencode import EntryFormat, ReencodeTarget

    cache, outside = tmp_path / "cache", tmp_path / "outside"
    (cache / "sub").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    image = write_png(tmp_path / "first.png", 256, 256, seed=(0, 5))
    suffix = {"zip": ".pt", "safetensors": ".safetensors", "npz": ".npz"}[container]
    entry = cache / "sub" / f"first{suffix}"
    target = ReencodeTarget(str(image), str(entry),
                            EntryFormat(container, None if container == "zip" else "latent", "float16", 4))
    plan = build_plan(scan_paths(cache), [str(cache)], Reencode(ReferenceEncoder(), targets=(target,)))
    assert len(plan.actions) == 1
    open_dir = confined.open_dir

    def swapping(root_fd: int, reldir: str, **kwargs) -> int:
        fd = open_dir(root_fd, reldir, **kwargs)
        if reldir == "sub" and not (cache / "sub").is_symlink():
            (cache / "sub").rename(cache / "sub_moved")
            (cache / "sub").symlink_to(outside / "sub", target_is_directory=True)
        return fd

    write_new = atomic_module.write_new

    def planting(path, data, *args, **kwargs) -> None:  # a file of the same name outside
        write_new(path, data, *args, **kwargs)
        (outside / "sub" / os.path.basename(path)).write_bytes(b"not what the run wrote")

    monkeypatch.setattr(confined, "open_dir", swapping)
    monkeypatch.setattr(atomic_module, "write_new", planting)
    result = plan.execute()
    monkeypatch.undo()

    assert [(o.state, o.message) for o in result.outcomes] == [("done", "")]
    assert (cache / "sub_moved" / entry.name).exists()
    assert sorted(p.name for p in (outside / "sub").iterdir()) == [
        f".cachedoctor-{result.run_id}-1.tmp"]  # the planted file, only read by the old code


def test_an_io_error_keeping_the_original_is_one_line_naming_the_file_once_and_nothing_is_lost(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [path] = retained_batch.build(cache, rows=[1], seed=5)
    before = tree_digest(cache)

    def failing(src, dst, *args, **kwargs):  # the quarantine's second name for the original
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(atomic_module.os, "link", failing)
    result = invoke("fix", str(cache), "--yes")
    monkeypatch.undo()
    assert result.exit_code == 1 and not result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("  failed")]
    assert line == f"  failed  compact    {path}: Input/output error"
    assert tree_digest(cache) == before
    assert not list(cache.rglob(".cachedoctor-*"))


def test_a_file_replaced_while_the_rest_of_the_scan_runs_is_not_planned_on_the_old_verdict(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fix --yes` scans, then plans: a trainer that rewrites a broken entry (write a temp,
    rename it over) after the scan read it, while the scan reads the other files, leaves a good
    file where the finding was. The plan must not quarantine it on the old file's verdict."""
    from cachedoctor import engine
    from cachedoctor.fixtures import clean, truncated_archive

    [good] = clean.build(cache / "b", n=1)
    [broken] = truncated_archive.build(cache / "a", seed=1)  # read first: "a" sorts before "b"
    read_entry = engine.read_entry

    def trainer_writes_meanwhile(entry, *args, **kwargs):
        if entry.path == str(good):
            fresh = broken.with_name(".tmp-fresh")
            fresh.write_bytes(good.read_bytes())
            os.replace(fresh, broken)
        return read_entry(entry, *args, **kwargs)

    monkeypatch.setattr(engine, "read_entry", trainer_writes_meanwhile)
    result = invoke("fix", str(cache), "--yes", "-j", "1")
    monkeypatch.undo()
    assert broken.read_bytes() == good.read_bytes()  # the trainer's entry stays in the cache
    assert ("CD101 1 file: changed since the scan read it: it was replaced by another file; scan "
            f"again {broken}") in " ".join(result.stdout.split()), result.stdout
