"""## What it does
Reports a tensor of a musubi-tuner cache file whose real shape or dtype is not what its key
declares. musubi names every tensor for what it holds: `latents_<F>x<H>x<W>_<dtype>` (also
`latents_image_…`, `latents_control_…`), `clip_<dtype>`, `f_indices_int32`. FLUX.2 leaves out
the frame axis: `latents_<H>x<W>_<dtype>` and `latents_control_<i>_<H>x<W>_<dtype>` hold
[C, H, W] (HiDream-O1's controls [H, W, D] patch tokens), so one of another H or W, or with a
frame axis, is reported. Also reports a latent whose file name gives another original size
(`_<WWWW>x<HHHH>_`) than its header's `width` and `height`. Only files with musubi's header
(`architecture`, `format_version`) are checked. Where musubi's own writer declares the main
latent's F or dtype on another key (FramePack's `latents_clean_…` hold 2 or 16 frames, Wan's
`clip_` output is float16 under the latent's bfloat16), only what the writer declares truly is
compared.

## Why is this bad?
musubi trusts the names. The training loader strips the size (`_<F>x<H>x<W>`, `_<H>x<W>`)
and the dtype from each key and stacks the tensors of a batch under what is left. It buckets
items by the size in the file name and the control keys' declared shapes. So:

- a latent that is not the size its key says crashes `torch.stack` in the middle of an epoch
  (or lands in a bucket it does not fit);
- one that is not the dtype its key says was cast by some other tool after caching, and trains
  in another precision than the rest;
- a file whose name gives another size than its header was renamed or copied from another
  item, and is bucketed by a size it was not encoded at.

## Example
```
CD306 error cache/qwen/img_101_0160x0096_qi.safetensors
      latents_1x12x20_bfloat16 is [16, 1, 16, 16] float32: its key declares 1x12x20 (F x H x W)
      bfloat16
```

## Fix
`cachedoctor fix` quarantines the file; musubi-tuner's caching script for the architecture
(`cache_latents.py`, `wan_cache_latents.py`, ... with `--skip_existing`) writes it again.
"""

from __future__ import annotations

import os
import re

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import FileMeta, TensorMeta
from cachedoctor.layouts.musubi import IMAGE_LATENT, LATENT_KEY, VIDEO_LATENT
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.units import shape_text

# dtype_to_str's names (str(torch.dtype) without "torch."), longest first: float8_e4m3fn
# before a shorter name that ends it
DTYPES = tuple(sorted((
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128"), key=len, reverse=True))
# `latents_<H>x<W>_<dtype>`, no frame axis: save_latent_cache_flux_2 ([C, H, W], controls
# `latents_control_<i>_<H>x<W>_` each of its own size) and save_pixel_cache_hidream_o1's
# controls ([H patches, W patches, D]) (cache_io.py, kohya-ss/musubi-tuner 30c658c4). A 3-D
# key never matches: the prefix ends at an underscore and `<F>x<H>x` is no `<H>x<W>_`.
IMAGE_KEY = re.compile(r"^latents_(?:[a-z0-9_]+_)?(?P<h>\d+)x(?P<w>\d+)_[a-z0-9_]+$")
PATCH_TOKENS = "hidream_o1_image"  # [H patches, W patches, D]: the size leads
# Keys whose size or dtype suffix musubi's writer takes from the main latent, not from the
# tensor itself (cache_io.py, kohya-ss/musubi-tuner 30c658c4), keyed by the `architecture`:
# - FramePack names `latents_clean_<F>x<H>x<W>` (also `_2x`, `_4x`) with the target latent's
#   F: the clean latents hold their own frame count (2, 2 and 16; N + 1 for one-frame
#   training). Only H and W are the tensor's own.
# - Wan names the I2V CLIP output `clip_<latent dtype>`: the latent is bfloat16, the CLIP
#   output float16. FramePack's `image_embeddings_<latent dtype>` likewise.
FRAMES_OF_MAIN = {"framepack": ("latents_clean_",)}
DTYPE_OF_MAIN = {"wan": ("clip_",), "framepack": ("image_embeddings_",)}


def declared_dtype(key: str) -> str | None:
    for dtype in DTYPES:
        if key.endswith("_" + dtype):
            return dtype
    return None


def declared_frames(tensor: TensorMeta, architecture: str | None) -> tuple[int, int, int] | None:
    """(F, H, W) the tensor really has, read as musubi lays it out: [C, F, H, W], or [C, H, W]
    for the image architectures that save F = 1 without its axis. Kandinsky 5's writer would
    store a 3-D latent as [1, C, H, W]; its caching script never passes one (images are
    one-frame videos) and its trainer reads 4-D as [C, F, H, W], so that stays a mismatch."""
    shape = tensor.shape
    if architecture == PATCH_TOKENS:
        return (1, shape[0], shape[1]) if len(shape) == 3 else None
    if len(shape) >= 4:
        return shape[-3], shape[-2], shape[-1]
    if len(shape) == 3:
        return 1, shape[-2], shape[-1]
    return None


def declared_size(tensor: TensorMeta, architecture: str | None) -> tuple[int, int] | None:
    """(H, W) of a tensor under a `<H>x<W>` key: [C, H, W], or HiDream-O1's [H, W, D]. None
    for any other rank: a frame axis the key does not declare is a mismatch."""
    shape = tensor.shape
    if len(shape) != 3:
        return None
    return (shape[0], shape[1]) if architecture == PATCH_TOKENS else (shape[1], shape[2])


def problems(meta: FileMeta) -> list[str]:
    architecture = meta.metadata.get("architecture")
    out = []
    for tensor in meta.tensors:
        if len(tensor.path) != 1 or not isinstance(tensor.path[0], str):
            continue
        key = tensor.path[0]
        wrong = []
        match = LATENT_KEY.match(key)
        if match is not None:
            want = (int(match["f"]), int(match["h"]), int(match["w"]))
            have = declared_frames(tensor, architecture)
            if have is not None and key.startswith(FRAMES_OF_MAIN.get(architecture, ())):
                have = (want[0], *have[1:])  # F is the main latent's, see FRAMES_OF_MAIN
            if have != want:
                wrong.append("{}x{}x{} (F x H x W)".format(*want))
        elif (image := IMAGE_KEY.match(key)) is not None and (
                declared_size(tensor, architecture) != (int(image["h"]), int(image["w"]))):
            wrong.append(f"{image['h']}x{image['w']} (H x W, no frame axis)")
        dtype = declared_dtype(key)
        if key.startswith(DTYPE_OF_MAIN.get(architecture, ())):
            dtype = None  # the main latent's dtype, see DTYPE_OF_MAIN
        if dtype is not None and dtype != tensor.dtype:
            wrong.append(dtype)
        if wrong:
            out.append(f"{key} is {shape_text(tensor.shape)} {tensor.dtype}: its key declares "
                       + " ".join(wrong))
    return out


def named_size(meta: FileMeta) -> str | None:
    """What is wrong with the size in a latent's name, against its header."""
    name = os.path.basename(meta.path)
    match = VIDEO_LATENT.match(name) or IMAGE_LATENT.match(name)
    width, height = meta.metadata.get("width"), meta.metadata.get("height")
    if match is None or width is None or height is None:
        return None
    if (match["w"].lstrip("0") or "0", match["h"].lstrip("0") or "0") == (width, height):
        return None
    return (f"its name says {match['w']}x{match['h']}, its header width {width[:20]} and "
            f"height {height[:20]}")


def applies(meta: FileMeta, ctx: RuleContext) -> bool:
    """Whether a file with these facts may be judged at all, whatever its name: a musubi
    safetensors cache (its header names a format version and an architecture)."""
    return meta.format == "safetensors" and "format_version" in meta.metadata and (
        "architecture" in meta.metadata)


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not applies(meta, ctx):
        return None
    found = problems(meta)
    size = named_size(meta)
    if size is not None:
        found.append(size)
    if not found:
        return None
    return RULE.finding(meta.path, "; ".join(found[:3]) + (
        f"; and {len(found) - 3:,} more" if len(found) > 3 else ""), ctx, tensors=len(found))


RULE = Rule(
    code="CD306",
    name="key-declaration-mismatch",
    severity=Severity.ERROR,
    summary="a tensor's shape or dtype is not what its key declares (musubi-tuner `latents_FxHxW_dtype`)",
    doc=__doc__,
    fix="quarantine",
    check_file=check,
    names=True,  # (the file's name is read: see rule.py)
    applies=applies,
)
