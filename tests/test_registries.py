"""Each registry (trainer layouts, readers, reporters) is a typed table: every entry satisfies
its Protocol, and a new entry is one module plus one line in the table."""

from __future__ import annotations

import io
import json
import types
from pathlib import Path

import pytest

from cachedoctor.findings import Report
from cachedoctor.formats import READERS, Reader
from cachedoctor.layouts import LAYOUTS, TrainerLayout, resolve
from cachedoctor.layouts.api import ConfigFile, Dataset, Layout
from cachedoctor.reporters import FORMATS, Reporter, reporter


def test_every_trainer_layout_is_registered_under_its_name() -> None:
    for name, module in LAYOUTS.items():
        assert isinstance(module, TrainerLayout), name
        assert name == module.NAME


def test_every_reader_reads_src_path_deep() -> None:
    assert READERS and all(isinstance(module, Reader) for module in READERS.values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_reporter_renders(fmt: str) -> None:
    chosen = reporter(fmt)
    assert isinstance(chosen, Reporter)
    out = io.StringIO()
    chosen.render(Report.build(("x",), [], 0, 0), out)  # (github prints nothing when clean)


def test_an_unknown_format_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        reporter("yaml")


def _toy_layout() -> types.ModuleType:
    """A trainer layout module: a config `toy.json` naming one cache dir."""
    module = types.ModuleType("toy")
    module.NAME = "toy"
    module.claims = lambda config: config.path.endswith("toy.json")
    module.discover = lambda folder: [str(Path(folder) / "toy.json")]

    def load(config: ConfigFile) -> Layout:
        cache = str(Path(config.path).parent / config.data["cache"])
        return Layout("toy", config.path, (Dataset("toy", cache_dirs=(cache,)),),
                      files=(config.path,))

    module.load = load
    return module


def test_a_new_trainer_layout_is_one_module_and_one_registry_line(tmp_path: Path,
                                                                  monkeypatch) -> None:
    (tmp_path / "latents").mkdir()
    (tmp_path / "toy.json").write_text(json.dumps({"cache": "latents"}))
    assert [lay.trainer for lay in resolve([str(tmp_path)])] == ["bare"]
    toy = _toy_layout()
    assert isinstance(toy, TrainerLayout)
    monkeypatch.setitem(LAYOUTS, toy.NAME, toy)
    [found] = resolve([str(tmp_path)])
    assert found.trainer == "toy"
    assert found.datasets[0].cache_dirs == (str(tmp_path / "latents"),)
