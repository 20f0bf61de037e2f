"""## What it does
Reports a file or directory that cannot be read at all: permission denied, a symlink loop, a
broken symlink, an I/O error from the device, or a file that vanished while the scan ran.

## Why is this bad?
The trainer will hit the same wall, usually hours in, when its data loader first touches the
file. A directory that cannot be listed hides every cache file inside it from this scan.

## Example
```
$ chmod 000 cache/vae/photos/3fa1e2.pt
$ cachedoctor scan cache/vae/photos
CD001 error cache/vae/photos/3fa1e2.pt  cannot read: permission denied
```

## Fix
None automatic. Restore read permission (`chmod u+r`), remove or repoint the symlink, or check
the disk. The scan goes on with every other file.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats import UNREADABLE
from cachedoctor.formats.meta import FileMeta
from cachedoctor.rule import Rule, RuleContext


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if meta.format == UNREADABLE:
        return RULE.finding(meta.path, meta.errors[0], ctx)


RULE = Rule(
    code="CD001",
    name="io-error",
    severity=Severity.ERROR,
    summary="a file or directory cannot be read (permissions, symlink loop, I/O error)",
    doc=__doc__,
    check_file=check,
)
