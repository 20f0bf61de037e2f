"""## What it does
Reports cache files of another architecture in a cache directory that holds mostly one: a
FLUX Kontext latent (`…_fk.safetensors`) among Qwen-Image ones (`…_qi.safetensors`). The
architecture is the one the file name says (musubi-tuner's `<stem>_<W>x<H>_<arch>` and
`<stem>_<arch>_te` safetensors); caches of several architectures in separate directories are
fine, and so is a directory where no architecture holds a clear majority (2/3 of its files):
one dataset config cached for two models, which musubi-tuner's architecture suffixes allow
(each model's loader, and its caching pass's clean-up, globs `*_<arch>.safetensors` only:
dataset/image_video_dataset.py `get_all_latent_cache_files`). kohya's npz are not judged:
kohya keeps every model's cache beside the images by design (`<stem>_<W>x<H>_sdxl.npz` next to
`_flux.npz`), and reads only its own architecture's.

## Why is this bad?
A few files of another architecture among one's were written by a caching pass of another
model whose dataset config points at the wrong `cache_directory`: that run's dataset is cached
somewhere it does not look for it (or only partly), and here its files are dead weight, since
each trainer globs only its own architecture.

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
from cachedoctor.majority import decide, ranked
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary


def _judged(role: str, fmt: str, family: str | None) -> bool:
    return role in (LATENT, TEXT) and fmt == SAFETENSORS and family is not None


def _mixed(view: DatasetView) -> dict[str, Counter]:
    """The folders whose judged files are of several families: their families' counts."""
    families = {g.family for g in view.tally() if _judged(g.role, g.format, g.family)}
    if len(families) < 2:
        return {}
    by_dir: dict[str, Counter] = defaultdict(Counter)
    for (folder, g), n in view.folder_tally().items():
        if _judged(g.role, g.format, g.family):
            by_dir[folder][g.family] += n
    # an even split is two models' passes over one dataset: no side is the stray one
    return {d: c for d, c in by_dir.items() if len(c) > 1 and decide(c).major is not None}


def _major(counts: Counter) -> tuple[str, int]:
    return ranked(counts)[0]  # a tie goes to the same family whatever order files came in


def _odd(s: FileSummary, mixed: dict[str, Counter]) -> bool:
    counts = mixed.get(os.path.dirname(s.path))
    return counts is not None and _judged(s.role, s.format, s.family) and \
        s.family != _major(counts)[0]


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """The files of another family than their folder's most."""
    mixed = _mixed(view)
    if not mixed:
        return None
    return lambda s: (None, None) if _odd(s, mixed) else None


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    mixed = _mixed(view)
    if not mixed:
        return
    for s in view:
        if not _odd(s, mixed):
            continue
        counts = mixed[os.path.dirname(s.path)]
        major, n = _major(counts)
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
    select=select,
)
