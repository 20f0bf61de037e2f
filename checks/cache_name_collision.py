"""## What it does
Reports images that map to one cache entry because the trainer names entries by the file stem
alone: SimpleTuner hashes the stem (`a.png` and `a.jpg` in one folder both become
`sha256("a").pt`); kohya names `a_<W>x<H>_<arch>.npz` by the stem and the image size (so the
two collide when their sizes match, and always in the old `a.npz` naming).

## Why is this bad?
Both images are trained on, but only one latent exists: whichever was encoded last overwrites
the other, so one image is silently trained with the other's latent (and, in SimpleTuner, with
its own caption).

## Example
```
CD407 error datasets/photos/beach.png
      beach.png and beach.jpg map to one cache entry (7e2c…1a.pt): one image's latent overwrites
      the other's; rename one, e.g. beach.png -> beach_png.png
```

## Fix
None automatic: rename one of the images (the finding suggests a name), then let the trainer
encode both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.rule import Rule, RuleContext, no_files
from cachedoctor.summary import DatasetView


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    facts = ctx.facts
    if facts is None or not facts.naming.stem_collisions:
        return
    for key, images in view.collisions():
        names = [os.path.basename(p) for p in images]
        entry = facts.naming.expected_entry(images[0])
        stem, ext = os.path.splitext(names[-1])
        rename = f"{stem}_{ext.lstrip('.').lower()}{ext}"
        yield RULE.finding(
            images[-1],
            f"{' and '.join(names[::-1]) if len(names) == 2 else ', '.join(names)} map to one "
            f"cache entry ({entry}): one image's latent overwrites the other's; rename one, e.g. "
            f"{names[-1]} -> {rename}",
            ctx, fix=None, images=images, key=key, rename=rename,
        )


RULE = Rule(
    code="CD407",
    name="cache-name-collision",
    severity=Severity.ERROR,
    summary="two images map to one cache file (SimpleTuner hashes the stem only: a.png, a.jpg)",
    doc=__doc__,
    check_dataset=check_dataset,
    select=no_files,
)
