"""What went wrong with the entries that do not match: the CD6xx verdicts.

A dataset is judged as a whole first. When mismatches are the fresh encode times a factor
plus a shift, its scaling differs (CD602). When most compared entries are as far from their
fresh encode as unrelated latents are, and the first few of them are no flip, crop or other
image, the cache is of another VAE (CD601).

The entries left are tried, cheapest first: against the fresh encodes of the other sampled
images of their bucket (CD605), against their image mirrored (CD603), and against
neighbouring crops (CD604). What none of these explains changed since it was cached (CD606).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cachedoctor.checks import (
    encoded_by_another_vae,
    flipped_latent,
    paired_with_another_image,
    scaling_factor_differs,
    stale_latent,
    wrong_crop,
)
from cachedoctor.findings import Finding
from cachedoctor.layouts.entries import EntrySpec, Geometry
from cachedoctor.rule import RuleContext
from cachedoctor.verify.compare import UNRELATED, Closeness, closeness, describe_factor, fit_scale

if TYPE_CHECKING:
    import torch

FIT_RESIDUAL = 0.1  # a scale fit leaving at most this much of the spread explains the entry
PROBES = 3  # far entries tried for a flip, crop or pairing before a cache is called another VAE
CROP_STEPS = (1, 2)  # neighbouring crops: shifted by this many latent pixels each way


@dataclass
class Checked:
    """One sampled entry: what it was compared with, how close it is, and the verdict."""

    dataset: str
    entry: str
    image: str | None = None
    spec: EntrySpec | None = None
    cached: torch.Tensor | None = None
    fresh: torch.Tensor | None = None
    close: Closeness | None = None
    unrelated: float = 0.0  # the bucket's unrelated level (compare.unrelated_level)
    factor: int = 8  # the VAE's downsampling factor: a crop moves by this many pixels a step
    verdict: str = "ok"  # ok, skipped, or a CD6xx code
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"entry": self.entry, "image": self.image, "verdict": self.verdict,
                **(self.close.as_dict() if self.close else {}),
                **({"note": self.note} if self.note else {}), **self.details}


Encode = Callable[[Sequence[EntrySpec], Sequence[Geometry | None], bool], list["torch.Tensor"]]
Nearby = Callable[[Checked], list[Checked]]  # encoded images next to the entry's, not sampled


def judge(dataset: str, where: str, checked: list[Checked], encode: Encode,
          nearby: Nearby = lambda c: []) -> Iterator[Finding]:
    """The findings of one dataset's compared entries; sets each entry's verdict."""
    ctx = RuleContext(dataset=dataset)
    compared = [c for c in checked if c.close is not None]
    off = [c for c in compared if not c.close.matches]  # type: ignore[union-attr]
    if not off:
        return
    # a scale fit that leaves nothing is the most specific answer: a cache scaled x0.18215
    # is also far from the fresh encode
    yield from _scaled(where, compared, off, ctx)
    off = [c for c in off if c.verdict == "ok"]
    far = [c for c in off if c.close.distance >= UNRELATED]  # type: ignore[union-attr]
    probed: list[Finding] = []
    if len(compared) >= 2 and len(far) * 2 > len(compared):
        # a cache written with every image mirrored, cropped or paired otherwise is far too:
        # another VAE only when a few of them are explained by none of those
        probed = [_single(c, compared, encode, ctx, nearby) for c in far[:PROBES]]
        if any(c.verdict != stale_latent.RULE.code for c in far[:PROBES]):
            yield from probed
            off = [c for c in off if c.verdict == "ok"]
            far = []
    if len(compared) >= 2 and len(far) * 2 > len(compared):
        for c in far:
            c.verdict = encoded_by_another_vae.RULE.code
        median = statistics.median(c.close.distance for c in far)  # type: ignore[union-attr]
        yield encoded_by_another_vae.RULE.finding(
            where, f"{len(far)} of {len(compared)} sampled latents are as far from a fresh encode "
            f"as unrelated latents are (median distance {median:.2f}): encoded by another VAE than "
            "the one given", ctx, entries=len(far), compared=len(compared), median_distance=round(median, 4))
        off = [c for c in off if c.verdict == "ok"]
    for c in off:
        yield _single(c, compared, encode, ctx, nearby)


def _scaled(where: str, compared: list[Checked], off: list[Checked], ctx: RuleContext) -> Iterator[Finding]:
    fits = []
    for c in off:
        a, b, residual = fit_scale(c.cached, c.fresh)  # type: ignore[arg-type]
        spread = float(c.cached.std())  # type: ignore[union-attr]
        if residual <= FIT_RESIDUAL and (abs(a - 1) > 0.02 or abs(b) > 0.02 * spread):
            c.verdict = scaling_factor_differs.RULE.code
            c.details.update(scale=round(a, 6), shift=round(b, 6))
            fits.append((a, b))
    if not fits:
        return
    a = statistics.median(f[0] for f in fits)
    b = statistics.median(f[1] for f in fits)
    shift = f" {'+' if b >= 0 else '-'} {abs(b):.4g}" if abs(b) > 1e-3 else ""
    yield scaling_factor_differs.RULE.finding(
        where, f"{len(fits)} of {len(compared)} sampled latents are {describe_factor(a)}{shift} of a "
        "fresh encode: the scaling factor differs (re-encode the whole cache)", ctx,
        entries=len(fits), compared=len(compared), scale=round(a, 6), shift=round(b, 6))


def _single(c: Checked, compared: list[Checked], encode: Encode, ctx: RuleContext,
            nearby: Nearby) -> Finding:
    assert c.close is not None and c.spec is not None and c.cached is not None
    name = os.path.basename(c.image or "")
    own = f"{c.close.distance:.2f}"
    # another image of the bucket: the sampled ones are encoded already; the images next to its
    # own in name order are encoded for it (a renamed or an inserted image shifts the pairing)
    others = [o for o in [*compared, *nearby(c)]
              if o is not c and o.fresh is not None and o.fresh.shape == c.cached.shape]
    best = _best(c, [(o.fresh, o) for o in others])
    if best is not None:
        other, close = best
        c.verdict = paired_with_another_image.RULE.code
        c.details.update(matches=other.image)
        return paired_with_another_image.RULE.finding(
            c.entry, f"matches the encode of {os.path.basename(other.image or '')} (distance "
            f"{close.distance:.2f}), not of its own image {name} ({own})", ctx,
            image=c.image, matches=other.image, distance=round(close.distance, 4))
    [mirrored] = encode([c.spec], [None], True)
    if _best(c, [(mirrored, None)]) is not None:
        c.verdict = flipped_latent.RULE.code
        return flipped_latent.RULE.finding(
            c.entry, f"matches the mirrored encode of {name}, not the image ({own})", ctx, image=c.image)
    crops = list(neighbour_crops(c.spec.geometry, c.factor))
    if crops:
        found = _best(c, list(zip(encode([c.spec] * len(crops), crops, False), crops, strict=True)))
        if found is not None:
            geometry, close = found
            left, top = geometry.crop[:2]
            want = c.spec.geometry.crop[:2]  # type: ignore[union-attr]
            c.verdict = wrong_crop.RULE.code
            c.details.update(crop=[left, top])
            return wrong_crop.RULE.finding(
                c.entry, f"matches the crop at ({left}, {top}) of {name} resized to "
                f"{geometry.resize[0]}x{geometry.resize[1]} (distance {close.distance:.2f}), not "
                f"the trainer's crop at ({want[0]}, {want[1]}) ({own})", ctx,
                image=c.image, crop=(left, top), expected_crop=want)
    c.verdict = stale_latent.RULE.code
    how = "was replaced" if c.close.distance >= UNRELATED else "changed"
    return stale_latent.RULE.finding(
        c.entry, f"differs from a fresh encode of {name} (distance {own}, cosine {c.close.cosine:.3f}): "
        f"the image {how} after this entry was written", ctx, image=c.image,
        distance=round(c.close.distance, 4), cosine=round(c.close.cosine, 4))


def _best(c: Checked, candidates: list[tuple[Any, Any]]) -> tuple[Any, Closeness] | None:
    """The candidate whose latent matches c's cached latent best, if one matches at all."""
    found = None
    for latent, what in candidates:
        close = closeness(c.cached, latent, c.unrelated)  # type: ignore[arg-type]
        if close.matches and close.distance < c.close.distance and (  # type: ignore[union-attr]
                found is None or close.distance < found[1].distance):
            found = (what, close)
    return found


def neighbour_crops(geometry: Geometry | None, factor: int) -> Iterator[Geometry]:
    """Crops of the resized image next to the trainer's: shifted by 1 and 2 latent pixels,
    and the corners, where the resized image leaves room."""
    if geometry is None:
        return
    left, top, width, height = geometry.crop
    room_x, room_y = geometry.resize[0] - width, geometry.resize[1] - height
    if room_x <= 0 and room_y <= 0:
        return
    seen = {(left, top)}
    offsets = [(left + dx * s * factor, top + dy * s * factor)
               for s in CROP_STEPS for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1))]
    offsets += [(0, 0), (room_x, 0), (0, room_y), (room_x, room_y)]
    for x, y in offsets:
        if 0 <= x <= room_x and 0 <= y <= room_y and (x, y) not in seen:
            seen.add((x, y))
            yield replace(geometry, crop=(x, y, width, height))
