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


# What the docs may not point at: notes that live outside the repository.
OUTSIDE = re.compile("|".join(["design" + r" notes?", "field" + r"[ -]notes?", "DESIGN" + r"\.md",
                               "research" + r"/\w", r"\.\./" + "shared"]), re.I)


def _tracked_text_files() -> list:
    import subprocess

    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in listed
            if name.endswith((".py", ".md", ".toml", ".txt", ".yaml", ".json", ".cfg")) or name == ".ci/run"]


def test_nothing_points_at_notes_outside_the_repository() -> None:
    files = _tracked_text_files()
    assert REPO / "README.md" in files and REPO / "docs" / "incidents.md" in files
    offenders = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for path in files if path.is_file()
                 for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                 if OUTSIDE.search(line)]
    assert offenders == []


def test_readme_links_into_docs_resolve() -> None:
    for target in re.findall(r"\]\(((?:docs)/[^)#]*)", README):
        assert (REPO / target).exists(), target


def test_incidents_page_covers_every_harness_scenario() -> None:
    from cachedoctor.harness.scenarios import SCENARIOS, load_scenario

    page = (REPO / "docs" / "incidents.md").read_text()
    sections = re.split(r"^## (?=\d\. )", page, flags=re.M)[1:]
    assert len(sections) == len(SCENARIOS) == 5
    for number, name in enumerate(SCENARIOS, 1):
        scenario = load_scenario(name)
        assert scenario.INCIDENT.startswith(f"docs/incidents.md #{number},"), scenario.INCIDENT
        section = sections[number - 1]
        assert section.startswith(f"{number}. ")
        assert f"`{name}`" in section, name
        for code in scenario.EXPECTED:
            assert code in section, (name, code)
        for heading in ("**What happened.**", "**What the user saw.**", "**Rules.**", "**Repair.**",
                        "**Harness.**"):
            assert heading in section, (name, heading)
    assert set(re.findall(r"CD\d{3}", page)) <= set(RULES)


def test_harness_list_points_at_the_incidents_page() -> None:
    from typer.testing import CliRunner

    from cachedoctor.cli import app

    lines = CliRunner().invoke(app, ["harness", "list"]).stdout.splitlines()
    assert len(lines) == 5
    assert all("[docs/incidents.md #" in line for line in lines)


def _readme_json(after: str) -> dict:
    """The first ```json block after `after`, with the `…` lines (findings left out) dropped."""
    import json

    block = README.split(after, 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    kept = "\n".join(line for line in block.splitlines() if line.strip() != "…")
    return json.loads(re.sub(r",(\s*[\]}])", r"\1", kept))


def test_readme_json_examples_are_real_runs(tmp_path, monkeypatch) -> None:
    """The README's JSON is what `cachedoctor demo demo` then `scan --format json` prints: the
    same keys in the same order, the same counts, and the findings shown are real ones."""
    import json

    from typer.testing import CliRunner

    from cachedoctor.cli import app

    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["demo", "demo"]).exit_code == 0

    def run(target: str) -> dict:
        result = CliRunner().invoke(app, ["scan", "--format", "json", "--isolated", target])
        return json.loads(result.stdout)

    shown, real = _readme_json("## JSON report"), run("demo/cache")
    assert list(shown) == list(real)
    assert shown["tool"]["name"] == real["tool"]["name"] and set(shown["tool"]) == set(real["tool"])
    assert shown["targets"] == real["targets"]
    assert list(shown["summary"]) == list(real["summary"])
    assert shown["summary"]["files"] == real["summary"]["files"]
    assert shown["summary"]["findings"] == real["summary"]["findings"]
    assert abs(shown["summary"]["bytes"] - real["summary"]["bytes"]) < real["summary"]["bytes"] // 10
    assert shown["findings"] and all(f in real["findings"] for f in shown["findings"])
    for finding in real["findings"]:
        assert list(finding) == list(shown["findings"][0])

    config_finding = _readme_json("where the config can be fixed, `change`")
    assert config_finding in run("demo/simpletuner")["findings"]
