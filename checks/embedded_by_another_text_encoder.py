"""## What it does
`cachedoctor verify --text-encoder SPEC` only. Reports a dataset whose sampled text embeddings
are, for most files, as far from a fresh embedding of their captions as the embeddings of
unrelated captions are, or have no tensor of the size the text encoder gives. The cache was
then written by another text encoder (another model, version or precision of it, another
hidden layer) than the one given with `--text-encoder`.

## Why is this bad?
Embeddings of the same shape from another text encoder load without complaint (two CLIP-L
fine-tunes, SD 2's OpenCLIP for SD 1.5's CLIP at 1024 features in a cache read as 1024), and
the model learns to follow conditioning its own text encoder never gives at inference: prompts
stop working, and nothing fails.

## Example
```
CD608 error train/10_person
      9 of 9 sampled text embeddings are as far from a fresh embedding of their caption as
      unrelated captions' embeddings are (median distance 1.31): embedded by another text
      encoder than transformers:/models/sdxl/text_encoder
```

## Fix
Check first that `--text-encoder` is the text encoder the trainer uses (and, for a pipeline
with two, the one whose output is compared: `transformers:PATH#2`). If it is, delete the text
cache and let the trainer encode the captions again (`fix --reencode` encodes latents only).
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD608",
    name="embedded-by-another-text-encoder",
    severity=Severity.ERROR,
    summary="verify: most sampled text embeddings are far from fresh embeddings of their captions",
    doc=__doc__,
    fix=None,
)
