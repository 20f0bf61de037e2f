"""`include-info` in `cachedoctor.toml` / `[tool.cachedoctor]`: `fix` acts on info findings too
(CD405 orphans), as `--include-info` does; `--include-info` / `--no-include-info` win over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachedoctor import config as configuration
from cachedoctor.fixtures.projects import aitoolkit

from conftest import invoke


@pytest.fixture
def orphan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """An ai-toolkit project whose only finding is an info CD405 orphan (its image deleted);
    the working directory is where a cachedoctor.toml would be found."""
    project = aitoolkit.build(tmp_path / "p", defects=["CD405"])
    monkeypatch.chdir(tmp_path)
    ((entry, _),) = project.expected["CD405"]
    return project.config, Path(entry).name


@pytest.mark.parametrize(("file", "flags", "acts"), [
    (None, (), False),
    ("include-info = true\n", (), True),
    ("include-info = false\n", (), False),
    ("include-info = true\n", ("--no-include-info",), False),
    ("include-info = false\n", ("--include-info",), True),
    (None, ("--include-info",), True),
])
def test_the_key_opts_in_and_the_flags_win(orphan: tuple[Path, str], tmp_path: Path,
                                           file: str | None, flags: tuple[str, ...],
                                           acts: bool) -> None:
    config, entry = orphan
    if file is not None:
        (tmp_path / "cachedoctor.toml").write_text(file)

    result = invoke("fix", str(config), "--dry-run", *flags)

    assert result.exit_code == 0, result.output
    assert (entry in result.stdout) is acts, result.stdout
    assert ("Nothing to fix." in result.stdout) is not acts
    assert ("not acted on: --include-info acts on them" in result.stdout) is not acts


def test_the_key_in_pyproject_applies(orphan: tuple[Path, str], tmp_path: Path) -> None:
    config, entry = orphan
    (tmp_path / "pyproject.toml").write_text("[tool.cachedoctor]\ninclude-info = true\n")
    result = invoke("fix", str(config), "--dry-run")
    assert result.exit_code == 0 and entry in result.stdout, result.output


def test_a_wrong_type_is_one_line_naming_the_key(orphan: tuple[Path, str], tmp_path: Path) -> None:
    config, _ = orphan
    path = tmp_path / "cachedoctor.toml"
    path.write_text('include-info = "yes"\n')
    result = invoke("fix", str(config), "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"cachedoctor: error: {path}: include-info: expected true or "
                                     "false, got 'yes'")


def test_layers_resolve_highest_first() -> None:
    on = configuration.parse({"include-info": True}, "file")
    unset = configuration.parse({}, "flags")
    off = configuration.parse({"include-info": False}, "flags")
    assert unset.over(on).include_info is True  # not set on top: the file's
    assert off.over(on).include_info is False
    assert configuration.policy(unset, isolated=True).include_info is False  # the default
