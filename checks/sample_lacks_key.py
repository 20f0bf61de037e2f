"""## What it does
Reports a OneTrainer image sample (`<i>.pt` in a variation folder) that lacks a tensor the
config's data loader reads from every sample: `latent_mask` with `masked_training` (or an
inpainting model type), `latent_conditioning_image` for the inpainting model types
(SD 1.5/2.0/XL inpainting, FLUX.1 Fill). Only where the cache is reused, that is with
`clear_cache_before_training` off.

## Why is this bad?
mgds keeps a variation folder with an `aggregate.pt` as it is and, for each item, copies every
name of the loader's `image_split_names` out of the sample (`DiskCache.get_item`:
`split_item[name]`): a sample cached before `masked_training` was turned on has no
`latent_mask`, and training stops with `KeyError: 'latent_mask'` at the first batch.

## Example
```
CD110 error workspace-cache/run/image/c0bc…38/variation-0/0.pt
      lacks latent_mask, which OneTrainer reads from every image sample with masked_training
      on: mgds stops with KeyError at the first batch that holds it
```

## Fix
`cachedoctor fix` moves the sample to the quarantine, and its folder's `aggregate.pt` with it,
so that OneTrainer caches the folder again with what its loader needs; or turn
`clear_cache_before_training` on.
"""

from __future__ import annotations

import os

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.onetrainer import LATENT_PATHS, sample_folder
from cachedoctor.rule import Rule, RuleContext

WHY = {"latent_mask": "with masked_training on (or an inpainting model type)",
       "latent_conditioning_image": "with an inpainting model type"}


def applies(meta: FileMeta, ctx: RuleContext) -> bool:
    """Whether a file with these facts may be judged at all, whatever its name: a sound,
    safe sample, in a cache OneTrainer reads with sample keys and does not rebuild first."""
    facts = ctx.facts
    needs = facts.options.get("sample_keys") if facts is not None else None
    return bool(needs) and not facts.cache_rebuilt_at_start and not meta.errors and (
        not meta.unsafe_globals)


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not applies(meta, ctx):
        return None
    facts = ctx.facts
    needs = facts.options.get("sample_keys")
    folder, name = os.path.split(meta.path)
    if not name.endswith(".pt") or not name[:-3].isdigit() or not sample_folder(folder):
        return None
    if facts.latent_cache_dir is None or not folder.startswith(facts.latent_cache_dir + os.sep):
        return None  # a text sample
    paths = {t.path for t in meta.tensors}
    if not paths & set(LATENT_PATHS):
        return None  # no image sample: CD101/CD107 say what it is
    keys = {p[0] for p in paths if p}
    lacking = [k for k in needs if k not in keys]
    if not lacking:
        return None
    return RULE.finding(
        meta.path, f"lacks {' and '.join(lacking)}, which OneTrainer reads from every image "
        f"sample {WHY[lacking[0]]}: mgds stops with KeyError at the first batch that holds it",
        ctx, lacking=lacking)


RULE = Rule(
    code="CD110",
    name="sample-lacks-key",
    severity=Severity.ERROR,
    summary="a OneTrainer sample lacks a tensor its data loader reads (latent_mask)",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_file=check,
    names=True,  # a sample is told by its name and folder, not its content alone
    applies=applies,
)
