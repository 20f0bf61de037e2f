"""Reporters, one module per format, each with `render(report, out, *, verbose, color, cwd)`.

A reporter that lists every file checked (junit) sets `NEEDS_PATHS = True`: the scan then keeps
the paths (`ScanOptions.keep_paths`), which it otherwise does not, to keep memory flat.
"""

from __future__ import annotations

from cachedoctor.reporters import github, json, junit, sarif, text

REPORTERS = {"text": text, "json": json, "sarif": sarif, "github": github, "junit": junit}
