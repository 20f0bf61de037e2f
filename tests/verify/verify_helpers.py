"""Trainer projects to verify, and ways to plant the defects verify must name, each made the way
it happens: latents written by another encoder, scaled once more, of the mirrored image, of
another image, of an image replaced since (its mtime put back)."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch

from cachedoctor.fixtures.devices import stored_as
from cachedoctor.fixtures.images import write_png
from cachedoctor.fixtures.latents import TinyVAE
from cachedoctor.fixtures.projects import Project, aitoolkit, kohya, onetrainer, simpletuner
from cachedoctor.formats import read_path
from cachedoctor.images import load
from cachedoctor.layouts import resolve
from cachedoctor.layouts.entries import NO_CHANGES
from cachedoctor.verify.sample import latent_entries

BUILDERS = {"simpletuner": simpletuner.build, "onetrainer": onetrainer.build, "kohya": kohya.build,
            "ai-toolkit": aitoolkit.build}


def pairs(project: Project) -> dict[Path, Path]:
    """entry -> its image, as the trainer's layout pairs them."""
    [layout] = resolve([str(project.config)])
    out = {}
    for dataset in layout.datasets:
        entries = dataset.naming.entries(dataset, NO_CHANGES)
        for entry in latent_entries(dataset.latent_cache_dir):
            out[Path(entry)] = Path(entries.source(entry))
    return out


def bucket_of(image: Path) -> str:
    return image.stem.split("_")[-1][0]  # fixtures name images img_<bucket><n>


def rewrite(entry: Path, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace the latent stored in `entry` by change(latent), in the entry's own container,
    dtype and keys (npz, safetensors with its metadata, torch zip or gzip, bare or a dict)."""
    if entry.suffix == ".npz":
        with np.load(entry, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        arrays["latents"] = change(torch.from_numpy(arrays["latents"])).numpy().astype(arrays["latents"].dtype)
        with open(entry, "wb") as f:
            np.savez(f, **arrays)
        return
    if entry.suffix == ".safetensors":
        tensors = safetensors.torch.load_file(entry)
        with safetensors.safe_open(entry, "pt") as f:
            metadata = f.metadata()
        tensors["latent"] = change(tensors["latent"]).to(tensors["latent"].dtype).contiguous()
        safetensors.torch.save_file(tensors, entry, metadata=metadata)
        return
    data = entry.read_bytes()
    gzipped = data[:2] == b"\x1f\x8b"
    obj = torch.load(io.BytesIO(gzip.decompress(data) if gzipped else data), weights_only=True,
                     map_location="cpu")
    [location] = read_path(str(entry)).locations or ("cpu",)  # OneTrainer saves from its device
    if isinstance(obj, dict):
        obj["latent_image"] = change(obj["latent_image"]).to(obj["latent_image"].dtype).clone()
    else:
        obj = change(obj).to(obj.dtype).clone()
    buffer = io.BytesIO()
    with stored_as(location) if location != "cpu" else contextlib.nullcontext():
        torch.save(obj, buffer)
    entry.write_bytes(gzip.compress(buffer.getvalue()) if gzipped else buffer.getvalue())


def encoded(image: Path, seed: int = 0, flip: bool = False) -> torch.Tensor:
    """TinyVAE's latent of the image file as it is (mirrored when asked)."""
    pixels = load(str(image))
    return TinyVAE(4, seed).encode((pixels.flip(-1) if flip else pixels)[None], "float32")[0]


def replace_image(image: Path, seed: int) -> None:
    """Another picture of the same size in its place, its modification time put back."""
    st = os.stat(image)
    width, height = load(str(image)).shape[-1], load(str(image)).shape[-2]
    write_png(image, width, height, seed)
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))


def digest(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime under root."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def failing_encoder(image: torch.Tensor) -> torch.Tensor:
    """An encoder of the user's that raises (--encoder verify_helpers:failing_encoder)."""
    raise RuntimeError("CUDA out of memory (pretend)")


def halving_encoder(image: torch.Tensor) -> torch.Tensor:
    """The reference encoder's latent halved: a module:callable encoder of another scale."""
    return TinyVAE(4, 0).encode(image[None], "float32")[0] / 2


# -- caption embeddings (verify --text-encoder)


def reference_text(caption: str, seed: int = 0, length: int | None = None) -> dict[str, torch.Tensor]:
    """The reference text encoder's outputs for `caption` (hidden, penultimate, pooled)."""
    from cachedoctor.verify.text_encoders import ReferenceTextEncoder

    return ReferenceTextEncoder(seed).encode([caption], length)[0]


def tokens(caption: str) -> int:
    """How many tokens the reference encoder makes of a caption: musubi stores embeddings of
    that length (varlen), unpadded."""
    return len(caption.replace(",", " ,").split()) + 2


def embed_kohya(project: Project, seed: int = 0) -> dict[Path, Path]:
    """Every `<stem>_te_outputs.npz` written again as sd-scripts writes SDXL's: hidden_state1 the
    first text encoder's penultimate layer (the one verified), hidden_state2 and pool2 the second's
    (another model here). entry -> caption file."""
    out = {}
    for caption_file in sorted((project.root / "train" / kohya.DATASET).glob("*.txt")):
        caption = caption_file.read_text().strip()
        first, second = reference_text(caption, seed), reference_text(caption, 7)
        entry = caption_file.with_name(f"{caption_file.stem}_te_outputs.npz")
        np.savez(entry, hidden_state1=first["penultimate"].half().numpy(),
                 hidden_state2=torch.cat([second["hidden"]] * 2, -1).half().numpy(),
                 pool2=torch.cat([second["pooled"]] * 2).half().numpy())
        out[entry] = caption_file
    return out


def embed_musubi(project: Project, seed: int = 0) -> dict[Path, str]:
    """Every `<stem>_<arch>_te.safetensors` written again with the embedding of the caption it
    records (`caption1`), unpadded (varlen), as cache_io writes it. entry -> caption."""
    from cachedoctor.fixtures.projects.musubi import save_text

    out = {}
    for entry in sorted(project.root.rglob("*_te.safetensors")):
        with safetensors.safe_open(entry, "pt") as f:
            metadata = f.metadata()
        caption = metadata["caption1"]
        hidden = reference_text(caption, seed, tokens(caption))["hidden"]
        save_text(entry, {"varlen_vl_embed_bfloat16": hidden.to(torch.bfloat16).contiguous()},
                  metadata["architecture"], caption)
        out[entry] = caption
    return out


def embed_simpletuner(project: Project, seed: int = 0) -> dict[Path, str]:
    """Every caption's `<md5(caption)>-sdxl.pt` written again as SimpleTuner's SDXL does:
    prompt_embeds the two encoders' penultimate states concatenated (the first verified),
    pooled_prompt_embeds the second's. entry -> caption."""
    out = {}
    text_dir = project.root / "cache" / "text" / simpletuner.FAMILY
    for caption_file in sorted((project.root / "datasets" / "photos").glob("*.txt")):
        caption = caption_file.read_text().strip()
        first, second = reference_text(caption, seed), reference_text(caption, 7)
        entry = text_dir / simpletuner.text_name(caption)
        torch.save({"prompt_embeds": torch.cat([first["penultimate"], second["hidden"]], -1)[None].half(),
                    "pooled_prompt_embeds": second["pooled"].half()}, entry)
        out[entry] = caption
    return out


def embed_onetrainer(project: Project, seed: int = 0) -> dict[Path, Path]:
    """Every text sample `text/<group>/variation-0/<i>.pt` written again as OneTrainer's SDXL
    does, for the image that the image group's aggregate.pt lists at i: tokens, the first
    encoder's penultimate state (verified), the second's state and pooled vector; saved from
    its train device. entry -> caption file."""
    cache = project.root / "workspace-cache" / "run"
    [image_dir] = (cache / "image").glob("*/variation-0")
    [text_dir] = (cache / "text").glob("*/variation-0")
    listed = torch.load(image_dir / "aggregate.pt", weights_only=True)
    out = {}
    for i, item in enumerate(listed):
        caption_file = (project.root / item["image_path"]).with_suffix(".txt")
        caption = caption_file.read_text().strip()
        first, second = reference_text(caption, seed), reference_text(caption, 7)
        sample = {"tokens_1": torch.arange(77), "text_encoder_1_hidden_state": first["penultimate"].half(),
                  "tokens_2": torch.arange(77),
                  "text_encoder_2_hidden_state": torch.cat([second["hidden"]] * 2, -1).half(),
                  "text_encoder_2_pooled_state": torch.cat([second["pooled"]] * 2).half()}
        with stored_as("cuda:0"):
            torch.save(sample, text_dir / f"{i}.pt")
        out[text_dir / f"{i}.pt"] = caption_file
    return out


TEXT_EMBEDDERS = {"kohya": embed_kohya, "musubi": embed_musubi, "simpletuner": embed_simpletuner,
                  "onetrainer": embed_onetrainer}


def failing_text_encoder(caption: str) -> torch.Tensor:
    """A text encoder of the user's that raises (--text-encoder verify_helpers:failing_text_encoder)."""
    raise RuntimeError("tokenizer exploded (pretend)")
