"""## What it does
Reports latents whose shape differs from the other latents of their aspect bucket. The bucket
comes from the trainer's own metadata: SimpleTuner's `aspect_ratio_bucket_*.json`, the size in
kohya's npz names with the dataset's bucket settings, OneTrainer's `crop_resolution` in
`aggregate.pt`, ai-toolkit's crop size in the safetensors header; in a bare cache dir, each
sub-folder is a bucket (files directly in the dir are not: a SimpleTuner VAE cache holds every
aspect ratio in one flat folder). The finding names the bucket's majority shape.

## Why is this bad?
Trainers batch latents of one bucket and stack them: one latent of another shape stops
training with `RuntimeError: stack expects each tensor to be equal size, but got [4, 72, 120]
at entry 0 and [4, 80, 112] at entry 2` (kohya sd-scripts #522, SimpleTuner #59) or SimpleTuner's
`latent shape mismatch`, at whatever step first draws that batch. The usual causes: the
resolution changed after the cache was built, two datasets share a cache dir (CD402), or the
image dir is the cache dir (CD401).

## Example
```
CD301 error cache/vae/sdxl/photos/9c0d…41.pt
      shape [4, 96, 96] differs from bucket 1.33: 37 of 40 latents there are [4, 96, 128]
```

## Fix
`cachedoctor fix` quarantines the minority files; `--reencode` encodes them again at the
bucket's size (the trainer also re-encodes missing entries on its next caching pass).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.inventory import LATENT
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import DatasetView
from cachedoctor.units import shape_text


def majority(counts: Counter, expected: tuple[int, int] | None) -> tuple:
    """The most common shape; on a tie, the one of the expected size, else the first seen."""
    ranked = counts.most_common()
    top = ranked[0][1]
    tied = [shape for shape, n in ranked if n == top]
    if expected is not None:
        for shape in tied:
            if tuple(shape[-2:]) == expected:
                return shape
    return tied[0]


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    counts: dict[tuple, Counter] = defaultdict(Counter)
    expected: dict[tuple, tuple[int, int]] = {}
    for g, n in view.tally().items():
        if g.role == LATENT and g.bucket is not None and g.shape:
            group = (g.family, g.bucket)
            counts[group][g.shape] += n
            if g.expected is not None:
                expected.setdefault(group, g.expected)
    mixed = {g: majority(c, expected.get(g)) for g, c in counts.items() if len(c) > 1}
    if not mixed:
        return
    for s in view:
        if s.role != LATENT or s.bucket is None or not s.shape:
            continue
        group = (s.family, s.bucket)
        major = mixed.get(group)
        if major is None or s.shape == major:
            continue
        total = sum(counts[group].values())
        n = counts[group][major]
        yield RULE.finding(
            s.path,
            f"shape {shape_text(s.shape)} differs from bucket {s.bucket}: {n:,} of {total:,} "
            f"latents there are {shape_text(major)}",
            ctx, bucket=s.bucket, shape=list(s.shape), majority_shape=list(major),
            majority_files=n, bucket_files=total,
        )


RULE = Rule(
    code="CD301",
    name="bucket-shape-mismatch",
    severity=Severity.ERROR,
    summary="latents of one aspect bucket (trainer metadata, else a sub-folder) disagree in shape",
    doc=__doc__,
    fix="quarantine",
    check_dataset=check_dataset,
)
