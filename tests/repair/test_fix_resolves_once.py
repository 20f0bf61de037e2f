"""`fix` resolves its targets once: the layouts it locks the caches of are the layouts it
scans, not a second resolve that must come out the same."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cachedoctor.engine  # noqa: F401  (imported before the patch: it binds resolve at import)
import cachedoctor.layouts as layouts
from cachedoctor.fixtures import empty_file

from conftest import invoke


def count_resolves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Every call of the layout resolver, wherever a module imported it from."""
    calls: list[tuple[str, ...]] = []
    real = layouts.resolve

    def counted(targets):
        targets = tuple(targets)
        calls.append(targets)
        return real(targets)

    for name, module in list(sys.modules.items()):
        if name.startswith("cachedoctor") and getattr(module, "resolve", None) is real:
            monkeypatch.setattr(module, "resolve", counted)
    return calls


def test_a_dry_run_resolves_its_targets_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_file.build(cache)
    calls = count_resolves(monkeypatch)

    result = invoke("fix", str(cache), "--dry-run", "--jobs", "1")

    assert result.exit_code == 0, result.output
    assert "Dry run: nothing changed." in result.stdout  # the scan found what to fix
    assert calls == [(str(cache),)]


def test_a_clean_cache_is_resolved_once_too(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache / "notes.txt").write_text("nothing to fix here\n")
    calls = count_resolves(monkeypatch)

    result = invoke("fix", str(cache), "--dry-run", "--jobs", "1")

    assert result.exit_code == 0, result.output
    assert "Nothing to fix." in result.stdout
    assert calls == [(str(cache),)]
