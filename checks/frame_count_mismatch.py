"""## What it does
Reports a musubi-tuner video latent whose frame count disagrees. The clip's frame count is in
its file name (`<stem>_<pos>-<frames>_<W>x<H>_<arch>.safetensors`). The latent is reported
when that count is not one of the dataset's `target_frames` (rounded to 4n+1, as musubi
rounds them), or not the `frame_count` in the file's header. It is also reported when its
frame axis is not (frames - 1) / 4 + 1, what musubi's video VAEs make of that many frames.

## Why is this bad?
musubi trains on every latent of the architecture in the cache directory: clips cached for
target frames the config no longer asks for (target_frames changed, the cache not rebuilt)
are still trained on, in buckets of their own. musubi buckets a clip by the frame count in its
name; a latent with another number of latent frames is stacked with the clips of that bucket
and `torch.stack` fails mid-epoch.

## Example
```
CD308 warning cache/hv/clip_0_00000-013_0160x0096_hv.safetensors
      a 13-frame clip: target_frames is [1, 9] (dataset.toml:18), so it is a clip of an older
      config that musubi still trains on
```

## Fix
`cachedoctor fix` quarantines the file; musubi-tuner's `cache_latents.py` (or the
architecture's caching script) without `--keep_cache` also deletes latents the dataset no
longer makes.
"""

from __future__ import annotations

import os

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.musubi import VIDEO_LATENT, latent_frames, main_latents
from cachedoctor.rule import Rule, RuleContext

# FramePack caches a clip as sections (`<stem>_<pos>-<frames>-<section>_...`), each latent one
# window of `fp_latent_window_size` latent frames, not the whole clip (fpack_cache_latents.py,
# kohya-ss/musubi-tuner 30c658c4): its frame axis says nothing about the clip's frame count.
SECTIONED = frozenset({"framepack"})


def _latent_axis(meta: FileMeta) -> int | None:
    """The frame axis of the main latent `latents_<F>x<H>x<W>_<dtype>` ([C, F, H, W])."""
    return next((t.shape[1] for t in main_latents(meta) if len(t.shape) == 4), None)


def applies(meta: FileMeta, ctx: RuleContext) -> bool:
    """Whether a file with these facts may be judged at all, whatever its name: a readable
    musubi safetensors latent whose header gives a frame count."""
    return meta.format == "safetensors" and not meta.errors and (
        "format_version" in meta.metadata and "frame_count" in meta.metadata)


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not applies(meta, ctx):
        return None
    name = os.path.basename(meta.path)
    if not name.endswith(".safetensors") or "-" not in name:
        return None
    match = VIDEO_LATENT.match(name)
    # musubi writes frame_count for video clips only: an image named like a clip is no clip
    if match is None:
        return None
    frames = int(match["frames"])
    problems = []
    header = meta.metadata["frame_count"]
    if header != str(frames):
        problems.append(f"its header says frame_count {header}")
    axis = None if meta.metadata.get("architecture") in SECTIONED else _latent_axis(meta)
    if axis is not None and axis != latent_frames(frames):
        problems.append(f"its latent has {axis} latent frames where {frames} frames make "
                        f"{latent_frames(frames)}")
    facts = ctx.facts
    targets = facts.options.get("target_frames") if facts is not None else None
    extraction = facts.options.get("frame_extraction") if facts is not None else None
    if targets and extraction != "full" and frames not in targets:
        origin = facts.origin("target_frames")
        where = f" ({origin})" if origin is not None else ""
        problems.append(f"target_frames is {list(targets)}{where}, so it is a clip of an older "
                        "config that musubi still trains on")
    if not problems:
        return None
    return RULE.finding(meta.path, f"a {frames}-frame clip: " + "; ".join(problems), ctx,
                        frames=frames, target_frames=list(targets) if targets else None)


RULE = Rule(
    code="CD308",
    name="frame-count-mismatch",
    severity=Severity.WARNING,
    summary="a video latent's frame count is not the config's target_frames, its header's or its latent's",
    doc=__doc__,
    fix="quarantine",
    check_file=check,
    names=True,  # (the file's name is read: see rule.py)
    applies=applies,
)
