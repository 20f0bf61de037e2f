"""diffusion-pipe caches of the 🤗 datasets era, before the sharded backend, scan clean.

Until 91efeb9 (tdrussell/diffusion-pipe, 2025-11-05, "Use new caching backend"),
utils/dataset.py `_map_and_cache` cached with `datasets.Dataset.map(cache_file_name=...,
num_proc=NUM_PROC)`: per size bucket `cache_<bucket>/latents_<fingerprint>.arrow`, text
embeddings as `text_embeddings_<i>_<fingerprint>.arrow` (in `ar_frames_<AR>_<frames>/` with
aspect buckets), the empty caption's as `uncond_text_embeddings_<i>_<fingerprint>.arrow` beside
the buckets (0fc9901, 2025-05-26; 4321d64 added `<i>`), each split `_<rank:05d>_of_<n:05d>` by
datasets where num_proc > 1 (6310d04, the last such version). The metadata/ folder and
`iteration_order/` are as now. Earlier versions wrote the same Arrow files under other folder
names (208178a: `cache/cache_<W>x<H>/latent_<fp>.arrow`; d00182e: `cache/<model>/cache_<W>x<H>`,
`ar_bucket_<AR>`; e0ce7e2: `cache_<W>x<H>x<F>`, `ar_frames_<AR>_<F>`).

The sharded backend never reads them: `Cache` makes `latents/`, `text_embeddings_<i>/` beside
them and caches again, leaving the Arrow files where they are (utils/cache.py `clear` removes
only its own folder's `*.bin`). So an old cache and an upgraded one (both side by side) are
healthy; a truncated Arrow file is still CD101.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cachedoctor.findings import Severity
from cachedoctor.fixtures.hf_datasets import stream
from cachedoctor.fixtures.projects import diffusion_pipe as dp

from conftest import scan_paths

pytest.importorskip("pyarrow")
NUM_PROC = 2  # min(8, os.cpu_count()), reduced by datasets to the rows where fewer


def serious(report) -> list:
    return [(f.code, f.path) for f in report.findings if f.severity >= Severity.WARNING]


def _arrow(folder: Path, prefix: str, fingerprint: str, rows: int) -> list[Path]:
    """What datasets' map(cache_file_name=f'{prefix}{fingerprint}.arrow', num_proc=NUM_PROC)
    leaves: one ArrowWriter stream per worker (a single file where one worker does it all)."""
    procs = min(NUM_PROC, rows)
    names = ([f"{prefix}{fingerprint}.arrow"] if procs == 1 else
             [f"{prefix}{fingerprint}_{r:05d}_of_{procs:05d}.arrow" for r in range(procs)])
    out = []
    for rank, name in enumerate(names):
        part = rows // procs + (rank < rows % procs)
        (folder / name).write_bytes(stream(part, fingerprint, seed=rank))
        out.append(folder / name)
    return out


def _datasets_era(root: Path, upgraded: bool = False) -> tuple[Path, list[Path]]:
    """dp.build's project with its caches as 6310d04 wrote them; `upgraded`: a newer
    diffusion-pipe has since cached it again into its sharded folders beside them."""
    project = dp.build(root)
    cache = dp.cache_of(project)
    written = []
    for bucket in sorted(cache.glob("cache_*")):
        rows = len(dp.shard_rows(bucket / "latents", 0))
        written += _arrow(bucket, "latents_", "0d9a0f92850d80db", rows)
        written += _arrow(bucket, "text_embeddings_0_", "56516ed9faa8a2fa", rows)
        if not upgraded:
            shutil.rmtree(bucket / "latents")
            shutil.rmtree(bucket / "text_embeddings_0")
    written += _arrow(cache, "uncond_text_embeddings_0_", "bd9ae488084441c0", 1)
    if not upgraded:
        shutil.rmtree(cache / "uncond_text_embeddings_0")
    return project.config, written


@pytest.mark.parametrize("upgraded", [False, True])
def test_datasets_era_cache_is_healthy(tmp_path: Path, upgraded: bool) -> None:
    config, written = _datasets_era(tmp_path, upgraded)
    report = scan_paths(config, keep_paths=True)
    assert serious(report) == []
    assert {str(p) for p in written} <= set(report.checked)
    for bare in (tmp_path / "dataset", tmp_path / "dataset" / "cache" / dp.MODEL):
        assert serious(scan_paths(bare)) == [], bare


def test_datasets_era_truncated_arrow_is_cd101(tmp_path: Path) -> None:
    config, written = _datasets_era(tmp_path)
    cut = next(p for p in written if p.name.startswith("latents_"))
    os.truncate(cut, cut.stat().st_size - 100)
    assert serious(scan_paths(config)) == [("CD101", str(cut))]
    assert serious(scan_paths(tmp_path / "dataset")) == [("CD101", str(cut))]
