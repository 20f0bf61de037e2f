"""retained-batch: every VAE cache file stores the whole encoded batch (docs/incidents.md, incident 4).

SimpleTuner #550: the VAE stage saved `latents[i]`, a view, and torch.save writes a view's whole
storage, so with a VAE batch of B each file is B times too large (7 of 8 files ~7x in the
issue). The files load and train correctly: the symptom is their size, measured here from the
files themselves. Fixed upstream in a0a36db6a by saving `latents[i].clone()`.

reproduce: the buggy writer, files measured, training on them (it works); scan: CD201.
verify: the buggy cache, then both repairs in turn (harness/repair.py): `cachedoctor fix`
(compact) on the buggy cache, then the corrected writer over it; after each, sizes back to one
latent each, every tensor bit-identical to the buggy cache's, a scan clean of CD201 and the
training loss identical to the buggy cache's (which trains correctly: only its size is wrong).
"""

from __future__ import annotations

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
INCIDENT = "docs/incidents.md #4, SimpleTuner #550"
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
    from cachedoctor.harness.repair import repairs
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
    done = []
    for how, repair in repairs(ctx, lambda: cache_latents(ctx, share, LatentWriter(), overwrite=True)):
        account = repair()
        after = measure(ctx, share)
        done.append({"how": how, **account, "after": after,
                     "identical": after["digests"] == before["digests"],
                     "loss": train_epoch(ctx, new_model(ctx.project.channels, ctx.device), samples, 0)})
        ctx.note(repairs=done)


def measure(ctx: RankContext, share: list) -> dict[str, Any]:
    """Bytes on disk, bytes of latent and bytes of stored storage of this rank's entries."""
    from cachedoctor.harness.data import load_entry
    from cachedoctor.harness.repair import tensor_digests

    disk = used = stored = 0
    paths = [ctx.project.vae_cache_path(sample.path) for sample in share]
    for path in paths:
        latent = load_entry(path)
        disk += os.path.getsize(path)
        used += latent.numel() * latent.element_size()
        stored += latent.untyped_storage().nbytes()
    return {"files": len(share), "disk_bytes": disk, "latent_bytes": used, "stored_bytes": stored,
            "digests": tensor_digests(paths)}


def observe(mode: str, launch: Launch) -> Observation:
    from cachedoctor.harness.repair import FIX, WRITER, summarize

    error = launch.first_error
    before = _total(launch.notes("before"))
    done = launch.notes("repairs")
    steps = summarize(done) if done and all(len(d) == len(done[0]) for d in done) else []
    for i, step in enumerate(steps):
        step.update(_sizes(_total([d[i]["after"] for d in done])))
    state = _sizes(before) if mode == "reproduce" or not steps else steps[-1]
    ratio = state["ratio"]
    reproduced = ratio >= OVERSIZE
    # two ratios: bytes on disk per byte of latent (pickle and zip records included), and
    # stored storage per latent, as CD201 reports it (x4.0 for a VAE batch of 4)
    symptom = (f"{state['files']} latent files take {state['disk_bytes']:,} B on disk for "
               f"{state['latent_bytes']:,} B of latents (x{state['disk_ratio']:.2f} on disk): each "
               f"stores its whole VAE batch (x{ratio:.1f})")
    loss_before = launch.notes("loss_before")
    losses = loss_before if mode == "reproduce" else (steps[-1]["losses"] if steps else [])
    details: dict[str, Any] = {"ratio": ratio, "disk_ratio": state["disk_ratio"],
                               "disk_bytes": state["disk_bytes"], "latent_bytes": state["latent_bytes"]}
    fixed = False
    if mode == "verify":
        details.update(before_ratio=_sizes(before)["ratio"], before_disk_bytes=before["disk_bytes"],
                       loss_before=loss_before[0] if loss_before else None,
                       tensors_identical=bool(steps) and all(s["tensors_identical"] for s in steps),
                       repairs=steps)
        fixed = (not error and details["before_ratio"] >= OVERSIZE and [s["how"] for s in steps]
                 == [FIX, WRITER] and all(
                     s["ratio"] == 1.0 and s["tensors_identical"] and s["losses"] == loss_before
                     for s in steps)
                 and not steps[0]["failed"] and not set(EXPECTED) & set(steps[0]["codes_after"]))
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


def _sizes(total: dict[str, Any]) -> dict[str, Any]:
    """The sizes of a cache, how far its stored storage exceeds its latents (`ratio`) and its
    bytes on disk do (`disk_ratio`)."""
    latent = total["latent_bytes"]
    ratio = total["stored_bytes"] / latent if latent else 0.0
    disk_ratio = total["disk_bytes"] / latent if latent else 0.0
    return {"files": total["files"], "disk_bytes": total["disk_bytes"], "latent_bytes": latent,
            "ratio": round(ratio, 2), "disk_ratio": round(disk_ratio, 2)}
