"""## What it does
Reports cache entries that no image maps to under the trainer's naming: latents of images that
were renamed, moved or deleted, files of an older naming scheme (SimpleTuner's unhashed
`<stem>.pt`, no longer read since hashing became the only scheme), OneTrainer files beyond
what their folder's `aggregate.pt` lists. Also reports a SimpleTuner bucket file
(`aspect_ratio_bucket_indices_<id>.json`) that lists images which no longer exist.

A OneTrainer sample that `aggregate.pt` lists for an image now gone is CD406's: mgds still
loads it.

## Why is this bad?
Orphans cost disk space and scan time and are never trained on; a pile of them usually means
a cache from another dataset or naming scheme sits in this one (see CD402). Stale bucket-file
entries are dropped by SimpleTuner's next file discovery, but with `skip_file_discovery`
including `aspect` the trainer still tries to load the missing images.

## Example
```
CD405 info cache/vae/sdxl/photos/beach_0042.pt
      old unhashed name: SimpleTuner names entries sha256(stem).pt and never reads this one
CD405 info datasets/photos/aspect_ratio_bucket_indices_photos.json
      lists 3 images that no longer exist: beach_0007.png, beach_0008.png, beach_0011.png
```

## Fix
`cachedoctor fix` moves orphans to the quarantine (SimpleTuner rebuilds a quarantined bucket
file at its next start).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.layouts.onetrainer import LISTED
from cachedoctor.rule import Rule, RuleContext, no_files
from cachedoctor.summary import DatasetView
from cachedoctor.units import count

WHY = {
    "unhashed": "old unhashed name: SimpleTuner names entries sha256(stem).pt and never reads "
                "this one",
    "legacy": "no image with this stem beside it (kohya's old <stem>.npz naming)",
    "unlisted": "its index is beyond what the folder's aggregate.pt lists: OneTrainer never "
                "reads it",
}
MAX_LISTED = 1000


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    facts = ctx.facts
    if facts is None or facts.cache_rebuilt_at_start:
        return
    for path, key, note in view.orphans():
        if note == LISTED:
            continue  # a OneTrainer sample mgds still loads: CD406's
        message = WHY.get(note or "", "no source image maps to this entry (a renamed or deleted "
                                      "image, or another dataset's cache)")
        yield RULE.finding(path, message, ctx, key=key, naming=note)
    gone = []
    for path in view.listed_but_gone():
        if len(gone) < MAX_LISTED:
            gone.append(path)
    if gone and facts.listing is not None:
        names = ", ".join(os.path.basename(p) for p in gone[:3]) + (", …" if len(gone) > 3 else "")
        verb = "no longer exists" if len(gone) == 1 else "no longer exist"
        yield RULE.finding(facts.listing.file, f"lists {count(len(gone), 'image')} that "
                           f"{verb}: {names}", ctx, images=gone)


RULE = Rule(
    code="CD405",
    name="orphan-cache-entries",
    severity=Severity.INFO,
    summary="cache entries with no source image (renamed images, old naming schemes)",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_dataset=check_dataset,
    select=no_files,
)
