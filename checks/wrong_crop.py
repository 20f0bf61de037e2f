"""## What it does
`cachedoctor verify` only. Reports a cache entry that matches another crop of its image
(shifted by a latent pixel or more, or at a corner) better than the crop the trainer's layout
says it takes (kohya's centred `crop_ltrb`, SimpleTuner's bucket crop, OneTrainer's
`crop_resolution`, ai-toolkit's crop metadata).

## Why is this bad?
The latent shows a part of the picture the trainer does not think it shows: the crop
coordinates that SDXL conditions on are wrong for it, and a subject at the edge may be cut.
It happens when the crop style changed (`crop_style` random, centre, corner) after caching,
or the bucket list changed without the cache.

## Example
```
CD604 warning output/cache/vae/sdxl/photos/4c1f…9e.pt
      matches the crop at (16, 0) of beach_0042.png resized to 160x128 (distance 0.02), not
      the trainer's crop at (8, 0) (0.71)
```

## Fix
Remove the entry and run `cachedoctor fix CONFIG --reencode --encoder SPEC`, or let the trainer
cache it again.
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD604",
    name="wrong-crop",
    severity=Severity.WARNING,
    summary="verify: a latent matches another crop of its image than the trainer's",
    doc=__doc__,
    fix="reencode",
)
