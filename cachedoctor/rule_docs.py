"""One Markdown page per rule (`docs/rules/CD201.md`): what `cachedoctor explain CD201` prints.

The pages are generated from the registry, so they say exactly what the installed tool says;
a test keeps them in sync. Regenerate them after changing a rule:

    python -m cachedoctor.rule_docs docs/rules

SARIF reports link each rule to its page when the project declares where the pages are
published: a `Rules` entry in `[project.urls]` (the folder's URL, ending in `/`).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from cachedoctor.rule import Rule

URL_LABEL = "Rules"


def heading(rule: Rule) -> str:
    return f"{rule.code} {rule.name} ({rule.severity}; fix: {rule.fix or 'none, manual'})"


def page(rule: Rule) -> str:
    return f"# {heading(rule)}\n\n{rule.doc.strip()}\n"


def what_it_does(rule: Rule) -> str:
    """The first section of a rule's text, as one paragraph (SARIF's fullDescription)."""
    text = rule.doc.split("## What it does", 1)[-1].split("\n## ", 1)[0]
    return " ".join(text.split()) or rule.summary


@functools.cache
def _pages_url() -> str | None:
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata("cachedoctor").get_all("Project-URL") or []
    except PackageNotFoundError:
        return None
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip() == URL_LABEL and url.strip():
            return url.strip().rstrip("/") + "/"
    return None


def rule_url(code: str) -> str | None:
    """The published page of rule `code`, or None when the project declares no such place."""
    base = _pages_url()
    return f"{base}{code}.md" if base else None


def write_pages(directory: Path) -> list[Path]:
    """Write every rule's page into `directory`, removing pages of rules that are gone."""
    from cachedoctor.checks import RULES

    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("CD*.md"):
        if stale.stem not in RULES:
            stale.unlink()
    written = []
    for rule in RULES.values():
        path = directory / f"{rule.code}.md"
        path.write_text(page(rule), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    pages = write_pages(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/rules"))
    print(f"wrote {len(pages)} rule pages")
