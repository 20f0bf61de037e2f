"""dir-overlap: the image dir is the VAE cache dir (docs/incidents.md, incident 5).

With `cache_dir_vae` equal to `instance_data_dir`, the first run writes its latents among the
images and trains fine. At the next start (a resume) the trainer discovers the folder again
and finds last run's cache files in it. The reference trainer, like trainers that accept
pre-encoded latents as samples, takes each `.pt` for a sample that skips the VAE; having no
image header, it goes to the dataset's default bucket, where latents of other aspect ratios
now meet and the batch cannot be stacked: "stack expects each tensor to be equal size"
(SimpleTuner #59; #643 and #788 for the cache dirs it shares). SimpleTuner's answer was to
refuse equal dirs at start-up; the fix here is the same config change: separate dirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cachedoctor.harness.launcher import Launch
from cachedoctor.harness.project import Project, write_project
from cachedoctor.harness.result import Observation

if TYPE_CHECKING:
    from cachedoctor.harness.rank import RankContext

NAME = "dir-overlap"
SUMMARY = "the image dir is the VAE cache dir: cache files become samples, a batch mixes shapes (CD401)"
INCIDENT = "docs/incidents.md #5, SimpleTuner #59, #643, #788"
EXPECTED = ("CD401",)
ATTEMPTS = 1
SIGNATURES = ("stack expects each tensor to be equal size", "latent shape mismatch")


def prepare(root: Path, ranks: int, mode: str) -> Project:
    return write_project(root, ranks, overlap=mode == "reproduce")


def run_rank(ctx: RankContext) -> None:
    from cachedoctor.harness.pipeline import prepare_caches, sync_buckets, train_epoch
    from cachedoctor.harness.training import new_model

    samples = sync_buckets(ctx)
    ctx.note(images=len(samples))
    prepare_caches(ctx, samples)
    model = new_model(ctx.project.channels, ctx.device)
    ctx.note(first_run_loss=train_epoch(ctx, model, samples, 0))
    # The next start of the trainer: file discovery runs on the same folder again.
    samples = sync_buckets(ctx)
    ctx.note(samples_found=len(samples))
    prepare_caches(ctx, samples)
    ctx.note(loss=train_epoch(ctx, model, samples, 1))


def observe(mode: str, launch: Launch) -> Observation:
    error = launch.first_error
    losses = launch.notes("loss")
    found = launch.notes("samples_found")
    images = (launch.notes("images") or [None])[0]
    return Observation(
        reproduced=bool(error and any(s in error.error for s in SIGNATURES)),
        failure=error.error if error else None,
        fixed=mode == "verify" and not error and bool(found) and set(found) == {images},
        trained=not error and len(losses) == len(launch.outcomes),
        loss=losses[0] if losses else None,
        details={"images": images, "samples_found_at_restart": found[0] if found else None,
                 "first_run_loss": (launch.notes("first_run_loss") or [None])[0]},
    )
