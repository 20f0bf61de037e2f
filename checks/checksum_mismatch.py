"""## What it does
With `--deep`, reads every entry of a zip-based cache file (torch zip, npz) and compares its
CRC32 with the one recorded in the central directory.

## Why is this bad?
torch never checks CRC32 when it loads a file (PyTorch builds miniz with CRC checks disabled,
pytorch/pytorch#28858), so a flipped bit in a latent loads silently and trains on a wrong
value. Bit rot on old disks, a bad network copy, or a damaged cloud sync all look like this.
numpy does check CRCs and fails with `BadZipFile: Bad CRC-32 for file 'latents.npy'`.
Files written with `torch.serialization.set_crc32_options(False)` record no CRCs; they are not
reported (nothing can be verified).

## Example
```
$ cachedoctor scan --deep cache/vae
CD103 error cache/vae/photos/3fa1e2.pt  CRC32 mismatch in 'photos/data/0' (recorded 0x1c291ca3, actual 0x5e1b7f02)
```

## Fix
`cachedoctor fix --deep` moves the file to the quarantine; with `--reencode` it is encoded
again from its image. A lossless repair is impossible: which bit changed is unknown.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.rule import Rule, RuleContext


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if meta.crc_errors:
        more = f" (+{len(meta.crc_errors) - 1} more entries)" if len(meta.crc_errors) > 1 else ""
        return RULE.finding(meta.path, meta.crc_errors[0] + more, ctx,
                            entries=list(meta.crc_errors))


RULE = Rule(
    code="CD103",
    name="checksum-mismatch",
    severity=Severity.ERROR,
    summary="--deep: a zip entry's bytes do not match its recorded CRC32",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    deep=True,
    check_file=check,
)
