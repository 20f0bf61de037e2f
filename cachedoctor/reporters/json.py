"""`--format json`: a public contract (README, "JSON report")."""

from __future__ import annotations

import json
from typing import Any, TextIO

from cachedoctor import __version__
from cachedoctor.findings import Report, display_path


def as_dict(report: Report, cwd: str | None = None) -> dict[str, Any]:
    return {
        "version": 1,
        "tool": {"name": "cachedoctor", "version": __version__},
        "targets": [display_path(t, cwd) if t.startswith("/") else t for t in report.targets],
        "summary": {
            "files": report.files,
            "bytes": report.bytes,
            "findings": report.counts,
        },
        "findings": [f.to_dict(cwd) for f in report.findings],
        "policy": report.policy.to_dict(),
    }


def render(report: Report, out: TextIO, *, verbose: bool = False, color: bool = False,
           cwd: str | None = None) -> None:
    json.dump(as_dict(report, cwd), out, indent=2)
    out.write("\n")
