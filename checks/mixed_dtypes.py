"""## What it does
Reports a cache whose latents (or whose text embeddings) were saved in more than one dtype:
`bfloat16` files among `float16` ones, `float32` among `bfloat16`. Latents and embeddings are
judged apart, caches that keep model families apart by name per family, and files of different
formats apart (kohya's npz is always float32, whatever the torch files beside it hold). One
finding per cache, listing the files of the minority dtypes.

The `text_embeddings_<i>/` caches of diffusion-pipe (one per text encoder) are judged apart.

## Why is this bad?
Files of one cache should come from one encoder at one precision. Mixed dtypes mean two runs
(a different `--vae_dtype` or mixed precision, another machine) wrote into one cache, so the
other rules' questions (same model? same resolution?) are worth asking. Most trainers cast on
load, so training goes on; batches that mix dtypes can still fail to stack or cost memory.

## Example
```
CD304 warning cache/vae/sdxl/photos  latents in 2 dtypes: float16 (212 files), float32 (8 files)
```

## Fix
None automatic: find which run wrote the minority files (see their mtime) and re-encode them,
or accept the mix if the trainer casts.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import TORCH_LEGACY, TORCH_ZIP
from cachedoctor.formats.shard_blobs import encoder_slot as slot
from cachedoctor.inventory import LATENT, TEXT
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import DatasetView
from cachedoctor.units import count

MAX_LISTED = 1000
CONTAINER = {TORCH_ZIP: "torch", TORCH_LEGACY: "torch"}  # one writer, two torch formats


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    counts: dict[tuple, Counter] = defaultdict(Counter)
    for g, n in view.tally().items():
        if g.dtype is not None:
            counts[(g.role, g.family, CONTAINER.get(g.format, g.format))][g.dtype] += n
    mixed = {g: c for g, c in counts.items() if len(c) > 1}
    if not mixed:
        return
    # diffusion-pipe keeps one text cache per text encoder (text_embeddings_<i>/), whose
    # dtypes may differ by design: where the files say so, they are counted per encoder
    by_encoder: dict[tuple, Counter] = defaultdict(Counter)
    for s in view:
        if s.dtype is not None:
            by_encoder[_group(s)][s.dtype] += 1
    if any(g[3] is not None for g in by_encoder):
        mixed = {g: c for g, c in by_encoder.items() if len(c) > 1}
        if not mixed:
            return
    else:
        mixed = {(*g, None): c for g, c in mixed.items()}
    major = {g: c.most_common(1)[0][0] for g, c in mixed.items()}
    minority: dict[tuple, list[str]] = defaultdict(list)
    folders: dict[tuple, set[str]] = defaultdict(set)
    for s in view:
        group = _group(s)
        if group not in mixed:
            continue
        folders[group].add(os.path.dirname(s.path))
        if s.dtype != major[group] and len(minority[group]) < MAX_LISTED:
            minority[group].append(s.path)
    common = {g: os.path.commonpath(sorted(f)) for g, f in folders.items()}
    facts = ctx.facts
    for group, dtype_counts in sorted(mixed.items(), key=lambda g: str(g[0])):
        role, family, _, encoder = group
        what = "latents" if role == LATENT else "text embeddings"
        if family:
            what += f" ({family})"
        if encoder:
            what += f" ({encoder})"
        where = None
        if facts is not None:
            where = facts.latent_cache_dir if role == LATENT else facts.text_cache_dir
            if where is not None and not common[group].startswith(where):
                where = None
        text = ", ".join(f"{d} ({count(n, 'file')})" for d, n in dtype_counts.most_common())
        yield RULE.finding(where or common[group],
                           f"{what} in {len(dtype_counts)} dtypes: {text}", ctx,
                           dtypes=dict(dtype_counts), files=minority[group])


def _group(s) -> tuple:
    return (s.role, s.family, CONTAINER.get(s.format, s.format),
            slot(s.path) if s.role == TEXT else None)


RULE = Rule(
    code="CD304",
    name="mixed-dtypes",
    severity=Severity.WARNING,
    summary="tensors of one cache disagree in dtype",
    doc=__doc__,
    check_dataset=check_dataset,
)
