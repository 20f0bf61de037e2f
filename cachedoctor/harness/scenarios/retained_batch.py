"""retained-batch: every VAE cache file stores the whole encoded batch (field notes, incident 4).

SimpleTuner #550: the VAE stage saved `latents[i]`, a view, and torch.save writes a view's whole
storage, so with a VAE batch of B each file is B times too large (7 of 8 files ~7x in the
issue). The files load and train correctly: the symptom is their size, measured here from the
files themselves. Fixed upstream in a0a36db6a by saving `latents[i].clone()`.

reproduce: the buggy writer, files measured, training on them (it works); scan: CD201.
verify: the buggy cache, then the repair (corrected writer now, `cachedoctor fix` once it
exists): sizes back to one latent each, every tensor bit-identical, the training loss identical.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachedoctor.harness.launcher import Launch
from cachedoctor.harness.project import Project, write_project
from cachedoctor.harness.result import Observation

if TYPE_CHECKING:
    from cachedoctor.harness.rank import RankContext

NAME = "retained-batch"
SUMMARY = "VAE latents saved as views of their batch: each file holds the whole batch (CD201)"
INCIDENT = "field notes #4, SimpleTuner #550"
EXPECTED = ("CD201",)
ATTEMPTS = 1
OVERSIZE = 1.5  # CD201's default min-ratio


def prepare(root: Path, ranks: int, mode: str) -> Project:
    return write_project(root, ranks)


def run_rank(ctx: RankContext) -> None:
    from cachedoctor.harness.pipeline import (
        bucket_share,
        cache_latents,
        prepare_caches,
        sync_buckets,
        train_epoch,
    )
    from cachedoctor.harness.repair import repair_cache
    from cachedoctor.harness.training import new_model
    from cachedoctor.harness.writers import LatentWriter

    samples = sync_buckets(ctx)
    share = bucket_share(ctx, samples)
    # Both modes start from the buggy cache: verify repairs it, and compares before with after.
    prepare_caches(ctx, samples, LatentWriter(clone=False))
    before = measure(ctx, share)
    ctx.note(before=before, loss_before=train_epoch(ctx, new_model(ctx.project.channels, ctx.device), samples, 0))
    if ctx.buggy:
        return
    how = repair_cache(ctx, lambda: cache_latents(ctx, share, LatentWriter(), overwrite=True))
    after = measure(ctx, share)
    ctx.note(repair=how, after=after, identical=after["digests"] == before["digests"],
             loss_after=train_epoch(ctx, new_model(ctx.project.channels, ctx.device), samples, 0))


def measure(ctx: RankContext, share: list) -> dict[str, Any]:
    """Bytes on disk, bytes of latent and bytes of stored storage of this rank's entries."""
    from cachedoctor.harness.data import load_entry

    disk = used = stored = 0
    digests = {}
    for sample in share:
        path = ctx.project.vae_cache_path(sample.path)
        latent = load_entry(path)
        disk += os.path.getsize(path)
        used += latent.numel() * latent.element_size()
        stored += latent.untyped_storage().nbytes()
        digests[path.name] = hashlib.sha256(latent.cpu().contiguous().numpy().tobytes()).hexdigest()
    return {"files": len(share), "disk_bytes": disk, "latent_bytes": used, "stored_bytes": stored,
            "digests": digests}


def observe(mode: str, launch: Launch) -> Observation:
    error = launch.first_error
    before, after = _total(launch.notes("before")), _total(launch.notes("after"))
    state = before if mode == "reproduce" else after
    ratio = state["stored_bytes"] / state["latent_bytes"] if state["latent_bytes"] else 0.0
    reproduced = ratio >= OVERSIZE
    symptom = (f"{state['files']} latent files take {state['disk_bytes']:,} B on disk for "
               f"{state['latent_bytes']:,} B of latents: each stores its whole VAE batch (x{ratio:.1f})")
    losses = launch.notes("loss_before" if mode == "reproduce" else "loss_after")
    details: dict[str, Any] = {"ratio": round(ratio, 2), "disk_bytes": state["disk_bytes"],
                               "latent_bytes": state["latent_bytes"]}
    fixed = False
    if mode == "verify":
        before_ratio = before["stored_bytes"] / before["latent_bytes"] if before["latent_bytes"] else 0.0
        loss_before = launch.notes("loss_before")
        identical = launch.notes("identical")
        details.update(before_ratio=round(before_ratio, 2), before_disk_bytes=before["disk_bytes"],
                       loss_before=loss_before[0] if loss_before else None,
                       tensors_identical=bool(identical) and all(identical),
                       repair=(launch.notes("repair") or [None])[0])
        fixed = (not error and before_ratio >= OVERSIZE and ratio == 1.0
                 and details["tensors_identical"] and bool(losses) and losses == loss_before)
    if error:
        details["error"] = error.error
    return Observation(
        reproduced=reproduced,
        failure=symptom if reproduced else (error.error if error else None),
        fixed=fixed,
        trained=not error and len(losses) == len(launch.outcomes),
        loss=losses[0] if losses else None,
        details=details,
    )


def _total(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("files", "disk_bytes", "latent_bytes", "stored_bytes")
    total: dict[str, Any] = {k: sum(r[k] for r in per_rank) for k in keys}
    total["digests"] = {k: v for r in per_rank for k, v in r["digests"].items()}
    return total
