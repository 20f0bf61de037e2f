"""ai-toolkit caches the project fixtures did not hold, as ostris/ai-toolkit 27a03a91 writes them:

- `_t_e_cache/<stem>_<md5b64>.safetensors` (dataloader_mixins.py `_build_text_embedding_path`)
  from the three savers PromptEmbeds.load tells apart by the header's `class_name`:
  toolkit/advanced_prompt_embeds.py `AdvancedPromptEmbeds.save` (ERNIE-Image, Boogu, HiDream-O1:
  one `text_embeds` [tokens, dim] per prompt, `class_name` metadata),
  extensions_built_in/diffusion_models/anima/anima.py `AnimaPromptEmbeds.save`
  (`qwen_prompt_embeds`, `qwen_attention_mask`, int64 `t5_input_ids`, `t5_attention_mask`), and
  toolkit/prompt_utils.py `PromptEmbeds.save` cut to each prompt's token count (LTX-2, 1ce24287);
  every file of a dataset has its own token count.
- `flip_x: true` (data_loader.py: a second item per image with flip_x): a second latent entry per
  image, its info dict (so its name's hash) with `flip_x: true` (get_latent_info_dict).

Written that way (AdvancedPromptEmbeds run from its source), each scanned clean by config, bare
and project, with and without --deep; these tests keep it so."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cachedoctor.fixtures.projects import aitoolkit

from conftest import scan_paths


def alarms(target: Path, deep: bool = False) -> list:
    return [(f.code, f.path, f.message) for f in scan_paths(target, deep=deep).findings
            if f.severity >= 2]


def _hash(info: dict) -> str:
    digest = hashlib.md5(json.dumps(info, sort_keys=True).encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").replace("=", "")


def embeddings(folder: Path, kind: str) -> None:
    """One `_t_e_cache` file per image and caption, saved as `kind`'s saver saves it."""
    cache = folder / "_t_e_cache"
    cache.mkdir()
    generator = torch.Generator().manual_seed(0)
    for n, image in enumerate(sorted(folder.glob("*.png"))):
        info = {"caption": image.with_suffix(".txt").read_text(),
                "text_embedding_space_version": kind, "text_embedding_version": 1}
        path = str(cache / f"{image.stem}_{_hash(info)}.safetensors")
        tokens = 7 + 3 * n
        if kind == "ernie":  # AdvancedPromptEmbeds.save: each key's one tensor, class_name
            save_file({"text_embeds": torch.randn(tokens, 3072, generator=generator).bfloat16()},
                      path, metadata={"class_name": "AdvancedPromptEmbeds"})
        elif kind == "anima":
            save_file({"qwen_prompt_embeds": torch.randn(1, tokens, 1024,
                                                         generator=generator).bfloat16(),
                       "qwen_attention_mask": torch.ones(1, tokens, dtype=torch.int64),
                       "t5_input_ids": torch.randint(0, 32000, (1, 512), generator=generator),
                       "t5_attention_mask": torch.ones(1, 512, dtype=torch.int64)},
                      path, metadata={"class_name": "AnimaPromptEmbeds"})
        else:  # PromptEmbeds.save of an LTX-2 prompt shrunk to its tokens: no metadata
            save_file({"text_embed": torch.randn(1, tokens, 3840, generator=generator).bfloat16(),
                       "attention_mask": torch.ones(1, tokens, dtype=torch.int64)}, path)


@pytest.mark.parametrize("kind", ["ernie", "anima", "ltx2"])
def test_text_embeddings_of_each_saver_are_clean(tmp_path: Path, kind: str) -> None:
    project = aitoolkit.build(tmp_path / "p")
    folder = project.root / "datasets" / aitoolkit.DATASET
    embeddings(folder, kind)
    project.config.write_text(project.config.read_text().replace(
        "cache_latents_to_disk: true",
        "cache_latents_to_disk: true\n          cache_text_embeddings: true"))
    for target in (project.config, folder, project.root):
        assert alarms(target) == []
    assert alarms(project.config, deep=True) == []


def test_flip_x_entries_beside_the_plain_ones_are_clean(tmp_path: Path) -> None:
    project = aitoolkit.build(tmp_path / "p")
    folder = project.root / "datasets" / aitoolkit.DATASET
    for entry in sorted((folder / "_latent_cache").glob("*.safetensors")):
        with safe_open(str(entry), "pt") as f:
            header = f.metadata()
        info = {k: (v if k in ("filename", "latent_space_version") else json.loads(v))
                for k, v in header.items() if k not in ("software", "format")}
        info["flip_x"] = True  # appended after the others (get_latent_info_dict)
        metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
        metadata.update(software=header["software"], format="pt")
        latent = load_file(str(entry))["latent"].flip(-1).contiguous()
        stem = Path(info["filename"]).stem
        save_file({"latent": latent},
                  str(folder / "_latent_cache" / f"{stem}_{_hash(info)}.safetensors"),
                  metadata=metadata)
    project.config.write_text(project.config.read_text().replace(
        "cache_latents_to_disk: true", "cache_latents_to_disk: true\n          flip_x: true"))
    assert len(list((folder / "_latent_cache").iterdir())) == 2 * len(list(folder.glob("*.png")))
    for target in (project.config, folder, project.root):
        assert alarms(target) == []
    assert alarms(project.config, deep=True) == []
