"""Reporters, one module per format, each with `render(report, out, *, verbose, color, cwd)`.

A reporter that lists every file checked (junit) sets `NEEDS_PATHS = True`: the scan then keeps
the paths (`ScanOptions.keep_paths`), which it otherwise does not, to keep memory flat.
Only the chosen reporter is imported: a scan's start-up should not pay for sarif's rule
catalogue or junit's XML.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FORMATS = ("text", "json", "sarif", "github", "junit")


def reporter(fmt: str) -> ModuleType:
    """The reporter module of `fmt` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise KeyError(fmt)
    return importlib.import_module(f"cachedoctor.reporters.{fmt}")
