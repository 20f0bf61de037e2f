"""## What it does
Reports latents whose channel count differs from the rest of their cache: 4-channel latents
(SD 1.x, SDXL VAEs) among 16-channel ones (SD3, Flux) or the reverse. Caches that keep several
model families apart by name (kohya's `_sdxl.npz` beside `_flux.npz`) are compared per family.

## Why is this bad?
A cache of two VAE families has been written by two runs with different models into one place.
The model rejects the foreign latents at the first batch that holds one (`expected input to
have 16 channels, but got 4 channels`), or, when shapes happen to agree elsewhere, it trains on
latents of a space it was never made for.

## Example
```
CD303 error cache/vae/flux/photos/3fa1…e2.pt
      4 channels where 212 of 220 latents in this cache have 16: a latent of another VAE family
```

## Fix
`cachedoctor fix` quarantines the minority files; `--reencode` encodes them again with the
model's VAE. Give each model family a cache dir of its own (SimpleTuner's default
`{output_dir}/cache/vae/{model_family}/{id}` does).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.inventory import LATENT
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import DatasetView


def channels(shape: tuple[int, ...]) -> int | None:
    """C of [C, H, W], [C, F, H, W] (video) or [1, C, H, W] (a saved batch of one), and
    [1, C, F, H, W] (a video batch of one)."""
    if len(shape) == 3:
        return shape[0]
    if len(shape) == 4:
        return shape[1] if shape[0] == 1 else shape[0]
    if len(shape) == 5 and shape[0] == 1:
        return shape[1]
    return None


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    counts: dict[str | None, Counter] = defaultdict(Counter)
    for g, n in view.tally().items():
        if g.role == LATENT and g.shape and channels(g.shape) is not None:
            counts[g.family][channels(g.shape)] += n
    mixed = {f: c.most_common(1)[0][0] for f, c in counts.items() if len(c) > 1}
    if not mixed:
        return
    for s in view:
        if s.role != LATENT or not s.shape or s.family not in mixed:
            continue
        c, major = channels(s.shape), mixed[s.family]
        if c is None or c == major:
            continue
        total = sum(counts[s.family].values())
        yield RULE.finding(
            s.path,
            f"{c} channels where {counts[s.family][major]:,} of {total:,} latents in this cache "
            f"have {major}: a latent of another VAE family",
            ctx, channels=c, majority_channels=major, shape=list(s.shape),
        )


RULE = Rule(
    code="CD303",
    name="mixed-latent-channels",
    severity=Severity.ERROR,
    summary="latents of one cache disagree in channel count (4 vs 16: two VAE families)",
    doc=__doc__,
    fix="quarantine",
    check_dataset=check_dataset,
)
