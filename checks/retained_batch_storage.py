"""## What it does
Compares the bytes stored for each tensor storage in a file with the bytes its tensors can
reach, and reports files that store much more than they use (`min-ratio`, default 1.5, and at
least `min-wasted-bytes`, default 4,096, wasted).

## Why is this bad?
`torch.save(batch[i])` saves a view, and torch writes the view's whole underlying storage: the
whole batch goes into every file (SimpleTuner #550: with batch size 8, 7 of 8 latent files
were about 7x too large). The files load and train correctly, so nothing fails; the cache just
takes batch-size times the disk, I/O and page cache it should.

## Example
```python
latents = vae.encode(images).latent_dist.sample()   # [8, 16, 96, 168]
for i, path in enumerate(paths):
    torch.save(latents[i], path)                     # writes all 8 latents, every time
```
```
CD201 warning cache/vae/photos/9c0d41.pt
      stores a whole batch: 4,128,768 B for 516,096 B of tensor (x8.0); 3,612,672 B wasted
```
The writer's fix is `torch.save(latents[i].clone(), path)`.

## Fix
`cachedoctor fix` rewrites the file compactly (`compact`): it loads with `weights_only=True`,
clones every tensor, saves in the same container, checks every tensor is bit-identical to the
original and then replaces the file, keeping the original in the quarantine.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta, TensorMeta
from cachedoctor.rule import Rule, RuleContext


def used_bytes(views: tuple[TensorMeta, ...]) -> int:
    """Bytes of the union of the views' extents (exact for contiguous views)."""
    spans = sorted(t.extent() for t in views)
    used, end = 0, -1
    for begin, stop in spans:
        if stop <= end:
            continue
        used += stop - max(begin, end)
        end = stop
    return used


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    tensors = meta.tensors
    if len(tensors) == 1 and tensors[0].extent() == (0, tensors[0].storage_bytes or 0):
        return None  # the common case: one tensor that is its whole storage
    min_ratio = float(RULE.setting(ctx, "min-ratio"))
    min_wasted = int(RULE.setting(ctx, "min-wasted-bytes"))
    stored = used = 0
    paths: list[str] = []
    for _key, nbytes, views in meta.storages():
        if not nbytes:
            continue
        reach = used_bytes(views)
        if reach > nbytes:
            continue  # views past their storage: the reader's CD101 (and no float holds 10**400)
        if nbytes >= min_ratio * max(reach, 1):
            stored += nbytes
            used += reach
            paths.extend(t.display_path for t in views)
    wasted = stored - used
    if not stored or wasted < min_wasted:
        return None
    ratio = stored / used if used else float("inf")
    return RULE.finding(
        meta.path,
        f"stores a whole batch: {stored:,} B for {used:,} B of tensor (x{ratio:.1f}); "
        f"{wasted:,} B wasted",
        ctx,
        ratio=round(ratio, 2) if used else None,
        stored_bytes=stored,
        used_bytes=used,
        wasted_bytes=wasted,
        tensors=paths,
    )


RULE = Rule(
    code="CD201",
    name="retained-batch-storage",
    severity=Severity.WARNING,
    summary="a tensor's stored storage is larger than it needs (a saved view of a batch)",
    doc=__doc__,
    fix=FixKind.COMPACT,
    check_file=check,
    settings={"min-ratio": 1.5, "min-wasted-bytes": 4096},
)
