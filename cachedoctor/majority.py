"""When the files of one dataset disagree (shape, channels, dtype, embedding keys), which side
is wrong: the one decision CD301, CD303, CD304 and CD305 share, and that `fix` acts on.

A side is wrong only when the other holds a clear majority: the largest group holds at least
two thirds of the files (twice as many as all the others together). Below that (5 against 5,
6 against 4) the counts are no evidence of which side is the foreign one; the rules then report
the split as a warning naming every group and `fix` leaves the files alone. A tie is never
broken, so no run order or worker count can change a verdict.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from cachedoctor.findings import Finding, Severity
from cachedoctor.units import count

if TYPE_CHECKING:
    from cachedoctor.rule import Rule, RuleContext
    from cachedoctor.summary import DatasetView, FileSummary

CLEAR = 2 / 3  # the share of the files the largest group needs
EXAMPLES = 3  # files named per group in a split's message and details


class Verdict(NamedTuple):
    """How the groups of one comparison stand: `major` is the clear majority's value, or None
    for a split (no side is known to be wrong)."""

    major: Hashable | None
    counts: Counter
    total: int

    @property
    def split(self) -> bool:
        return self.major is None


def decide(counts: Counter) -> Verdict | None:
    """The verdict over `counts` (value -> files), or None when they all agree."""
    if len(counts) < 2:
        return None
    total = sum(counts.values())
    ranked = counts.most_common(2)
    (top, n), (_, second) = ranked
    # exact in integers: n / total >= 2/3
    clear = 3 * n >= 2 * total and n > second
    return Verdict(top if clear else None, counts, total)


class PerFolder:
    """One value per file (`value`: None for a file not compared), decided per folder group
    and family of a dataset: the verdicts, the selector and the pass over the files that the
    rules comparing one value (CD303's channels, CD305's embedding keys) share. `value` reads
    the fields a summary and its tally Group both have (role, shape, dtype, signature)."""

    def __init__(self, view: DatasetView, value: Callable[[Any], Hashable | None]) -> None:
        counts: dict[tuple, Counter] = defaultdict(Counter)
        for g, n in view.tally().items():
            v = value(g)
            if v is not None:
                counts[(g.group, g.family)][v] += n
        self.value = value
        self.verdicts = {key: verdict for key, c in counts.items()
                         if (verdict := decide(c)) is not None}
        # after `minorities`: per split group, its values' example paths
        self.split: dict[tuple, dict[Hashable, list[str]]] = defaultdict(lambda: defaultdict(list))

    def selector(self) -> Callable[[FileSummary], tuple | None] | None:
        """The files of the minority values, and a few of each side of a split."""
        if not self.verdicts:
            return None

        def wanted(s: FileSummary) -> tuple | None:
            v = self.value(s)
            verdict = self.verdicts.get((s.group, s.family)) if v is not None else None
            if verdict is None:
                return None
            if verdict.split:
                return ((s.group, s.family), v), EXAMPLES
            return (((s.group, s.family), v), None) if v != verdict.major else None

        return wanted

    def minorities(self, view: DatasetView) -> Iterator[tuple[FileSummary, Hashable, Verdict]]:
        """Each file whose value is not its group's clear majority, with the value and the
        verdict; the examples of split groups go to `split`."""
        if not self.verdicts:
            return
        for s in view:
            v = self.value(s)
            verdict = self.verdicts.get((s.group, s.family)) if v is not None else None
            if verdict is None:
                continue
            if verdict.split:
                keep(self.split[(s.group, s.family)][v], s.path)
            elif v != verdict.major:
                yield s, v, verdict

    def split_findings(self, rule: Rule, ctx: RuleContext, configured: str | None, noun: str,
                       label: Callable[[Any], str]) -> Iterator[Finding]:
        """After `minorities`: the warning of each split (`noun`: "latents"; `configured`: the
        dataset's cache dir, if the config names one), in a stable order."""
        for (group, family), files in sorted(self.split.items(), key=lambda kv: str(kv[0])):
            yield split_finding(rule, place(group, configured, files), ctx,
                                f"{noun} ({family})" if family else noun,
                                self.verdicts[(group, family)], label, files)


def examples(paths: Iterable[str], limit: int = EXAMPLES) -> list[str]:
    """The first `limit` of `paths` in sorted order (a stable choice, whatever the walk's order)."""
    return sorted(paths)[:limit]


def keep(kept: list[str], path: str, limit: int = EXAMPLES) -> None:
    """Add `path` to `kept`, a sorted list of at most `limit` paths: the examples of a group of
    any size in constant memory, the same ones whatever order the files come in."""
    if len(kept) < limit or path < kept[-1]:
        bisect.insort(kept, path)
        del kept[limit:]


def ranked(counts: Counter) -> list[tuple[Hashable, int]]:
    """(value, files) from the most files to the fewest, ties in the values' text order, so a
    message reads the same on every run."""
    return sorted(counts.items(), key=lambda item: (-item[1], str(item[0])))


def split_finding(rule: Rule, path: str, ctx: RuleContext, subject: str, verdict: Verdict,
                  label: Callable[[Any], str], files: Mapping[Any, Iterable[str]],
                  **details: Any) -> Finding:
    """The warning for a split (`verdict.major` is None) among `subject` ("latents",
    "text embeddings") under `path`: every group with its count and a few of its files
    (`files`: value -> its files, in any order). No fix: nothing says which side is foreign.
    `details` hold `values` (what each group has, the finding's identity for a baseline),
    `counts` and `examples` (which change as the cache grows)."""
    named = {v: examples(files.get(v, ())) for v, _ in ranked(verdict.counts)}
    parts = []
    for value, n in ranked(verdict.counts):
        shown = [_near(p, path) for p in named[value]]
        more = ", …" if n > len(shown) else ""
        parts.append(f"{label(value)}: {count(n, 'file')} ({', '.join(shown)}{more})")
    message = (f"{subject} split with no clear majority: {'; '.join(parts)}. Neither side is "
               f"known to be the foreign one (a clear majority holds {CLEAR_TEXT} of the files): "
               "check which is right; fix leaves them alone")
    finding = rule.finding(path, message, ctx, fix=None,
                           values=[label(v) for v, _ in ranked(verdict.counts)],
                           counts={label(v): n for v, n in verdict.counts.items()},
                           examples={label(v): named[v] for v in named}, **details)
    return dataclasses.replace(finding, severity=Severity.WARNING)


CLEAR_TEXT = "2/3"


def place(group: str | None, configured: str | None, files: Mapping[Any, Iterable[str]]) -> str:
    """Where a split is reported: a bare tree's dataset folder, else the trainer config's cache
    dir, else the folder the files share."""
    if group is not None:
        return group
    if configured is not None:
        return configured
    return os.path.commonpath(sorted({os.path.dirname(p) for ps in files.values() for p in ps}))


def _near(file: str, folder: str) -> str:
    """`file` as seen from `folder` (its name, or its path under `folder`)."""
    if file.startswith(folder.rstrip(os.sep) + os.sep):
        return file[len(folder.rstrip(os.sep)) + 1:]
    return os.path.basename(file)
