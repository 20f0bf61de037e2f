"""## What it does
Reports a cache entry whose source image was modified after the entry was written (by more
than `tolerance-seconds`, default 2, for file systems that keep coarse times). Images and
entries are paired by the trainer's naming. In a OneTrainer cache it also reports a variation
folder whose `aggregate.pt` lists images that no longer exist. In a diffusion-pipe cache, whose
`metadata.db` records the fingerprint of the dataset the cache was built from, it reports a
cache that holds items but no fingerprint.

## Why is this bad?
No trainer checks: SimpleTuner, kohya (`bmaltais/kohya_ss#1629`: an edited image keeps its old
npz "when resolution remain same"), OneTrainer with `clear_cache_before_training` off, and
ai-toolkit (whose hash covers sizes, not content) all reuse the old latent. The model trains on
the picture as it was before the edit, or on a different picture that took the old one's name.
OneTrainer's mgds takes a variation folder with an `aggregate.pt` as cached and loads sample
`<i>.pt` for the concept's i-th image as it lists them now (DiskCache.get_item): with an image
deleted, it still trains on the deleted picture's sample and never loads the last one(s) the
folder holds, whose images are still there.
diffusion-pipe deletes and rebuilds a cache whose fingerprint differs from the dataset's (so a
mismatch heals itself at the next start), but where the fingerprint row is missing it stores
the current one and keeps every item: items of whatever dataset built them are trusted.

## Example
```
CD406 warning cache/vae/sdxl/photos/4c1f…9e.pt
      its image beach_0042.png was modified 3 h after this entry was written: the latent is of
      the old picture
CD406 warning workspace-cache/run/image/c0bc…38/variation-0
      aggregate.pt lists 1 image that no longer exists (cats1.png): mgds maps samples to the
      concept's images by number, so it still trains on theirs, …
```

## Fix
`cachedoctor fix` quarantines the entry; `--reencode` (or the trainer's next caching pass)
encodes the image as it is now. For a OneTrainer variation folder it moves its concept's image
and text `aggregate.pt` away (both: mgds pairs latent and text samples by number), and
OneTrainer caches the concept again at its next start. A diffusion-pipe cache folder (`metadata.db` and its shards) is
quarantined as a whole, and diffusion-pipe rebuilds it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.formats.shard_blobs import INDEX_FORMAT
from cachedoctor.layouts.onetrainer import LISTED, OneTrainerNaming
from cachedoctor.rule import Rule, RuleContext, no_files
from cachedoctor.summary import DatasetView
from cachedoctor.units import age, count


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    facts = ctx.facts
    if facts is None or facts.cache_rebuilt_at_start:
        return
    tolerance = float(RULE.setting(ctx, "tolerance-seconds"))
    last = None
    yield from _shifted(view, ctx)
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


def _shifted(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    """OneTrainer variation folders whose aggregate.pt lists images that are gone: one finding
    per folder, whose fix moves the concept's image and text aggregate.pt files away (both:
    mgds pairs their samples by number, so one cached again alone would pair each latent with
    another image's caption)."""
    gone: dict[str, list[str]] = {}
    for path, key, note in view.orphans():
        if note == LISTED:
            gone.setdefault(os.path.dirname(path), []).append(key)
    naming = ctx.facts.naming if ctx.facts is not None else None
    for folder, images in gone.items():
        names = ", ".join(os.path.basename(i) for i in images[:3]) + (", …" if len(images) > 3 else "")
        aggregates = naming.concept_aggregates(folder) if isinstance(naming, OneTrainerNaming) else ()
        paired = any(f"{os.sep}text{os.sep}" in a for a in aggregates)
        then = ("moving its concept's image and text aggregate.pt away makes OneTrainer cache "
                "the concept again" if paired else "move this aggregate.pt and its concept's "
                "text aggregate.pt out of the cache, and OneTrainer caches the concept again")
        yield RULE.finding(
            folder, f"aggregate.pt lists {count(len(images), 'image')} that no longer "
            f"{'exists' if len(images) == 1 else 'exist'} "
            f"({names}): mgds maps samples to the concept's images by number, so it still trains "
            "on theirs, and with fewer images than listed it never loads the folder's last "
            f"sample(s); {then}", ctx, fix=FixKind.QUARANTINE if paired else None,
            images=images, files=list(aggregates) if paired else [])


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
