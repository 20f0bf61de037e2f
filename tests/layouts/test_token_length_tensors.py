"""Text-encoder outputs with a tensor per token: its length is the caption's token count, which
differs from caption to caption in a healthy cache. Only feature sizes are compared (CD305).

Each cache is written as its trainer writes it:
- ai-toolkit (ostris/ai-toolkit 27a03a91): `toolkit/advanced_prompt_embeds.py`
  `AdvancedPromptEmbeds.save` (one tensor per key, header metadata `class_name` and
  `frozen_dtype_keys`), named by `toolkit/dataloader_mixins.py` `_build_text_embedding_path`.
  HiDream-O1 (`extensions_built_in/diffusion_models/hidream/hidream_o1_model.py`
  `get_prompt_embeds`) stores the tokenizer's ids, int64 [1, tokens], as `text_embeds`;
  MiniMax-H3 (`minimax_h3/minimax_h3.py`) stores `text_embeds` [tokens, 5120] and
  `text_token_tags` int64 [tokens].
- SimpleTuner (bghira/SimpleTuner bc8e6ab7): `simpletuner/helpers/models/minimaxh3/model.py`
  `slice_text_embedding_for_cache` keeps each caption's own length of `prompt_embeds`
  [1, tokens, D] and `text_token_tags` int64 [1, tokens]; `caching/text_embeds.py` saves them
  as `md5(caption)-minimaxh3.pt`.
- diffusion-pipe (tdrussell/diffusion-pipe 8f83dbf2): `models/base.py`
  `get_call_text_encoder_fn` pads a caching batch to its longest caption, so
  `text_embeds_<i>` [tokens, D] and `attention_mask_<i>` [tokens] differ from batch to batch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import save_file

from cachedoctor.fixtures.projects import aitoolkit, simpletuner
from cachedoctor.fixtures.projects import diffusion_pipe as dp

from conftest import by_code, scan_paths

CAPTIONS = ("a cat", "a photo of a cat on a red sofa", "a dog running on the beach at dusk",
            "portrait", "a bowl of fruit, oil painting, soft light, high detail")


def alarms(*targets: Path) -> list:
    return [f for f in scan_paths(*targets).findings if f.severity >= 2]


def tokens(caption: str) -> int:
    """A token count that grows with the caption (a chat template's tokens and one per word)."""
    return 12 + len(caption.split())


def aitoolkit_text_path(image: Path, caption: str, arch: str) -> Path:
    """`_build_text_embedding_path`: `_t_e_cache/<stem>_<urlsafe b64 of md5 of the info>`."""
    info = OrderedDict([("caption", caption), ("text_embedding_space_version", arch),
                        ("text_embedding_version", 1)])
    digest = hashlib.md5(json.dumps(info, sort_keys=True).encode("utf-8")).digest()
    name = base64.urlsafe_b64encode(digest).decode("ascii").replace("=", "")
    return image.parent / "_t_e_cache" / f"{image.stem}_{name}.safetensors"


def save_advanced(path: Path, tensors: dict, frozen: str) -> None:
    """AdvancedPromptEmbeds.save: each key's one tensor, class name and frozen keys in the header."""
    path.parent.mkdir(exist_ok=True)
    save_file(tensors, str(path),
              metadata={"class_name": "AdvancedPromptEmbeds", "frozen_dtype_keys": frozen})


def aitoolkit_project(root: Path, arch: str) -> tuple[Path, list[tuple[Path, str]]]:
    """An ai-toolkit project caching text embeddings, its images' captions of several lengths."""
    project = aitoolkit.build(root)
    config = project.config.read_text().replace(
        "cache_latents_to_disk: true",
        "cache_latents_to_disk: true\n          cache_text_embeddings: true", 1)
    project.config.write_text(config)
    shots = []
    for n, image in enumerate(sorted((root / "datasets" / aitoolkit.DATASET).glob("*.png"))):
        caption = CAPTIONS[n % len(CAPTIONS)]
        image.with_suffix(".txt").write_text(caption)
        # the caption, and the blank one caption dropout loads (caption_dropout_rate)
        shots += [(image, caption), (image, "")]
    return project.config, shots


def hidream_o1(caption: str) -> dict:
    return {"text_embeds": torch.arange(tokens(caption), dtype=torch.int64).unsqueeze(0)}


def minimax_h3(caption: str, features: int = 64) -> dict:
    n = tokens(caption)
    return {"text_embeds": torch.randn(n, features).to(torch.bfloat16),
            "text_token_tags": torch.zeros(n, dtype=torch.int64)}


def test_aitoolkit_hidream_o1_token_ids_of_any_length_are_no_mismatch(tmp_path: Path) -> None:
    config, shots = aitoolkit_project(tmp_path, "hidream_o1")
    for image, caption in shots:
        save_advanced(aitoolkit_text_path(image, caption, "hidream_o1"), hidream_o1(caption),
                      "text_embeds")
    assert alarms(config) == []
    assert alarms(tmp_path / "datasets") == []


def test_aitoolkit_minimax_h3_token_tags_vary_but_a_feature_size_is_compared(
        tmp_path: Path) -> None:
    config, shots = aitoolkit_project(tmp_path, "minimax_h3")
    paths = []
    for image, caption in shots:
        paths.append(aitoolkit_text_path(image, caption, "minimax_h3"))
        save_advanced(paths[-1], minimax_h3(caption), "text_token_tags")
    assert alarms(config) == []
    assert alarms(tmp_path / "datasets") == []
    image, caption = shots[2]
    save_advanced(paths[2], minimax_h3(caption, features=96), "text_token_tags")  # another encoder
    for target in (config, tmp_path / "datasets"):
        found = [(f.code, f.path) for f in alarms(target)]
        assert found == [("CD305", str(paths[2]))], target
        (finding,) = by_code(scan_paths(target), "CD305")
        assert "text_embeds has 96 features (64 in the others)" in finding.message


def test_simpletuner_minimaxh3_token_tags_vary_but_a_feature_size_is_compared(
        tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "text" / "minimaxh3"
    cache.mkdir(parents=True)
    paths = []
    for caption in CAPTIONS * 2:
        n = tokens(caption) + len(paths) % 3  # a keyframe's vision tokens lengthen some
        paths.append(cache / simpletuner.text_name(caption + str(len(paths)), "minimaxh3"))
        torch.save({"prompt_embeds": torch.randn(1, n, 64).to(torch.bfloat16),
                    "text_token_tags": torch.zeros(1, n, dtype=torch.int64)}, paths[-1])
    assert alarms(tmp_path / "cache") == []
    n = tokens(CAPTIONS[0])
    torch.save({"prompt_embeds": torch.randn(1, n, 32).to(torch.bfloat16),
                "text_token_tags": torch.zeros(1, n, dtype=torch.int64)}, paths[0])
    assert [(f.code, f.path) for f in alarms(tmp_path / "cache")] == [("CD305", str(paths[0]))]


def test_diffusion_pipe_batches_padded_to_their_longest_caption(tmp_path: Path) -> None:
    """models/base.py pads each caching batch to its longest caption: an item's token count is
    its batch's. A batch of another hidden size is still CD305."""
    project = dp.build(tmp_path)
    cache = dp.cache_of(project)
    folders = [*sorted(cache.glob("cache_*/text_embeddings_0")), cache / "uncond_text_embeddings_0"]
    for folder in folders:
        shutil.rmtree(folder)
        longest = [tokens(c) for c in CAPTIONS[:4]]
        dp.write_cache(folder, [{"text_embeds_0": torch.randn(n, 64).to(torch.bfloat16),
                                 "attention_mask_0": torch.ones(n, dtype=torch.int64)}
                                for n in longest])
    assert alarms(project.config) == []
    assert alarms(cache) == []
    odd = folders[0]
    dp.write_cache(odd, [{"text_embeds_0": torch.randn(9, 96).to(torch.bfloat16),
                          "attention_mask_0": torch.ones(9, dtype=torch.int64)}])
    offset = dp.shard_rows(odd, 1)[0][0]
    assert [(f.code, f.path) for f in alarms(project.config)] == [
        ("CD305", f"{odd / 'shard_1.bin'}@{offset}")]
