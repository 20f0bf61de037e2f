"""Findings and the Report that collects them: frozen data, never exceptions."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from types import MappingProxyType
from typing import Any

from cachedoctor.applied import AppliedPolicy
from cachedoctor.fix_kinds import FixKind
from cachedoctor.units import BIG_DIGITS, number


class Severity(IntEnum):
    INFO = 1
    WARNING = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown severity {text!r}: expected error, warning or info") from None


class FailOn(StrEnum):
    """When a scan fails (exit 1, CacheProblems): on a finding at or above a severity, or never."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    NEVER = "never"

    @property
    def threshold(self) -> Severity | None:
        """The least severity that fails; None for `never`."""
        return None if self is FailOn.NEVER else Severity[self.name]

    @classmethod
    def of(cls, value: FailOn | str) -> FailOn:
        """`value` as a FailOn ("Warning" too); ValueError names the levels."""
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"unknown fail-on level {value!r}: expected "
                             f"{', '.join(cls)}") from None


DEFAULT_FAIL_ON = FailOn.ERROR  # the setting's one default (config, command line, API)


def _frozen(details: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType({k: _bounded_value(v) for k, v in (details or {}).items()})


# Every finding is bounded where it is made, whatever rule or reader made it: a hostile header
# can hold a 4,000-digit shape, and a report line must stay a line.
MAX_MESSAGE = 1000  # characters of a message
MAX_DETAIL_TEXT = 8192  # characters of one string in details (a path may be 4,096 bytes)
# a run of digits, or a number grouped by thousands ("159,999,...,984")
_DIGIT_RUN = re.compile(rf"\d{{{BIG_DIGITS + 1},}}|\d{{1,3}}(?:,\d{{3}}){{{BIG_DIGITS // 3},}}(?!\d)")


def bounded(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` with every run of more than BIG_DIGITS digits written as 'a 400-digit number',
    cut to `limit` characters ('... (1,234 more characters)')."""
    if not isinstance(text, str):
        text = str(text)
    if len(text) > BIG_DIGITS:
        text = _DIGIT_RUN.sub(_digit_count, text)
    if len(text) > limit:
        cut = limit - 40
        text = f"{text[:cut]}... ({len(text) - cut:,} more characters)"
    return text


def _digit_count(match: re.Match) -> str:
    return f"a {len(match.group().replace(',', '')):,}-digit number"


def _bounded_value(value: Any) -> Any:
    """Details as they may be kept: a number too long to print (or to write as JSON: Python
    refuses str() past 4,300 digits) becomes its description, in a string too, and a long
    string is cut. Lists stay whole: repair reads some (CD502's files)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if -(10 ** BIG_DIGITS) < value < 10 ** BIG_DIGITS else number(value)
    if isinstance(value, str):  # paths (absolute) stay as they are: repair uses them
        if value.startswith(os.sep) and len(value) <= MAX_DETAIL_TEXT:
            return value
        return bounded(value, MAX_DETAIL_TEXT) if len(value) > BIG_DIGITS else value
    if type(value) in (list, tuple):
        return type(value)(map(_bounded_value, value))
    if isinstance(value, Mapping):
        return {k: _bounded_value(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem in one place. `path` is absolute; reporters make it relative for display."""

    code: str
    name: str
    severity: Severity
    path: str
    message: str
    dataset: str | None = None
    details: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    fix: FixKind | None = None
    # (size, mtime_ns, inode, device, ctime_ns) of the file as its reader saw it, for a finding
    # on the file that reader read (FileMeta.stat): a repair acts only on the file the scan judged
    stat: tuple[int, int, int, int, int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        message = bounded(self.message)
        if message is not self.message:
            object.__setattr__(self, "message", message)
        if not isinstance(self.details, MappingProxyType):  # a copy of a finding is bounded
            object.__setattr__(self, "details", _frozen(self.details))

    def __reduce__(self):
        # MappingProxyType does not pickle; findings cross process boundaries.
        return (
            Finding,
            (self.code, self.name, self.severity, self.path, self.message, self.dataset,
             dict(self.details), self.fix, self.stat),
        )

    @property
    def sort_key(self) -> tuple:
        return (self.dataset or "", self.code, self.path, self.message)

    def to_dict(self, cwd: str | None = None) -> dict[str, Any]:
        """One finding as the JSON report writes it (README, "JSON report": a public contract)."""
        return {
            "code": self.code,
            "name": self.name,
            "severity": str(self.severity),
            "path": display_path(self.path, cwd),
            "dataset": None if self.dataset is None else printable(self.dataset),
            "message": printable(self.message),
            "details": jsonable(self.details),
            "fix": self.fix,
        }


def jsonable(value: Any) -> Any:
    """Details hold tuples, paths and numbers; JSON wants lists and strings."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v) for v in items]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return printable(value) if isinstance(value, str) else value
    return printable(str(value))


# C0, DEL and C1 controls: a file name may hold a newline, or an escape sequence that retitles or
# clears the terminal a report is printed on; and the Unicode line separators (str.splitlines and
# JavaScript end a line there) and bidi controls (they show text in another order than it is)
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    c: f"\\u{c:04x}" for c in (0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F),
                               *range(0x2066, 0x206A))}


def printable(text: str) -> str:
    """File names need not be UTF-8, nor free of control characters: undecodable bytes and
    control characters show as \\xNN, so a name is one line of inert text."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") \
        .translate(_CONTROLS)


def display_path(path: str, cwd: str | None = None) -> str:
    """The path as the user would type it: relative to the working dir when under it."""
    cwd = cwd or os.getcwd()
    if path == cwd:
        return "."
    if path.startswith(cwd.rstrip(os.sep) + os.sep):
        return printable(os.path.relpath(path, cwd))
    return printable(path)


def wasted(finding: Finding) -> int:
    """The bytes a finding says could be reclaimed (0 when it says none, or no number)."""
    value = finding.details.get("wasted_bytes", 0)
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else 0
    return value if isinstance(value, int) else 0


@dataclass(frozen=True)
class Report:
    """What one scan found. Findings are sorted by dataset, code and path."""

    targets: tuple[str, ...]
    findings: tuple[Finding, ...]
    files: int
    bytes: int
    datasets: tuple[str, ...] = ()
    trainers: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()  # every file checked, sorted; only with ScanOptions.keep_paths
    policy: AppliedPolicy = field(default_factory=AppliedPolicy)  # set by api and the CLI
    # what the incremental index did: files "read" and "reused", "judged" (--changed-since),
    # the "scan" id, its "location" and "notices"; empty when the scan used none
    # (a dict, not a mappingproxy: a Report pickles, CacheProblems crosses processes)
    index: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def build(cls, targets: Iterable[str], findings: Iterable[Finding], files: int, nbytes: int,
              datasets: Iterable[str] = (), trainers: Iterable[str] = (),
              checked: Iterable[str] = (), index: Mapping[str, Any] | None = None) -> Report:
        ordered = tuple(sorted(findings, key=lambda f: f.sort_key))
        return cls(tuple(targets), ordered, files, nbytes, tuple(datasets), tuple(trainers),
                   tuple(sorted(checked)), index=dict(index or {}))

    def count(self, severity: Severity) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    @property
    def counts(self) -> dict[str, int]:
        return {str(s): self.count(s) for s in (Severity.ERROR, Severity.WARNING, Severity.INFO)}

    def fails(self, fail_on: FailOn | str) -> bool:
        """True when a finding is at or above `fail_on` (`never` never fails)."""
        threshold = FailOn.of(fail_on).threshold
        return threshold is not None and any(f.severity >= threshold for f in self.findings)

    def exit_code(self, fail_on: FailOn | str = DEFAULT_FAIL_ON) -> int:
        return 1 if self.fails(fail_on) else 0
