"""## What it does
`cachedoctor verify --text-encoder SPEC` only. Reports a text-embedding file that differs from
a fresh embedding of the caption its trainer gives it now, while the rest of the dataset
matches its captions: the caption changed after the embedding was cached. Where the file
records the caption it embedded (musubi-tuner's `caption1`), that caption is embedded too, and
the finding says when it matches; where the embedding matches another sampled item's caption,
it names that item (captions swapped or renamed).

## Why is this bad?
The trainer trains on the cached embedding, not on the caption file: an edited caption keeps
its old embedding, and nothing compares the two again (kohya and musubi-tuner skip existing
text-encoder outputs; a renamed caption file pairs an image with another image's text).

## Example
```
CD607 warning train/10_person/img_003_te_outputs.npz
      differs from an embedding of its caption 'a photo of a red car' (img_003.txt; distance
      0.94, cosine 0.412): the caption changed after this embedding was cached
```

## Fix
`fix --reencode` encodes latents only, so this is by hand: delete the files named and run the
trainer's text-encoder caching again (kohya: a run with `--cache_text_encoder_outputs_to_disk`
encodes the missing ones; musubi-tuner: its `cache_text_encoder_outputs.py` with
`--skip_existing`; SimpleTuner encodes missing embeddings at start-up).
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD607",
    name="caption-changed",
    severity=Severity.WARNING,
    summary="verify: a text embedding differs from a fresh embedding of its caption",
    doc=__doc__,
    fix=None,
)
