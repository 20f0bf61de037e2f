"""## What it does
`cachedoctor verify` only. Reports a cache entry that matches the fresh encode of another image
of the same bucket, not its own: entries and images are paired wrongly.

## Why is this bad?
After images are renamed or swapped (or with a hash-named cache whose names no longer follow
the files, diffusers #14430), the trainer loads one picture's latent with another's caption:
the model learns wrong captions for real pictures, and nothing in the files says so.

## Example
```
CD605 error output/cache/vae/sdxl/photos/4c1f…9e.pt
      matches the encode of beach_0043.png (distance 0.01), not of its own image
      beach_0042.png (0.97)
```

## Fix
Remove the entries named and run `cachedoctor fix CONFIG --reencode --encoder SPEC`, or let the
trainer cache them again; check that the images were not renamed by hand during caching.
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD605",
    name="paired-with-another-image",
    severity=Severity.ERROR,
    summary="verify: a latent matches another image of its bucket, not its own",
    doc=__doc__,
    fix="reencode",
)
