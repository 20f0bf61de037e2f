"""The repair plan: one action per file that a finding's fix names, built first, run second.

`build_plan(report, roots)` reads no tensor and changes nothing; `Plan.execute()` applies it
(apply.py). Where several findings name one file, one action serves them all: quarantine wins
(a broken or hostile file is never loaded), then compact (which also stores every tensor on the
CPU), then to-cpu. Info findings are left out unless asked for (`include_info`: `fix
--include-info`); the plan lists them. Findings without an automatic fix become notes (with the config edit, where
the finding carries one in `details["change"]`, with its `line`).

Under --reencode (`Reencode`), every quarantined entry of a rule in REENCODE_AFTER
and every image without its entry (CD404) gets a reencode action: the trainer's layout names the
source image and describes the entry it would write (layouts/entries.py); where it cannot, a
skip note says why.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from cachedoctor import reclaim
from cachedoctor.checks import interrupted_write, missing_cache_entries
from cachedoctor.findings import Finding, Report
from cachedoctor.fix_kinds import FILE_FIXES, KINDS, QUARANTINE, REENCODE, REWRITES, FixKind
from cachedoctor.formats.shard_blobs import unit_files
from cachedoctor.inventory import LATENT, classify
from cachedoctor.layouts.entries import NO_CHANGES, Changes, Entries, EntrySpec, NoSpec, neighbour_format
from cachedoctor.layouts.onetrainer import REBUILT, rebuilds
from cachedoctor.repair.apply import Outcome, RunResult, run
from cachedoctor.repair.caches import root_of
from cachedoctor.repair.confined import FileId
from cachedoctor.repair.reencode import ReencodeTarget

if TYPE_CHECKING:
    from cachedoctor.layouts import Dataset, Layout
    from cachedoctor.repair.encoders import Encoder
    from cachedoctor.repair.session import Guard

# quarantined entries of these rules are encoded again under --reencode (README, the `reencode` action)
REENCODE_AFTER = frozenset({"CD101", "CD102", "CD103", "CD105", "CD106", "CD301", "CD302", "CD303",
                            "CD406"})
# Entries quarantined for these are not stored as their trainer stores entries: never copied.
UNLIKE = frozenset({"CD101", "CD102", "CD103", "CD105", "CD303"})
NOT_A_LATENT = ("no re-encode: not a latent (text-encoder outputs need the text encoder: the "
                "trainer's caching pass writes them again)")


@dataclass(frozen=True)
class Action:
    """One change to one file of one cache."""

    kind: FixKind
    path: str  # absolute
    root: str  # the cache root whose .cachedoctor/ journals and quarantines it
    codes: tuple[str, ...]  # the findings it resolves
    size: int = 0  # bytes of the file now (0 for a new entry)
    freed: int = 0  # bytes the cache shrinks by once purged (reclaim.freed; compact: an estimate)
    target: ReencodeTarget | None = None  # reencode: what to write
    planned: FileId | None = None  # the file as planned: the run skips it if it changed since
    why: str = ""  # an action no finding names: why the plan takes it

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
    """What --reencode needs: an encoder; the datasets of the trainer configs (id -> Dataset:
    their layouts name each entry's image and describe the entries their trainer writes);
    and, for caches no layout describes, the source image of entries (entry path -> image path)
    and entries to create outright."""

    encoder: Encoder
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    targets: tuple[ReencodeTarget, ...] = ()
    datasets: Mapping[str, Dataset] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, encoder: Encoder, layouts: Iterable[Layout]) -> Reencode:
        """For a scan of these layouts (dataset ids as the scan gives them)."""
        return cls(encoder, datasets=datasets_of(layouts))


def datasets_of(layouts: Iterable[Layout]) -> Mapping[str, Dataset]:
    """The layouts' datasets by id, as the scan of these layouts names them."""
    return MappingProxyType({d.id: d for layout in layouts for d in layout.datasets})


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    notes: tuple[Note, ...] = ()
    encoder: Encoder | None = field(default=None, compare=False)
    left_out: tuple[Note, ...] = ()  # info findings with a fix, acted on only with include_info

    @property
    def expected_freed_size(self) -> int:
        """Bytes the caches shrink by once the run's quarantine is purged (reclaim.py: the
        scan's "reclaimable" for the same findings). Until then the originals stay on disk."""
        return sum(a.freed for a in self.actions)

    @property
    def quarantined_size(self) -> int:
        """Bytes of originals a run moves or copies into the quarantine (removed or replaced)."""
        return sum(a.size for a in self.actions if a.kind != REENCODE)

    @property
    def bytes_rewritten(self) -> int:
        return sum(a.rewritten for a in self.actions)

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(sorted({a.root for a in self.actions}))

    def of_kind(self, kind: FixKind) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind == kind)

    def execute(self, *, guard: Guard | None = None, run_id: str | None = None, wait: float = 0.0,
                command: str = "",
                on_start: Callable[[str], None] | None = None,
                on_outcome: Callable[[Outcome], None] | None = None) -> RunResult:
        """Apply the plan (under each cache's lock, journaled; see apply.py): under `guard`, the
        locks the caller took before its scan (session.guarded), else under locks taken for the
        run. `on_start(run_id)` is called once the run is journaled, before its first change."""
        return run(self, guard=guard, run_id=run_id, wait=wait, command=command, on_start=on_start,
                   on_outcome=on_outcome)


def build_plan(report: Report, roots: Iterable[str], reencode: Reencode | None = None, *,
               include_info: bool = False, datasets: Mapping[str, Dataset] | None = None) -> Plan:
    """The plan for `report`'s findings in the caches `roots` (cache_roots of the targets).
    Info findings are left out (`Plan.left_out`) unless `include_info`. Without `reencode`,
    `datasets` (the layouts' datasets by id) let a missing entry that no encoder can write
    name the trainer's own command instead of --reencode."""
    roots = tuple(roots)
    files: dict[str, list[Finding]] = {}
    missing: list[Finding] = []
    notes: list[Note] = []
    left_out: list[Note] = []
    described: dict[str, Entries | None] = {}  # per dataset: its layout's entries, made once
    for finding in report.findings:
        if finding.fix is not None and not reclaim.acted_on(finding, include_info):
            left_out.append(Note(finding.code, finding.path, finding.message))
        elif finding.fix is None:
            change, line = finding.details.get("change"), finding.details.get("line")
            edit = f"line {line}: {change}" if change and line else change
            notes.append(Note(finding.code, finding.path, finding.message, edit))
        elif finding.fix == REENCODE and finding.code == missing_cache_entries.RULE.code:
            if reencode is None:
                notes.append(_skip(finding.code, finding.path,
                                   _unencoded(finding, datasets, described)))
            else:
                missing.append(finding)
        elif finding.fix not in FILE_FIXES:
            notes.append(_skip(finding.code, finding.path, f"no automatic {finding.fix} in this version"))
        elif finding.fix != QUARANTINE and unit_files(finding.path) is not None:
            notes.append(_skip(finding.code, finding.path, "a blob in a diffusion-pipe shard: "
                               "never rewritten in place (quarantine its cache folder to rebuild it)"))
        elif reclaim.young_temp(finding):
            notes.append(_skip(finding.code, finding.path, "written in the last minutes: its writer may "
                               "still be running (moving it would break its rename); stop it first"))
        else:
            for path in _files_of(finding):
                why = _why_not(path, roots) or _changed_since_read(finding, path)
                if why:
                    notes.append(_skip(finding.code, path, why))
                else:
                    files.setdefault(path, []).append(finding)
    actions = [_action(path, findings, root_of(path, roots) or "") for path, findings in files.items()]
    if reencode is not None:
        actions += _Reencodes(reencode, roots, actions, notes).actions(files, missing)
    actions += _rebuilds(actions, roots)
    actions.sort(key=lambda a: (KINDS.index(a.kind), a.path))
    return Plan(tuple(actions), tuple(notes), reencode.encoder if reencode else None, tuple(left_out))


def _files_of(finding: Finding) -> list[str]:
    """A finding on a dir (CD502 over a cache) lists its files in details["files"]; one on a
    part of a diffusion-pipe cache (a blob, a shard, metadata.db) names the whole folder, which
    diffusion-pipe rebuilds together (its items are positional)."""
    # (a shard no offsets table locates is no item's: it goes alone, as any interrupted write)
    unit = unit_files(finding.path) if finding.code != interrupted_write.RULE.code else None
    if unit is not None:
        return unit
    listed = finding.details.get("files")
    if listed and os.path.isdir(finding.path):
        return [str(p) for p in listed]
    return [finding.path]


def _why_not(path: str, roots: tuple[str, ...]) -> str | None:
    root = root_of(path, roots)
    if root is None:
        return "outside the caches given"
    if os.path.islink(path):
        return "a symlink: repair or remove its target (or the link) yourself"
    if not os.path.isfile(path):
        return "not a regular file"
    # the scan follows symlinked folders; a repair stays inside the cache's real folder
    folder = os.path.realpath(os.path.dirname(path))
    if root_of(os.path.join(folder, ""), (os.path.realpath(root),)) is None:
        return (f"reached through a symlinked folder: it lives in {folder}, outside the cache; "
                "run fix there")
    return None


def _changed_since_read(finding: Finding, path: str) -> str | None:
    """Why `path` is no longer the file the scan's reader judged (None when it is, or when the
    finding does not say what the reader saw). A file replaced or rewritten while the rest of
    the scan ran (a trainer's atomic write) is another file: never planned on the old verdict."""
    if finding.stat is None or finding.path != path:
        return None
    size, mtime_ns, ino, dev, _ = finding.stat
    try:
        why = FileId(dev, ino, size, mtime_ns).differs(os.lstat(path))
    except FileNotFoundError:
        why = "is gone"
    return f"changed since the scan read it: it {why}; scan again" if why else None


def _skip(code: str, path: str, why: str) -> Note:
    return Note(code, path, why, skipped=True)


def _action(path: str, findings: list[Finding], root: str) -> Action:
    kind = reclaim.kind_of(f.fix for f in findings)
    st = os.lstat(path)
    codes = tuple(sorted({f.code for f in findings}))
    return Action(kind, path, root, codes, st.st_size, reclaim.freed(kind, st.st_size, findings, path),
                  planned=FileId.of(st))


ENCODES_IT = "missing: `--reencode --encoder SPEC` encodes it"


def _unencoded(finding: Finding, datasets: Mapping[str, Dataset] | None,
               described: dict[str, Entries | None]) -> str:
    """What the plan says of a missing entry without --reencode: that --reencode writes it,
    or, where the trainer's layout cannot describe it (musubi-tuner, diffusion-pipe), why not
    and the trainer's command. `described` keeps each dataset's entries (they read their
    neighbours once, however many entries are missing)."""
    found = datasets.get(finding.dataset) if datasets and finding.dataset is not None else None
    if found is None:
        return ENCODES_IT
    if found.id not in described:
        described[found.id] = found.naming.entries(found, NO_CHANGES)
    entries = described[found.id]
    if entries is not None:
        try:
            entries.spec(finding.path)
        except NoSpec as exc:
            return f"no re-encode: {_reason(exc)}"
        except (OSError, ValueError):
            pass  # --reencode says what went wrong, entry by entry
    return ENCODES_IT


class _Reencodes:
    """The reencode actions of a plan: one per quarantined entry whose image is known, one per
    missing entry (CD404), each as the trainer's layout describes it."""

    def __init__(self, reencode: Reencode, roots: tuple[str, ...], actions: list[Action],
                 notes: list[Note]) -> None:
        self.reencode, self.roots, self.notes = reencode, roots, notes
        self.leaving = frozenset(a.path for a in actions if a.kind == QUARANTINE)
        self.quarantined = [a for a in actions if a.kind == QUARANTINE]
        self.changes = Changes(
            unlike=frozenset(a.path for a in self.quarantined if UNLIKE.intersection(a.codes)),
            to_cpu=frozenset(a.path for a in actions if a.kind in REWRITES))
        self._entries: dict[str | None, Entries] = {}

    def entries(self, dataset: str | None) -> Entries:
        if dataset not in self._entries:
            found = self.reencode.datasets.get(dataset) if dataset is not None else None
            made = found.naming.entries(found, self.changes) if found is not None else None
            self._entries[dataset] = made or _BareEntries(self.changes)
        return self._entries[dataset]

    def actions(self, files: Mapping[str, list[Finding]], missing: list[Finding]) -> list[Action]:
        jobs: list[ReencodeTarget] = []
        for action in self.quarantined:
            codes = tuple(c for c in action.codes if c in REENCODE_AFTER)
            if not codes:
                continue
            if classify(os.path.basename(action.path), os.path.dirname(action.path)) != LATENT:
                self.notes.append(_skip(codes[0], action.path, NOT_A_LATENT))
                continue
            finding = files[action.path][0]
            entries = self.entries(finding.dataset)
            try:
                image = self.reencode.sources.get(action.path) or entries.source(action.path)
                jobs.append(ReencodeTarget.of(entries.spec(image, action.path), codes))
            except (NoSpec, OSError, ValueError) as exc:
                self.notes.append(_skip(codes[0], action.path, f"no re-encode: {_reason(exc)}"))
        for finding in missing:
            try:
                spec = self.entries(finding.dataset).spec(finding.path)
                jobs.append(ReencodeTarget.of(spec, (finding.code,)))
            except (NoSpec, OSError, ValueError) as exc:
                self.notes.append(_skip(finding.code, finding.path, f"no re-encode: {_reason(exc)}"))
        out: dict[str, Action] = {}
        for job in (*jobs, *self.reencode.targets):
            if job.path in out:
                continue  # a quarantined entry and a missing one that the trainer names alike
            root = root_of(job.path, self.roots)
            if root is None:
                self.notes.append(_skip(job.codes[0], job.path, "no re-encode: the entry would be "
                                        "outside the caches given"))
            elif not os.path.isdir(os.path.dirname(job.path)):
                # a run creates files only, so that undo leaves the tree exactly as it was
                self.notes.append(_skip(job.codes[0], job.path, "no re-encode: its folder does not "
                                        "exist yet (the trainer's caching pass creates it)"))
            elif os.path.lexists(job.path) and job.path not in self.leaving:
                self.notes.append(_skip(job.codes[0], job.path, "no re-encode: the entry exists"))
            else:
                out[job.path] = Action(REENCODE, job.path, root, job.codes, target=job)
        return list(out.values())


def _rebuilds(actions: list[Action], roots: tuple[str, ...]) -> list[Action]:
    """The OneTrainer aggregate.pt files that go with the samples the plan removes, so that
    OneTrainer caches those folders again (layouts/onetrainer.rebuilds)."""
    codes = {a.path: a.codes for a in actions}
    out = []
    gone = rebuilds([a.path for a in actions if a.kind == QUARANTINE],
                    [a.path for a in actions if a.kind == REENCODE])
    for aggregate, samples in gone.items():
        root = root_of(aggregate, roots)
        if root is not None and _why_not(aggregate, roots) is None:
            st = os.lstat(aggregate)
            out.append(Action(QUARANTINE, aggregate, root, tuple(sorted({c for p in samples for c in codes[p]})),
                              st.st_size, st.st_size, why=REBUILT, planned=FileId.of(st)))
    return out


def _reason(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": ")
    return str(exc)


class _BareEntries(Entries):
    """A cache no trainer layout describes: images only from `Reencode.sources`, the format of
    the healthy single-latent files beside the entry."""

    def spec(self, image: str, replacing: str | None = None) -> EntrySpec:
        if replacing is None:
            raise NoSpec("a bare cache: give the trainer's config, whose layout names the entry")
        found = self.once(os.path.dirname(replacing),
                          lambda: neighbour_format(replacing, exclude=self.unlike))
        return EntrySpec(image, replacing, found)
