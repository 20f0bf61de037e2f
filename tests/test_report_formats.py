"""The CI formats: SARIF for code scanning, GitHub annotations, JUnit XML; --output."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cachedoctor.checks import RULES
from cachedoctor.findings import Finding, Report, Severity
from cachedoctor.reporters import github, junit, sarif
from cachedoctor.rule_docs import page

from conftest import REPO, invoke


@pytest.fixture
def broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache under the working dir with an error, a warning and a clean file."""
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "data" / "cache"
    cache.mkdir(parents=True)
    (cache / "empty, really.pt").write_bytes(b"")
    (cache / "tmpabcd1234").write_bytes(b"x" * 10)
    (cache / "caption.txt").write_text("a photo\n")
    return cache


def test_sarif_structure(broken: Path) -> None:
    result = invoke("scan", "data/cache", "--format", "sarif", "--isolated", "-j", "1")
    assert result.exit_code == 1
    log = json.loads(result.stdout)
    assert log["$schema"] == "https://json.schemastore.org/sarif-2.1.0.json"
    assert log["version"] == "2.1.0"
    (run,) = log["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == list(RULES)
    for rule in rules:
        assert rule["shortDescription"]["text"] and rule["fullDescription"]["text"]
        assert "## What it does" in rule["help"]["text"]
    root = run["originalUriBaseIds"]["%SRCROOT%"]["uri"]
    assert root == broken.parent.parent.as_uri() + "/"
    ids = {r["id"] for r in rules}
    levels = {}
    for res in run["results"]:
        assert res["ruleId"] in ids
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"]
        assert res["message"]["text"]
        (location,) = res["locations"]
        artifact = location["physicalLocation"]["artifactLocation"]
        assert artifact["uriBaseId"] == "%SRCROOT%"
        assert not artifact["uri"].startswith("/")
        assert res["partialFingerprints"]
        levels[artifact["uri"]] = (res["ruleId"], res["level"])
    assert levels == {"data/cache/empty%2C%20really.pt": ("CD102", "error"),
                      "data/cache/tmpabcd1234": ("CD104", "warning"),
                      "data/cache/caption.txt": ("CD107", "warning")}


def test_sarif_full_description_is_the_first_section() -> None:
    rule = next(r for r in sarif.as_dict(Report.build((), [], 0, 0))["runs"][0]["tool"]["driver"]["rules"]
                if r["id"] == "CD201")
    assert rule["fullDescription"]["text"].startswith("Compares the bytes stored")
    assert "##" not in rule["fullDescription"]["text"]
    assert rule["defaultConfiguration"] == {"level": "warning"}


def test_sarif_help_uri_only_where_the_project_declares_its_rule_pages(monkeypatch) -> None:
    from cachedoctor import rule_docs

    monkeypatch.setattr(rule_docs, "_pages_url", lambda: None)
    assert all("helpUri" not in r for r in sarif.as_dict(Report.build((), [], 0, 0))["runs"][0]
               ["tool"]["driver"]["rules"])
    monkeypatch.setattr(rule_docs, "_pages_url", lambda: "https://example.org/docs/rules/")
    rules = sarif.as_dict(Report.build((), [], 0, 0))["runs"][0]["tool"]["driver"]["rules"]
    assert rules[0]["helpUri"] == f"https://example.org/docs/rules/{rules[0]['id']}.md"


def test_sarif_location_outside_the_working_dir_is_an_absolute_uri(tmp_path: Path) -> None:
    finding = Finding("CD102", "empty-file", Severity.ERROR, "/elsewhere/a b.pt", "empty")
    (res,) = sarif.as_dict(Report.build((), [finding], 1, 0), cwd=str(tmp_path))["runs"][0]["results"]
    artifact = res["locations"][0]["physicalLocation"]["artifactLocation"]
    assert artifact == {"uri": "file:///elsewhere/a%20b.pt"}


def test_github_annotations(broken: Path) -> None:
    result = invoke("scan", "data/cache", "--format", "github", "--isolated", "-j", "1")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines == sorted(lines, key=lambda line: line.split("title=")[1][:5])
    assert lines[0] == ("::error file=data/cache/empty%2C really.pt,title=CD102::"
                        "empty-file: empty file: 0 bytes where a cache entry should be")
    assert lines[1].startswith("::warning file=data/cache/tmpabcd1234,title=CD104::interrupted-write: ")
    assert lines[2].startswith("::warning file=data/cache/caption.txt,title=CD107::foreign-file: ")
    for line in lines:
        assert re.fullmatch(r"::(error|warning|notice) file=[^,:]+,title=CD\d{3}::[^\n]+", line)


def test_github_escapes_what_would_end_a_command() -> None:
    finding = Finding("CD101", "unreadable-archive", Severity.INFO, "/c/x:y,z.pt", "100% bad\nreally")
    out = _render(github, Report.build((), [finding], 1, 0), cwd="/c")
    assert out == "::notice file=x%3Ay%2Cz.pt,title=CD101::unreadable-archive: 100%25 bad\\x0areally\n"


def test_junit_one_case_per_file_and_a_failure_per_finding(broken: Path) -> None:
    result = invoke("scan", "data/cache", "--format", "junit", "--isolated", "-j", "1")
    assert result.exit_code == 1
    root = ET.fromstring(result.stdout)
    assert root.tag == "testsuites"
    cases = root.findall("./testsuite/testcase")
    assert sorted(c.get("name") for c in cases) == ["caption.txt", "empty, really.pt", "tmpabcd1234"]
    failures = {c.get("name"): [f.get("type") for f in c.findall("failure")] for c in cases}
    assert failures == {"caption.txt": ["CD107"], "empty, really.pt": ["CD102"], "tmpabcd1234": ["CD104"]}
    assert root.get("tests") == "3" and root.get("failures") == "3"
    assert {c.get("classname") for c in cases} == {"data/cache"}


def test_junit_counts_clean_files_as_passing_cases(broken: Path) -> None:
    (broken / "empty, really.pt").unlink()
    (broken / "caption.txt").unlink()
    (broken / "tmpabcd1234").unlink()
    for i in range(3):
        (broken / f"notes{i}.md").write_text("x")  # CD107, but ignored below
    result = invoke("scan", "data/cache", "--format", "junit", "--isolated", "--ignore", "CD107")
    assert result.exit_code == 0
    root = ET.fromstring(result.stdout)
    assert root.get("tests") == "3" and root.get("failures") == "0"
    assert all(not list(c) for c in root.iter("testcase"))


def test_junit_lists_files_read_by_worker_processes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b", "c", "d"):  # a batch per directory: enough batches for a pool
        (tmp_path / "cache" / name).mkdir(parents=True)
        (tmp_path / "cache" / name / "notes.md").write_text("x")
    result = invoke("scan", "cache", "--format", "junit", "--isolated", "-j", "2", "--ignore", "CD107")
    names = sorted(c.get("file") for c in ET.fromstring(result.stdout).iter("testcase"))
    assert names == [f"cache/{n}/notes.md" for n in "abcd"]


def test_junit_survives_control_characters_in_names(tmp_path: Path) -> None:
    finding = Finding("CD102", "empty-file", Severity.ERROR, str(tmp_path / "a\x01b.pt"), "bad \x1b[31m")
    root = ET.fromstring(_render(junit, Report.build((), [finding], 1, 0), cwd=str(tmp_path)))
    (case,) = root.iter("testcase")
    assert case.get("name") == "a\\x01b.pt"


def test_text_shows_control_characters_in_names_as_escapes(tmp_path: Path) -> None:
    """A file name is inert text: no escape sequence reaches the terminal, no newline splits a
    finding in two."""
    from cachedoctor.reporters import text

    (tmp_path / "x\x1b]0;PWN\x07\x1b[2J\nb.pt").write_bytes(b"")
    result = invoke("scan", str(tmp_path), "--isolated")
    (line,) = [line for line in result.stdout.splitlines() if ": CD102 " in line]
    assert "x\\x1b]0;PWN\\x07\\x1b[2J\\x0ab.pt" in line
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", result.stdout.replace("\n", ""))
    finding = Finding("CD102", "empty-file", Severity.ERROR, str(tmp_path / "a.pt"), "bad \x1b[31m")
    assert "bad \\x1b[31m" in _render(text, Report.build((), [finding], 1, 0), cwd=str(tmp_path))


def test_output_writes_the_report_and_the_terminal_gets_the_summary(broken: Path) -> None:
    result = invoke("scan", "data/cache", "--format", "sarif", "--output", "reports/cd.sarif", "--isolated")
    assert result.exit_code == 1
    log = json.loads(Path("reports/cd.sarif").read_text())
    assert len(log["runs"][0]["results"]) == 3
    assert "1 error, 2 warnings" in result.stdout
    assert "CD102" in result.stdout.splitlines()[0]
    assert result.stdout.rstrip().endswith("Report written to reports/cd.sarif")


def test_output_that_cannot_be_written_is_a_usage_error(broken: Path) -> None:
    Path("taken").write_text("a file, not a directory")
    result = invoke("scan", "data/cache", "--output", "taken/report.json", "--isolated")
    assert result.exit_code == 2
    assert result.stderr.startswith("cachedoctor: error: cannot write taken/report.json")


def test_rule_pages_match_the_registry() -> None:
    pages = REPO / "docs" / "rules"
    assert sorted(p.stem for p in pages.glob("*.md")) == sorted(RULES), \
        "run `python -m cachedoctor.rule_docs docs/rules`"
    for code, rule in RULES.items():
        assert (pages / f"{code}.md").read_text() == page(rule), \
            f"docs/rules/{code}.md is stale: run `python -m cachedoctor.rule_docs docs/rules`"


def test_explain_prints_the_rule_page() -> None:
    result = invoke("explain", "CD201")
    assert result.stdout.strip() == page(RULES["CD201"]).removeprefix("# ").strip()


def _render(module, report: Report, cwd: str) -> str:
    import io

    out = io.StringIO()
    module.render(report, out, cwd=cwd)
    return out.getvalue()


def test_every_format_renders_an_empty_report(tmp_path: Path) -> None:
    from cachedoctor.reporters import FORMATS, reporter

    for name in FORMATS:
        module = reporter(name)
        text = _render(module, Report.build((str(tmp_path),), [], 0, 0), cwd=os.fspath(tmp_path))
        if name in ("json", "sarif"):
            json.loads(text)
        elif name == "junit":
            ET.fromstring(text)


def test_junit_failure_body_has_real_newlines_and_escapes_only_the_message() -> None:
    finding = Finding("CD101", "unreadable-archive", Severity.ERROR, "/c/a.pt", "cut short\nreally",
                      details={"entry": "archive/data/0"})
    root = ET.fromstring(_render(junit, Report.build((), [finding], 1, 0), cwd="/c"))
    (failure,) = root.iter("failure")
    lines = failure.text.split("\n")
    assert lines[0] == "CD101 unreadable-archive (error) in a.pt"
    assert lines[1] == "cut short\\x0areally"  # a newline inside a message stays inert
    assert lines[2] == 'details: {"entry": "archive/data/0"}'
    assert lines[3].startswith("fix: quarantine" if finding.fix else "fix: manual")
    assert len(lines) == 4


def _table(findings: list[Finding]) -> list[str]:
    """The terminal table's rows (color on, as on a terminal), without the escapes."""
    import io

    from cachedoctor.reporters import text

    out = io.StringIO()
    text.render(Report.build((), findings, len(findings), 0), out, color=True, cwd="/c")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    return [" ".join(line.split()) for line in plain.splitlines()]


def test_table_collapses_only_findings_that_say_the_same_thing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per row
    orphan = "no source image maps to this entry (a renamed or deleted image)"
    findings = [
        Finding("CD405", "orphan-cache-entries", Severity.INFO, "/c/cache/index.json", "lists 1 image "
                "that no longer exists: img_201.png", dataset="photos"),
        *(Finding("CD405", "orphan-cache-entries", Severity.INFO, f"/c/cache/{i:064x}.pt", orphan,
                  dataset="photos") for i in range(5)),
        Finding("CD405", "orphan-cache-entries", Severity.INFO, "/c/cache/img_000.pt",
                "old unhashed name: never read", dataset="photos"),
        *(Finding("CD302", "latent-size-mismatch", Severity.ERROR, f"/c/cache/l{i}.pt",
                  f"latent is {16 + i}x16; bucket 1.0 needs 16x16", dataset="photos") for i in range(3)),
    ]
    rows = _table(findings)
    row = {text: next(r for r in rows if text in r) for text in ("img_201.png", orphan, "never read", "latent is")}
    assert "(+" not in row["img_201.png"] and "(and" not in row["img_201.png"]
    assert row[orphan].endswith("(and 4 more like it)")  # the five orphans: one row
    assert "(and" not in row["never read"]
    assert row["latent is"].endswith("(and 2 more like it)")  # three size mismatches: one kind, numbers aside
    assert len([r for r in rows if " CD405 " in r]) == 3


def test_gist_keeps_words_and_drops_what_varies() -> None:
    from cachedoctor.reporters.text import gist

    assert gist("its image img_101.png was modified 50 min after") == gist(
        "its image cat.jpg was modified 3 min after")
    assert gist("an image in a cache dir") != gist("a text file (caption?) in a cache dir")
    assert gist("one image's latent overwrites the other's") == "one image's latent overwrites the other's"


def test_a_single_file_target_is_labelled_with_its_folder(tmp_path: Path) -> None:
    from conftest import scan_paths

    (tmp_path / "latents").mkdir()
    (tmp_path / "latents" / "img_0000.pt").write_bytes(b"")
    (finding,) = scan_paths(tmp_path / "latents" / "img_0000.pt").findings
    assert finding.code == "CD102"
    assert finding.dataset == "latents"


def test_next_names_reencode_only_when_entries_are_missing() -> None:
    """After a scan with CD404, the hint says that the plan can encode them (issue #12)."""
    from cachedoctor.reporters.text import next_steps

    def report(*fixes: str) -> Report:
        return Report(("cache",), tuple(
            Finding("CD404" if fix == "reencode" else "CD101", "x", Severity.ERROR, f"cache/{i}.pt",
                    "m", fix=fix) for i, fix in enumerate(fixes)), files=len(fixes), bytes=0)

    assert "--reencode --encoder SPEC` it also encodes the 2 missing entries" in \
        next_steps(report("reencode", "reencode", "quarantine"))
    assert "--reencode" not in next_steps(report("quarantine"))


def _on_a_terminal(*args: str) -> tuple[int, str, str]:
    """The installed command with its stdout on a pseudo-terminal, as a user at a shell runs it."""
    import pty
    import subprocess
    import sys

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "cachedoctor", *args], stdout=follower,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    return proc.wait(timeout=120), b"".join(chunks).decode(), stderr


def test_the_terminal_table_shows_rich_markup_in_names_as_written(tmp_path: Path) -> None:
    """The table is drawn by rich, which reads `[...]` in a string as markup: a file name must
    neither forge a hyperlink or a style nor, with an unmatched `[/]`, fail the whole report."""
    cache = tmp_path / "cache"
    (cache / "a[").mkdir(parents=True)
    (cache / "a[" / "]b.pt").write_bytes(b"")  # shown as a[/]b.pt: a closing tag
    (cache / "[link=https:__evil.example]c[_link].pt").write_bytes(b"")
    code, out, err = _on_a_terminal("scan", "--verbose", "--isolated", str(cache))
    assert code == 1, err
    assert "MarkupError" not in err and "internal error" not in err
    flat = re.sub(r"\s+", "", out)  # the table folds long names over lines
    assert "a[/]b.pt" in flat
    assert "[link=https:__evil.example]c[_link].pt" in flat
    assert "\x1b]8;" not in out  # no OSC 8 hyperlink


# what may not reach a reader from a cache: C0/C1 controls (escape sequences, newlines), the
# Unicode line separators and the bidi controls that reorder what a line shows
FORGING = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                     "\u2066-\u2069]")


def _strings(value: object):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


@pytest.mark.parametrize("fmt", ["text", "json", "sarif", "github", "junit"])
def test_names_inside_files_and_of_files_reach_no_format_as_controls(fmt: str, tmp_path: Path) -> None:
    """A zip member's name and a file's name are the cache author's text: in every format, in a
    message as in a path, no escape sequence, line separator or bidi override gets through (in
    JSON, not even as an escape that a consumer decodes and prints)."""
    import zipfile

    forged = "\x1b]0;PWN\x07\x1b[2J\nFAKE: CD000 error\u2028\u202egnp.evil"
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "member.npz", "w") as z:
        z.writestr(forged + ".npy", b"no array")
    (cache / f"{forged}.pt").write_bytes(b"")
    result = invoke("scan", str(cache), "--isolated", "--format", fmt)
    assert result.exit_code == 1
    texts = list(_strings(json.loads(result.stdout))) if fmt in ("json", "sarif") else [result.stdout]
    assert not [t for t in texts if FORGING.search(t.replace("\n", ""))]
    assert not any(line.startswith("FAKE") for t in texts for line in t.splitlines())
    assert sum(t.count("\\u202egnp.evil") for t in texts) >= 2  # the name and the member, shown
