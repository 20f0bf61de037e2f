"""## What it does
Reports a musubi-tuner latent with no text-encoder output beside it: musubi pairs
`<stem>_<W>x<H>_<arch>.safetensors` (a video clip's `<stem>_<pos>-<frames>_<W>x<H>_<arch>`)
with `<stem>_<arch>_te.safetensors` in the same cache directory, and this one has none (or
none that can be read: see its CD1xx finding).

## Why is this bad?
musubi does not fail on it: when it builds its buckets it logs `Text encoder output cache file
not found` and leaves the item out. The text-encoder caching pass was interrupted or run on
another dataset config, and the model trains on fewer samples than the dataset holds.

## Example
```
CD411 error cache/qwen/img_201_0096x0160_qi.safetensors
      no readable img_201_qi_te.safetensors beside it: musubi skips this item (run
      src/musubi_tuner/qwen_image_cache_text_encoder_outputs.py --skip_existing)
```

## Fix
Run musubi-tuner's text-encoder caching script for the architecture with `--skip_existing`: it
writes the missing outputs only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.inventory import LATENT, TEXT
from cachedoctor.layouts.musubi import ARCHITECTURES, IMAGE_LATENT, TEXT_ENTRY, VIDEO_LATENT, script
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary


def _items(path: str) -> list[tuple[str, str, str]]:
    """(directory, item stem, arch) of a musubi latent, as prepare_for_training splits it: as a
    video clip's and as an image's name (an image may be named like a clip)."""
    name = os.path.basename(path)
    out = []
    for pattern in (VIDEO_LATENT, IMAGE_LATENT):
        match = pattern.match(name)
        if match is not None and match["arch"] in ARCHITECTURES:
            out.append((os.path.dirname(path), match["stem"], match["arch"]))
    return out


def _paired(s: FileSummary) -> bool:
    """A musubi latent, or a text-encoder output one may pair with."""
    if s.role == LATENT:
        return s.family in ARCHITECTURES
    return s.role == TEXT and TEXT_ENTRY.match(os.path.basename(s.path)) is not None


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """Every musubi latent and text-encoder output: the rule pairs them by name."""
    if not any(g.role == LATENT and g.family in ARCHITECTURES for g in view.tally()):
        return None
    return lambda s: (None, None) if _paired(s) else None


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    if not any(g.role == LATENT and g.family in ARCHITECTURES for g in view.tally()):
        return
    texts = set()
    for s in view:
        if s.role == TEXT:
            match = TEXT_ENTRY.match(os.path.basename(s.path))
            if match is not None:
                texts.add((os.path.dirname(s.path), match["stem"], match["arch"]))
    for s in view:
        if s.role != LATENT or s.family not in ARCHITECTURES:
            continue
        items = _items(s.path)
        if not items or any(item in texts for item in items):
            continue
        _, stem, arch = items[0]
        yield RULE.finding(
            s.path,
            f"no readable {stem}_{arch}_te.safetensors beside it: musubi skips this item (run "
            f"{script(arch, 'text_encoder_outputs')} --skip_existing)",
            ctx, text_entry=f"{stem}_{arch}_te.safetensors",
        )


RULE = Rule(
    code="CD411",
    name="missing-text-entry",
    severity=Severity.ERROR,
    summary="a musubi-tuner latent has no text-encoder output beside it: the item is left out of training",
    doc=__doc__,
    check_dataset=check_dataset,
    select=select,
)
