"""`--format junit`: JUnit XML for CI test tabs (GitLab, Jenkins, Azure, GitHub test reporters).

Every file checked is a test case (class: its directory, name: its file name), so a test tab
shows "48,210 passed, 2 failed"; each finding is a `<failure>` of its file's test case
(`type` is the rule code). Findings about a directory (CD502 across files, a directory that
cannot be listed) are test cases of their own.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import TextIO
from xml.etree import ElementTree as ET

from cachedoctor.findings import Finding, Report, display_path, jsonable, printable

# XML 1.0 has no way to write most control characters; file names and messages may hold them.
NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

# The CLI asks the engine for the paths of every file checked only for reporters that say so.
NEEDS_PATHS = True


def xml_text(text: str) -> str:
    return NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", printable(text))


def _testcase(path: str, findings: list[Finding], cwd: str | None) -> ET.Element:
    shown = xml_text(display_path(path, cwd))
    directory, name = os.path.split(shown)
    case = ET.Element("testcase", classname=directory or ".", name=name or shown, file=shown)
    for f in findings:
        failure = ET.SubElement(case, "failure", type=f.code,
                                message=xml_text(f"{f.code} {f.name}: {f.message}"))
        # one line each, escaped one by one: the newlines between them are the body's own
        failure.text = "\n".join(xml_text(part) for part in (
            f"{f.code} {f.name} ({f.severity}) in {shown}", f.message,
            f"details: {json.dumps(jsonable(f.details), ensure_ascii=False)}",
            f"fix: {f.fix or 'manual'}; `cachedoctor explain {f.code}` says more"))
    return case


def render(report: Report, out: TextIO, *, verbose: bool = False, color: bool = False,
           cwd: str | None = None) -> None:
    by_path: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings:
        by_path[f.path].append(f)
    paths = list(dict.fromkeys([*report.checked, *by_path]))
    cases = [_testcase(p, by_path.get(p, []), cwd) for p in sorted(paths)]
    failed = sum(1 for c in cases if len(c))
    counts = {"tests": str(len(cases)), "failures": str(failed), "errors": "0", "skipped": "0"}
    root = ET.Element("testsuites", name="cachedoctor", **counts)
    suite = ET.SubElement(root, "testsuite", name="cachedoctor scan", **counts)
    properties = ET.SubElement(suite, "properties")  # the policy the scan ran under
    ET.SubElement(properties, "property", name="cachedoctor.policy",
                  value=xml_text(report.policy.summary()))
    for warning in report.policy.warnings:
        ET.SubElement(properties, "property", name="cachedoctor.warning", value=xml_text(warning))
    suite.extend(cases)
    if report.policy.warnings:
        ET.SubElement(suite, "system-err").text = xml_text("\n".join(report.policy.warnings))
    ET.indent(root)
    out.write('<?xml version="1.0" encoding="UTF-8"?>\n')
    out.write(ET.tostring(root, encoding="unicode"))
    out.write("\n")
