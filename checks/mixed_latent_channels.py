"""## What it does
Reports latents whose channel count differs from the rest of their dataset: 4-channel latents
(SD 1.x, SDXL VAEs) among 16-channel ones (SD3, Flux) or the reverse. Only latents are counted
(not text embeddings, not an `original_size` beside them), only within one dataset (a trainer
config's dataset; in a bare tree, each folder of cache files, see the README's grouping rule),
and caches that keep model families apart by name (kohya's `_sdxl.npz` beside `_flux.npz`)
per family. A file is reported only when the other channel count holds a clear majority: at
least 2/3 of the latents. Below that (5 against 5) nothing says which side is foreign: the
split is one warning naming both sides, and `fix` leaves it alone.

## Why is this bad?
A cache of two VAE families has been written by two runs with different models into one place.
The model rejects the foreign latents at the first batch that holds one (`expected input to
have 16 channels, but got 4 channels`), or, when shapes happen to agree elsewhere, it trains on
latents of a space it was never made for.

## Example
```
CD303 error cache/vae/flux/photos/3fa1…e2.pt
      4 channels where 212 of 220 latents in this dataset have 16: a latent of another VAE family
CD303 warning cache/vae/mixed
      latents split with no clear majority: 16 channels: 5 files (0a1f….pt, 3c9e….pt, 7d20….pt,
      …); 4 channels: 5 files (1b2c….pt, 5e6f….pt, 9a0b….pt, …). Neither side is known to be
      the foreign one (a clear majority holds 2/3 of the files): check which is right; fix
      leaves them alone
```

## Fix
`cachedoctor fix` quarantines the minority files of a clear majority; `--reencode` encodes them
again with the model's VAE. A split is yours to settle: move one family's files to a cache dir
of its own. Give each model family a cache dir of its own (SimpleTuner's default
`{output_dir}/cache/vae/{model_family}/{id}` does).
"""

from __future__ import annotations

from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.inventory import LATENT
from cachedoctor.majority import PerFolder
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary, Group


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


def _counted(shape: tuple[int, ...] | None, dtype: str | None) -> int | None:
    # a summary's dtype is None unless its latent is floating: an int tensor is no latent
    return channels(shape) if shape and dtype is not None else None


def _channels(s: FileSummary | Group) -> int | None:
    return _counted(s.shape, s.dtype) if s.role == LATENT else None


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """The latents of the minority channel counts, and a few of each side of a split."""
    return PerFolder(view, _channels).selector()


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    compared = PerFolder(view, _channels)
    for s, c, verdict in compared.minorities(view):
        yield RULE.finding(
            s.path,
            f"{c} channels where {verdict.counts[verdict.major]:,} of {verdict.total:,} "
            f"latents in this dataset have {verdict.major}: a latent of another VAE family",
            ctx, channels=c, majority_channels=verdict.major, shape=list(s.shape),
        )
    yield from compared.split_findings(RULE, ctx, ctx.facts.latent_cache_dir if ctx.facts else None,
                                       "latents", lambda c: f"{c} channels")


RULE = Rule(
    code="CD303",
    name="mixed-latent-channels",
    severity=Severity.ERROR,
    summary="latents of one dataset disagree in channel count (4 vs 16: two VAE families)",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_dataset=check_dataset,
    select=select,
)
