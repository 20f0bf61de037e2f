"""## What it does
`cachedoctor verify` only. Reports a dataset whose sampled latents are, for most entries, as
far from a fresh encode of their image as the latents of unrelated pictures are. The cache was
written by another VAE than the one given with `--encoder` (SD 1.5's and SDXL's VAEs both give
4-channel latents of the same shape), or by another version or precision of it.

## Why is this bad?
Every file is well-formed, so the metadata checks pass, and the trainer loads the latents
without complaint; the model then learns to denoise latents its VAE decodes to something
else. Nothing fails until the samples look wrong, hours later.

## Example
```
CD601 error output/cache/vae/sdxl/photos
      58 of 64 sampled latents are as far from a fresh encode as unrelated latents are
      (median distance 1.02): encoded by another VAE than diffusers:/models/sdxl-vae
```

## Fix
Check first that `--encoder` is the VAE the trainer uses. If it is, the whole cache is of
another VAE: move the latent cache dir aside and let the trainer cache again, or remove the
entries and run `cachedoctor fix CONFIG --reencode --encoder SPEC` (missing entries are
encoded again).
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD601",
    name="encoded-by-another-vae",
    severity=Severity.ERROR,
    summary="verify: most sampled latents are as far from a fresh encode as unrelated latents",
    doc=__doc__,
    fix="reencode",
)
