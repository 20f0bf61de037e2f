"""`--format sarif`: SARIF 2.1.0, the format GitHub code scanning (and most CI dashboards) take.

One run; its driver lists every rule (id, name, short and full description, the whole
`cachedoctor explain` text as help, and a help URI where the project declares where its rule
pages live); each finding is a result whose location is relative to `%SRCROOT%`, the working
directory the scan ran in. Cache files are binary, but code scanning shows only results with a
line, so each location names line 1. Results carry the baseline fingerprint as a partial
fingerprint, so code scanning tracks an alert across runs without hashing the file itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from cachedoctor import __version__
from cachedoctor.baseline import fingerprint
from cachedoctor.checks import RULES
from cachedoctor.findings import Finding, Report, Severity, jsonable, printable
from cachedoctor.remote import is_remote
from cachedoctor.rule import Rule
from cachedoctor.rule_docs import rule_url, what_it_does

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SRCROOT = "%SRCROOT%"
LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}
FINGERPRINT_KEY = "cachedoctor/v1"


def _rule(rule: Rule) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": what_it_does(rule)},
        "help": {"text": rule.doc.strip(), "markdown": rule.doc.strip()},
        "defaultConfiguration": {"level": LEVEL[rule.severity]},
        "properties": {"fix": rule.fix, "deep": rule.deep},
    }
    url = rule_url(rule.code)
    if url:
        entry["helpUri"] = url
    return entry


def _location(path: str, cwd: str) -> dict[str, Any]:
    if is_remote(path):  # an S3 object: its URL is its address
        return {"physicalLocation": {"artifactLocation": {"uri": path}, "region": {"startLine": 1}}}
    rel = os.path.relpath(path, cwd)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):  # outside %SRCROOT%
        artifact = {"uri": Path(path).as_uri()}
    else:
        artifact = {"uri": quote(os.fsencode(rel).replace(os.fsencode(os.sep), b"/")),
                    "uriBaseId": SRCROOT}
    return {"physicalLocation": {"artifactLocation": artifact, "region": {"startLine": 1}}}


def _result(finding: Finding, index: int, cwd: str) -> dict[str, Any]:
    return {
        "ruleId": finding.code,
        "ruleIndex": index,
        "level": LEVEL[finding.severity],
        "message": {"text": printable(finding.message)},
        "locations": [_location(finding.path, cwd)],
        "partialFingerprints": {FINGERPRINT_KEY: fingerprint(finding, cwd)},
        "properties": {"dataset": finding.dataset, "fix": finding.fix,
                       "details": jsonable(finding.details)},
    }


def _invocation(report: Report) -> dict[str, Any]:
    """The policy the scan ran under: a configuration notification per guard rule switched off
    (code scanning shows them on the run), the config layers and rules off as properties."""
    policy = report.policy
    notes = [{"level": "warning", "message": {"text": printable(text)},
              "associatedRule": {"id": code}} for code, text in policy.alerts]
    return {
        "executionSuccessful": True,
        "toolConfigurationNotifications": notes,
        "properties": {"configs": list(policy.configs), "isolated": policy.isolated,
                       "disabled": [{"code": code, "by": by} for code, by in policy.disabled]},
    }


def as_dict(report: Report, cwd: str | None = None) -> dict[str, Any]:
    cwd = cwd or os.getcwd()
    rules = list(RULES.values())
    # a report built elsewhere may name codes this registry lacks; they still need an entry
    known = set(RULES)
    for finding in report.findings:
        if finding.code not in known:
            known.add(finding.code)
            rules.append(Rule(finding.code, finding.name, finding.severity, finding.name, ""))
    index = {rule.code: i for i, rule in enumerate(rules)}
    return {
        "$schema": SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "cachedoctor",
                "version": __version__,
                "semanticVersion": __version__,
                "rules": [_rule(rule) for rule in rules],
            }},
            "originalUriBaseIds": {SRCROOT: {"uri": Path(cwd).as_uri().rstrip("/") + "/"}},
            "invocations": [_invocation(report)],
            "results": [_result(f, index[f.code], cwd) for f in report.findings],
            "columnKind": "unicodeCodePoints",
        }],
    }


def render(report: Report, out: TextIO, *, verbose: bool = False, color: bool = False,
           cwd: str | None = None) -> None:
    json.dump(as_dict(report, cwd), out, indent=2, ensure_ascii=False)
    out.write("\n")
