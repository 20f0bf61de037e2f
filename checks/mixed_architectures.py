"""## What it does
Reports cache files of another architecture in a cache directory that holds mostly one: a
FLUX Kontext latent (`…_fk.safetensors`) among Qwen-Image ones (`…_qi.safetensors`). The
architecture is the one the file name says (musubi-tuner's `<stem>_<W>x<H>_<arch>` and
`<stem>_<arch>_te` safetensors); caches of several architectures in separate directories are
fine. kohya's npz are not judged: kohya keeps every model's cache beside the images by design
(`<stem>_<W>x<H>_sdxl.npz` next to `_flux.npz`), and reads only its own architecture's.

## Why is this bad?
One cache directory is one dataset's cache for one model. Two caching passes for different
models pointed at the same `cache_directory` leave two sets of latents and text-encoder
outputs side by side. Each trainer globs only its own architecture, so the other set is dead
weight. But the next caching pass of either (without `--keep_cache`) treats the directory as
its own, and a dataset config copied from one model to the other silently reuses the wrong
set's captions and buckets. Usually the dataset config of one of the runs points at the wrong
directory.

## Example
```
CD309 warning cache/qwen/img_000_0128x0128_fk.safetensors
      architecture fk in a cache directory where 18 of 19 files are qi: give each model's
      dataset its own cache_directory
```

## Fix
None automatic: give each model's dataset config its own `cache_directory` and move the other
architecture's files there (or delete them).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import SAFETENSORS
from cachedoctor.inventory import LATENT, TEXT
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import DatasetView


def _judged(role: str, fmt: str, family: str | None) -> bool:
    return role in (LATENT, TEXT) and fmt == SAFETENSORS and family is not None


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    families = {g.family for g in view.tally() if _judged(g.role, g.format, g.family)}
    if len(families) < 2:
        return
    by_dir: dict[str, Counter] = defaultdict(Counter)
    for s in view:
        if _judged(s.role, s.format, s.family):
            by_dir[os.path.dirname(s.path)][s.family] += 1
    mixed = {d: c for d, c in by_dir.items() if len(c) > 1}
    if not mixed:
        return
    for s in view:
        counts = mixed.get(os.path.dirname(s.path))
        if counts is None or not _judged(s.role, s.format, s.family):
            continue
        major, n = counts.most_common(1)[0]
        if s.family == major:
            continue
        yield RULE.finding(
            s.path,
            f"architecture {s.family} in a cache directory where {n:,} of "
            f"{sum(counts.values()):,} files are {major}: give each model's dataset its own "
            "cache_directory",
            ctx, family=s.family, majority_family=major,
        )


RULE = Rule(
    code="CD309",
    name="mixed-architectures",
    severity=Severity.WARNING,
    summary="cache files of several model architectures in one cache directory (file names say which)",
    doc=__doc__,
    check_dataset=check_dataset,
)
