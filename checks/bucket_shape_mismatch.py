"""## What it does
Reports latents whose shape differs from the other latents of their aspect bucket. The bucket
comes from the trainer's own metadata: SimpleTuner's `aspect_ratio_bucket_*.json`, the size in
kohya's npz names with the dataset's bucket settings, OneTrainer's `crop_resolution` in
`aggregate.pt`, ai-toolkit's crop size in the safetensors header; in a bare cache dir, a
bucket-named sub-folder (`1024x1024`, `1.33`) is a bucket (files of any other folder are not: a
SimpleTuner VAE cache holds every aspect ratio in one flat folder, or in sub-folders that mirror
the image folders). Which shape is right: where the trainer's metadata gives the
bucket's size, the one shape of that size (evidence, whatever the counts); else a clear majority
(at least 2/3 of the bucket's latents). Files of another shape are reported, naming the right
one. Without either (3 against 2, no metadata) the bucket's split is one warning naming both
shapes, and `fix` leaves it alone.

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
`cachedoctor fix` quarantines the minority files of a clear majority; `--reencode` encodes them
again at the bucket's size (the trainer also re-encodes missing entries on its next caching
pass). A split is yours to settle: the bucket's expected size (CD302) often tells which side is
right.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.inventory import LATENT
from cachedoctor.majority import EXAMPLES, Verdict, decide, keep, place, split_finding
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary
from cachedoctor.units import shape_text


def judge(counts: Counter, expected: tuple[int, int] | None) -> Verdict | None:
    """The bucket's verdict: the one shape of the trainer's expected size when there is one,
    else decide()'s clear majority or split."""
    if len(counts) < 2:
        return None
    if expected is not None:
        fitting = [shape for shape in counts if tuple(shape[-2:]) == expected]
        if len(fitting) == 1:
            return Verdict(fitting[0], counts, sum(counts.values()))
    return decide(counts)


def _verdicts(view: DatasetView) -> tuple[dict[tuple, Verdict], dict[tuple, tuple[int, int]]]:
    """Per (group, family, bucket), the verdict over its latents' shapes, and the sizes the
    trainer expects."""
    counts: dict[tuple, Counter] = defaultdict(Counter)
    expected: dict[tuple, tuple[int, int]] = {}
    for g, n in view.tally().items():
        # dtype None: no floating latent (an int64 tensor is some other value, not a latent)
        if g.role == LATENT and g.bucket is not None and g.shape and g.dtype is not None:
            key = (g.group, g.family, g.bucket)
            counts[key][g.shape] += n
            if g.expected is not None:
                expected.setdefault(key, g.expected)
    verdicts: dict[tuple, Verdict] = {}
    for key, c in counts.items():
        if (verdict := judge(c, expected.get(key))) is not None:
            verdicts[key] = verdict
    return verdicts, expected


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """The files of the minority shapes, and a few of each side of a split."""
    verdicts, _ = _verdicts(view)
    if not verdicts:
        return None

    def wanted(s: FileSummary) -> tuple | None:
        if s.role != LATENT or s.bucket is None or not s.shape or s.dtype is None:
            return None
        key = (s.group, s.family, s.bucket)
        verdict = verdicts.get(key)
        if verdict is None:
            return None
        if verdict.split:
            return (key, s.shape), EXAMPLES
        return ((key, s.shape), None) if s.shape != verdict.major else None

    return wanted


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    verdicts, expected = _verdicts(view)
    if not verdicts:
        return
    split: dict[tuple, dict[tuple, list[str]]] = defaultdict(lambda: defaultdict(list))
    for s in view:
        if s.role != LATENT or s.bucket is None or not s.shape or s.dtype is None:
            continue
        key = (s.group, s.family, s.bucket)
        verdict = verdicts.get(key)
        if verdict is None:
            continue
        if verdict.split:
            keep(split[key][s.shape], s.path)
        elif s.shape != verdict.major:
            n = verdict.counts[verdict.major]
            yield RULE.finding(
                s.path,
                f"shape {shape_text(s.shape)} differs from bucket {s.bucket}: {n:,} of "
                f"{verdict.total:,} latents there are {shape_text(verdict.major)}"
                + (", the size the trainer's bucket needs"
                   if expected.get(key) == tuple(verdict.major[-2:]) else ""),
                ctx, bucket=s.bucket, shape=list(s.shape), majority_shape=list(verdict.major),
                majority_files=n, bucket_files=verdict.total,
            )
    for key, files in sorted(split.items(), key=lambda kv: str(kv[0])):
        where = place(key[0], ctx.facts.latent_cache_dir if ctx.facts else None, files)
        yield split_finding(RULE, where, ctx, f"latents of bucket {key[2]}", verdicts[key],
                            shape_text, files, bucket=key[2])


RULE = Rule(
    code="CD301",
    name="bucket-shape-mismatch",
    severity=Severity.ERROR,
    summary="latents of one aspect bucket (trainer metadata, else a sub-folder) disagree in shape",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_dataset=check_dataset,
    select=select,
)
