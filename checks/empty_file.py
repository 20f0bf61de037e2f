"""## What it does
Reports a cache file of zero bytes.

## Why is this bad?
A writer that opened the file and died before writing (out of memory, SIGKILL, a full disk,
or SimpleTuner's writers before 2024-11, which opened the final path with `open(path, "wb")`)
leaves an empty file under the final name. The trainer sees that the entry exists, skips
re-encoding it, and fails when it loads it: `EOFError` (`Ran out of input`) from torch, `header
too small` from safetensors, `File is not a zip file` from numpy.

## Example
```
CD102 error cache/vae/photos/9c0d41.pt  empty file: 0 bytes where a cache entry should be
```

## Fix
`cachedoctor fix` moves it to the quarantine; with `--reencode` the entry is encoded again.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import EMPTY, FileMeta
from cachedoctor.inventory import LATENT, METADATA, TEXT
from cachedoctor.rule import Rule, RuleContext


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if meta.format != EMPTY:
        return None
    if ctx.entry is not None and ctx.entry.role not in (LATENT, TEXT, METADATA):
        return None  # an empty caption or temp file is CD107's or CD104's
    return RULE.finding(meta.path, "empty file: 0 bytes where a cache entry should be", ctx)


RULE = Rule(
    code="CD102",
    name="empty-file",
    severity=Severity.ERROR,
    summary="a cache file has zero bytes",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_file=check,
)
