"""## What it does
Reports tensors stored on different devices within one file (`{"latent_image": <cpu>,
"latent_mask": <cuda:0>}`), and caches whose files were saved from different devices (some on
`cpu`, some on `cuda:0`, or on `cuda:0` and `cuda:1`), across the whole cache of a dataset:
every folder of it, latents and text embeddings alike.

## Why is this bad?
Loaded without `map_location`, the tensors land on different devices, and the first operation
that combines them fails: `RuntimeError: Expected all tensors to be on the same device, but
found at least two devices, cuda:0 and cpu!` (OneTrainer #459: validation mixed cached CPU
tensors with live CUDA ones). A cache whose files disagree usually had several writers (ranks,
or a GPU and a CPU caching pass); which device a sample loads onto then depends on the sample.

Not reported where the trainer's loader passes `map_location` (SimpleTuner: `"cpu"`; OneTrainer's
mgds: its `train_device`; a OneTrainer cache scanned without its config, known by its
`aggregate.pt` files; finetrainers' `finetrainers-precomputed-data/`, whose Wan items hold CUDA
latents beside CPU means): every tensor then lands on that one device, whatever it was saved from.
kohya's npz, ai-toolkit's safetensors and 🤗 datasets' Arrow files record no device at all. A
cache no trainer config describes (its loader unknown) is judged as a plain `torch.load` would
load it, each folder of cache files on its own (a folder of several projects holds caches that
different trainers load), and a OneTrainer cache in it (`<sha256>/variation-<n>` folders) as mgds
loads it.

## Example
```
CD502 error cache/1024x1024/0007.pt  tensors on different devices: cpu (latent_image), cuda:0 (latent_mask)
CD502 error cache                    files saved from different devices: cpu: 28 files, cuda:0: 12 files
```

## Fix
`cachedoctor fix` rewrites every tensor of the affected files on the CPU (`to-cpu`),
bit-identical.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.base import ANY_DEVICE
from cachedoctor.majority import keep
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary
from cachedoctor.units import count

MAX_LISTED = 1000


def _mapped(ctx: RuleContext) -> bool:
    """Whether the trainer loads with map_location: every tensor on one device, no mix."""
    return ctx.facts is not None and ctx.facts.expected_device == ANY_DEVICE


def check_file(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if len(meta.tensors) < 2 or _mapped(ctx):
        return None
    locations = meta.locations
    if len(locations) < 2:
        return None
    where = {loc: [t.display_path for t in meta.tensors if t.location == loc] for loc in locations}
    text = ", ".join(f"{loc} ({', '.join(paths[:3])})" for loc, paths in where.items())
    return RULE.finding(meta.path, f"tensors on different devices: {text}", ctx, locations=where)


def _counts(view: DatasetView) -> dict[str | None, Counter[str]]:
    """Files per device, per group: the caches side by side in a bare tree are loaded by
    different trainers, so only files of one group are compared."""
    counts: dict[str | None, Counter[str]] = {}
    for g, n in view.tally().items():
        if len(g.locations) == 1:  # a file mixed within itself is reported by check_file
            counts.setdefault(g.group, Counter())[g.locations[0]] += n
    return {group: by_location for group, by_location in counts.items() if len(by_location) >= 2}


def _off_cpu(s: FileSummary) -> bool:
    return len(s.locations) == 1 and s.locations[0] != "cpu"


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """The first MAX_LISTED files (by path) saved off the CPU, of each group that mixes."""
    mixed = {} if _mapped(ctx) else _counts(view)
    if not mixed:
        return None
    return lambda s: (s.group, MAX_LISTED) if s.group in mixed and _off_cpu(s) else None


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    if _mapped(ctx):
        return
    mixed = _counts(view)
    if not mixed:
        return
    off_cpu: dict[str | None, list[str]] = {group: [] for group in mixed}  # what the fix rewrites
    for s in view:
        if s.group in mixed and _off_cpu(s):
            keep(off_cpu[s.group], s.path, MAX_LISTED)
    for group in sorted(mixed, key=lambda g: g or ""):
        common = view.common_folder(lambda g, group=group: len(g.locations) == 1 and g.group == group)
        counts = mixed[group]
        text = ", ".join(f"{loc}: {count(n, 'file')}" for loc, n in counts.most_common())
        yield RULE.finding(common, f"files saved from different devices: {text}", ctx,
                           locations=dict(counts), files=off_cpu[group])


RULE = Rule(
    code="CD502",
    name="mixed-devices",
    severity=Severity.ERROR,
    summary="one file, or one cache, holds tensors stored on different devices",
    doc=__doc__,
    fix=FixKind.TO_CPU,
    check_file=check_file,
    check_dataset=check_dataset,
    select=select,
)
