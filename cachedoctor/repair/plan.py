"""The repair plan: one action per file that a finding's fix names, built first, run second.

`build_plan(report, roots)` reads no tensor and changes nothing; `Plan.execute()` applies it
(apply.py). Where several findings name one file, one action serves them all: quarantine wins
(a broken or hostile file is never loaded), then compact (which also stores every tensor on the
CPU), then to-cpu. Findings without an automatic fix become notes (with the config edit, where
the finding carries one in `details["edit"]`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from cachedoctor.checks import interrupted_write
from cachedoctor.findings import Finding, Report
from cachedoctor.repair.caches import root_of
from cachedoctor.repair.reencode import EntryFormat, NoFormat, ReencodeTarget, neighbour_format

if TYPE_CHECKING:
    from cachedoctor.repair.apply import Outcome, RunResult
    from cachedoctor.repair.encoders import Encoder

QUARANTINE, COMPACT, TO_CPU, REENCODE = "quarantine", "compact", "to-cpu", "reencode"
KINDS = (QUARANTINE, COMPACT, TO_CPU, REENCODE)  # the order a run applies them in
REWRITES = frozenset({COMPACT, TO_CPU})
# DESIGN.md §4's "quarantine (+ re-encode)": under --reencode these entries are encoded again.
REENCODE_AFTER = frozenset({"CD101", "CD102", "CD103", "CD105", "CD106", "CD301", "CD302", "CD406"})
RECENT = interrupted_write.RECENT_SECONDS  # a younger temp file may belong to a running writer


@dataclass(frozen=True)
class Action:
    """One change to one file of one cache."""

    kind: str  # quarantine, compact, to-cpu, reencode
    path: str  # absolute
    root: str  # the cache root whose .cachedoctor/ journals and quarantines it
    codes: tuple[str, ...]  # the findings it resolves
    size: int = 0  # bytes of the file now (0 for a new entry)
    freed: int = 0  # bytes the cache shrinks by (compact: CD201's estimate of the waste)
    target: ReencodeTarget | None = None  # reencode: what to write

    @property
    def relpath(self) -> str:
        return os.path.relpath(self.path, self.root)

    @property
    def rewritten(self) -> int:
        return self.size if self.kind in REWRITES else 0


@dataclass(frozen=True)
class Note:
    """A finding the plan does not act on: a manual fix (with the config edit, where the finding
    gives one), or a fix that cannot be applied here (`skipped`, with why)."""

    code: str
    path: str
    message: str
    edit: str | None = None
    skipped: bool = False


@dataclass(frozen=True)
class Reencode:
    """What --reencode needs: an encoder, the source image of entries the plan quarantines
    (entry path -> image path; trainer layouts know it, a bare cache does not), and entries to
    create outright (CD404)."""

    encoder: Encoder
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    targets: tuple[ReencodeTarget, ...] = ()


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    notes: tuple[Note, ...] = ()
    encoder: Encoder | None = field(default=None, compare=False)

    @property
    def expected_freed_size(self) -> int:
        """Bytes the caches shrink by. The quarantine keeps every original until you delete it."""
        return sum(a.freed for a in self.actions)

    @property
    def bytes_rewritten(self) -> int:
        return sum(a.rewritten for a in self.actions)

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(sorted({a.root for a in self.actions}))

    def of_kind(self, kind: str) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind == kind)

    def execute(self, *, run_id: str | None = None, wait: float = 0.0, command: str = "",
                on_start: Callable[[str], None] | None = None,
                on_outcome: Callable[[Outcome], None] | None = None) -> RunResult:
        """Apply the plan (under each cache's lock, journaled; see apply.py). `on_start(run_id)`
        is called once the run is journaled, before its first change."""
        from cachedoctor.repair.apply import run

        return run(self, run_id=run_id, wait=wait, command=command, on_start=on_start,
                   on_outcome=on_outcome)


def build_plan(report: Report, roots: Iterable[str], reencode: Reencode | None = None) -> Plan:
    """The plan for `report`'s findings in the caches `roots` (cache_roots of the targets)."""
    roots = tuple(roots)
    files: dict[str, list[Finding]] = {}
    notes: list[Note] = []
    for finding in report.findings:
        if finding.fix is None:
            notes.append(Note(finding.code, finding.path, finding.message, finding.details.get("edit")))
        elif finding.fix not in (QUARANTINE, COMPACT, TO_CPU):
            notes.append(_skip(finding.code, finding.path, f"no automatic {finding.fix} in this version"))
        elif finding.code == interrupted_write.RULE.code and \
                finding.details.get("age_seconds", RECENT) < RECENT:
            notes.append(_skip(finding.code, finding.path, "written in the last minutes: its writer may "
                               "still be running (moving it would break its rename); stop it first"))
        else:
            for path in _files_of(finding):
                why = _why_not(path, roots)
                if why:
                    notes.append(_skip(finding.code, path, why))
                else:
                    files.setdefault(path, []).append(finding)
    actions = [_action(path, findings, root_of(path, roots) or "") for path, findings in files.items()]
    if reencode is not None:
        actions += _reencodes(actions, roots, reencode, notes)
    actions.sort(key=lambda a: (KINDS.index(a.kind), a.path))
    return Plan(tuple(actions), tuple(notes), reencode.encoder if reencode else None)


def _files_of(finding: Finding) -> list[str]:
    """A finding on a dir (CD502 over a cache) lists its files in details["files"]."""
    listed = finding.details.get("files")
    if listed and os.path.isdir(finding.path):
        return [str(p) for p in listed]
    return [finding.path]


def _why_not(path: str, roots: tuple[str, ...]) -> str | None:
    if root_of(path, roots) is None:
        return "outside the caches given"
    if os.path.islink(path):
        return "a symlink: repair or remove its target (or the link) yourself"
    if not os.path.isfile(path):
        return "not a regular file"
    return None


def _skip(code: str, path: str, why: str) -> Note:
    return Note(code, path, why, skipped=True)


def _action(path: str, findings: list[Finding], root: str) -> Action:
    fixes = {f.fix for f in findings}
    kind = next(k for k in (QUARANTINE, COMPACT, TO_CPU) if k in fixes)
    size = os.stat(path).st_size
    if kind == QUARANTINE:
        freed = size
    elif kind == COMPACT:
        freed = sum(int(f.details.get("wasted_bytes", 0)) for f in findings)
    else:
        freed = 0
    codes = tuple(sorted({f.code for f in findings}))
    return Action(kind, path, root, codes, size, freed)


def _reencodes(actions: list[Action], roots: tuple[str, ...], reencode: Reencode,
               notes: list[Note]) -> list[Action]:
    """A reencode for every quarantined entry with a known image, and for every given target."""
    leaving = {a.path for a in actions if a.kind == QUARANTINE}
    jobs: list[ReencodeTarget] = []
    formats: dict[str, EntryFormat | str] = {}  # per dir: the neighbours' format, or why none
    for action in actions:
        codes = tuple(c for c in action.codes if c in REENCODE_AFTER)
        if action.kind != QUARANTINE or not codes:
            continue
        image = reencode.sources.get(action.path)
        if image is None:
            notes.append(_skip(codes[0], action.path, "no re-encode: its source image is unknown "
                               "(a bare cache; give the trainer's config)"))
            continue
        directory = os.path.dirname(action.path)
        if directory not in formats:
            try:
                formats[directory] = neighbour_format(action.path, exclude=leaving)
            except NoFormat as exc:
                formats[directory] = f"no re-encode: {exc}"
        found = formats[directory]
        if isinstance(found, str):
            notes.append(_skip(codes[0], action.path, found))
        else:
            jobs.append(ReencodeTarget(image, action.path, found, codes))
    out = []
    for job in (*jobs, *reencode.targets):
        root = root_of(job.path, roots)
        if root is None:
            notes.append(_skip(job.codes[0], job.path, "outside the caches given"))
        elif os.path.lexists(job.path) and job.path not in leaving:
            notes.append(_skip(job.codes[0], job.path, "no re-encode: the entry exists"))
        else:
            out.append(Action(REENCODE, job.path, root, job.codes, target=job))
    return out
