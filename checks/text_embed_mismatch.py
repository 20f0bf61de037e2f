"""## What it does
Reports text-embedding files whose keys or feature sizes differ from the rest of their cache:
`prompt_embeds` of 4096 features among files of 2048 (a T5 cache among CLIP ones), or files
with `pooled_prompt_embeds` among files without. Sequence lengths (masks, token ids) may vary
and are not compared. A diffusion-pipe cache keeps one sharded cache per text encoder
(`text_embeddings_<i>/`): each is compared with its own kind only.

## Why is this bad?
The embeddings of one cache feed one model: files of another text encoder (another model
family, or an old SimpleTuner cache dir reused after `--model_family` changed) fail at the
first batch that holds one (`mat1 and mat2 shapes cannot be multiplied`), or a missing key
raises `KeyError` in the trainer's collate function.

## Example
```
CD305 error cache/text/flux/10f34c853ae35b374b489315e55183a4-flux.pt
      keys or sizes differ from 40 of 42 embeddings in this cache: prompt_embeds has 2048
      features (4096 in the others); pooled_prompt_embeds has 1280 features (768 in the others)
```

## Fix
`cachedoctor fix` quarantines the minority files; the trainer encodes the captions again.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.shard_blobs import encoder_slot as slot
from cachedoctor.inventory import TEXT
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import DatasetView

# keys whose last dimension is a sequence length, not a feature size
SEQUENCE_KEY = re.compile(r"(mask|ids|tokens|time_ids)", re.IGNORECASE)


def normalized(signature: tuple) -> tuple:
    return tuple((key, None if SEQUENCE_KEY.search(key) else dim) for key, dim in signature)


def describe(theirs: tuple, ours: tuple) -> str:
    mine, other = dict(ours), dict(theirs)
    parts = [f"{k} has {mine[k]} features ({other[k]} in the others)"
             for k in mine if k in other and mine[k] != other[k]]
    if extra := [k for k in mine if k not in other]:
        parts.append(f"has {', '.join(extra)}, which the others lack")
    if missing := [k for k in other if k not in mine]:
        parts.append(f"lacks {', '.join(missing)}")
    return "; ".join(parts)


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    counts: Counter = Counter()
    for g, n in view.tally().items():
        if g.role == TEXT and g.signature:
            counts[normalized(g.signature)] += n
    if len(counts) < 2:
        return
    # several signatures: counted again per text encoder where the files say which
    by_slot: dict[str | None, Counter] = {}
    for s in view:
        if s.role == TEXT and s.signature:
            by_slot.setdefault(slot(s.path), Counter())[normalized(s.signature)] += 1
    if set(by_slot) == {None}:  # no diffusion-pipe blob: the tally's counts, as they were
        by_slot = {None: counts}
    majors = {k: (c.most_common(1)[0], sum(c.values())) for k, c in by_slot.items()}
    for s in view:
        if s.role != TEXT or not s.signature:
            continue
        mine = normalized(s.signature)
        (major, n), total = majors[slot(s.path)]
        if mine == major:
            continue
        yield RULE.finding(
            s.path,
            f"keys or sizes differ from {n:,} of {total:,} embeddings in this cache: "
            f"{describe(major, mine)}",
            ctx, signature=[list(k) for k in mine], majority_signature=[list(k) for k in major],
        )

RULE = Rule(
    code="CD305",
    name="text-embed-mismatch",
    severity=Severity.ERROR,
    summary="text-embedding files of one cache disagree in keys or feature sizes (two model families)",
    doc=__doc__,
    fix="quarantine",
    check_dataset=check_dataset,
)
