"""A scan's worker pool started from a process that runs other threads (a training script with
torch.distributed, a logging thread, wandb's): fork would copy a lock another thread holds,
held, into every worker, and the pre-flight would hang forever; forkserver or spawn would run
the training script's top level again in every worker. Each scenario runs in its own process
group under a timeout, so a regression fails the test instead of hanging CI."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cachedoctor import engine
from cachedoctor.layouts import resolve
from cachedoctor.options import ScanOptions
from fixtures import BUILDERS, clean

from conftest import run_in_group

FORK = "fork" in multiprocessing.get_all_start_methods()
TIMEOUT = 60  # a pooled scan of 14 files takes a few seconds; a deadlocked one, forever

# The script's top level is a library the workers use: its reads take a module-level lock (as a
# C library's global lock, or a handler's lock, would). A worker forked while another thread of
# the scanning process holds it waits for it forever. (A helper's workers never import the
# script; spawned ones import it again, with a lock of their own.)
SCRIPT = textwrap.dedent("""
    import json
    import multiprocessing
    import os
    import signal
    import sys
    import threading

    from cachedoctor import engine
    from cachedoctor.options import ScanOptions

    LOCK = threading.Lock()
    _read = engine.read_entry
    if os.environ.get("POOL_START"):
        engine.pool_start = lambda: os.environ["POOL_START"]

    def read_entry(entry, *rest):
        if (os.path.basename(entry.path) == os.environ.get("KILL_ON")
                and multiprocessing.parent_process() is not None):
            os.kill(os.getpid(), signal.SIGKILL)  # a worker killed on one file
        with LOCK:
            return _read(entry, *rest)

    engine.read_entry = read_entry

    def findings(report):
        return sorted((f.code, f.path, f.message) for f in report.findings)

    if __name__ == "__main__":
        cache = sys.argv[1]
        engine.BATCH = 2  # 7 batches: more than IN_PROCESS_BATCHES, so the scan starts a pool
        held, release = threading.Event(), threading.Event()

        def hold():
            with LOCK:
                held.set()
                release.wait()

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        held.wait()
        method = engine.pool_start()
        pooled = engine.scan([cache], ScanOptions(jobs=2, index=False, keep_paths=True))
        release.set()
        holder.join()
        alone = engine.scan([cache], ScanOptions(jobs=1, index=False, keep_paths=True))
        print(json.dumps({"method": method, "pooled": findings(pooled),
                          "alone": findings(alone), "files": [pooled.files, alone.files],
                          "checked": [len(pooled.checked), len(alone.checked)]}))
""")


def _cache(tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    clean.build(cache, n=12)
    BUILDERS["CD102"](cache)  # an empty file: a finding both scans must make
    return cache


def _run(tmp_path: Path, cache: Path, source: str = SCRIPT, **env: str) -> dict:
    """The script run in a process group of its own; on timeout the whole group (its workers
    and helper too) is killed and the test fails."""
    script = tmp_path / "threaded_launch.py"
    script.write_text(source)
    out, err = run_in_group([sys.executable, str(script), str(cache)], TIMEOUT,
                            "a pooled scan started beside a thread holding a lock hung",
                            cwd=tmp_path, env={**os.environ, **env})
    return {**json.loads(out.splitlines()[-1]), "stdout": out, "stderr": err}


def test_a_scan_beside_a_thread_holding_a_lock_finishes_with_the_same_findings(
        tmp_path: Path) -> None:
    result = _run(tmp_path, _cache(tmp_path))
    assert result["method"] == "helper"
    assert result["pooled"] == result["alone"]
    assert any(code == "CD102" for code, _, _ in result["pooled"])
    assert result["files"] == [13, 13] and result["checked"] == [13, 13]


def test_spawned_workers_beside_a_thread_finish_and_one_killed_costs_only_its_file(
        tmp_path: Path) -> None:
    """Where there is no fork (Windows) the workers are spawned: they unpickle what they are
    given, and the files of a broken pool are read again one at a time (_isolated) in children
    spawned too, each given its end of a pipe."""
    result = _run(tmp_path, _cache(tmp_path), KILL_ON="latent_007.pt", POOL_START="spawn")
    assert result["method"] == "spawn"
    killed = [(code, path) for code, path, _ in result["pooled"] if code == "CD002"]
    assert killed == [("CD002", str(tmp_path / "cache" / "latent_007.pt"))]
    assert [f for f in result["pooled"] if f[0] != "CD002"] == result["alone"]
    assert result["files"] == [13, 13] and result["checked"] == [13, 13]


# A training script with no main guard, a thread of which holds a lock its readers take:
# forked workers would wait for the lock forever; workers of forkserver or spawn would run all
# of it again (its training too).
UNGUARDED = textwrap.dedent("""
    import json
    import sys
    import threading

    from cachedoctor import engine
    from cachedoctor.options import ScanOptions

    print("top level ran")
    LOCK = threading.Lock()
    _read = engine.read_entry

    def read_entry(*args):
        with LOCK:
            return _read(*args)

    engine.read_entry = read_entry
    engine.BATCH = 2
    cache = sys.argv[1]
    held, release = threading.Event(), threading.Event()

    def hold():
        with LOCK:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    pooled = engine.scan([cache], ScanOptions(jobs=2, index=False))
    release.set()
    holder.join()
    alone = engine.scan([cache], ScanOptions(jobs=1, index=False))
    print(json.dumps({"pooled": sorted(map(repr, pooled.findings)),
                      "alone": sorted(map(repr, alone.findings)),
                      "files": [pooled.files, alone.files]}))
""")


def test_an_unguarded_script_holding_a_lock_is_never_run_again(tmp_path: Path) -> None:
    result = _run(tmp_path, _cache(tmp_path), UNGUARDED)
    assert result["stdout"].count("top level ran") == 1
    assert result["pooled"] == result["alone"] and result["files"] == [13, 13]
    assert "Warning" not in result["stderr"]


# A guarded script whose top level fails in any other process: spawned workers, which import
# it again, never start, which is no file's fault.
NO_WORKERS = textwrap.dedent("""
    import json
    import os
    import sys
    import threading

    from cachedoctor import engine
    from cachedoctor.options import ScanOptions

    engine.pool_start = lambda: "spawn"
    if os.environ.get("SCAN_PROCESS") not in (None, str(os.getpid())):
        raise RuntimeError("not in this process")

    if __name__ == "__main__":
        os.environ["SCAN_PROCESS"] = str(os.getpid())
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        engine.BATCH = 2
        cache = sys.argv[1]
        pooled = engine.scan([cache], ScanOptions(jobs=2, index=False, keep_paths=True))
        stop.set()
        alone = engine.scan([cache], ScanOptions(jobs=1, index=False, keep_paths=True))
        print(json.dumps({"pooled": sorted(map(repr, pooled.findings)),
                          "alone": sorted(map(repr, alone.findings)),
                          "files": [pooled.files, alone.files],
                          "checked": [len(pooled.checked), len(alone.checked)]}))
""")


def test_workers_that_cannot_start_leave_the_files_to_this_process(tmp_path: Path) -> None:
    result = _run(tmp_path, _cache(tmp_path), NO_WORKERS)
    assert result["pooled"] == result["alone"] and not any("CD002" in f for f in result["pooled"])
    assert result["files"] == [13, 13] and result["checked"] == [13, 13]
    assert "worker processes did not start" in result["stderr"]
    assert "read in this process instead" in result["stderr"]


def _method_in_fresh_process(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=TIMEOUT, check=True).stdout
    return out.split()[-1]


@pytest.mark.skipif(not FORK, reason="no fork on this platform")
def test_the_single_threaded_command_line_forks_its_workers() -> None:
    # (a fresh process: pytest's own may run threads, numpy's OpenBLAS pool among them)
    assert _method_in_fresh_process("""
        import cachedoctor.cli
        from cachedoctor import engine
        print(engine.pool_start())
    """) == "fork"


@pytest.mark.skipif(not FORK, reason="no fork on this platform")
def test_a_python_thread_or_torch_makes_the_workers_start_afresh() -> None:
    assert _method_in_fresh_process("""
        import threading
        from cachedoctor import engine
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        print(engine.pool_start())
        stop.set()
    """) == "helper"
    pytest.importorskip("torch")
    assert _method_in_fresh_process("""
        import torch
        from cachedoctor import engine
        print(engine.pool_start())
    """) == "helper"


def test_what_a_fresh_worker_is_given_pickles(tmp_path: Path) -> None:
    """A helper's or spawned workers' options and datasets are pickled, not inherited."""
    from cachedoctor.fixtures.projects import (
        aitoolkit,
        diffusion_pipe,
        kohya,
        musubi,
        onetrainer,
        simpletuner,
    )

    options = ScanOptions(deep=True, jobs=3, selected=frozenset({"CD101"}), exclude=("*.tmp",),
                          severity={"CD101": "warning"}, settings={"CD201": {"min-ratio": 2.0}},
                          shard=(1, 4))
    assert pickle.loads(pickle.dumps(options)) == options
    for module in (aitoolkit, diffusion_pipe, kohya, musubi, onetrainer, simpletuner):
        project = module.build(tmp_path / module.__name__.rsplit(".", 1)[-1])
        datasets = engine.datasets_of(resolve((str(project.config),)))
        assert datasets and pickle.loads(pickle.dumps(datasets)) == datasets, module.__name__


# The public pre-flight in a real training process: torch imported, a gloo process group up
# (its threads), a thread holding a lock the readers take.
GLOO = SCRIPT.replace('''if __name__ == "__main__":
''', '''if __name__ == "__main__":
    import torch.distributed as dist

    import cachedoctor

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store",
                            rank=0, world_size=1)
''', 1).replace(
    '''    pooled = engine.scan([cache], ScanOptions(jobs=2, index=False, keep_paths=True))''',
    '''    pooled = cachedoctor.preflight(cache, fail_on="never", jobs=2, isolated=True, index=False)''',
    1)


def test_preflight_under_a_gloo_group_beside_a_thread_holding_a_lock(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    assert GLOO.count("cachedoctor.preflight(") == 1
    result = _run(tmp_path, _cache(tmp_path), GLOO)
    assert result["method"] == "helper"
    assert result["pooled"] == result["alone"]
    assert any(code == "CD102" for code, _, _ in result["pooled"])


# A scan stopped part-way (the consumer of check_files stops: an exception, Ctrl-C): the
# helper and its workers go too, and quickly.
STOPPED = textwrap.dedent("""
    import json
    import sys
    import threading
    import time

    import psutil

    from cachedoctor import engine
    from cachedoctor.layouts import resolve
    from cachedoctor.options import ScanOptions

    if __name__ == "__main__":
        engine.BATCH = 2
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        options = ScanOptions(jobs=2, index=False)
        layouts = resolve((sys.argv[1],))
        results = engine.check_files(engine.plan(layouts, options), options,
                                     engine.selected_rules(options), engine.datasets_of(layouts))
        next(results)
        helpers = psutil.Process().children(recursive=True)
        began = time.monotonic()
        results.close()
        gone, alive = psutil.wait_procs(helpers, timeout=20)
        print(json.dumps({"method": engine.pool_start(), "helpers": len(helpers),
                          "alive": [p.pid for p in alive], "took": time.monotonic() - began}))
""")


def test_a_stopped_scan_leaves_no_process_behind(tmp_path: Path) -> None:
    pytest.importorskip("psutil")
    result = _run(tmp_path, _cache(tmp_path), STOPPED)
    assert result["method"] == "helper"
    assert result["helpers"] >= 3  # the helper and its two workers
    assert result["alive"] == [] and result["took"] < 15, result
