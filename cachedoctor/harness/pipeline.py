"""The reference encode/train pipeline, in the steps a SimpleTuner run takes on each rank:
discover the dataset and share the buckets, cache latents and text embeddings for this rank's
share, then train on batches read back from the caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cachedoctor.harness.data import loader
from cachedoctor.harness.encoders import TinyTextEncoder, read_images, vae_on
from cachedoctor.harness.project import Sample, discover, read_buckets, write_bucket_files
from cachedoctor.harness.training import TinyDenoiser, train_steps
from cachedoctor.harness.writers import LatentWriter, TextEmbedCache

if TYPE_CHECKING:
    from cachedoctor.harness.rank import RankContext

VAE_BATCH_SIZE = 4  # SimpleTuner's --vae_batch_size default


def sync_buckets(ctx: RankContext) -> list[Sample]:
    """The main process discovers the dataset and writes the bucket files; the others reload."""
    if ctx.main:
        write_bucket_files(ctx.project, discover(ctx.project))
    ctx.barrier()
    return read_buckets(ctx.project)


def bucket_share(ctx: RankContext, samples: Sequence[Sample]) -> list[Sample]:
    """This rank's contiguous share of every bucket: what it encodes and what it trains on."""
    share = []
    for bucket in sorted({s.bucket for s in samples}):
        share += ctx.shard([s for s in samples if s.bucket == bucket])
    return share


def cache_latents(ctx: RankContext, samples: Sequence[Sample], writer: LatentWriter, *,
                  overwrite: bool = False) -> None:
    """Encode the images among `samples` (those with no entry yet, unless `overwrite`),
    VAE_BATCH_SIZE per batch."""
    vae = vae_on(ctx.device, ctx.project.channels)
    todo = [s for s in samples if not s.path.endswith(".pt")
            and (overwrite or not ctx.project.vae_cache_path(s.path).exists())]
    for bucket in sorted({s.bucket for s in todo}):
        in_bucket = [s for s in todo if s.bucket == bucket]
        for start in range(0, len(in_bucket), VAE_BATCH_SIZE):
            chunk = in_bucket[start : start + VAE_BATCH_SIZE]
            latents = vae.encode(read_images([s.path for s in chunk], ctx.device))
            writer.save_batch([ctx.project.vae_cache_path(s.path) for s in chunk], latents,
                              [s.size for s in chunk])


def cache_text_embeds(ctx: RankContext, captions: Sequence[str]) -> None:
    """Write the embeddings of `captions` missing from the text cache (the fixed writer)."""
    cache = TextEmbedCache(buggy=False, lock_dir=ctx.project.output_dir, pause=0.0)
    encoder = TinyTextEncoder(ctx.device)
    for caption in dict.fromkeys(captions):
        path = ctx.project.text_cache_path(caption)
        if not path.exists():
            cache.save_to_cache(path, encoder.encode(caption))
    cache.wait_for_pending_writes()
    cache.stop()


def prepare_caches(ctx: RankContext, samples: Sequence[Sample], writer: LatentWriter | None = None) -> None:
    """This rank's share of latents and text embeddings (correct writers unless told), then a barrier."""
    share = bucket_share(ctx, samples)
    cache_latents(ctx, share, writer or LatentWriter())
    cache_text_embeds(ctx, [s.caption for s in share])
    ctx.barrier()


def train_epoch(ctx: RankContext, model: TinyDenoiser, samples: Sequence[Sample], epoch: int) -> float:
    """One epoch over this rank's batches; every rank runs the same number of steps."""
    batches = loader(ctx.project, samples, ctx.rank, ctx.world, epoch)
    steps = ctx.all_reduce_min(len(batches))
    return train_steps(ctx, model, batches, steps, seed=epoch)
