"""clear-each-epoch: `vae_cache_clear_each_epoch` with several ranks (docs/incidents.md, incident 2).

At each epoch boundary SimpleTuner's main process recomputes the buckets, and then every rank
clears the whole VAE cache and re-encodes its own share (SimpleTuner's
simpletuner/helpers/caching/vae.py). Without synchronisation around the clearing, a rank deletes
latents another rank has just re-encoded, and that rank's next batch fails in
`retrieve_from_cache`: "Some images were not correctly cached during the VAE Cache operations"
(SimpleTuner #848; 8x H100, fine on one GPU). Here the main process's bucket refresh (it
re-reads every image) is what makes it clear last, after the other rank has re-encoded and read
its first batch. Each epoch boundary is one attempt.

verify: the same load with `vae_cache_clear_each_epoch: false`, SimpleTuner's advice.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from cachedoctor.harness.launcher import Launch
from cachedoctor.harness.project import Project, write_project
from cachedoctor.harness.result import Observation

if TYPE_CHECKING:
    from cachedoctor.harness.project import Sample
    from cachedoctor.harness.rank import RankContext

NAME = "clear-each-epoch"
SUMMARY = "each rank clears and re-encodes the VAE cache every epoch: ranks delete each other's latents (CD403, CD404)"
INCIDENT = "docs/incidents.md #2, SimpleTuner #848"
EXPECTED = ("CD403", "CD404")
ATTEMPTS = 1
BOUNDARIES = 3  # epoch boundaries (attempts) before the buggy run counts as not reproduced
SIGNATURE = "Some images were not correctly cached during the VAE Cache operations"


def prepare(root: Path, ranks: int, mode: str) -> Project:
    return write_project(root, ranks, family="flux", clear_each_epoch=mode == "reproduce")


def run_rank(ctx: RankContext) -> None:
    from cachedoctor.harness.pipeline import bucket_share, prepare_caches, sync_buckets, train_epoch
    from cachedoctor.harness.training import new_model

    samples = sync_buckets(ctx)
    share = bucket_share(ctx, samples)
    prepare_caches(ctx, samples)
    model = new_model(ctx.project.channels, ctx.device)
    for epoch in range(BOUNDARIES + 1):
        if epoch:
            ctx.note(boundaries=epoch)
            if ctx.project.clear_each_epoch:
                rebuild_cache(ctx, share)
        loss = train_epoch(ctx, model, samples, epoch)
    ctx.note(loss=loss, missing_entries=sum(not ctx.project.vae_cache_path(s.path).exists() for s in samples))


def rebuild_cache(ctx: RankContext, share: list[Sample]) -> None:
    """SimpleTuner's epoch rollover with nothing to hold the ranks together."""
    from cachedoctor.fixtures.images import read_png
    from cachedoctor.harness.pipeline import cache_latents
    from cachedoctor.harness.project import discover, write_bucket_files
    from cachedoctor.harness.writers import LatentWriter

    if ctx.main:  # recompute the buckets with ignore_existing_cache=True: open every image
        samples = discover(ctx.project)
        for sample in samples:
            read_png(sample.path)
        write_bucket_files(ctx.project, samples)
    clear_cache(ctx.project.vae_cache_dir)
    cache_latents(ctx, share, LatentWriter())


def clear_cache(cache_dir: Path) -> None:
    """Every entry in the cache dir, as each rank lists it now; another rank's deletions are
    not errors (SimpleTuner logs them at debug level since #1298)."""
    for name in os.listdir(cache_dir):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(cache_dir / name)


def observe(mode: str, launch: Launch) -> Observation:
    error = launch.first_error
    losses = launch.notes("loss")
    missing = launch.notes("missing_entries")
    boundaries = launch.notes("boundaries")
    return Observation(
        reproduced=bool(error and SIGNATURE in error.error),
        failure=error.error if error else None,
        fixed=mode == "verify" and not error and bool(missing) and not any(missing),
        trained=not error and len(losses) == len(launch.outcomes),
        loss=losses[0] if losses else None,
        attempts=max(boundaries, default=0) if mode == "reproduce" else None,
        details={"epochs": BOUNDARIES + 1, "missing_entries": missing[0] if missing else None},
    )
