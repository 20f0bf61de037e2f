"""What a repair frees: one definition for the scan's "reclaimable", the plan's "shrink by" and
the result's "shrank by".

Bytes are apparent sizes (`st_size`, what `du --apparent-size --bytes` adds up), not allocated
blocks: they are what the file holds on any file system, and the same before a copy and after.

A file's bytes count once, under the one action a repair takes on it:

- its whole size when a finding quarantines it (broken or hostile wins);
- else the bytes a compact drops: CD201's estimate of the storage nobody uses, scaled by a
  gzip file's compression;
- else nothing. A to-cpu rewrite changes a few bytes of device names; the result says how many.

Quarantined and replaced originals stay on disk, in the cache's quarantine, until
`cachedoctor purge` deletes them. The cache shrinks by this number only then.

By default `fix` acts on findings at warning or above (`--include-info` adds info ones), and so
does this count.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from cachedoctor.checks import interrupted_write
from cachedoctor.findings import Severity
from cachedoctor.fix_kinds import COMPACT, FILE_FIXES, QUARANTINE, FixKind

RECENT = interrupted_write.RECENT_SECONDS
GZIP_MAGIC = b"\x1f\x8b"


class _Finding(Protocol):
    code: str
    severity: Severity
    path: str
    fix: FixKind | None
    details: Mapping[str, Any]


def acted_on(finding: _Finding, include_info: bool = False) -> bool:
    """True when `fix` (with or without --include-info) acts on this finding's fix by default."""
    return finding.fix is not None and (include_info or finding.severity >= Severity.WARNING)


def young_temp(finding: _Finding) -> bool:
    """A temp file written in the last minutes: its writer may still be running, so fix leaves it."""
    return finding.code == interrupted_write.RULE.code and \
        finding.details.get("age_seconds", RECENT) < RECENT


def kind_of(fixes: Iterable[FixKind | None]) -> FixKind:
    """The one action for a file several findings name: quarantine, else compact, else to-cpu."""
    fixes = set(fixes)
    return next(k for k in FILE_FIXES if k in fixes)


def freed(kind: FixKind, size: int, findings: Iterable[_Finding], path: str | None = None) -> int:
    """Bytes the cache shrinks by (after purge) when `kind` acts on the file `path` of `size`
    bytes."""
    if kind == QUARANTINE:
        return size
    if kind == COMPACT:
        wasted = sum(int(f.details.get("wasted_bytes", 0)) for f in findings)
        return round(wasted * _disk_share(path)) if path else wasted
    return 0


def _disk_share(path: str) -> float:
    """Bytes on disk per byte of the torch stream: 1, or for a gzip file (SimpleTuner's
    compressed caches; CD201 counts stream bytes) its compressed size over the uncompressed
    size its trailer records (ISIZE, modulo 4 GiB: past that the estimate stays 1)."""
    try:
        with open(path, "rb") as f:
            if f.read(2) != GZIP_MAGIC:
                return 1.0
            size = f.seek(-4, os.SEEK_END) + 4
            stream = int.from_bytes(f.read(4), "little")
    except (OSError, ValueError):
        return 1.0
    return size / stream if stream > size else 1.0


def apparent_size(path: str) -> int:
    """A file's bytes (0 when it cannot be read: the finding says why)."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def reclaimable(findings: Iterable[_Finding], include_info: bool = False) -> int:
    """What a fix of these findings, then a purge of its quarantine, frees (see the module doc)."""
    files: dict[str, list[_Finding]] = {}
    for finding in findings:
        if not acted_on(finding, include_info) or finding.fix not in FILE_FIXES or young_temp(finding):
            continue
        listed = finding.details.get("files")
        for path in ([str(p) for p in listed] if listed and os.path.isdir(finding.path) else [finding.path]):
            files.setdefault(path, []).append(finding)
    total = 0
    for path, named in files.items():
        kind = kind_of(f.fix for f in named)
        total += freed(kind, apparent_size(path) if kind == QUARANTINE else 0, named, path)
    return total
