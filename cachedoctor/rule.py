"""The one small protocol every rule in checks/ implements.

A rule module holds its explanation as the module docstring and one `RULE = Rule(...)`.
A rule checks one file, a whole dataset, the trainer configs, or several of these:

- `check_file(meta, ctx)` runs in the worker processes and returns its one finding or None.
  It runs for every file, so it must be cheap. For a latent or text file it judges the
  file's facts and entry, never its path or mtime, which it only names: the engine gives
  files with a twin's facts the twin's verdict (engine.ScanState). A rule that must read the
  file's name (musubi names declare sizes and frame counts) says so (`names=True`): the
  engine then runs it for every file, twin or not. Its `applies(meta, ctx)`, which reads the
  facts and entry alone, may say that no file with these facts can draw its finding, whatever
  its name. Then the twins sharing those facts skip it. `check_file` begins with the same
  `applies`, so the two cannot disagree.
- `check_dataset(view, ctx)` runs once after the files are read, over compact per-file
  summaries and coverage rows, and yields findings.
- `check_layouts(layouts, ctx)` runs once per scan in the main process, over every Layout,
  so that facts spanning two configs are visible, and yields findings.

Rules never open files: what they know comes from the readers and the layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind

if TYPE_CHECKING:
    from cachedoctor.formats.meta import FileMeta
    from cachedoctor.inventory import Entry
    from cachedoctor.layouts.base import Dataset, Layout, Origin
    from cachedoctor.summary import DatasetView, FileSummary


class _RulesFix(Enum):
    RULES_FIX = "the rule's fix"


RULES_FIX = _RulesFix.RULES_FIX  # Rule.finding's default: the fix the rule declares


# A dataset rule's selection of the files it reads (Rule.select): for a file's summary, None
# when the rule has no use for it, else (key, limit): the rule reads the `limit` files of `key`
# with the smallest paths (its examples), or with limit None, every file of the key.
Selector = Callable[["FileSummary"], tuple[Hashable, int | None] | None]


def no_files(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """Rule.select of a rule that reads no file's summary (coverage rows and tallies only)."""
    return None


class RuleContext(NamedTuple):
    """What a rule may know besides its input: the options and the dataset being checked.
    (A NamedTuple: one is made per file, so it must be cheap.)"""

    deep: bool = False
    dataset: str | None = None
    settings: Mapping[str, Mapping[str, Any]] = MappingProxyType({})  # overrides by rule code
    entry: Entry | None = None  # file rules: the file's role and area from the walk
    facts: Dataset | None = None  # what the trainer config says about the dataset


@dataclass(frozen=True)
class Rule:
    """A rule of the catalogue: its code, severity, explanation, fix and the checks it runs."""

    code: str
    name: str
    severity: Severity
    summary: str  # one line for `cachedoctor rules`
    doc: str  # the module docstring: What it does / Why is this bad? / Example / Fix
    fix: FixKind | None = None  # the repair action; None = manual
    deep: bool = False  # only runs under --deep (reads whole tensors)
    check_file: Callable[[FileMeta, RuleContext], Finding | None] | None = None
    names: bool = False  # check_file reads the file's name: never judged from a twin's verdict
    # a names rule: False when check_file returns None for any file with these facts, whatever
    # its name (check_file returns None when it is False): twins sharing them skip the rule
    applies: Callable[[FileMeta, RuleContext], bool] | None = None
    check_dataset: Callable[[DatasetView, RuleContext], Iterable[Finding]] | None = None
    check_layouts: Callable[[Sequence[Layout], RuleContext], Iterable[Finding]] | None = None
    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # defaults
    # Which files' summaries check_dataset reads besides the view's tally, spans and coverage
    # (a sharded preflight ships only those between ranks, see reduce.py); None: every file.
    select: Callable[[DatasetView, RuleContext], Selector | None] | None = None

    def setting(self, ctx: RuleContext, key: str) -> Any:
        """A threshold such as CD201's `min-ratio`: from config or flags, else the default."""
        return ctx.settings.get(self.code, {}).get(key, self.settings[key])

    def finding(self, path: str, message: str, ctx: RuleContext | None = None,
                fix: FixKind | _RulesFix | None = RULES_FIX, **details: Any) -> Finding:
        """A finding of this rule, repaired by the rule's fix; `fix=None` when this occurrence
        cannot be repaired."""
        action = self.fix if fix is RULES_FIX else fix
        return Finding(
            code=self.code,
            name=self.name,
            severity=self.severity,
            path=path,
            message=message,
            dataset=ctx.dataset if ctx else None,
            details=details,
            fix=action,
        )

    def problem_findings(self, layouts: Sequence[Layout], kind: str) -> Iterator[Finding]:
        """A finding of this rule for every config problem of `kind` the layouts report."""
        for layout in layouts:
            for problem in layout.problems:
                if problem.kind == kind:
                    yield self.config_finding(problem.origin, problem.message, problem.dataset,
                                              **problem.details)

    def config_finding(self, origin: Origin, message: str, dataset: str | None = None,
                       change: str | None = None, **details: Any) -> Finding:
        """A finding about a config: the path is the config file, `details` carry the key, the
        line and the change that fixes it (`"vae_cache_clear_each_epoch": false`)."""
        extra = {"key": origin.key, "line": origin.line}
        if change is not None:
            extra["change"] = change
        return Finding(code=self.code, name=self.name, severity=self.severity, path=origin.file,
                       message=message, dataset=dataset, details={**extra, **details},
                       fix=None)
