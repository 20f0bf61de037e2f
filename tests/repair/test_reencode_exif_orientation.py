"""`cachedoctor fix --reencode` reads a photo the way the trainer does: upright by its EXIF
orientation for SimpleTuner, OneTrainer and ai-toolkit, as stored for kohya.

- bghira/SimpleTuner bc8e6ab7 simpletuner/helpers/image_manipulation/training_sample.py:
  `self.image = exif_transpose(self.image)` before its sizes and crops are taken;
- Nerogar/mgds 3a6994ad src/mgds/pipelineModules/LoadImage.py: `read_image(path, ...,
  apply_exif_orientation=True)`, else `ImageOps.exif_transpose(image)`;
- ostris/ai-toolkit 27a03a91 toolkit/dataloader_mixins.py `load_and_process_image`:
  `exif_transpose(Image.open(self.path))`, and data_loader.py sizes the image the same way;
- kohya-ss/sd-scripts 48d368fa library/train_util.py `load_image`: `Image.open` and
  `convert("RGB")` only, so the stored pixels as they are.

A camera that stores its sensor's pixels upside down tags them with EXIF orientation 3 (turned a
quarter: 6). Each image here is written that way: the fixture's picture stored turned, so the
trainers that apply the tag see the very picture the fixture encoded. The image's mtime is then
newer than its entry (CD406): the entry is quarantined and encoded again, and must hold the
latent the trainer cached for that picture."""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from repair_helpers import isolated_state, tree_digest  # noqa: F401
from safetensors.torch import load_file

from cachedoctor.fixtures.projects import Project, aitoolkit, kohya, onetrainer, simpletuner

from conftest import invoke, scan_paths

RUN_ID = re.compile(r"Applying run (\S+) ")
# EXIF orientation -> how the camera stored the upright picture: 3 turned 180 degrees, 6 a
# quarter turn (width and height swapped: exif_transpose turns it back with ROTATE_270)
STORED = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90}


def tagged(image: Path, turned: bool, orientation: int = 3) -> None:
    """Rewrite the PNG with EXIF `orientation`; its pixels stored turned that way where
    `turned` (so that an EXIF-aware reader sees the picture as before)."""
    picture = Image.open(image).convert("RGB")
    if turned:
        picture = picture.transpose(STORED[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", exif=exif)
    image.write_bytes(buffer.getvalue())


def _onetrainer(project: Project, image: Path) -> Path:
    [folder] = (project.root / "workspace-cache" / "run" / "image").glob("*/variation-0")
    index = sorted(p.name for p in image.parent.glob("img_*.png")).index(image.name)
    return folder / f"{index}.pt"


def _simpletuner(project: Project, image: Path) -> Path:
    return project.root / "output/models/cache/vae/sdxl/photos" / simpletuner.vae_name(image)


def _aitoolkit(project: Project, image: Path) -> Path:
    stem = image.stem
    [entry] = (image.parent / "_latent_cache").glob(f"{stem}_*.safetensors")
    return entry


def _torch_latent(path: Path) -> torch.Tensor:
    import gzip

    data = path.read_bytes()
    raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    return value["latent_image"] if isinstance(value, dict) else value


TRAINERS: dict[str, tuple[Callable, str, Callable, Callable]] = {
    "simpletuner": (simpletuner.build, "datasets/photos/img_101.png", _simpletuner, _torch_latent),
    "onetrainer": (onetrainer.build, "datasets/person/img_101.png", _onetrainer, _torch_latent),
    "ai-toolkit": (aitoolkit.build, "datasets/person/img_101.png", _aitoolkit,
                   lambda p: load_file(str(p))["latent"]),
}


@pytest.mark.parametrize("orientation", list(STORED))
@pytest.mark.parametrize("name", list(TRAINERS))
def test_a_turned_photo_is_encoded_upright(name: str, orientation: int, tmp_path: Path) -> None:
    build, rel, entry_of, load = TRAINERS[name]
    project = build(tmp_path / name)
    image = project.root / rel
    entry = entry_of(project, image)
    cached = load(entry)  # what the trainer cached for the upright picture
    tagged(image, turned=True, orientation=orientation)
    before = tree_digest(project.root)
    assert "CD406" in {f.code for f in scan_paths(project.config).findings}

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    again = load(entry_of(project, image))
    assert again.dtype == cached.dtype and torch.equal(again, cached), \
        "not the latent of the picture the trainer sees"
    assert not scan_paths(project.config).findings

    invoke("undo", RUN_ID.search(result.output)[1])
    assert tree_digest(project.root) == before


def test_kohya_encodes_the_stored_pixels_whatever_the_tag(tmp_path: Path) -> None:
    """The clean counterpart: sd-scripts ignores the tag, so the entry is the stored pixels'."""
    project = kohya.build(tmp_path, {"CD404"})
    folder = project.root / "train" / kohya.DATASET
    image = folder / "img_002.png"  # its npz is the one CD404 took away
    tagged(image, turned=False, orientation=3)
    stored = np.asarray(Image.open(image).convert("RGB"))

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    with np.load(folder / kohya.npz_name(image, 256, 256), allow_pickle=False) as npz:
        latent = torch.from_numpy(npz["latents"])
    from cachedoctor.fixtures.latents import TinyVAE

    rgb = torch.from_numpy(stored.copy()).permute(2, 0, 1).unsqueeze(0)
    assert torch.equal(latent, TinyVAE(4, seed=0).encode(rgb, "float32")[0])
    assert hashlib.sha256(stored.tobytes()).digest() != hashlib.sha256(
        np.ascontiguousarray(stored[::-1, ::-1]).tobytes()).digest()  # the tag would matter
