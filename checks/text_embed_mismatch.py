"""## What it does
Reports text-embedding files whose keys or feature sizes differ from the rest of their dataset:
`prompt_embeds` of 4096 features among files of 2048 (a T5 cache among CLIP ones), or files
with `pooled_prompt_embeds` among files without. Sequence lengths may vary and are not
compared: only a tensor's last dimension is, and not that of a mask, of token ids, or of any
integer or bool tensor (ids, per-token tags or indexes: one value per token of the caption).
Only embeddings of one dataset are compared (a trainer config's text cache; in a bare tree, each
folder of cache files), of one model family where the names tell it (SimpleTuner's
`-<family>.pt`, kohya's `_<arch>_te.npz` beside `_te_outputs.npz`, musubi's
`_<arch>_te.safetensors`; diffusion-pipe's `text_embeddings_<i>/`, one sharded cache per text
encoder), and a file is reported only when the other signature holds a clear majority (at least
2/3 of the embeddings). Below that the split is one warning naming both sides, and `fix` leaves
it alone.

## Why is this bad?
The embeddings of one cache feed one model: files of another text encoder (another model
family, or an old SimpleTuner cache dir reused after `--model_family` changed) fail at the
first batch that holds one (`mat1 and mat2 shapes cannot be multiplied`), or a missing key
raises `KeyError` in the trainer's collate function.

## Example
```
CD305 error cache/text/flux/10f34c853ae35b374b489315e55183a4-flux.pt
      keys or sizes differ from 40 of 42 embeddings in this dataset: prompt_embeds has 2048
      features (4096 in the others); pooled_prompt_embeds has 1280 features (768 in the others)
```

## Fix
`cachedoctor fix` quarantines the minority files of a clear majority; the trainer encodes the
captions again. A split is yours to settle: give each text encoder a cache dir of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.inventory import TEXT
from cachedoctor.majority import PerFolder
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary, Group

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


def _label(signature: tuple) -> str:
    return ", ".join(f"{k}[{d}]" if d is not None else k for k, d in signature) or "<none>"


def _signature(s: FileSummary | Group) -> tuple | None:
    return normalized(s.signature) if s.role == TEXT and s.signature else None


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """The embeddings of the minority signatures, and a few of each side of a split."""
    return PerFolder(view, _signature).selector()


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    compared = PerFolder(view, _signature)
    for s, mine, verdict in compared.minorities(view):
        yield RULE.finding(
            s.path,
            f"keys or sizes differ from {verdict.counts[verdict.major]:,} of {verdict.total:,} "
            f"embeddings in this dataset: {describe(verdict.major, mine)}",
            ctx, signature=[list(k) for k in mine],
            majority_signature=[list(k) for k in verdict.major],
        )
    yield from compared.split_findings(RULE, ctx, ctx.facts.text_cache_dir if ctx.facts else None,
                                       "text embeddings", _label)


RULE = Rule(
    code="CD305",
    name="text-embed-mismatch",
    severity=Severity.ERROR,
    summary="text-embedding files of one dataset disagree in keys or feature sizes (two model families)",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_dataset=check_dataset,
    select=select,
)
