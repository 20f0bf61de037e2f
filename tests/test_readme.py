"""The README stays true: its rule table is the registry's, and CI runs its test command."""

from __future__ import annotations

import re

from cachedoctor.checks import RULES
from cachedoctor.cli import rules_table

from conftest import REPO

README = (REPO / "README.md").read_text()


def test_rules_table_matches_the_registry() -> None:
    table = re.search(r"<!-- rules-table.*?-->\n(.*?)\n<!-- end rules-table -->", README, re.S)
    assert table is not None
    assert table.group(1) == rules_table(RULES.values())


def test_quick_start_has_two_commands_and_ci_runs_the_second() -> None:
    quick = README.split("## Quick start", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = quick.strip().splitlines()
    assert len(commands) == 2
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == commands[1]
