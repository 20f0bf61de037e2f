"""`cachedoctor fix --reencode` of ai-toolkit's flip_x entries encodes the mirrored image.

ostris/ai-toolkit 27a03a91: with `flip_x: true` (toolkit/data_loader.py) each image gets a
second item whose `get_latent_info_dict` (toolkit/dataloader_mixins.py) adds `flip_x: true`, so
its entry has a name of its own, and `load_and_process_image` transposes the image
(`Image.FLIP_LEFT_RIGHT`) before it resizes and crops it to the bucket; flip_y likewise top to
bottom. `get_latent` loads the entry by that name (`load_file(...)["latent"]`) and trains on it
as the mirrored sample. An entry re-encoded under a flip_x name from the unmirrored image is the
plain sample under the mirrored one's name.

The flip entries are written as in tests/layouts/test_aitoolkit_embeds_and_flips.py: the plain
entry's info with `flip_x` appended, hashed into the name, in the header."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from repair_helpers import isolated_state, tree_digest  # noqa: F401
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

from cachedoctor.fixtures.latents import TinyVAE
from cachedoctor.fixtures.projects import aitoolkit

from conftest import invoke, scan_paths

RUN_ID = re.compile(r"Applying run (\S+) ")


def _hash(info: dict) -> str:  # dataloader_mixins.py get_latent_path
    digest = hashlib.md5(json.dumps(info, sort_keys=True).encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").replace("=", "")


def _latent_of(image: Image.Image) -> torch.Tensor:
    """The reference encoder's bf16 latent of a PIL image (the fixture's scaling is 1)."""
    rgb = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).unsqueeze(0)
    return TinyVAE(4, seed=0).encode(rgb, "bfloat16")[0]


def flipped_project(tmp_path: Path, key: str) -> tuple[Path, Path, dict[Path, Path]]:
    """The ai-toolkit project with `key` (flip_x or flip_y) on: a second entry per image, its
    latent the encoding of the mirrored image. Returns (config, folder, {image: flip entry})."""
    project = aitoolkit.build(tmp_path / "p")
    folder = project.root / "datasets" / aitoolkit.DATASET
    transpose = Image.FLIP_LEFT_RIGHT if key == "flip_x" else Image.FLIP_TOP_BOTTOM
    flips = {}
    for entry in sorted((folder / "_latent_cache").glob("*.safetensors")):
        with safe_open(str(entry), "pt") as f:
            header = f.metadata()
        info = {k: (v if k in ("filename", "latent_space_version") else json.loads(v))
                for k, v in header.items() if k not in ("software", "format")}
        info[key] = True  # appended after the others (get_latent_info_dict)
        metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
        metadata.update(software=header["software"], format="pt")
        image = folder / info["filename"]
        target = folder / "_latent_cache" / f"{image.stem}_{_hash(info)}.safetensors"
        # the fixture's images are the size of their bucket: no resize, no crop
        save_file({"latent": _latent_of(Image.open(image).transpose(transpose))}, str(target),
                  metadata=metadata)
        flips[image] = target
    project.config.write_text(project.config.read_text().replace(
        "cache_latents_to_disk: true", f"cache_latents_to_disk: true\n          {key}: true"))
    return project.config, folder, flips


def _check_reencoded(tmp_path: Path, key: str) -> None:
    config, _, flips = flipped_project(tmp_path, key)
    assert not scan_paths(config).findings  # the clean project: nothing to fix
    image, entry = sorted(flips.items())[1]
    original = entry.read_bytes()
    entry.write_bytes(original[:-64])  # cut short: CD101, its header (so its info) intact
    before = tree_digest(config.parent.parent)

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert not scan_paths(config).findings
    latent = load_file(str(entry), device="cpu")["latent"]  # get_latent's call
    mirrored = load(original)["latent"]  # what ai-toolkit wrote for the mirrored item
    assert latent.dtype == torch.bfloat16 and torch.equal(latent, mirrored)
    assert not torch.equal(latent, _latent_of(Image.open(image)))  # not the plain item's
    with safe_open(str(entry), "pt") as f:
        assert f.metadata()[key] == "true"

    invoke("undo", RUN_ID.search(result.output)[1])
    assert tree_digest(config.parent.parent) == before


def test_a_flip_x_entry_is_encoded_from_the_image_mirrored_left_to_right(tmp_path: Path) -> None:
    _check_reencoded(tmp_path, "flip_x")


def test_a_flip_y_entry_is_encoded_from_the_image_mirrored_top_to_bottom(tmp_path: Path) -> None:
    _check_reencoded(tmp_path, "flip_y")


def test_a_plain_entry_beside_the_flips_stays_unmirrored(tmp_path: Path) -> None:
    """The clean counterpart: the plain entry of the same image is the unmirrored encoding."""
    config, folder, flips = flipped_project(tmp_path, "flip_x")
    image = sorted(flips)[1]
    [plain] = [p for p in (folder / "_latent_cache").glob(f"{image.stem}_*.safetensors")
               if p != flips[image]]
    original = plain.read_bytes()
    plain.write_bytes(original[:-64])

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(str(plain))["latent"], load(original)["latent"])
    assert not scan_paths(config).findings
