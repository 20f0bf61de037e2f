"""Shared by the repair tests: a cache with every fixable defect, tree digests, a fix in-process."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from cachedoctor.fixtures import (
    bit_flip,
    clean,
    device_tagged,
    empty_file,
    interrupted_write,
    mixed_devices,
    nonfinite,
    retained_batch,
    truncated_archive,
    unsafe_pickle,
)
from cachedoctor.inventory import STATE_DIR
from cachedoctor.repair import build_plan, recover_caches
from cachedoctor.repair.caches import KEPT_SUFFIX, QUARANTINE_DIR, state_dir

from conftest import scan_paths

MARKER = "PAYLOAD-RAN"  # what the hostile fixtures would create if anything loaded them


@pytest.fixture(autouse=True)
def isolated_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep the index of fixed caches (index.py) out of the user's home."""
    home = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(home))
    return home


def tree_digest(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every file under `root`, cachedoctor's own state dir excepted."""
    out = {}
    for parent, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != STATE_DIR]
        for name in files:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def quarantine_of(root: Path, run_id: str) -> Path:
    return Path(state_dir(str(root))) / QUARANTINE_DIR / run_id


def kept_copy(root: Path, run_id: str, relpath: os.PathLike | str) -> Path:
    """Where run `run_id` keeps the original of the file at `relpath` of the cache."""
    return quarantine_of(root, run_id) / f"{relpath}{KEPT_SUFFIX}"


def kept_digest(root: Path, run_id: str) -> dict[str, str]:
    """tree_digest of the run's quarantine, by the relpath each copy was kept for."""
    return {rel.removesuffix(KEPT_SUFFIX): sha
            for rel, sha in tree_digest(quarantine_of(root, run_id)).items()}


def every_fixable_defect(root: Path, marker: Path) -> Path:
    """A small cache holding every defect `fix` repairs (clean files beside them). --deep finds
    CD103 and CD106."""
    clean.build(root, n=3, container="gzip")
    truncated_archive.build(root, seed=1)
    truncated_archive.build(root, how="legacy", seed=2, name="truncated_legacy")
    empty_file.build(root)
    bit_flip.build(root, seed=3)
    interrupted_write.build(root, seed=4)
    interrupted_write.build(root, how="lock", name="stale")
    unsafe_pickle.build(root, marker=marker, how="tensor_attribute", seed=5)
    unsafe_pickle.build(root, marker=marker, how="gzip", seed=6, name="unsafe_gzip")
    nonfinite.build(root, seed=7)
    retained_batch.build(root, rows=[1], seed=8)
    retained_batch.build(root, container="gzip", key="latents", rows=[2], seed=9, name="retained_gzip")
    retained_batch.build(root, container="legacy", rows=[3], seed=10, name="retained_legacy")
    device_tagged.build(root / "bucket_a", seed=11)
    mixed_devices.build(root / "bucket_b", seed=12)
    return root


def fix_in_process(*roots: Path, deep: bool = True, **execute):
    """Recover, scan, plan and apply, as `cachedoctor fix --yes` does; (plan, result)."""
    recover_caches([str(r) for r in roots])
    report = scan_paths(*roots, deep=deep)
    plan = build_plan(report, [str(r) for r in roots])
    return plan, plan.execute(**execute)


def copy_cache(template: Path, to: Path) -> Path:
    """A copy of a cache with its files' times (stale lock and temp ages matter)."""
    shutil.copytree(template, to, symlinks=True)
    return to
