"""A fix killed at any moment leaves every file whole; undo (or the next fix) then brings the
cache back to a consistent state, and undo to the original bytes.

Two ways in: a crash injected before every file-system operation and journal commit of a run
(and, on top, of the undo that follows), in-process and exhaustively, with and without hard
links; and SIGKILL of the real CLI at random moments.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from repair_helpers import (
    MARKER,
    copy_cache,
    every_fixable_defect,
    fix_in_process,
    isolated_state,  # noqa: F401
    tree_digest,
)

from cachedoctor.fix_kinds import KINDS
from cachedoctor.fixtures import clean, device_tagged, interrupted_write, retained_batch, truncated_archive
from cachedoctor.fixtures.images import write_png
from cachedoctor.repair import build_plan, recover_caches, undo_run
from cachedoctor.repair.encoders import ReferenceEncoder
from cachedoctor.repair.journal import Journal
from cachedoctor.repair.plan import Plan, Reencode
from cachedoctor.repair.reencode import EntryFormat, ReencodeTarget
from cachedoctor.repair.undo import NothingToUndo

from conftest import scan_paths

SIGKILL_TRIALS = 30


class Crash(BaseException):
    """Stands for SIGKILL: nothing catches it (finally blocks run, as the kernel's cleanup of a
    killed process closes its files and drops its locks)."""


class Injector:
    """Counts the operations that change files or the journal, and crashes before the n-th."""

    FILE_OPS = ("rename", "replace", "link", "unlink", "fsync", "mkdir")
    JOURNAL_OPS = ("update", "begin_run", "set_run_state")

    def __init__(self, crash_at: int | None = None, links: bool = True) -> None:
        self.crash_at = crash_at
        self.links = links
        self.count = 0

    def tick(self) -> None:
        self.count += 1
        if self.count == self.crash_at:
            raise Crash(self.count)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with pytest.MonkeyPatch.context() as mp:
            for name in self.FILE_OPS:
                mp.setattr(os, name, self._file_op(getattr(os, name), name))
            real_write = os.write

            def write(fd: int, data: bytes) -> int:  # a crash mid-write leaves half the bytes
                self.count += 1
                if self.count == self.crash_at:
                    real_write(fd, bytes(data[: len(data) // 2]))
                    raise Crash(self.count)
                return real_write(fd, data)

            mp.setattr(os, "write", write)
            for name in self.JOURNAL_OPS:
                mp.setattr(Journal, name, self._journal_op(getattr(Journal, name)))
            yield

    def _file_op(self, real, name: str):
        def op(*args, **kwargs):
            self.tick()
            if not self.links and name == "link":
                raise OSError(errno.EPERM, "no hard links here")
            if not self.links and name in ("rename", "replace") and \
                    os.path.dirname(os.path.abspath(args[0])) != os.path.dirname(os.path.abspath(args[1])):
                raise OSError(errno.EXDEV, "cross-device link")
            return real(*args, **kwargs)

        return op

    def _journal_op(self, real):
        def op(*args, **kwargs):
            self.tick()
            return real(*args, **kwargs)

        return op


def small_cache(root: Path, images: Path) -> tuple[Path, dict[str, str], list[ReencodeTarget]]:
    """One file for each action (reencode twice: a quarantined entry and a missing one)."""
    clean.build(root, n=2, container="gzip")
    truncated_archive.build(root, how="gzip")
    interrupted_write.build(root)
    retained_batch.build(root, container="gzip", rows=[1], seed=1)
    device_tagged.build(root / "bucket", seed=2)
    images.mkdir()
    first = write_png(images / "first.png", 512, 512, seed=(0, 5))
    second = write_png(images / "second.png", 512, 512, seed=(0, 6))
    missing = ReencodeTarget(str(second), str(root / "missing.pt"), EntryFormat("gzip", None, "float16", 4))
    return root, {"truncated_archive.pt": str(first)}, [missing]


def plan_for(cache: Path, sources: dict[str, str], targets: list[ReencodeTarget], template: Path) -> Plan:
    """The plan for a copy of the template (the sources and targets re-rooted onto the copy)."""
    moved = [ReencodeTarget(t.image, t.path.replace(str(template), str(cache)), t.format) for t in targets]
    reencode = Reencode(ReferenceEncoder(), {str(cache / k): v for k, v in sources.items()}, tuple(moved))
    recover_caches([str(cache)])  # as `fix` does before it scans
    return build_plan(scan_paths(cache), [str(cache)], reencode)


def undo_everything(cache: Path) -> None:
    """Undo every run not undone yet, latest first."""
    while True:
        try:
            undo_run(None, [str(cache)])
        except NothingToUndo:
            return


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "copies"])
def test_a_crash_before_any_operation_is_undone_byte_for_byte(tmp_path: Path, links: bool) -> None:
    template, sources, targets = small_cache(tmp_path / "template", tmp_path / "images")
    original = tree_digest(template)
    probe = copy_cache(template, tmp_path / "probe")
    plan = plan_for(probe, sources, targets, template)
    counter = Injector(links=links)
    with counter.installed():
        result = plan.execute()
    assert {o.action.kind for o in result.outcomes} == set(KINDS) and not result.failed
    assert not scan_paths(probe).findings
    rng = random.Random(0)
    for n in range(1, counter.count + 1):
        cache = copy_cache(template, tmp_path / f"crash{n}")
        plan = plan_for(cache, sources, targets, template)
        with Injector(n, links).installed(), pytest.raises(Crash):
            plan.execute()
        if n % 5 == 0:  # the next fix finishes the repair
            result = plan_for(cache, sources, targets, template).execute()
            assert not result.failed, (n, result.failed)
            assert not scan_paths(cache).findings, n
        elif n % 5 == 1:  # and the undo itself is killed, then run again
            undo_probe = Injector(links=links)
            scratch = copy_cache(cache, tmp_path / f"scratch{n}")
            with undo_probe.installed(), contextlib.suppress(NothingToUndo):
                undo_run(None, [str(scratch)])
            if undo_probe.count:
                with Injector(rng.randint(1, undo_probe.count), links).installed(), \
                        pytest.raises((Crash, NothingToUndo)):
                    undo_run(None, [str(cache)])
        undo_everything(cache)
        assert tree_digest(cache) == original, f"crash before operation {n}"
        assert not list(cache.rglob(".cachedoctor-*")), f"temp files left after operation {n}"


def test_sigkill_at_random_moments_then_undo_or_fix(tmp_path: Path) -> None:
    template = every_fixable_defect(tmp_path / "template", tmp_path / MARKER)
    original = tree_digest(template)
    env = dict(os.environ)  # with isolated_state's CACHEDOCTOR_STATE_DIR
    command = [sys.executable, "-m", "cachedoctor", "fix", "--yes", "--deep", "-j", "1"]

    calibration = copy_cache(template, tmp_path / "calibration")
    began = time.monotonic()
    with subprocess.Popen([*command, str(calibration)], stdout=subprocess.PIPE, text=True, env=env) as proc:
        _wait_for(proc, "Applying run")
        applying = time.monotonic()
        _wait_for(proc, "Run ")  # the result: every action applied (what follows is exit)
        window = time.monotonic() - applying
        assert proc.wait(timeout=120) == 0
    startup = applying - began
    assert not scan_paths(calibration, deep=True).findings

    seed = random.randrange(2**32)
    rng = random.Random(seed)

    def trial(i: int) -> str:
        cache = copy_cache(template, tmp_path / f"kill{i}")
        with subprocess.Popen([*command, str(cache)], stdout=subprocess.PIPE, text=True, env=env) as proc:
            if i % 8 == 7:  # during start-up or the scan: nothing changed yet
                time.sleep(rng.uniform(0, startup))
            else:
                _wait_for(proc, "Applying run")
                time.sleep(rng.uniform(0, window))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        state = _progress(cache)
        now = tree_digest(cache)
        for finding in scan_paths(cache, deep=True).findings:  # every file old or new, never half
            rel = os.path.relpath(finding.path, cache)
            assert os.path.basename(rel).startswith(".cachedoctor-") or now.get(rel) == original.get(rel), \
                f"trial {i} (seed {seed}), killed at {state}: {rel} is half-written: {finding.message}"
        if i % 6 == 5:  # the next fix finishes the repair (in-process: the same code, no start-up)
            _, again = fix_in_process(cache)
            assert not again.failed, (seed, i, again.failed)
            assert not scan_paths(cache, deep=True).findings, (seed, i)
        undo_everything(cache)
        assert tree_digest(cache) == original, f"trial {i} (seed {seed}), killed at {state}"
        assert not list(cache.rglob(".cachedoctor-*")), (seed, i)
        return state

    with ThreadPoolExecutor(2) as pool:
        states = list(pool.map(trial, range(SIGKILL_TRIALS)))
    assert not (tmp_path / MARKER).exists()
    assert len(set(states)) >= 3, f"the kills hit too few distinct moments: {states}"


def _wait_for(proc: subprocess.Popen, start: str) -> None:
    """Read the fix's output up to a line that starts with `start` ("Applying run": the run is
    journaled and about to change its first file)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(start):
            return
    raise AssertionError(f"fix ended before it printed {start!r}")


def _progress(cache: Path) -> str:
    """How far the killed run got: its actions' states, as the journal has them."""
    if not (cache / ".cachedoctor" / "journal.sqlite").exists():
        return "no journal"
    with Journal.open(str(cache)) as journal:
        runs = journal.runs()
        if not runs:
            return "no run"
        states = [a.state for a in journal.actions(runs[-1].run_id)]
    return ",".join(f"{s}:{states.count(s)}" for s in sorted(set(states)))
