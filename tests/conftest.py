"""Shared helpers: scan a path in-process, run the real CLI in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachedoctor.engine import scan
from cachedoctor.findings import Report
from cachedoctor.options import ScanOptions

REPO = Path(__file__).resolve().parent.parent


def scan_paths(*targets: os.PathLike | str, select: tuple[str, ...] | None = None,
               extend_select: tuple[str, ...] = (), ignore: tuple[str, ...] = (),
               **options) -> Report:
    """engine.scan with these ScanOptions; `select`, `extend_select` and `ignore` become its
    enabled rules the one way every selection does (resolve_selection)."""
    options.setdefault("jobs", 1)
    if select is not None or extend_select or ignore:
        from cachedoctor.checks import RULES
        from cachedoctor.options import Selection, resolve_selection

        layer = Selection(tuple(select) if select else None, tuple(extend_select), tuple(ignore))
        options["selected"] = frozenset(resolve_selection([layer], RULES))
    return scan([str(t) for t in targets], ScanOptions(**options))


def by_code(report: Report, code: str) -> list:
    return [f for f in report.findings if f.code == code]


def codes(report: Report) -> set[str]:
    return {f.code for f in report.findings}


def run_cli(*args: str, cwd: os.PathLike | str | None = None, env: dict | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed command, as a user runs it (python -m keeps it on this interpreter)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "cachedoctor", *args], capture_output=True,
                          text=True, cwd=cwd, env=full_env, timeout=timeout)


def run_in_group(args: list[str], timeout: float, hang: str, **popen) -> tuple[str, str]:
    """`args` run in a process group of its own: (stdout, stderr) of a run that exits 0. On
    timeout the whole group (the scan's helper and workers too) is killed and the test fails,
    saying `hang` happened; a run that fails fails the test with its stderr."""
    import signal

    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, **popen)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail(f"{hang} ({timeout} s)")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 0, err
    return out, err


def invoke(*args: str):
    """The CLI in-process (much faster than run_cli): exit_code, stdout and stderr."""
    from typer.testing import CliRunner

    from cachedoctor.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(autouse=True)
def _state_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`fix` records the caches it repaired in a small index (repair/index.py) under the user's
    home; a test's index goes into pytest's temp dir instead, removed after the test. (No
    monkeypatch here: set up before a test's own, this is torn down after it, so a test's patched
    os functions are gone when rmtree runs.)"""
    state = tmp_path_factory.mktemp("state")
    before = os.environ.get("CACHEDOCTOR_STATE_DIR")
    os.environ["CACHEDOCTOR_STATE_DIR"] = str(state)
    yield
    if before is None:
        os.environ.pop("CACHEDOCTOR_STATE_DIR", None)
    else:
        os.environ["CACHEDOCTOR_STATE_DIR"] = before
    shutil.rmtree(state, ignore_errors=True)  # kept by no retention policy: nothing to look at


@pytest.fixture
def fs(fs):  # pyfakefs's `fs`, and what a scan inside it left in the process
    """A scan under pyfakefs hashes a fake file system for the index's code stamp (every source
    file missing) and functools.cache keeps it: later real scans in the same process then
    stamped their verdicts unlike the CLI's, and reused none of an index a CLI scan wrote."""
    from cachedoctor.index import code_stamp

    code_stamp.cache_clear()
    yield fs
    code_stamp.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """Fixtures encode tiny tensors: torch's thread pool (sized for every core the machine
    shows, not the ones a CI runner grants) costs far more than it saves there."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    return path
