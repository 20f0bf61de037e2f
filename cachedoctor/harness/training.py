"""A tiny conditional denoiser and the steps that train it across the ranks.

Gradients are averaged with all_reduce each step, as DDP does, so the ranks move in lockstep
and a rank that stops makes the others wait at the next step. The update is plain SGD written
out: `torch.optim` imports torch._dynamo on first use, 1.4 s of every rank's start-up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from cachedoctor.harness.encoders import POOLED

if TYPE_CHECKING:
    from cachedoctor.harness.rank import RankContext

LEARNING_RATE = 0.05
SIGMA = 0.5


class TinyDenoiser(nn.Module):
    """Predicts the noise added to a latent, given the pooled text embedding and SDXL time_ids."""

    def __init__(self, channels: int, width: int = 32) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(channels, width, 3, padding=1)
        self.text = nn.Linear(POOLED, width)
        self.time = nn.Linear(6, width)
        self.conv_out = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, noisy: torch.Tensor, pooled: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
        condition = self.text(pooled.float()) + self.time(time_ids.float() / 1024)
        hidden = torch.nn.functional.silu(self.conv_in(noisy) + condition[:, :, None, None])
        return self.conv_out(hidden)


def new_model(channels: int, device: torch.device, seed: int = 0) -> TinyDenoiser:
    torch.manual_seed(seed)  # every rank starts from the same weights, as DDP's broadcast ensures
    return TinyDenoiser(channels).to(device)


def train_steps(ctx: RankContext, model: TinyDenoiser, batches: Iterable[dict[str, torch.Tensor]],
                steps: int, seed: int = 0) -> float:
    """`steps` SGD steps on `batches` (read from the cache as each step asks); the mean loss.

    Inputs are moved to the rank's device here, as a trainer's collate does. Noise comes from a
    CPU generator seeded per rank, so a run is bit-for-bit repeatable on one device.
    """
    generator = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    losses = []
    batch_iter = iter(batches)
    for _ in range(steps):
        batch = next(batch_iter)
        latents = batch["latents"].to(ctx.device).float()
        noise = torch.randn(latents.shape, generator=generator).to(ctx.device)
        prediction = model(latents + SIGMA * noise, batch["pooled"].to(ctx.device),
                           batch["time_ids"].to(ctx.device))
        loss = torch.nn.functional.mse_loss(prediction, noise)
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                ctx.all_reduce_mean(parameter.grad)
                parameter -= LEARNING_RATE * parameter.grad
        losses.append(ctx.all_reduce_mean(loss.detach().clone()).item())
    mean = sum(losses) / len(losses) if losses else float("nan")
    if not math.isfinite(mean):
        raise FloatingPointError(f"training loss is not finite: {mean}")
    return mean
