"""device-mismatch: latents cached from the training device, mixed with CPU tensors (incident 3).

OneTrainer #459 (fixed in a30953d6): mgds' DiskCache saves tensors still on train_device (no
`.cpu()`) beside conditioning built on the CPU, and validation feeds the cached tensors, as
loaded, to the model with live ones. The cache here stores each entry as
`{"latents", "original_size", "crop_coordinates"}`: latents from the VAE's device, the SDXL
micro-conditioning from Python ints on the CPU (CD502 in every file, CD501 for the GPU part).

On a GPU host validation then fails for real: "Expected all tensors to be on the same device".
On a CPU-only host the ranks stand in for GPU ranks (their storages carry `cuda:<rank>`, see
RankContext.gpu_stand_in), and the same files fail to load at the first training batch:
"Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False".

verify: the buggy cache is repaired twice in turn (harness/repair.py): `cachedoctor fix`
(`to-cpu`) on the buggy cache, then the corrected writer (saving on the CPU) over it; after each,
every tensor is bit-identical to the buggy cache's (loaded onto the CPU), a scan is clean of
CD501 and CD502, the cache trains with the same loss, and validation, which now moves what it
reads to the model's device, runs.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from cachedoctor.harness.launcher import Launch
from cachedoctor.harness.project import Project, write_project
from cachedoctor.harness.result import Observation

if TYPE_CHECKING:
    from cachedoctor.harness.project import Sample
    from cachedoctor.harness.rank import RankContext
    from cachedoctor.harness.training import TinyDenoiser

NAME = "device-mismatch"
SUMMARY = "latents cached on the training device beside CPU tensors; validation mixes them (CD501, CD502)"
INCIDENT = "docs/incidents.md #3, OneTrainer #459"
EXPECTED = ("CD501", "CD502")
ATTEMPTS = 1
# "... on a CUDA device but torch.cuda.is_available() is False", or "... on CUDA device 1 but
# torch.cuda.device_count() is 1"; and the mix of devices in one operation.
SIGNATURES = ("Attempting to deserialize object on", "Expected all tensors to be on the same device")


def prepare(root: Path, ranks: int, mode: str) -> Project:
    return write_project(root, ranks, plain_loader=True)


def run_rank(ctx: RankContext) -> None:
    from cachedoctor.harness.data import load_entry
    from cachedoctor.harness.pipeline import bucket_share, cache_latents, prepare_caches, sync_buckets
    from cachedoctor.harness.rank import describe
    from cachedoctor.harness.repair import repairs, tensor_digests
    from cachedoctor.harness.writers import LatentWriter

    samples = sync_buckets(ctx)
    share = bucket_share(ctx, samples)
    prepare_caches(ctx, samples, LatentWriter(to_cpu=False, gpu_stand_in=ctx.gpu_stand_in,
                                              with_conditioning=True))
    if ctx.buggy:
        train_and_validate(ctx, samples, share[0], move_cached=False)
        return
    paths = [ctx.project.vae_cache_path(s.path) for s in share]
    try:
        load_entry(paths[0])
        ctx.note(before_repair="loads")
    except (RuntimeError, pickle.UnpicklingError) as exc:  # torch 2.4 wraps the error in the latter
        ctx.note(before_repair=describe(exc))
    before = tensor_digests(paths)
    done = []
    rewrite = lambda: cache_latents(ctx, share, LatentWriter(with_conditioning=True), overwrite=True)  # noqa: E731
    for how, repair in repairs(ctx, rewrite):
        account = repair()
        identical = tensor_digests(paths) == before
        loss, validation = train_and_validate(ctx, samples, share[0], move_cached=True)
        done.append({"how": how, **account, "identical": identical, "loss": loss,
                     "validation_loss": validation})
        ctx.note(repairs=done)


def train_and_validate(ctx: RankContext, samples: list[Sample], sample: Sample, *,
                       move_cached: bool) -> tuple[float, float | None]:
    """An epoch on the cache, then the main process's validation: (loss, validation loss)."""
    from cachedoctor.harness.pipeline import train_epoch
    from cachedoctor.harness.training import new_model

    model = new_model(ctx.project.channels, ctx.device)
    loss = train_epoch(ctx, model, samples, 0)
    ctx.note(loss=loss)
    validation = validate(ctx, model, sample, move_cached=move_cached) if ctx.main else None
    if validation is not None:
        ctx.note(validation_loss=validation)
    return loss, validation


def validate(ctx: RankContext, model: TinyDenoiser, sample: Sample, *, move_cached: bool) -> float:
    """The main process's validation: one cached sample, live noise on the model's device.

    The buggy step uses the cached tensors where loading put them (OneTrainer #459); the fixed
    one moves them to the model's device first, as a30953d6's device sync does.
    """
    import torch

    from cachedoctor.harness.data import load_entry
    from cachedoctor.harness.training import SIGMA

    entry = load_entry(ctx.project.vae_cache_path(sample.path))
    text = load_entry(ctx.project.text_cache_path(sample.caption))
    latents = entry["latents"][None].float()
    pooled = text["pooled_prompt_embeds"][None]
    time_ids = torch.cat([entry["original_size"], entry["crop_coordinates"], entry["original_size"]])[None]
    if move_cached:
        latents, pooled, time_ids = (t.to(ctx.device) for t in (latents, pooled, time_ids))
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    with torch.no_grad():
        prediction = model(latents + SIGMA * noise, pooled, time_ids)
    return torch.nn.functional.mse_loss(prediction, noise).item()


def observe(mode: str, launch: Launch) -> Observation:
    from cachedoctor.harness.repair import FIX, WRITER, summarize

    error = launch.first_error
    losses = launch.notes("loss")
    validation = launch.notes("validation_loss")
    reproduced = bool(error and any(s in error.error for s in SIGNATURES))
    trained = not error and len(losses) == len(launch.outcomes)
    details: dict = {"validation_loss": validation[0] if validation else None}
    fixed = False
    if mode == "verify":
        done = launch.notes("repairs")
        steps = summarize(done) if done and all(len(d) == len(done[0]) for d in done) else []
        for i, step in enumerate(steps):
            step["validation_loss"] = done[0][i]["validation_loss"]
        details.update(before_repair=(launch.notes("before_repair") or [None])[0], repairs=steps)
        fixed = (not error and [s["how"] for s in steps] == [FIX, WRITER]
                 and all(s["tensors_identical"] and s["validation_loss"] is not None
                         and math.isfinite(s["validation_loss"]) for s in steps)
                 and steps[0]["losses"] == steps[1]["losses"]
                 and not steps[0]["failed"] and not set(EXPECTED) & set(steps[0]["codes_after"]))
    return Observation(
        reproduced=reproduced,
        failure=error.error if error else None,
        fixed=fixed,
        trained=trained,
        loss=losses[0] if losses else None,
        details=details,
    )
