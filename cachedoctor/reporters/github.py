"""`--format github`: GitHub Actions workflow commands, one annotation per finding.

`::error file=cache/a.pt,title=CD101::unreadable-archive: truncated ...` shows up on the run's
summary page (and on the file, when it is in the repository). Warnings are `::warning`, info
`::notice`. Values are escaped as @actions/core escapes them.
"""

from __future__ import annotations

from typing import TextIO

from cachedoctor.findings import Report, Severity, display_path, printable

COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def render(report: Report, out: TextIO, *, verbose: bool = False, color: bool = False,
           cwd: str | None = None) -> None:
    for warning in report.policy.warnings:  # a rule switched off by config, on the run's summary
        out.write(f"::warning title=cachedoctor config::{escape_data(printable(warning))}\n")
    for f in report.findings:
        where = escape_property(display_path(f.path, cwd))
        message = escape_data(printable(f"{f.name}: {f.message}"))
        out.write(f"::{COMMAND[f.severity]} file={where},title={f.code}::{message}\n")
