"""The published malicious corpus of a peer scanner, scored by the loaders themselves.

The corpus is not in the repository (fetch it for a local run: picklescan's `tests/data` and
`tests/data2`), so this test runs only when CACHEDOCTOR_HOSTILE_CORPUS names its folders
(separated by os.pathsep); benchmarks/hostile_corpus.py prints the full table.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from conftest import REPO

CORPUS = [Path(p) for p in os.environ.get("CACHEDOCTOR_HOSTILE_CORPUS", "").split(os.pathsep) if p]

pytestmark = pytest.mark.skipif(not CORPUS, reason="CACHEDOCTOR_HOSTILE_CORPUS is not set")


def _scorer():
    spec = importlib.util.spec_from_file_location("hostile_corpus", REPO / "benchmarks" / "hostile_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_file_a_loader_executes_is_an_error_and_no_benign_file_is_cd105() -> None:
    result = _scorer().score(CORPUS)
    rows = result["rows"]
    missed = [r["file"] for r in rows if r["group"] != "benign" and not r["error"]]
    false = [r["file"] for r in rows if r["group"] == "benign" and r["cd105"]]
    assert result["summary"]["executes"] > 0
    assert not missed, missed
    assert not false, false
