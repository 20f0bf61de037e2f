"""The code's prose stands alone and reads: comments and docstrings cite only pages the
repository holds, and no module docstring runs on in one long sentence."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

from conftest import REPO

LONGEST_SENTENCE = 60  # words; the longest today is 54


def _tracked(suffix: str) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in listed if name.endswith(suffix) and (REPO / name).is_file()]


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python module."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno if node.body else 1, doc))
    return out


def sentences(doc: str) -> list[str]:
    """The sentences of a docstring's prose: paragraphs and list items split at . ; ! ?
    (indented and fenced blocks are examples, not prose; `code` counts as one word)."""
    out = []
    for block in re.split(r"\n\s*\n|\n\s*(?=[-*] |\d+\. )", doc):
        if block.startswith("    ") or "```" in block:
            continue
        text = re.sub(r"`[^`]*`", "CODE", re.sub(r"\s+", " ", block)).strip()
        out += [s for s in re.split(r"(?<=[.;!?])\s+", text) if s]
    return out


def test_code_names_only_markdown_pages_the_repository_holds() -> None:
    """A comment or docstring that cites a Markdown page cites one a reader of the repository
    can open: notes kept elsewhere are out of their reach."""
    pages = {path.name for path in _tracked(".md")}
    offenders = [f"{path.relative_to(REPO)}:{line}: {name}"
                 for path in _tracked(".py")
                 for line, text in _prose(path.read_text())
                 for name in re.findall(r"[\w.-]+\.md\b", text)
                 if name.rsplit("/", 1)[-1] not in pages and not re.fullmatch(r"CD\d{3}\.md", name)]
    assert offenders == []


def test_module_docstrings_are_short_sentences() -> None:
    long = [f"{path.relative_to(REPO)}: {len(s.split())} words: {s[:80]}..."
            for path in _tracked(".py")
            if path.relative_to(REPO).parts[0] in ("cachedoctor", "checks", "fixtures", "benchmarks")
            for s in sentences(ast.get_docstring(ast.parse(path.read_text())) or "")
            if len(s.split()) > LONGEST_SENTENCE]
    assert long == []


def test_the_sentence_splitter_sees_a_run_on_sentence() -> None:
    run_on = " ".join(["a clause, and"] * 30) + " the end."
    assert [len(s.split()) for s in sentences(f"Title.\n\n{run_on}")] == [1, 92]
    short = "One. Two; three!\n\n    an example line that is not prose\n\n- an item. Another."
    assert sentences(short) == ["One.", "Two;", "three!", "- an item.", "Another."]
