"""Caches written the way the four main trainers write them scan with no warning or error.

Each builder follows the trainer's own writer, beyond what the project fixtures hold:
- SimpleTuner (bghira/SimpleTuner bc8e6ab7): `simpletuner/helpers/caching/vae.py`
  `generate_vae_cache_filename` (sha256 of the stem, under the image's sub-folder of
  `instance_data_dir`), `data_backend/local.py` `torch_save` (gzip or plain), and
  `caching/text_embeds.py` `create_hash` (`md5(caption)-<family>.pt`); a second model family's
  caches beside the first (`cache/vae/flux/photos`, `cache/text/flux`).
- kohya sd-scripts (kohya-ss/sd-scripts 48d368fa): `library/strategy_base.py`
  `save_latents_to_disk` (float32 `latents`, `latents_flipped`, `alpha_mask`; FLUX's
  multi-resolution keys `_<h>x<w>`, one file holding two resolutions) and
  `library/strategy_flux.py` (`_flux_te.npz`).
- OneTrainer (Nerogar/OneTrainer 23df3832) through mgds (Nerogar/mgds 3a6994ad)
  `src/mgds/pipelineModules/DiskCache.py`: a second concept with two image and text variations.
- ai-toolkit (ostris/ai-toolkit 27a03a91) `toolkit/dataloader_mixins.py`
  `_build_text_embedding_path` and `toolkit/prompt_utils.py` `PromptEmbeds.save`: `_t_e_cache`
  with each caption's embedding and, with `caption_dropout_rate`, a blank one per image.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from cachedoctor.fixtures.clean import kohya_arrays
from cachedoctor.fixtures.latents import save_latent
from cachedoctor.fixtures.projects import aitoolkit, encode, images, kohya, onetrainer, simpletuner

from conftest import scan_paths


def alarms(*targets: Path) -> list:
    """Warnings and errors of a scan of `targets`."""
    return [f for f in scan_paths(*targets).findings if f.severity >= 2]


def build_simpletuner(root: Path) -> Path:
    project = simpletuner.build(root)
    photos = project.root / "datasets" / "photos"
    cache = project.root / "output/models/cache/vae/sdxl/photos"
    indices_file = photos / "aspect_ratio_bucket_indices_photos.json"
    metadata_file = photos / "aspect_ratio_bucket_metadata_photos.json"
    indices, metadata = json.loads(indices_file.read_text()), json.loads(metadata_file.read_text())
    moved: dict[str, str] = {}
    for n, image in enumerate(sorted(photos.glob("*.png"))):
        sub = "portraits" if n % 2 else "landscapes"
        (photos / sub).mkdir(exist_ok=True)
        (cache / sub).mkdir(exist_ok=True)
        target = photos / sub / image.name
        shutil.move(image, target)
        shutil.move(image.with_suffix(".txt"), target.with_suffix(".txt"))
        shutil.move(cache / simpletuner.vae_name(image), cache / sub / simpletuner.vae_name(image))
        moved[str(image)] = str(target)
    indices["aspect_ratio_bucket_indices"] = {
        key: [moved[p] for p in paths] for key, paths in indices["aspect_ratio_bucket_indices"].items()}
    indices_file.write_text(json.dumps(indices))
    metadata_file.write_text(json.dumps({moved[k]: v for k, v in metadata.items()}))
    flux = project.root / "output/models/cache/vae/flux/photos"
    for n, image in enumerate(sorted(photos.rglob("*.png"))):
        width, height = Image.open(image).size
        latent = encode(image, width, height, n, channels=16, dtype="bfloat16")
        target = flux / image.parent.name / simpletuner.vae_name(image)
        target.parent.mkdir(parents=True, exist_ok=True)
        save_latent(target, latent, "gzip" if n % 2 else "zip")
    text = project.root / "cache/text/flux"
    text.mkdir(parents=True)
    for n, caption in enumerate(sorted({t.read_text() for t in photos.rglob("*.txt")})):
        generator = torch.Generator().manual_seed(n)
        embeds = {"prompt_embeds": torch.randn(512, 4096, generator=generator).bfloat16(),
                  "pooled_prompt_embeds": torch.randn(768, generator=generator).bfloat16(),
                  "time_ids": None, "attention_masks": torch.ones(1, 512, dtype=torch.int64)}
        save_latent(text / simpletuner.text_name(caption, "flux"), embeds, "gzip")
    return project.config


def build_kohya(root: Path) -> Path:
    project = kohya.build(root)
    folder = project.root / "train" / kohya.DATASET
    for n, image in enumerate(sorted(folder.glob("*.png"))):
        width, height = Image.open(image).size
        arrays = kohya_arrays(encode(image, width, height, n, dtype="float32"))
        arrays["latents_flipped"] = np.flip(arrays["latents"], 2).copy()
        arrays["alpha_mask"] = np.ones((height, width), dtype=np.float32)
        np.savez(folder / kohya.npz_name(image, width, height), **arrays)
        flux: dict[str, np.ndarray] = {}
        for scale in (1, 2):
            latent = encode(image, width // scale, height // scale, n, channels=16)
            suffix = f"_{latent.shape[1]}x{latent.shape[2]}"
            flux["latents" + suffix] = latent.float().numpy()
            flux["original_size" + suffix] = np.array([width, height])
            flux["crop_ltrb" + suffix] = np.array([0, 0, width // scale, height // scale])
        np.savez(folder / kohya.npz_name(image, width, height, "flux"), **flux)
        rng = np.random.default_rng(n)
        np.savez(folder / f"{image.stem}_flux_te.npz",
                 l_pooled=rng.standard_normal(768).astype("float32"),
                 t5_out=rng.standard_normal((512, 4096)).astype("float32"),
                 txt_ids=np.zeros((512, 3), "float32"), t5_attn_mask=np.ones(512, "int64"),
                 apply_t5_attn_mask=False)
    return project.config


def build_onetrainer(root: Path) -> Path:
    project = onetrainer.build(root)
    concepts_file = project.root / "training_concepts/concepts.json"
    concepts = json.loads(concepts_file.read_text())
    style = onetrainer.concept("datasets/style", name="style", seed=999)
    style["image_variations"] = style["text_variations"] = 2
    concepts_file.write_text(json.dumps([*concepts, style], indent=4))
    written = images(project.root / "datasets/style", n_per_bucket=2, seed=5, prefix="sty")
    cache = project.root / "workspace-cache/run"
    for variation in range(2):
        image_dir = cache / "image" / onetrainer.group_key(
            [style["path"], style["seed"], False, style["image"]]) / f"variation-{variation}"
        text_dir = cache / "text" / onetrainer.group_key(
            [style["path"], style["seed"], False, style["text"]]) / f"variation-{variation}"
        image_dir.mkdir(parents=True)
        text_dir.mkdir(parents=True)
        aggregate = []
        for i, (path, width, height, seed) in enumerate(written):
            torch.save({"latent_image": encode(path, width, height, seed, dtype="float32"),
                        "original_resolution": (height, width), "crop_offset": (0, 0)},
                       image_dir / f"{i}.pt")
            aggregate.append({"crop_resolution": (height, width),
                              "image_path": str(Path("datasets/style") / path.name)})
            torch.save(onetrainer.text_sample(i), text_dir / f"{i}.pt")
        torch.save(aggregate, image_dir / "aggregate.pt")
        torch.save([{} for _ in written], text_dir / "aggregate.pt")
    return project.config


def build_aitoolkit(root: Path) -> Path:
    project, folder, _ = aitoolkit.multi_resolution(root)
    config = project.config.read_text().replace(
        "cache_latents_to_disk: true",
        'cache_latents_to_disk: true\n          cache_text_embeddings: true\n'
        '          control_path: "datasets/control"', 1)
    project.config.write_text(config)
    images(project.root / "datasets" / "control", n_per_bucket=1, seed=3, caption=False)
    (folder / "_t_e_cache").mkdir()
    for n, image in enumerate(sorted(folder.glob("*.png"))):
        caption = image.with_suffix(".txt").read_text()
        for text in (caption, ""):  # the caption, and the blank one caption dropout loads
            item = OrderedDict([("caption", text), ("text_embedding_space_version", "sdxl"),
                                ("text_embedding_version", 1)])
            digest = hashlib.md5(json.dumps(item, sort_keys=True).encode()).digest()
            name = base64.urlsafe_b64encode(digest).decode().replace("=", "")
            generator = torch.Generator().manual_seed(n)
            save_file({"text_embed": torch.randn(1, 77, 2048, generator=generator).bfloat16(),
                       "pooled_embed": torch.randn(1, 1280, generator=generator).bfloat16()},
                      folder / "_t_e_cache" / f"{image.stem}_{name}.safetensors")
    return project.config


BUILDERS = {"simpletuner": build_simpletuner, "kohya": build_kohya,
            "onetrainer": build_onetrainer, "aitoolkit": build_aitoolkit}


def test_each_trainer_s_cache_is_clean_by_config_project_and_bare(tmp_path: Path) -> None:
    configs = {name: build(tmp_path / name) for name, build in BUILDERS.items()}
    for name, config in configs.items():
        assert not alarms(config), name
        assert not alarms(tmp_path / name), name
    assert not alarms(tmp_path / "simpletuner" / "output/models/cache")
    assert not alarms(tmp_path / "simpletuner" / "cache")
    assert not alarms(tmp_path / "kohya" / "train")
    assert not alarms(tmp_path / "onetrainer" / "workspace-cache")
    assert not alarms(tmp_path / "aitoolkit" / "datasets")
    assert not alarms(tmp_path)  # the four projects side by side
