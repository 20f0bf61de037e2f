"""## What it does
Reports what an interrupted write leaves in a cache dir: temp files of atomic writes that never
reached their rename (atomicwrites' `tmpXXXXXXXX`, SimpleTuner's late-2024 `.<name>.tmp`,
`*.pt.tmp`, `*.partial`, rsync's `.<name>.XXXXXX` of a copy killed mid-file) and lock files
older than `stale-lock-seconds` (default one hour) that hold something (a pid-file lock's
pid). An empty lock file is what `filelock` (🤗 datasets and hub, and the trainers that use
them) leaves after every release: its `flock` dies with its holder, so it blocks nobody and is
not reported.

## Why is this bad?
Each one is a write that died: the final file it was meant to replace is missing or older than
intended, so look for CD404 (missing entries) next to it. Temp files also take disk space, and
old lock files can block a trainer that waits on them. A temp file modified in the last few
minutes may belong to a trainer that is still writing: stop it before repairing.

## Example
```
CD104 warning cache/text/tmpk2x9_a1b  temp file of an interrupted atomic write: 34,331 B, 3 days old
```

## Fix
`cachedoctor fix` moves the leftovers to the quarantine (nothing is deleted).
"""

from __future__ import annotations

import os
import re
import time

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.inventory import TEMP
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.units import age

ATOMICWRITES_TEMP = re.compile(r"^tmp[a-z0-9_]{8}$")
RECENT_SECONDS = 600


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    entry = ctx.entry
    if entry is None or entry.role != TEMP:
        return None
    name = os.path.basename(entry.path)
    old = max(0.0, time.time() - meta.mtime)
    if name.endswith(".lock"):
        limit = float(RULE.setting(ctx, "stale-lock-seconds"))
        if old < limit or meta.size == 0:
            return None  # a live writer holds it, or filelock's empty file (flock: never stale)
        return RULE.finding(entry.path, f"stale lock file, {age(old)} old: its writer is gone",
                            ctx, kind="lock", age_seconds=round(old))
    if ATOMICWRITES_TEMP.match(name):
        what = "temp file of an interrupted atomic write"
    else:
        what = f"temp file of an interrupted write of '{name.lstrip('.').removesuffix('.tmp')}'"
    message = f"{what}: {meta.size:,} B, {age(old)} old"
    if old < RECENT_SECONDS:
        message += " (recent: a writer may still be running)"
    return RULE.finding(entry.path, message, ctx, kind="temp", age_seconds=round(old),
                        complete=meta.ok and meta.is_tensor_file)


RULE = Rule(
    code="CD104",
    name="interrupted-write",
    severity=Severity.WARNING,
    summary="temp files of interrupted atomic writes, stale lock files",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_file=check,
    settings={"stale-lock-seconds": 3600},
)
