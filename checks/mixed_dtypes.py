"""## What it does
Reports a dataset whose latents (or whose text embeddings) were saved in more than one dtype:
`bfloat16` files among `float16` ones, `float32` among `bfloat16`. Only a latent's own dtype
counts (not an int64 `original_size` or a mask beside it); latents and embeddings are judged
apart, each dataset apart (a trainer config's dataset; in a bare tree, each folder of cache
files), caches that keep model families apart by name per family, and files of different
formats apart (kohya's npz is always float32, whatever the torch files beside it hold). One
finding per dataset: with a clear majority (at least 2/3 of the files) it lists the files of the
other dtypes; below that it names both sides of the split.

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

from collections import Counter, defaultdict
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import TORCH_LEGACY, TORCH_ZIP
from cachedoctor.inventory import LATENT
from cachedoctor.majority import Verdict, decide, keep, ranked, split_finding
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary
from cachedoctor.units import count

MAX_LISTED = 1000
CONTAINER = {TORCH_ZIP: "torch", TORCH_LEGACY: "torch"}  # one writer, two torch formats


def _key(role: str, group: str | None, family: str | None, fmt: str) -> tuple:
    return (role, group, family, CONTAINER.get(fmt, fmt))


def _verdicts(view: DatasetView) -> dict[tuple, Verdict]:
    """Per (role, group, family, container), the verdict over its files' dtypes."""
    counts: dict[tuple, Counter] = defaultdict(Counter)
    for g, n in view.tally().items():
        if g.dtype is not None:  # None: no floating latent or embedding to judge
            counts[_key(g.role, g.group, g.family, g.format)][g.dtype] += n
    verdicts: dict[tuple, Verdict] = {}
    for key, c in counts.items():
        if (verdict := decide(c)) is not None:
            verdicts[key] = verdict
    return verdicts


def _listed(s: FileSummary, verdicts: dict[tuple, Verdict]) -> tuple | None:
    """The (comparison, dtype) a file is listed under: a minority's, or either side of a split."""
    if s.dtype is None:
        return None
    key = _key(s.role, s.group, s.family, s.format)
    verdict = verdicts.get(key)
    if verdict is None or not (verdict.split or s.dtype != verdict.major):
        return None
    return key, s.dtype


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """The first MAX_LISTED files (by path) of each listed dtype."""
    verdicts = _verdicts(view)
    if not verdicts:
        return None

    def wanted(s: FileSummary) -> tuple | None:
        listed = _listed(s, verdicts)
        return None if listed is None else (listed, MAX_LISTED)

    return wanted


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    verdicts = _verdicts(view)
    if not verdicts:
        return
    files: dict[tuple, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for s in view:
        listed = _listed(s, verdicts)
        if listed is not None:
            keep(files[listed[0]][listed[1]], s.path, MAX_LISTED)
    for key, verdict in sorted(verdicts.items(), key=lambda kv: str(kv[0])):
        role, group, family, _ = key
        what = "latents" if role == LATENT else "text embeddings"
        if family:
            what += f" ({family})"
        common = view.common_folder(
            lambda g, key=key: g.dtype is not None and _key(g.role, g.group, g.family, g.format) == key)
        where = group or _configured(ctx, role, common) or common
        if verdict.split:
            yield split_finding(RULE, where, ctx, f"{what} dtypes", verdict, str, files[key])
            continue
        text = ", ".join(f"{d} ({count(n, 'file')})" for d, n in ranked(verdict.counts))
        minority = sorted(p for d, ps in files[key].items() if d != verdict.major for p in ps)
        yield RULE.finding(where, f"{what} in {len(verdict.counts)} dtypes: {text}", ctx,
                           dtypes=sorted(verdict.counts), majority_dtype=verdict.major,
                           counts=dict(verdict.counts), files=minority)


def _configured(ctx: RuleContext, role: str, common: str) -> str | None:
    """The trainer config's cache dir of `role`, when the files (under `common`) are under it."""
    facts = ctx.facts
    if facts is None:
        return None
    where = facts.latent_cache_dir if role == LATENT else facts.text_cache_dir
    if where is None or not common.startswith(where):
        return None
    return where


RULE = Rule(
    code="CD304",
    name="mixed-dtypes",
    severity=Severity.WARNING,
    summary="tensors of one dataset disagree in dtype",
    doc=__doc__,
    check_dataset=check_dataset,
    select=select,
)
