"""## What it does
With `--deep`, reads the values of every floating-point tensor and reports NaN or Inf.

## Why is this bad?
A VAE run in fp16 overflows on some images (values past 65,504 become Inf, Inf − Inf becomes
NaN), and the NaN is cached. Every step that draws the sample then produces a NaN loss that
poisons the weights. SimpleTuner deletes such files at collate time and raises `contains NaN or
Inf values`; other trainers train on them silently.

## Example
```
$ cachedoctor scan --deep cache/vae
CD106 error cache/vae/photos/3fa1e2.pt  1,024 NaN/Inf values in <root>
```

## Fix
`cachedoctor fix --deep` moves the file to the quarantine; re-encode it with `--reencode`,
ideally with the VAE in fp32 or bf16 (`--vae_dtype`).
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.rule import Rule, RuleContext


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not meta.nonfinite:
        return None
    total = sum(count for _, count in meta.nonfinite)
    where = ", ".join("".join(f"[{p!r}]" for p in path) or "<root>" for path, _ in meta.nonfinite)
    return RULE.finding(meta.path, f"{total:,} NaN/Inf values in {where}", ctx,
                        count=total, tensors={str(list(p)): c for p, c in meta.nonfinite})


RULE = Rule(
    code="CD106",
    name="non-finite-values",
    severity=Severity.ERROR,
    summary="--deep: NaN or Inf in a latent or embedding",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    deep=True,
    check_file=check,
)
