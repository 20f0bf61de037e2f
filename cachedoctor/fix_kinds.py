"""The repair vocabulary: what `fix` can do to a file. Rules name it (`Rule(fix=...)`), reclaim.py
counts by it, and the planner, the run, rollback and the renderers act on it. A leaf module
(it imports nothing of cachedoctor), so every layer imports it from below.

The values are the words the CLI, the JSON report and the journal show; a FixKind is a str, so
they serialize and compare as those words.
"""

from __future__ import annotations

from enum import StrEnum


class FixKind(StrEnum):
    QUARANTINE = "quarantine"  # move the file into the run's quarantine
    COMPACT = "compact"  # rewrite without the storage nobody uses
    TO_CPU = "to-cpu"  # rewrite with every storage on the CPU
    REENCODE = "reencode"  # write the entry again from its image


QUARANTINE, COMPACT, TO_CPU, REENCODE = FixKind
KINDS = (QUARANTINE, COMPACT, TO_CPU, REENCODE)  # the order a run applies them in
FILE_FIXES = (QUARANTINE, COMPACT, TO_CPU)  # the order one file's action is chosen in
REWRITES = frozenset({COMPACT, TO_CPU})
