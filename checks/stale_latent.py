"""## What it does
`cachedoctor verify` only. Reports a cache entry that differs from a fresh encode of its image
while the rest of the dataset matches, and no flip, crop, scale or other image of the sampled
bucket explains it: the image changed after the entry was written. Unlike CD406 it does not
rely on times, so it sees an image edited or replaced with its modification time kept (a copy
with `cp -p`, `rsync -t`, a restore from a backup).

## Why is this bad?
The trainer trains on the picture as it was: a retouched image keeps its old latent, a
replaced one trains another picture under its caption.

## Example
```
CD606 warning train/10_person/img_003_0256x0256_sdxl.npz
      differs from a fresh encode of img_003.png (distance 0.42, cosine 0.911): the image
      changed after this entry was written
```

## Fix
Remove the entry and run `cachedoctor fix CONFIG --reencode --encoder SPEC`, or let the trainer
cache it again.
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD606",
    name="stale-latent",
    severity=Severity.WARNING,
    summary="verify: a latent differs from a fresh encode of its image (changed since)",
    doc=__doc__,
    fix="reencode",
)
