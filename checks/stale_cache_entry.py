"""## What it does
Reports a cache entry whose source image was modified after the entry was written (by more
than `tolerance-seconds`, default 2, for file systems that keep coarse times). Images and
entries are paired by the trainer's naming. In a diffusion-pipe cache, whose `metadata.db`
records the fingerprint of the dataset the cache was built from, it reports a cache that holds
items but no fingerprint.

## Why is this bad?
No trainer checks: SimpleTuner, kohya (`bmaltais/kohya_ss#1629`: an edited image keeps its old
npz "when resolution remain same"), OneTrainer with `clear_cache_before_training` off, and
ai-toolkit (whose hash covers sizes, not content) all reuse the old latent. The model trains on
the picture as it was before the edit, or on a different picture that took the old one's name.
diffusion-pipe deletes and rebuilds a cache whose fingerprint differs from the dataset's (so a
mismatch heals itself at the next start), but where the fingerprint row is missing it stores
the current one and keeps every item: items of whatever dataset built them are trusted.

## Example
```
CD406 warning cache/vae/sdxl/photos/4c1f…9e.pt
      its image beach_0042.png was modified 3 h after this entry was written: the latent is of
      the old picture
```

## Fix
`cachedoctor fix` quarantines the entry; `--reencode` (or the trainer's next caching pass)
encodes the image as it is now. A diffusion-pipe cache folder (`metadata.db` and its shards) is
quarantined as a whole, and diffusion-pipe rebuilds it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.formats.shard_blobs import INDEX_FORMAT
from cachedoctor.rule import Rule, RuleContext, no_files
from cachedoctor.summary import DatasetView
from cachedoctor.units import age


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    facts = ctx.facts
    if facts is None or facts.cache_rebuilt_at_start:
        return
    tolerance = float(RULE.setting(ctx, "tolerance-seconds"))
    last = None
    for path, mtime, image, image_mtime in view.stale(tolerance):
        if path == last:
            continue  # two images on one entry: CD407's
        last = path
        yield RULE.finding(
            path,
            f"its image {os.path.basename(image)} was modified {age(image_mtime - mtime)} after "
            "this entry was written: the latent is of the old picture",
            ctx, image=image, newer_by_seconds=round(image_mtime - mtime, 1),
        )


def check_file(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if meta.format != INDEX_FORMAT or not meta.metadata.get("unfingerprinted"):
        return None
    items = int(meta.metadata.get("items", "0"))
    return RULE.finding(meta.path, f"{items:,} cached items but no fingerprint: diffusion-pipe "
                        "will store the current dataset's and trust items it cannot tell are "
                        "of another dataset", ctx, items=items)


RULE = Rule(
    code="CD406",
    name="stale-cache-entry",
    severity=Severity.WARNING,
    summary="the source image is newer than its cache entry",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_dataset=check_dataset,
    select=no_files,
    check_file=check_file,
    settings={"tolerance-seconds": 2.0},
)
