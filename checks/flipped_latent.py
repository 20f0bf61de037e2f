"""## What it does
`cachedoctor verify` only. Reports a cache entry that matches the encode of its image mirrored
left to right, not the image as it is.

## Why is this bad?
A cache written with flip augmentation on (kohya's `flip_aug`, SimpleTuner's and OneTrainer's
random flips) and read by a run with it off, or an image flipped after caching, trains the
model on the mirror image, every epoch: text, logos and asymmetric subjects come out reversed.

## Example
```
CD603 warning train/10_person/img_004_0256x0256_sdxl.npz
      matches the mirrored encode of img_004.png (distance 0.01), not the image (0.93)
```

## Fix
Remove the entry and run `cachedoctor fix CONFIG --reencode --encoder SPEC` (it is then
missing and is encoded again), or let the trainer cache it again.
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD603",
    name="flipped-latent",
    severity=Severity.WARNING,
    summary="verify: a latent matches its image mirrored, not the image",
    doc=__doc__,
    fix="reencode",
)
