"""The human report: a rich table on a terminal, one line per finding in a pipe.

On a terminal, many findings of one rule in one dataset collapse into one row with a count
(`--verbose` lists every file); in a pipe every finding gets its own greppable line.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import TextIO

from cachedoctor.findings import Finding, Report, Severity, display_path, printable
from cachedoctor.findings import wasted as wasted_bytes
from cachedoctor.reclaim import reclaimable
from cachedoctor.units import count, human_bytes

STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def render(report: Report, out: TextIO, *, verbose: bool = False, color: bool = False,
           cwd: str | None = None) -> None:
    if color:
        _table(report, out, verbose, cwd)
    else:
        for f in report.findings:
            out.write(line(f, cwd) + "\n")
    out.write(summary_line(report) + "\n")
    hint = next_steps(report)
    if hint:
        out.write(hint + "\n")


def where(finding: Finding, cwd: str | None = None) -> str:
    """The finding's path as the user would type it; `file:line` for a config finding."""
    at = finding.details.get("line")
    return display_path(finding.path, cwd) + (f":{at}" if at else "")


def line(f: Finding, cwd: str | None = None) -> str:
    """One finding as one greppable line: `path: CODE severity [dataset] message`."""
    dataset = f" [{printable(f.dataset)}]" if f.dataset else ""
    return f"{where(f, cwd)}: {f.code} {f.severity}{dataset} {printable(f.message)}"


def brief(report: Report, limit: int = 10, cwd: str | None = None) -> str:
    """A few lines for a person: the worst findings first (at most `limit`), the counts, and
    what to run next. The terminal gets this when the report goes to a file (`--output`), and
    it is the message of `cachedoctor.CacheProblems`."""
    worst = sorted(report.findings, key=lambda f: (-f.severity, f.sort_key))
    lines = [line(f, cwd) for f in worst[:limit]]
    if len(worst) > limit:
        lines.append(f"... and {len(worst) - limit:,} more")
    lines.append(summary_line(report))
    hint = next_steps(report)
    return "\n".join([*lines, hint] if hint else lines)


# What differs between findings that say the same thing of different files: numbers, sizes,
# hashes and file names (any word with a digit, a word with an extension) and quoted values.
# (a quote only where it opens a word: "image's" is no quote)
VARYING = re.compile(r"""(?<!\w)'[^']*'|"[^"]*"|\S*\d\S*|\S+\.[A-Za-z]\w{0,4}\b""")


def gist(message: str) -> str:
    """The message with what varies from file to file taken out: two findings with one gist
    say the same thing, and may share a row."""
    return VARYING.sub("#", message)


def _groups(report: Report, verbose: bool) -> list[list[Finding]]:
    if verbose:
        return [[f] for f in report.findings]
    groups: dict[tuple[str, str, str], list[Finding]] = {}
    for f in report.findings:
        groups.setdefault((f.dataset or "", f.code, gist(f.message)), []).append(f)
    return list(groups.values())


def _table(report: Report, out: TextIO, verbose: bool, cwd: str | None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=out, force_terminal=True, highlight=False)
    if not report.findings:
        console.print("[green]No problems found.[/green]")
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("dataset", "rule", "sev", "where", "what"):
        table.add_column(column, overflow="fold", no_wrap=column in ("rule", "sev"))
    for group in _groups(report, verbose):
        first = group[0]
        place = where(first, cwd)
        what = first.message
        if len(group) > 1:
            place += f" (+{len(group) - 1})"
            wasted = sum(map(wasted_bytes, group))
            if wasted:
                what += f"; {human_bytes(wasted)} wasted in {len(group):,} files"
            else:
                what += f" (and {len(group) - 1:,} more like it)"
        # Text, not str: a str cell is rich markup, and a file named `[link=URL]` or `a[/]b.pt`
        # would forge a hyperlink or styles, or fail the whole report with a MarkupError
        table.add_row(
            Text(printable(first.dataset or "-")),
            first.code,
            Text(str(first.severity), style=STYLE[first.severity]),
            Text(printable(place)),
            Text(printable(what)),
        )
    console.print(table)


def summary_line(report: Report) -> str:
    counts = report.counts
    parts = [
        f"{count(report.files, 'file')}, {human_bytes(report.bytes)}",
        f"{count(counts['error'], 'error')}, {count(counts['warning'], 'warning')}, "
        f"{counts['info']:,} info",
    ]
    freed = reclaimable(report.findings)
    if freed:
        parts.append(f"{human_bytes(freed)} reclaimable")
    return " · ".join(parts)


def next_steps(report: Report) -> str:
    if not report.findings:
        return ""
    codes = sorted({f.code for f in report.findings}, key=lambda c: (
        -max(f.severity for f in report.findings if f.code == c), c))
    explain = f"`cachedoctor explain {codes[0]}` says why it matters"
    if not any(f.fix for f in report.findings):
        return f"Next: {explain} and how to fix it."
    targets = " ".join(shlex.quote(display_path(t) if os.path.isabs(t) else t) for t in report.targets)
    missing = sum(1 for f in report.findings if f.fix == "reencode")
    entries = count(missing, "missing entry", "missing entries")
    encode = f" (with `--reencode --encoder SPEC` it also encodes the {entries})" if missing else ""
    return f"Next: `cachedoctor fix {targets} --dry-run` shows the repair plan{encode}; {explain}."
