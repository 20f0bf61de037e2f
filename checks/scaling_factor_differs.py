"""## What it does
`cachedoctor verify` only. Reports a dataset whose sampled latents are a fresh encode times a
factor (plus a shift): a least-squares fit cached ≈ a·fresh + b leaves almost nothing, and `a`
is not 1 (or `b` is not 0). The finding gives the factor and names the VAE family whose
scaling factor it is: `x0.18215` scaled once more than the trainer does, `x1/0.13025` scaled
once less.

## Why is this bad?
Trainers differ in what they store: SimpleTuner and ai-toolkit store latents already scaled
(and shifted), kohya and OneTrainer unscaled, scaling as they load. A cache written by one
convention and read by the other, or a changed `scaling_factor` in the VAE config, feeds the
model latents several times too large or too small: training runs, and learns the wrong noise
level.

## Example
```
CD602 error output/cache/vae/sdxl/photos
      64 of 64 sampled latents are x7.6775 (x1/0.13025: SDXL's 0.13025 missing) of a fresh
      encode: the scaling factor differs
```

## Fix
The whole cache, not single entries: move the latent cache dir aside and let the trainer
cache again (or remove the entries and run `cachedoctor fix CONFIG --reencode --encoder SPEC`).
Check that the VAE config's `scaling_factor` and `shift_factor` are the ones the trainer uses.
"""

from __future__ import annotations

from cachedoctor.findings import Severity
from cachedoctor.rule import Rule

RULE = Rule(
    code="CD602",
    name="scaling-factor-differs",
    severity=Severity.ERROR,
    summary="verify: sampled latents are a fresh encode times a factor (plus a shift)",
    doc=__doc__,
    fix="reencode",
)
