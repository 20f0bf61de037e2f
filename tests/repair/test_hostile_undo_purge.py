"""Between a fix and its undo, someone with write access to the cache swaps what the quarantine
holds: a quarantined original becomes a symlink to a file outside the cache, or a FIFO. Undo
must not put such a thing back in the cache as if it were the original, must not read through
it, and must not block on it. (Journal rows and run ids forged to lead out of the cache:
test_audit_hostile_state.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from repair_helpers import isolated_state, kept_copy  # noqa: F401

from cachedoctor.fixtures import clean, truncated_archive

from conftest import run_cli


def _fixed(cache: Path) -> tuple[str, Path]:
    clean.build(cache, n=2)
    [torn] = truncated_archive.build(cache)
    result = run_cli("fix", str(cache), "--yes")
    assert result.returncode == 0, result.stderr
    run_id = next(line.split()[-1] for line in result.stdout.splitlines()
                  if line.startswith("Undo with: "))
    return run_id, Path(torn)


@pytest.mark.parametrize("planted", ["symlink", "fifo", "symlink to a folder"])
def test_undo_never_puts_back_what_was_planted_in_the_quarantine(tmp_path: Path, planted: str) -> None:
    cache, victim = tmp_path / "cache", tmp_path / "victim"
    cache.mkdir()
    victim.mkdir()
    (victim / "secret.txt").write_text("outside the cache")
    run_id, torn = _fixed(cache)
    kept = kept_copy(cache, run_id, torn.relative_to(cache))
    assert kept.is_file() and not torn.exists()
    kept.unlink()
    if planted == "fifo":
        os.mkfifo(kept)
    elif planted == "symlink":
        kept.symlink_to(victim / "secret.txt")
    else:
        kept.symlink_to(victim, target_is_directory=True)

    result = run_cli("undo", run_id, "--cache", str(cache), timeout=60)

    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert "no longer a regular file" in result.stdout, result.stdout
    assert not os.path.lexists(torn)  # nothing stands in the cache in the original's place
    assert os.path.lexists(kept)  # what was planted is left where it was found
    assert (victim / "secret.txt").read_text() == "outside the cache"
    assert sorted(os.listdir(victim)) == ["secret.txt"]
