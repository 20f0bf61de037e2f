"""## What it does
With `--deep`, reports a latent in a safetensors cache of which at least 1% of the values
(`min-fraction`) are exactly zero. Only tensors that are latents are judged: keys starting with
`latent` (musubi-tuner's `latents_<F>x<H>x<W>_<dtype>`, ai-toolkit's `latent`).

## Why is this bad?
A VAE latent has essentially no values that are exactly zero. musubi-tuner's
`save_latent_cache_common` replaces every NaN with 0 before it saves (it logs `tensor has NaN,
replace NaN with 0` and goes on): a VAE that overflowed in float16 on part of an image or of
some video frames leaves a region of zeros that CD106 cannot see, and the model learns that
the region is flat grey.

## Example
```
CD108 warning cache/hv/clip_3_00000-025_0960x0544_hv.safetensors
      4,080 of 65,280 values (6.2%) are exactly 0 in latents_7x68x120_bfloat16: NaN replaced
      with zeros when it was cached?
```

## Fix
`cachedoctor fix --deep` moves the file to the quarantine; cache it again with the VAE in
float32 or bfloat16 (musubi-tuner: `--vae_dtype`).
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import FileMeta
from cachedoctor.rule import Rule, RuleContext


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not meta.zeros:
        return None
    least = RULE.setting(ctx, "min-fraction")
    found = [(path, zeros, total) for path, zeros, total in meta.zeros
             if path and isinstance(path[0], str) and path[0].startswith("latent") and total
             and zeros / total >= least and zeros >= 16]
    if not found:
        return None
    parts = [f"{zeros:,} of {total:,} values ({zeros / total:.1%}) are exactly 0 in "
             f"{'/'.join(map(str, path))}" for path, zeros, total in found]
    return RULE.finding(meta.path, "; ".join(parts) + ": NaN replaced with zeros when it was "
                        "cached?", ctx,
                        tensors={"/".join(map(str, p)): [z, t] for p, z, t in found})


RULE = Rule(
    code="CD108",
    name="zeroed-values",
    severity=Severity.WARNING,
    summary="--deep: a latent with a share of values exactly 0 (NaN replaced with zeros when cached)",
    doc=__doc__,
    fix="quarantine",
    deep=True,
    check_file=check,
    settings={"min-fraction": 0.01},
)
