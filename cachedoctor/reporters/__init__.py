"""Reporters, one module per format, each with `render(report, out, *, verbose, color, cwd)`."""

from __future__ import annotations

from cachedoctor.reporters import json, text

REPORTERS = {"text": text, "json": json}
