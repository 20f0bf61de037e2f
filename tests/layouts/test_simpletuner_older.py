"""Text embeds written by older SimpleTuner: before the dict format (d27ed803, 2025-03 model
refactor) `save_to_cache` stored a tuple, `(prompt_embeds, add_text_embeds)` for SDXL
(helpers/caching/text_embeds.py at 2f8fc6e7, 2024-11); bc8e6ab7 still loads it
(`load_from_cache` converts tuples)."""

from __future__ import annotations

from pathlib import Path

import torch

from cachedoctor.fixtures.latents import save_latent
from cachedoctor.fixtures.projects import age_all, simpletuner

from conftest import by_code, scan_paths


def test_tuple_text_embeds_are_clean_and_a_foreign_one_is_cd305(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "st")
    text = project.root / "cache" / "text" / "sdxl"
    for n, path in enumerate(sorted(text.glob("*.pt"))):
        embeds = simpletuner.text_embeds(n)
        save_latent(path, (embeds["prompt_embeds"], embeds["pooled_prompt_embeds"][None]),
                    "gzip" if n % 2 else "zip")
    age_all(project.root)
    for target in (project.config, text):
        assert [f for f in scan_paths(target).findings if f.severity >= 2] == []
    flux = simpletuner.text_embeds(99, "flux")
    bad = text / simpletuner.text_name("an old flux caption\n")
    save_latent(bad, (flux["prompt_embeds"], flux["pooled_prompt_embeds"][None],
                      torch.zeros(1, 3)), "gzip")
    age_all(project.root)
    assert [Path(f.path) for f in by_code(scan_paths(project.config), "CD305")] == [bad]
