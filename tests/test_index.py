"""The incremental index (cachedoctor/index.py): a rescan reuses the verdicts of unchanged files
and reads every file whose stat changed, with results identical to a scan without the index;
a corrupt, locked or unwritable index never changes a result."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from cachedoctor import engine, index
from cachedoctor.api import resolve_policy
from cachedoctor.config import ConfigError
from cachedoctor.findings import Severity
from cachedoctor.fixtures.demo import write_demo
from cachedoctor.options import ScanOptions

OPTIONS = ScanOptions(jobs=1)
HOUR = 3600


def _age(root: Path, seconds: float = HOUR) -> None:
    """Files as a trainer left them a while ago (the index records no file modified in the
    last RACY_NS); older files keep their age (the demo's day-old temp file)."""
    past = time.time() - seconds
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mtime > past:
            os.utime(path, (past, past))


@pytest.fixture(scope="module")
def demo_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo") / "cache"
    write_demo(root)
    _age(root)
    return root


@pytest.fixture
def demo(demo_template: Path, tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(demo_template, root, symlinks=True)  # copy2: mtimes kept
    return root


def scan(root: Path, **changes) -> engine.Report:
    return engine.scan([str(root)], dataclasses.replace(OPTIONS, **changes))


def fresh(root: Path, **changes) -> engine.Report:
    return scan(root, index=False, **changes)


def same(*reports: engine.Report) -> bool:
    """Whether the reports say the same (a temp file's age in seconds ticks between two scans)."""
    def comparable(report: engine.Report) -> tuple:
        findings = tuple(dataclasses.replace(f, details={k: v for k, v in f.details.items()
                                                         if k != "age_seconds"})
                         for f in report.findings)
        return (report.files, report.bytes, report.datasets, report.trainers, findings)

    first = comparable(reports[0])
    return all(comparable(r) == first for r in reports[1:])


def recordable(root: Path) -> int:
    """How many files of the demo the index records (latents; no temp file, image, caption)."""
    return sum(1 for p in root.rglob("*.pt") if ".cachedoctor" not in p.parts)


def test_a_rescan_reuses_every_recorded_file_and_finds_the_same(demo: Path) -> None:
    before = fresh(demo)
    assert not (demo / ".cachedoctor").exists()
    first = scan(demo)
    assert (demo / ".cachedoctor" / index.NAME).is_file()
    again = scan(demo)
    assert same(before, first, again)
    assert {f.code for f in again.findings} >= {"CD101", "CD102", "CD105", "CD107", "CD201", "CD502"}
    assert first.index["reused"] == 0 and first.index["read"] == first.files
    assert again.index["reused"] == recordable(demo)
    assert again.index["read"] == again.files - recordable(demo)


def _same_size_new_inode(path: Path) -> None:
    """Replace `path` with other bytes of the same size and the same mtime (a new inode)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # the tail zeroed: a torn archive
    other = path.with_name(path.name + ".new")
    other.write_bytes(bytes(data))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    new = path.stat()
    assert (new.st_size, new.st_mtime_ns) == (st.st_size, st.st_mtime_ns) and new.st_ino != st.st_ino


def _touch(path: Path) -> None:
    os.utime(path, (time.time() - 60, time.time() - 60))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _add(path: Path) -> None:
    shutil.copy2(path.parent / "retained_batch_3.pt", path.parent / "retained_batch_copy.pt")


def _delete(path: Path) -> None:
    (path.parent / "truncated_archive.pt").unlink()


@pytest.mark.parametrize("change", [_touch, _same_size_new_inode, _truncate, _add, _delete])
def test_a_changed_file_is_read_again(demo: Path, change) -> None:
    scan(demo)
    change(demo / "latent_000.pt")
    after = scan(demo)
    assert same(after, fresh(demo))
    if change is _touch:
        assert after.index["reused"] == recordable(demo) - 1
    elif change in (_same_size_new_inode, _truncate):
        assert after.index["reused"] == recordable(demo) - 1
        assert any(f.path == str(demo / "latent_000.pt") and f.code == "CD101" for f in after.findings)
    elif change is _add:
        assert after.index["reused"] == recordable(demo) - 1
        assert any(f.path.endswith("retained_batch_copy.pt") and f.code == "CD201" for f in after.findings)
    else:
        assert after.index["reused"] == recordable(demo)
        assert not any(f.path.endswith("truncated_archive.pt") for f in after.findings)


def test_another_code_or_rule_selection_rejudges_everything(demo: Path, monkeypatch) -> None:
    scan(demo)
    monkeypatch.setattr(index, "code_stamp", lambda: "another release")
    changed = scan(demo)
    assert changed.index["reused"] == 0 and same(changed, fresh(demo))
    assert scan(demo).index["reused"] == recordable(demo)
    cd1 = resolve_policy(select="CD1", isolated=True).options.selected
    narrower = scan(demo, selected=cd1)
    assert narrower.index["reused"] == 0 and same(narrower, fresh(demo, selected=cd1))
    assert scan(demo, deep=True).index["reused"] == 0


def test_the_code_stamp_follows_every_source_byte(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "rule.py").write_text("LIMIT = 1\n")
    stamp = index.source_digest("1.0", [str(tmp_path / "pkg")])
    assert stamp == index.source_digest("1.0", [str(tmp_path / "pkg")])
    assert stamp != index.source_digest("1.1", [str(tmp_path / "pkg")])
    (tmp_path / "pkg" / "rule.py").write_text("LIMIT = 2\n")
    assert stamp != index.source_digest("1.0", [str(tmp_path / "pkg")])
    assert index.code_stamp() == index.code_stamp()


def test_a_corrupt_index_is_rebuilt_with_a_notice(demo: Path) -> None:
    scan(demo)
    db = demo / ".cachedoctor" / index.NAME
    for side in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        side.unlink(missing_ok=True)
    db.write_bytes(os.urandom(8192))
    rebuilt = scan(demo)
    assert same(rebuilt, fresh(demo))
    assert any("rebuilt" in n for n in rebuilt.index["notices"])
    assert scan(demo).index["reused"] == recordable(demo)


def test_tampered_rows_are_read_again(demo: Path) -> None:
    scan(demo)
    with sqlite3.connect(demo / ".cachedoctor" / index.NAME) as db:
        db.execute("UPDATE files SET findings = '[[\"CD999\"' , summary = 'cos\\nsystem\\n'")
    tampered = scan(demo)
    assert same(tampered, fresh(demo))
    assert tampered.index["reused"] == 0


@pytest.mark.parametrize("hold", ["BEGIN EXCLUSIVE", "PRAGMA locking_mode = EXCLUSIVE"])
def test_a_locked_index_is_skipped_with_a_notice(demo: Path, monkeypatch, hold: str) -> None:
    scan(demo)
    _touch(demo / "latent_001.pt")  # something to write
    monkeypatch.setattr(index, "BUSY_MS", 100)
    holder = sqlite3.connect(demo / ".cachedoctor" / index.NAME, isolation_level=None)
    try:
        holder.execute(hold)
        if hold.startswith("PRAGMA"):  # the exclusive lock is taken by the next write
            holder.execute("BEGIN IMMEDIATE")
            holder.execute("INSERT OR REPLACE INTO meta VALUES ('held', '1')")
            holder.execute("COMMIT")
        locked = scan(demo)
    finally:
        holder.close()
    assert same(locked, fresh(demo))
    assert any("lock" in n for n in locked.index["notices"]), locked.index


def test_two_concurrent_scans_share_the_index(demo: Path) -> None:
    command = [sys.executable, "-m", "cachedoctor", "scan", "--format", "json", "--isolated",
               "--fail-on", "never", "-j", "1", str(demo)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    expected = fresh(demo)
    for stdout, _ in outputs:
        assert json.loads(stdout)["summary"]["findings"] == expected.counts
    with sqlite3.connect(demo / ".cachedoctor" / index.NAME) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT count(*) FROM scans").fetchone() == (2,)
    after = scan(demo)
    assert same(after, expected) and after.index["reused"] == recordable(demo), \
        (after.index, [run[1] for run in outputs])


def test_a_cache_that_cannot_hold_the_index_uses_the_user_dir(demo: Path, tmp_path: Path,
                                                               monkeypatch) -> None:
    (demo / ".cachedoctor").write_text("not a directory\n")  # .cachedoctor/ cannot be made
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(tmp_path / "state"))
    first = scan(demo)
    again = scan(demo)
    assert same(first, again, fresh(demo))
    assert again.index["reused"] == recordable(demo)
    assert again.index["location"].startswith(str(tmp_path / "state" / "index"))
    # and with no writable place at all, the scan runs without one
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(demo / ".cachedoctor" / "state"))
    bare = scan(demo)
    assert same(bare, fresh(demo)) and bare.index["reused"] == 0
    assert any("no writable place" in n for n in bare.index["notices"])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes read-only dirs")
def test_a_read_only_cache_works(demo: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(tmp_path / "state"))
    dirs = [demo, *[p for p in demo.rglob("*") if p.is_dir()]]
    for d in dirs:
        d.chmod(0o555)
    try:
        first, again = scan(demo), scan(demo)
    finally:
        for d in dirs:
            d.chmod(0o755)
    assert same(first, again, fresh(demo))
    assert not (demo / ".cachedoctor").exists()
    assert again.index["reused"] == recordable(demo)


def test_a_symlinked_state_dir_is_not_followed(demo: Path, tmp_path: Path, monkeypatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (demo / ".cachedoctor").symlink_to(elsewhere)
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(tmp_path / "state"))
    assert same(scan(demo, rebuild_index=True), fresh(demo))
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("stranger", ["world-writable", "group-writable", "another user's"])
def test_an_index_another_user_can_write_is_not_trusted(demo: Path, tmp_path: Path, monkeypatch,
                                                         stranger: str) -> None:
    """A rescan takes the index's verdicts on trust: an index someone else can write could call a
    hostile file clean, so it is left alone (never read, never written) and the user's own place
    is used."""
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(tmp_path / "state"))
    scan(demo)
    theirs = demo / ".cachedoctor" / index.NAME
    if stranger == "world-writable":
        theirs.chmod(0o666)
    elif stranger == "group-writable":
        theirs.chmod(0o660)
    elif os.geteuid() == 0:
        os.chown(theirs, 12345, 12345)
    else:
        pytest.skip("only root can give a file to another user")
    before = theirs.read_bytes()
    first, again = scan(demo), scan(demo)
    assert first.index["reused"] == 0 and again.index["reused"] == recordable(demo)
    assert again.index["location"].startswith(str(tmp_path / "state" / "index"))
    assert same(first, again, fresh(demo))
    assert theirs.read_bytes() == before


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
def test_the_index_is_made_private_under_a_sharing_umask(demo: Path) -> None:
    """Under umask 002 (shared machines) SQLite would make the index and its WAL writable by
    the group, whose members could forge verdicts; it is made 0600 instead, and is used."""
    old = os.umask(0o002)
    try:
        first = scan(demo)
        db = sqlite3.connect(demo / ".cachedoctor" / index.NAME)  # (holds the WAL open)
        db.execute("PRAGMA journal_mode = WAL").fetchone()
        db.execute("SELECT count(*) FROM meta").fetchone()
        made = [p for p in (demo / ".cachedoctor").iterdir() if p.name.startswith(index.NAME)]
        modes = {p.name: p.stat().st_mode & 0o777 for p in made}
        db.close()
        again = scan(demo)
    finally:
        os.umask(old)
    assert modes and all(mode == 0o600 for mode in modes.values()), modes
    assert again.index["reused"] == recordable(demo) and same(first, again, fresh(demo))


def test_no_index_and_rebuild_index(demo: Path) -> None:
    fresh(demo)
    assert not (demo / ".cachedoctor").exists()
    scan(demo)
    rebuilt = scan(demo, rebuild_index=True)
    assert rebuilt.index["reused"] == 0 and same(rebuilt, fresh(demo))
    assert scan(demo).index["reused"] == recordable(demo)


def test_changed_since_judges_changed_files_and_every_dataset(demo: Path) -> None:
    first = scan(demo)
    _truncate(demo / "latent_000.pt")
    _add(demo / "latent_000.pt")
    since = scan(demo, changed_since=first.index["scan"])
    changed = {str(demo / "latent_000.pt"), str(demo / "retained_batch_copy.pt")}
    full = fresh(demo)
    file_codes = {"CD101", "CD102", "CD104", "CD105", "CD107", "CD201", "CD501"}
    assert {f.path for f in since.findings if f.code in file_codes} == changed
    # the dataset rules saw every file: CD502 (devices mixed across files) is found as before
    assert [f for f in since.findings if f.code not in file_codes] == \
        [f for f in full.findings if f.code not in file_codes] != []
    assert since.index["judged"] == 2 and since.index["reused"] == recordable(demo) - 2
    assert since.files == full.files
    # a time works as a run does; one in the future judges nothing, one long ago everything
    assert scan(demo, changed_since=str(time.time() + HOUR)).index["judged"] == 0
    assert same(scan(demo, changed_since="2001-01-01T00:00:00Z"), full)


def test_changed_since_a_repair_run(demo: Path) -> None:
    from cachedoctor.repair.journal import Journal

    with Journal.open(str(demo)) as journal:
        journal.begin_run("run-1", [], "fix")
    _truncate(demo / "latent_000.pt")
    report = scan(demo, changed_since="run-1")
    assert report.index["judged"] == 1
    with pytest.raises(ConfigError, match="changed-since 'nothing-like-it'"):
        scan(demo, changed_since="nothing-like-it")


@pytest.mark.parametrize("value", ["inf", "1e400", "9" * 400, "0001-01-01T00:00:00+14:00"])
def test_a_time_out_of_range_is_a_config_error(value: str, demo: Path) -> None:
    """Seconds past a float, or an ISO time before year 1 in UTC: OverflowError and
    ValueError escaped since_ns (an internal error from the CLI)."""
    with pytest.raises(ConfigError, match="changed-since"):
        scan(demo, changed_since=value)


def test_the_fixture_corpus_scans_the_same_with_the_index(tmp_path: Path) -> None:
    from cachedoctor.fixtures import corpus

    for name in corpus.BUILDERS:
        tree = corpus.build(name, tmp_path / name)
        dataset, codes = next(iter(tree.plantable.items()))
        planted = corpus.build(name, tmp_path / f"{name}-planted", plant=(dataset, codes[0]))
        for root in (tree.root, planted.root):
            _age(root)
            before = fresh(root)
            assert same(before, scan(root)), name
            again = scan(root)
            assert same(again, before), name
            assert again.index["reused"] > 0, name


def test_the_command_line_flags(demo: Path) -> None:
    from conftest import invoke

    args = ("scan", "--isolated", "--fail-on", "never", "-j", "1", "--format", "json", str(demo))
    plain = invoke(*args, "--no-index")
    assert plain.exit_code == 0 and not (demo / ".cachedoctor").exists()
    first = invoke(*args)
    assert "index:" not in first.stderr  # nothing reused yet: nothing to say
    again = invoke(*args)
    assert f"index: 3 files read, {recordable(demo):,} reused" in again.stderr  # tmp, png, txt
    def found(result) -> list:  # (a temp file's age ticks between scans)
        return [(f["code"], f["path"], f["message"]) for f in json.loads(result.stdout)["findings"]]

    assert found(again) == found(plain)
    rebuilt = invoke(*args, "--rebuild-index")
    assert "reused" not in rebuilt.stderr
    since = invoke(*args, "--changed-since", str(time.time() + HOUR))
    assert "judged the 0 changed since" in since.stderr
    bad = invoke(*args, "--changed-since", "yesterday-ish")
    assert bad.exit_code == 2 and "--changed-since 'yesterday-ish'" in bad.stderr


def test_the_api_takes_the_index_options(demo: Path) -> None:
    import cachedoctor

    assert cachedoctor.scan(demo, isolated=True, index=False).index == {}
    cachedoctor.scan(demo, isolated=True, jobs=1)
    assert cachedoctor.scan(demo, isolated=True, jobs=1).index["reused"] == recordable(demo)
    report = cachedoctor.scan(demo, isolated=True, jobs=1, changed_since=time.time() + HOUR)
    assert report.index["judged"] == 0


def test_a_big_directory_is_looked_up_by_name(demo: Path, monkeypatch) -> None:
    monkeypatch.setattr(index, "WHOLE_DIR", 1)  # every batch asks for its names
    scan(demo)
    _truncate(demo / "latent_000.pt")
    again = scan(demo)
    assert same(again, fresh(demo)) and again.index["reused"] == recordable(demo) - 1


def test_a_report_with_index_figures_pickles(demo: Path) -> None:
    import pickle

    report = scan(demo)
    assert pickle.loads(pickle.dumps(report)).index == report.index


def test_the_start_of_a_scan_is_read_from_the_clock_that_stamps_files(tmp_path: Path) -> None:
    """--changed-since RUN compares stamps with the run's start: a file changed just after it
    must never look older. time.time_ns() fails this (the kernel stamps with a coarser clock,
    up to a tick behind): the cause of a flaky test_changed_since_... in full-suite runs."""
    probe = tmp_path / index.NAME
    probe.write_bytes(b"")
    for i in range(200):
        for start in (index.fs_now(str(probe)), index.fs_now(None)):
            path = tmp_path / f"changed-{i}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # no fstat: a coarse stamp
            os.write(fd, b"x")
            os.close(fd)
            st = path.stat()
            assert max(st.st_mtime_ns, st.st_ctime_ns) >= start
            path.unlink()


def _latents(root: Path, folders: int = 3, per: int = 20) -> Path:
    """A bare cache of clean latents (what the per-directory fast path is for); the last
    folder's last two latents of another shape, so that the dataset rules find something."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        from index_rescan import latent_bytes
    finally:
        sys.path.pop(0)
    import struct

    blob = latent_bytes()
    header = json.dumps({"latents": {"dtype": "F16", "shape": [4, 16, 16],
                                     "data_offsets": [0, 4 * 16 * 16 * 2]}}).encode()
    header += b" " * (-len(header) % 8)
    other = struct.pack("<Q", len(header)) + header + bytes(4 * 16 * 16 * 2)
    for f in range(folders):
        (root / "latents" / f"{f:02d}").mkdir(parents=True)
        for i in range(per):
            odd = f == folders - 1 and i >= per - 2
            (root / "latents" / f"{f:02d}" / f"img_{f}_{i:03d}.safetensors").write_bytes(
                other if odd else blob)
    _age(root)
    return root


def _counts(root: Path) -> tuple[int, int]:
    with sqlite3.connect(root / ".cachedoctor" / index.NAME) as db:
        return (db.execute("SELECT count(*) FROM dirs").fetchone()[0],
                db.execute("SELECT count(*) FROM files").fetchone()[0])


@pytest.mark.parametrize("change", [None, _touch, _same_size_new_inode, _truncate, "add", "delete"])
def test_a_directory_of_clean_files_is_one_row_and_any_change_is_read_again(
        tmp_path: Path, change) -> None:
    root = _latents(tmp_path / "cache")
    first = scan(root)
    assert _counts(root) == (3, 0)  # one row per directory, no row per file
    target = root / "latents" / "01" / "img_1_005.safetensors"
    _apply(change, target, target.with_name("img_1_999.safetensors"))
    after = _rescanned(root, first, change, 60)
    if change is _truncate:
        assert any(f.code == "CD101" and f.path == str(target) for f in after.findings)


def _apply(change, target: Path, new: Path) -> None:
    """`change` (a function of the file, "add" a copy as `new`, "delete", None) to `target`."""
    if change == "add":
        shutil.copy2(target, new)
    elif change == "delete":
        target.unlink()
    elif change is not None:
        change(target)


def _rescanned(root: Path, first: engine.Report, change, total: int) -> engine.Report:
    """The rescan after `change`: what a fresh scan finds, having read the changed or new file
    only; the scan after it reads nothing more (but a file with a finding: a file modified in
    the last RACY_NS is not recorded either)."""
    after = scan(root)
    assert same(after, fresh(root))
    if change is None:
        assert same(after, first) and after.index["reused"] == total
    elif change == "delete":
        assert after.index["reused"] == total - 1 and after.index["read"] == 0
    else:  # the changed or new file is read again, the others reused
        assert after.index["read"] == 1 and after.files == after.index["reused"] + 1
    again = scan(root)
    assert same(again, after) and again.index["read"] == (change is _truncate)
    return after


@pytest.mark.parametrize("change", [None, _touch, _same_size_new_inode, _truncate, "add", "delete"])
def test_a_big_directory_is_a_row_per_batch_and_any_change_is_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change) -> None:
    """A flat cache of many files (a kohya or SimpleTuner cache dir) comes in many batches:
    each is one `dirs` row, and a change reads the changed file only, not its batch nor the
    batches after it."""
    monkeypatch.setattr(engine, "BATCH", 64)  # (batches of 64 to 256 names: 600 files, ~6)
    root = _latents(tmp_path / "cache", folders=1, per=600)
    folder = root / "latents" / "00"
    first = scan(root)
    chunks = _counts(root)[0]
    assert chunks > 3 and _counts(root) == (chunks, 0)
    target = folder / "img_0_300.safetensors"
    # a new name that does not end a batch (one that does splits its batch in two: the new
    # half has no row, and its files are read again)
    name = next(n for n in (f"new_{i}.safetensors" for i in range(100))
                if zlib.crc32(n.encode()) % 32)
    _apply(change, target, folder / name)
    after = _rescanned(root, first, change, 600)
    if change is not _truncate:  # (file by file once, then its batch's row is made anew)
        assert scan(root).index["reused"] == after.files and _counts(root)[1] == 0


def test_a_changed_directory_gets_its_fast_row_back(tmp_path: Path) -> None:
    root = _latents(tmp_path / "cache")
    scan(root)
    _touch(root / "latents" / "00" / "img_0_003.safetensors")
    assert scan(root).index["read"] == 1
    assert _counts(root) == (3, 1)  # the file read again has a row of its own
    assert scan(root).index["reused"] == 60  # file by file: the directory's row is made anew
    assert _counts(root) == (3, 0)


def test_a_tampered_directory_row_is_read_file_by_file_or_again(tmp_path: Path) -> None:
    root = _latents(tmp_path / "cache")
    expected = fresh(root)
    scan(root)
    with sqlite3.connect(root / ".cachedoctor" / index.NAME) as db:
        db.execute("UPDATE dirs SET summaries = '[[1, \"x\"]]', coverage = '[1]', fp = x'00'")
    assert same(scan(root), expected)
    with sqlite3.connect(root / ".cachedoctor" / index.NAME) as db:
        db.execute("UPDATE dirs SET summaries = '[[[1], 20], [1, 1000000000000]]', fp = x'00'")
    assert same(scan(root), expected)
    with sqlite3.connect(root / ".cachedoctor" / index.NAME) as db:
        db.execute("UPDATE dirs SET detail = 'cos\\nsystem\\n', fp = x'00'")
    tampered = scan(root)
    assert same(tampered, expected) and tampered.index["reused"] == 0
    # a deflate bomb for a detail: inflated no further than the row's file count allows
    scan(root)
    bomb = zlib.compress(bytes(64 << 20), 9)
    with sqlite3.connect(root / ".cachedoctor" / index.NAME) as db:
        db.execute("UPDATE dirs SET detail = ?, fp = x'00'", (bomb,))
        folder = db.execute("SELECT key, dir, scope, fp, files, bytes, summaries, coverage, "
                            "detail FROM dirs").fetchone()
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            index._folder_rows(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # (inflated whole: 64 MiB)
    bombed = scan(root)
    assert same(bombed, expected) and bombed.index["reused"] == 0


def test_changed_since_in_a_directory_of_clean_files(tmp_path: Path) -> None:
    root = _latents(tmp_path / "cache")
    first = scan(root)
    _truncate(root / "latents" / "02" / "img_2_000.safetensors")
    since = scan(root, changed_since=first.index["scan"])
    assert since.index["judged"] == 1
    assert {f.path for f in since.findings if f.code == "CD101"} == \
        {str(root / "latents" / "02" / "img_2_000.safetensors")}


def test_the_start_of_a_repair_run_is_read_from_the_clock_that_stamps_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--changed-since RUN for a `fix` run: a file the run changes just after it began must
    never look older than the run. Its start was once time.time(), which runs up to a tick
    ahead of the stamps the kernel gives files: here it runs 20 ms ahead, as on a machine
    whose journal commits faster than a tick (it failed so)."""
    from cachedoctor.repair import journal as journal_module
    from cachedoctor.repair.journal import Journal

    real = time.time
    monkeypatch.setattr(journal_module.time, "time", lambda: real() + 0.02)
    with Journal.open(str(tmp_path)) as journal:
        for i in range(100):
            journal.begin_run(f"run-{i}", [], "fix")
            path = tmp_path / f"changed-{i}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # no fstat: a coarse stamp
            os.write(fd, b"x")
            os.close(fd)
            st = path.stat()
            assert max(st.st_mtime_ns, st.st_ctime_ns) >= index.since_ns(f"run-{i}", None, [str(tmp_path)])
            path.unlink()


def test_diffusion_pipe_shards_are_judged_every_time(tmp_path: Path) -> None:
    """A shard's verdict depends on metadata.db (its offsets): neither is recorded, so a
    metadata.db rewritten under unchanged shards is judged again."""
    from cachedoctor.fixtures.projects import diffusion_pipe as dp

    cache = dp.cache_of(dp.build(tmp_path))
    _age(cache)
    first = scan(cache)
    assert not any(f.severity >= Severity.WARNING for f in first.findings)
    with sqlite3.connect(cache / ".cachedoctor" / index.NAME) as db:
        names = [n.decode() for (n,) in db.execute("SELECT name FROM files")]
        for row in db.execute("SELECT * FROM dirs"):
            names += [r[1].decode() for r in index._folder_rows(row)]
    assert not [n for n in names if n.startswith("shard_") or n == "metadata.db"]
    for db_file in cache.rglob("metadata.db"):
        db_file.write_bytes(b"not a database" * 100)
    after = scan(cache)
    assert same(after, fresh(cache)) and any(f.severity >= Severity.WARNING for f in after.findings)


def test_a_big_directory_scanned_with_other_options_in_turn(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Scans of one index with --exclude, as ranks of a sharded preflight and plain, in turn:
    each finds what a scan without the index finds with the same options (an excluded name
    leaves its batch without a row; each rank keeps rows of its own), and the plain rescan at
    the end reads nothing."""
    monkeypatch.setattr(engine, "BATCH", 64)
    root = _latents(tmp_path / "cache", folders=1, per=600)
    runs = [{}, {"exclude": ("*img_0_3*",)}, {"shard": (0, 2)}, {"shard": (1, 2)}, {},
            {"shard": (0, 2)}, {"exclude": ("*img_0_3*",)}]
    for changes in runs:
        report = scan(root, **changes)
        assert same(report, fresh(root, **changes)), changes
    # (a sharded rank's file findings are its own files'; dataset rules see every rank's)
    assert scan(root, shard=(0, 2)).index["read"] == 0
    last = scan(root)
    assert last.index["read"] == 0 and last.index["reused"] == 600 and same(last, fresh(root))


def test_a_latent_whose_facts_come_from_its_image_is_judged_every_time(tmp_path: Path) -> None:
    """kohya's legacy `<stem>.npz` names no size: its bucket is its image's, read from the
    image's header. An image replaced by one of another bucket (its npz untouched) makes the
    npz a CD302; the rescan reused the npz's summary, with the old image's bucket, and found
    nothing."""
    import numpy as np
    from PIL import Image

    from cachedoctor.fixtures.clean import kohya_arrays
    from cachedoctor.fixtures.projects import age_all, encode, kohya

    built = kohya.build(tmp_path / "k")
    folder = built.root / "train" / kohya.DATASET
    for new in folder.glob("*_sdxl.npz"):
        new.unlink()
    for seed, image in enumerate(sorted(folder.glob("*.png"))):
        width, height = Image.open(image).size
        np.savez(folder / f"{image.stem}.npz",
                 **kohya_arrays(encode(image, width, height, seed, dtype="float32")))
    age_all(built.root)
    first = scan(built.config)
    assert not [f for f in first.findings if f.severity >= Severity.WARNING]
    image = folder / "img_000.png"
    before = image.stat()
    size = (320, 192) if Image.open(image).size != (320, 192) else (256, 256)
    Image.new("RGB", size).save(image)  # another bucket, and the image as old as it was
    os.utime(image, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = scan(built.config)
    assert same(after, fresh(built.config))
    assert [Path(f.path).name for f in after.findings if f.code == "CD302"] == ["img_000.npz"]


def test_an_ai_toolkit_cache_whose_images_are_gone_scans_as_a_fresh_scan(tmp_path: Path) -> None:
    """Scanned bare, an ai-toolkit `_latent_cache` keys its entries to images only while its
    image folder holds any (a cache copied away from its images is judged file by file). The
    images deleted, the rescan reused the entries' keys and called every one an orphan (CD405),
    where a fresh scan finds nothing."""
    from cachedoctor.fixtures.projects import aitoolkit

    folder = aitoolkit.build(tmp_path / "a").root / "datasets" / aitoolkit.DATASET
    scan(folder)
    for path in [*folder.glob("*.png"), *folder.glob("*.txt")]:
        path.unlink()
    after = scan(folder)
    assert same(after, fresh(folder))
    assert not [f for f in after.findings if f.code == "CD405"]
