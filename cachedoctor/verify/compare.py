"""How close a cached latent is to a fresh encode.

`error` is the normalised error |c - f| / |f|; `cosine` the cosine similarity of c and f. Both
depend on how much latents of different images differ, so the verdicts use `distance`. That
is |c - f| over the distance between latents of unrelated images of the same bucket: the
median distance between the fresh encodes of two sampled images. With one image only, it is
sqrt(2)·|f - mean(f)|, how far apart two independent latents of f's statistics are. 0 is the
same latent; about 1 is the latent of another picture (or of another VAE).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MATCH = 0.25  # distance at or below which a latent is the fresh one (resampling, rounding)
UNRELATED = 0.6  # distance at or above which it is the latent of another picture

KNOWN_FACTORS = {  # scaling factors of the VAE families, as their configs give them
    0.18215: "SD 1.x/2.x's 0.18215",
    0.13025: "SDXL's 0.13025",
    1.5305: "SD3's 1.5305",
    0.3611: "Flux's 0.3611",
}


@dataclass(frozen=True)
class Closeness:
    error: float
    cosine: float
    distance: float

    @property
    def matches(self) -> bool:
        return self.distance <= MATCH

    def as_dict(self) -> dict[str, float]:
        return {"error": round(self.error, 5), "cosine": round(self.cosine, 5),
                "distance": round(self.distance, 5)}


def closeness(cached: torch.Tensor, fresh: torch.Tensor, unrelated: float) -> Closeness:
    c, f = cached.double().flatten(), fresh.double().flatten()
    diff = float((c - f).norm())
    norm_f, norm_c = float(f.norm()), float(c.norm())
    error = diff / norm_f if norm_f else math.inf
    cosine = float(c @ f) / (norm_c * norm_f) if norm_c and norm_f else 0.0
    return Closeness(error, cosine, diff / unrelated if unrelated else math.inf)


def unrelated_level(fresh: list[torch.Tensor]) -> float:
    """The distance between latents of unrelated images of one bucket (see the module doc)."""
    import statistics

    pairs = [float((a.double() - b.double()).norm()) for a, b in itertools.pairwise(fresh)]
    if pairs:
        return statistics.median(pairs)
    f = fresh[0].double()
    return math.sqrt(2) * float((f - f.mean()).norm())


def fit_scale(cached: torch.Tensor, fresh: torch.Tensor) -> tuple[float, float, float]:
    """(a, b, residual): least squares cached ≈ a·fresh + b; residual |c - (a·f + b)| / |c - mean c|."""
    c, f = cached.double().flatten(), fresh.double().flatten()
    fc, cc = f - f.mean(), c - c.mean()
    var = float(fc @ fc)
    if not var:
        return 1.0, 0.0, math.inf
    a = float(fc @ cc) / var
    b = float(c.mean() - a * f.mean())
    spread = float(cc.norm())
    residual = float((c - (a * f + b)).norm()) / spread if spread else math.inf
    return a, b, residual


def describe_factor(a: float) -> str:
    """x0.18215, with the VAE family it is the factor of (or its inverse) where it is one."""
    for factor, name in KNOWN_FACTORS.items():
        if abs(a / factor - 1) < 0.02:
            return f"x{a:.5g} ({name}: scaled once more than the trainer does)"
        if abs(a * factor - 1) < 0.02:
            return f"x{a:.5g} (x1/{factor}: {name} missing)"
    return f"x{a:.5g}"
