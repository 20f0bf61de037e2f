"""Reporters, one module per format, each a Reporter: `render(report, out, *, verbose, color,
cwd)`. A new format is one module plus one line in REPORTERS.

A reporter that lists every file checked (junit) sets `NEEDS_PATHS = True`: the scan then keeps
the paths (`ScanOptions.keep_paths`), which it otherwise does not, to keep memory flat.
Only the chosen reporter is imported: a scan's start-up should not pay for sarif's rule
catalogue or junit's XML.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, TextIO, runtime_checkable

if TYPE_CHECKING:
    from cachedoctor.findings import Report


@runtime_checkable
class Reporter(Protocol):
    """A reporter module."""

    def render(self, report: Report, out: TextIO, *, verbose: bool = False, color: bool = False,
               cwd: str | None = None) -> None: ...


# format -> the module that renders it (imported when chosen)
REPORTERS: dict[str, str] = {
    "text": "cachedoctor.reporters.text",
    "json": "cachedoctor.reporters.json",
    "sarif": "cachedoctor.reporters.sarif",
    "github": "cachedoctor.reporters.github",
    "junit": "cachedoctor.reporters.junit",
}
FORMATS = tuple(REPORTERS)


def reporter(fmt: str) -> Reporter:
    """The reporter of `fmt` (one of FORMATS); KeyError for any other."""
    module = importlib.import_module(REPORTERS[fmt])
    if not isinstance(module, Reporter):
        raise TypeError(f"{REPORTERS[fmt]} has no render(report, out, ...)")
    return module
