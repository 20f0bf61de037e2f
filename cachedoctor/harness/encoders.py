"""The reference encoders: the fixtures' TinyVAE on a device, and a text-encoder stand-in.

Both are seeded and deterministic, so every rank, and every run, computes bit-identical caches
for the same inputs: a difference between two runs is then the writer's doing, never the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from cachedoctor.fixtures.images import read_png
from cachedoctor.fixtures.latents import TinyVAE

TOKENS = 77  # CLIP's sequence length
HIDDEN = 2048  # SDXL's concatenated CLIP-L + CLIP-G hidden size
POOLED = 1280  # SDXL's pooled text embedding


def vae_on(device: torch.device, channels: int, seed: int = 0) -> TinyVAE:
    """TinyVAE with its weights on `device` (the fixture keeps them on the CPU)."""
    vae = TinyVAE(channels, seed)
    vae.weight = vae.weight.to(device)
    vae.bias = vae.bias.to(device)
    return vae


def read_images(paths: Sequence[str | Path], device: torch.device) -> torch.Tensor:
    """The images of one bucket as one uint8 batch [B, 3, H, W] on `device`."""
    return torch.stack([read_png(p)[2] for p in paths]).to(device)


class TinyTextEncoder:
    """Caption bytes -> seeded embedding table -> SDXL-shaped prompt and pooled embeddings.

    The output has SDXL's sizes (a 77 x 2048 fp16 embedding is a 315 KB cache file). The size
    of the file decides which error a reader of a half-written one gets: torch.load says
    "failed finding central directory" only for a truncated archive over ~68 KiB.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.device = device
        self.table = (torch.randn(256, HIDDEN, generator=generator) / HIDDEN**0.5).to(device)
        self.position = torch.linspace(1.0, 0.5, TOKENS).to(device)
        self.pool = (torch.randn(HIDDEN, POOLED, generator=generator) / HIDDEN**0.5).to(device)

    def encode(self, caption: str) -> dict[str, torch.Tensor]:
        """SimpleTuner's SDXL text-cache entry for one caption (a leading 1 on prompt_embeds)."""
        ids = list(caption.encode()[:TOKENS])
        ids += [0] * (TOKENS - len(ids))
        hidden = self.table[torch.tensor(ids, device=self.device)] * self.position[:, None]
        pooled = torch.tanh(hidden.mean(0) @ self.pool)
        return {"prompt_embeds": hidden[None].half(), "pooled_prompt_embeds": pooled.half()}
