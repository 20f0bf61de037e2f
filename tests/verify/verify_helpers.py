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
