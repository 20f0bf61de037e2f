"""A read that never returns (a dead NFS hard mount, a FUSE filesystem that stopped answering)
costs only its file: the worker stuck on it past STALL_SECONDS is killed, the file gets a CD002
finding, and every other file is judged as a scan without it judges them. Each scenario runs
in its own process group under a timeout, so a regression fails the test instead of hanging
CI. The workers are forked, so they inherit the stand-in reader."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures import BUILDERS, clean

from conftest import run_in_group

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="the stand-in reader reaches forked workers only")

TIMEOUT = 60  # a watched scan of 13 files takes a few seconds; an unwatched one, forever

# The stand-in reader, imported by the script and (as sitecustomize) by a helper process.
PATCH = textwrap.dedent("""
    import multiprocessing
    import os
    import time

    from cachedoctor import engine

    engine.BATCH = int(os.environ.get("BATCH", "2"))  # 2: 7 batches, more than
    # IN_PROCESS_BATCHES, so the scan starts a pool
    engine.pool_start = lambda: os.environ.get("POOL_START", "fork")
    engine.STALL_SECONDS = float(os.environ["STALL_SECONDS"])
    _read = engine.read_entry

    def read_entry(entry, *rest):
        name = os.path.basename(entry.path)
        if multiprocessing.parent_process() is not None:  # in a worker or an _isolated child
            if name == os.environ.get("STALL_ON"):
                while True:  # a read that never returns
                    time.sleep(3600)
            if name == os.environ.get("KILL_ON"):
                os._exit(3)
            time.sleep(float(os.environ.get("EACH", "0")))
        return _read(entry, *rest)

    engine.read_entry = read_entry
""")

SCRIPT = textwrap.dedent("""
    import json
    import os
    import sys
    import time

    import stall_patch  # noqa: F401
    from cachedoctor import engine
    from cachedoctor.options import ScanOptions

    def findings(report):
        return sorted((f.code, f.path, f.message) for f in report.findings)

    if __name__ == "__main__":
        cache = sys.argv[1]
        batches = [b.names for b in engine.plan(engine.resolve([cache]), ScanOptions())]
        if os.environ.get("PAIR"):  # the two files of one batch (in the walk's order): the
            # first kills its worker, the second never returns (forked children see os.environ)
            pair = next(b for b in batches if len(b) == 2 and "empty_file.pt" not in b)
            os.environ["KILL_ON"], os.environ["STALL_ON"] = pair
        began = time.monotonic()
        pooled = engine.scan([cache], ScanOptions(jobs=2, index=False, keep_paths=True))
        took = time.monotonic() - began
        skip = tuple(n for n in (os.environ.get("STALL_ON"),) if n)
        alone = engine.scan([cache], ScanOptions(jobs=1, index=False, keep_paths=True,
                                                 exclude=skip))
        print(json.dumps({"pooled": findings(pooled), "alone": findings(alone), "took": took,
                          "checked": sorted(pooled.checked), "files": pooled.files,
                          "killed": os.environ.get("KILL_ON"),
                          "stalled": os.environ.get("STALL_ON")}))
""")


def _cache(tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    clean.build(cache, n=12)
    BUILDERS["CD102"](cache)  # an empty file: a finding every scan must make
    return cache


def _run(tmp_path: Path, **env: str) -> dict:
    """The script run in a process group of its own; on timeout the whole group (its workers
    too) is killed and the test fails."""
    cache = _cache(tmp_path)
    script = tmp_path / "stalled_scan.py"
    script.write_text(SCRIPT)
    (tmp_path / "stall_patch.py").write_text(PATCH)
    out, _ = run_in_group([sys.executable, str(script), str(cache)], TIMEOUT,
                          "a scan with a read that never returns hung", cwd=tmp_path,
                          env={**os.environ, "STALL_SECONDS": "1", **env})
    return {**json.loads(out.splitlines()[-1]), "cache": cache}


def _stall_message(result: dict, name: str) -> list:
    return [(code, message) for code, path, message in result["pooled"]
            if path == str(result["cache"] / name)]


def test_a_read_that_never_returns_costs_only_its_file(tmp_path: Path) -> None:
    result = _run(tmp_path, STALL_ON="latent_005.pt")
    _assert_stalled_alone(result)


def test_a_read_that_never_returns_in_a_helpers_pool_costs_only_its_file(tmp_path: Path) -> None:
    """A threaded caller's helper process runs the pool (and so the watchdog) itself: it gets
    the stand-in reader as its sitecustomize."""
    (tmp_path / "sitecustomize.py").write_text("import stall_patch  # noqa: F401\n")
    result = _run(tmp_path, STALL_ON="latent_005.pt", POOL_START="helper",
                  PYTHONPATH=str(tmp_path))
    _assert_stalled_alone(result)


def _assert_stalled_alone(result: dict) -> None:
    assert result["took"] < 15  # the stall (1 s) and a re-read of the batches in flight
    assert _stall_message(result, "latent_005.pt") == [
        ("CD002", "reading this file did not finish within 1 s (a hung filesystem: a dead "
                  "network mount, a FUSE filesystem that stopped answering?); the worker "
                  "reading it was stopped and it was not judged")]
    others = [f for f in result["pooled"] if not f[1].endswith("latent_005.pt")]
    assert others == result["alone"]  # judged as a scan without the stalled file judges them
    assert any(code == "CD102" for code, _, _ in others)
    assert result["files"] == 13 and len(result["checked"]) == 13  # each file counted once


def test_a_read_that_never_returns_in_a_batch_read_again_file_by_file(tmp_path: Path) -> None:
    """The first file of a batch kills its worker: the batch is read again one file at a time
    (_isolated), and there the read of its second file never returns."""
    result = _run(tmp_path, PAIR="1")
    killed, stalled = result["killed"], result["stalled"]
    [(code, died)] = _stall_message(result, killed)
    assert code == "CD002" and "exited with status 3" in died
    [(code, stall)] = _stall_message(result, stalled)
    assert code == "CD002" and "did not finish within 1 s" in stall
    others = [f for f in result["pooled"] if not f[1].endswith((killed, stalled))]
    assert others == [f for f in result["alone"] if not f[1].endswith(killed)]
    assert result["files"] == 13 and len(result["checked"]) == 13


def test_a_slow_read_that_progresses_is_not_stopped(tmp_path: Path) -> None:
    # 0.4 s a file, 4 a batch: each file well within 1 s, each batch past it
    result = _run(tmp_path, EACH="0.4", BATCH="4")
    assert not [f for f in result["pooled"] if f[0] == "CD002"]
    assert result["pooled"] == result["alone"]
    assert result["files"] == 13
