"""embed-write-race: ranks write one text-embedding cache with no lock (docs/incidents.md, incident 1).

SimpleTuner #1147 (8 GPUs, ~25 samples, so every rank meets every prompt): the writer thread
`batch_write_embeddings` died at start-up with "UnboundLocalError: cannot access local variable
'batch'", and reading the cache failed with "PytorchStreamReader failed reading zip archive:
failed finding central directory". Fixed by PR #1160 (lock + temp file + rename) and #1206.

Each rank starts its cache (and its writer thread) before the text encoder has anything for it:
the buggy thread's first poll comes up empty and it dies. The race follows: every rank queues
every prompt, its own slice first; writer threads write with a plain `open(path, "wb")`, each
file in two halves with a pause, while every rank reads the other slices as their files appear.
A reader meets another rank's half-written archive and its rank fails; the launcher then
terminates the group mid-write, as torchrun does, and the half-written files stay on disk for
the next run and for `scan` (CD101). A try that sees no torn read is run again, up to ATTEMPTS
times. The dead writer is restarted for the race (SimpleTuner's run just stalled there).

verify: `batch` initialised, temp file + fsync + rename under a per-file lock, the same load for
ROUNDS rounds: no reader error, no corrupt file, no temp file left; then training.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from cachedoctor.harness.launcher import Launch
from cachedoctor.harness.project import Project, write_project
from cachedoctor.harness.result import Observation

if TYPE_CHECKING:
    from cachedoctor.harness.rank import RankContext

NAME = "embed-write-race"
SUMMARY = "ranks write shared text embeds with no lock and no rename: readers see half-written archives (CD101)"
INCIDENT = "docs/incidents.md #1, SimpleTuner #1147, PR #1160"
EXPECTED = ("CD101",)
ATTEMPTS = 3
ROUNDS = 3
READ_TIMEOUT = 30.0
# What torch.load says about a torn file. Cut short: "failed finding central directory", or
# Errno 22 when 4-68 KiB are left. Empty: EOFError. Its head lost to a second writer's
# truncation: no zip magic, so the legacy and weights-only paths complain.
HALF_WRITTEN = ("PytorchStreamReader failed reading zip archive", "[Errno 22] Invalid argument", "EOFError",
                "Weights only load failed", "legacy .tar format")
WRITER_BUG = "UnboundLocalError: cannot access local variable 'batch'"


def prepare(root: Path, ranks: int, mode: str) -> Project:
    return write_project(root, ranks)


def run_rank(ctx: RankContext) -> None:
    from cachedoctor.harness.encoders import TinyTextEncoder
    from cachedoctor.harness.pipeline import bucket_share, cache_latents, sync_buckets, train_epoch
    from cachedoctor.harness.rank import describe
    from cachedoctor.harness.training import new_model
    from cachedoctor.harness.writers import LatentWriter, TextEmbedCache

    samples = sync_buckets(ctx)
    cache_latents(ctx, bucket_share(ctx, samples), LatentWriter())
    captions = sorted({s.caption for s in samples})
    # The prompt set is tiny, so every rank trains on every prompt and encodes them all, its
    # own slice first; the other slices' files it finds on disk are their owners' writes.
    own = ctx.shard(captions)
    others = [c for c in captions if c not in own]
    cache = TextEmbedCache(buggy=ctx.buggy, lock_dir=ctx.project.output_dir)
    encoder = TinyTextEncoder(ctx.device)  # "loading the text encoder": after the thread's first poll
    cache.polled.wait(READ_TIMEOUT)
    cache.thread.join(cache.poll * 2)
    ctx.note(writer_error=describe(cache.error) if cache.error else None, writer_alive=cache.thread.is_alive())
    entries = {c: encoder.encode(c) for c in captions}
    corrupt = leftovers = 0
    for done in range(1 if ctx.buggy else ROUNDS):
        ctx.barrier()
        if ctx.main:
            for path in ctx.project.text_cache_dir.iterdir():
                path.unlink()
        ctx.barrier()
        for caption in own + others:
            cache.save_to_cache(ctx.project.text_cache_path(caption), entries[caption])
        if not cache.thread.is_alive():
            # SimpleTuner's run stalled here, its embedding progress bar at zero (#1147). The
            # harness starts the same buggy writer again, its queue full, to get to the race.
            cache.thread = cache.start_writer()
        read_cache(ctx, others)
        cache.wait_for_pending_writes()
        ctx.barrier()
        corrupt += unreadable(ctx, captions)
        leftovers += sum(1 for p in ctx.project.text_cache_dir.iterdir() if p.name.startswith("tmp"))
        ctx.note(rounds=done + 1, corrupt_files=corrupt, temp_files=leftovers)
    cache.stop()
    ctx.note(loss=train_epoch(ctx, new_model(ctx.project.channels, ctx.device), samples, 0))


def read_cache(ctx: RankContext, captions: list[str]) -> None:
    """Load each of the other ranks' embeddings as soon as it exists; a torn read raises
    (SimpleTuner logs "Failed to load corrupt torch file" and re-raises). With one rank there
    is nothing to read here, and no race: "fine on one GPU"."""
    from cachedoctor.harness.data import load_entry

    pending = list(captions)
    deadline = time.monotonic() + READ_TIMEOUT
    while pending:
        for caption in list(pending):
            path = ctx.project.text_cache_path(caption)
            if path.exists():
                load_entry(path)
                pending.remove(caption)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} text embeddings never appeared")
        time.sleep(0.001)


def unreadable(ctx: RankContext, captions: list[str]) -> int:
    """How many of this rank's share of the files torch cannot load once every writer is done."""
    from cachedoctor.harness.data import load_entry

    bad = 0
    for caption in ctx.shard(captions):
        try:
            load_entry(ctx.project.text_cache_path(caption))
        except (RuntimeError, OSError, EOFError):
            bad += 1
    return bad


def observe(mode: str, launch: Launch) -> Observation:
    error = launch.first_error
    losses = launch.notes("loss")
    writer_errors = [e for e in launch.notes("writer_error") if e]
    torn_read = bool(error and any(s in error.error for s in HALF_WRITTEN))
    if mode == "verify":
        rounds, corrupt, temp = (launch.notes(k) for k in ("rounds", "corrupt_files", "temp_files"))
        fixed = (not error and not writer_errors and rounds == [ROUNDS] * len(launch.outcomes)
                 and not any(corrupt) and not any(temp))
        details = {"rounds": ROUNDS, "corrupt_files": sum(corrupt), "temp_files": sum(temp),
                   "writer_alive_after_empty_poll": all(launch.notes("writer_alive"))}
    else:
        fixed = False
        details = {}
    return Observation(
        reproduced=torn_read and any(e.startswith(WRITER_BUG) for e in writer_errors),
        failure=error.error if error else None,
        fixed=fixed,
        trained=not error and len(losses) == len(launch.outcomes),
        loss=losses[0] if losses else None,
        details={**details, "writer_error": writer_errors[0] if writer_errors else None},
    )
