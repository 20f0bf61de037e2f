"""The reference trainer's data path: a bucketed DataLoader that reads only the caches.

Batches come from one aspect bucket each (SimpleTuner's invariant), from this rank's share of
every bucket; a batch is fetched whole (`__getitems__`) so that, like SimpleTuner's
`retrieve_from_cache`, a batch with images missing from the VAE cache fails with its message.
Files are read with `torch.load(path, weights_only=True)` and no map_location: the stored
device decides where a tensor lands, as it does in every script that loads that way.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from cachedoctor.harness.project import Project, Sample, shard

TRAIN_BATCH_SIZE = 2


def missing_entries_message(dataset_id: str, images: list[str]) -> str:
    """vae.py `encode_images`, word for word (SimpleTuner's simpletuner/helpers/caching/vae.py)."""
    return (f"(id={dataset_id}) Some images were not correctly cached during the VAE Cache operations. "
            f"Ensure --skip_file_discovery=vae is not set.\nProblematic images: {images}")


def load_entry(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def latent_path(project: Project, sample: Sample) -> Path:
    """A pre-encoded `.pt` sample is its own latent; an image's latent is its cache entry."""
    if sample.path.endswith(".pt"):
        return Path(sample.path)
    return project.vae_cache_path(sample.path)


class CachedSamples(Dataset):
    """Samples as the training step sees them: cached latents and cached text embeddings."""

    def __init__(self, project: Project, samples: Sequence[Sample]) -> None:
        self.project = project
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        samples = [self.samples[i] for i in indices]
        missing = [s.path for s in samples if not latent_path(self.project, s).exists()]
        if missing:
            # SimpleTuner raises a bare Exception: the same class, so the same first line in the log
            raise Exception(missing_entries_message(self.project.dataset_id, missing))
        return [self.item(s) for s in samples]

    def item(self, sample: Sample) -> dict[str, torch.Tensor]:
        entry = load_entry(latent_path(self.project, sample))
        text = load_entry(self.project.text_cache_path(sample.caption))
        if isinstance(entry, dict):  # latents with their micro-conditioning, as cached
            latents = entry["latents"]
            time_ids = torch.cat([entry["original_size"], entry["crop_coordinates"], entry["original_size"]])
        else:
            latents = entry
            width, height = sample.size or (latents.shape[-1] * 8, latents.shape[-2] * 8)
            time_ids = torch.tensor([width, height, 0, 0, width, height])
        return {"latents": latents, "pooled": text["pooled_prompt_embeds"], "time_ids": time_ids}


class BucketBatches(Sampler[list[int]]):
    """This rank's share of every bucket, shuffled with (seed, epoch), cut into full batches."""

    def __init__(self, samples: Sequence[Sample], rank: int, world: int, epoch: int, seed: int = 0) -> None:
        self.batches: list[list[int]] = []
        rng = random.Random(f"{seed}-{epoch}")
        by_bucket: dict[str, list[int]] = {}
        for index, sample in enumerate(samples):
            by_bucket.setdefault(sample.bucket, []).append(index)
        for bucket in sorted(by_bucket):
            share = shard(by_bucket[bucket], rank, world)
            rng.shuffle(share)
            self.batches += [share[i : i + TRAIN_BATCH_SIZE]
                             for i in range(0, len(share) - TRAIN_BATCH_SIZE + 1, TRAIN_BATCH_SIZE)]
        rng.shuffle(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def loader(project: Project, samples: Sequence[Sample], rank: int, world: int, epoch: int) -> DataLoader:
    """No worker processes: a read happens at the moment the training step asks for its batch."""
    return DataLoader(CachedSamples(project, samples),
                      batch_sampler=BucketBatches(samples, rank, world, epoch),
                      collate_fn=default_collate, num_workers=0)
