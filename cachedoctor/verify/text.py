"""verify's text half: a sample of each dataset's caption embeddings against fresh embeddings of
their captions (`--text-encoder SPEC`).

A cached file holds several tensors (SDXL's two hidden states and a pooled vector, or one
concatenation of them); the text encoder gives its last and penultimate hidden states and a
pooled vector. Each cached tensor is compared with each output of the same sequence length
whose features it holds (the whole tensor, or its leading features: SDXL's trainers put CLIP-L's
768 before OpenCLIP's 1280), and the pairing with the lowest median error over the dataset's
sample is the dataset's: which layer the trainer stores is found, not configured.

Distances are scaled as the latents' are (compare.py), by how far the embedding of another
sampled caption, tokenized to the same length, lies from the entry's: 0 is its caption's
embedding, about 1 another caption's. What does not match is diagnosed in this order:
the caption the file records (musubi's `caption1`) or another sampled caption matches it
(CD607); most of the dataset far (CD608, another text encoder); else CD607 for each.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachedoctor.checks import caption_changed, embedded_by_another_text_encoder
from cachedoctor.findings import Finding
from cachedoctor.rule import RuleContext
from cachedoctor.verify.captions import NotPaired, TextEntry, text_entries
from cachedoctor.verify.compare import UNRELATED, Closeness, closeness
from cachedoctor.verify.encode import Unreadable
from cachedoctor.verify.results import DatasetResult
from cachedoctor.verify.sample import choose
from cachedoctor.verify.text_encoders import Outputs, TextEncoder

if TYPE_CHECKING:
    import torch

    from cachedoctor.layouts.base import Dataset, Layout
    from cachedoctor.verify.run import VerifyOptions

Pairing = tuple[str, str, int | None]  # (cached tensor, encoder output, leading features or None)


@dataclass
class TextChecked:
    """One sampled text-embedding file: its caption, how close it is, and the verdict."""

    dataset: str
    entry: str
    caption: str | None
    source: str
    recorded: str | None = None
    cached: dict[str, torch.Tensor] | None = None
    fresh: Outputs | None = None
    other: Outputs | None = None  # another caption, tokenized to this entry's length
    close: Closeness | None = None
    unrelated: float = 0.0  # the distance to another caption's embedding at this length
    verdict: str = "ok"  # ok, skipped, or a CD6xx code
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"entry": self.entry, "caption": self.caption, "verdict": self.verdict,
                **(self.close.as_dict() if self.close else {}),
                **({"note": self.note} if self.note else {}), **self.details}


class Counter:
    """Captions embedded and seconds spent embedding them."""

    def __init__(self) -> None:
        self.captions, self.seconds = 0, 0.0

    def encode(self, encoder: TextEncoder, captions: Sequence[str], length: int | None,
               batch_size: int) -> list[Outputs]:
        out: list[Outputs] = []
        start = time.perf_counter()
        try:
            for i in range(0, len(captions), batch_size):
                out.extend(_encode(encoder, captions[i:i + batch_size], length))
        finally:
            self.seconds += time.perf_counter() - start
        self.captions += len(captions)
        return out


def _encode(encoder: TextEncoder, captions: Sequence[str], length: int | None) -> list[Outputs]:
    from cachedoctor.repair.encoders import EncoderError

    try:
        return encoder.encode(captions, length)
    except EncoderError:
        raise
    except Exception as exc:  # the user's callable, a CUDA out-of-memory: one line
        from cachedoctor.checks.checker_error import describe

        raise EncoderError(f"text encoder {encoder.spec} failed on {len(captions)} caption(s): "
                           f"{describe(exc)}") from None


def run_text(layouts: Sequence[Layout], encoder: TextEncoder, options: VerifyOptions,
             progress: Callable[[str], None], counter: Counter) -> tuple[list[DatasetResult], list[Finding]]:
    """Verify a sample of every dataset's text embeddings; reads only."""
    results, findings = [], []
    seen: set[str] = set()
    for layout in layouts:
        for dataset in layout.datasets:
            result = _dataset(layout.trainer, dataset, encoder, options, progress, counter, seen)
            if result is None:
                continue
            results.append(result)
            findings.extend(_judge(result, encoder, options, counter))
    return results, findings


def _dataset(trainer: str, dataset: Dataset, encoder: TextEncoder, options: VerifyOptions,
             progress: Callable[[str], None], counter: Counter, seen: set[str]) -> DatasetResult | None:
    where = dataset.text_cache_dir
    result = DatasetResult(dataset.id, trainer, where, kind="text")
    try:
        found = [e for e in text_entries(trainer, dataset) if e.path not in seen]
    except NotPaired as exc:
        if where is None or not os.path.isdir(where) or not os.listdir(where):
            return None
        result.note = str(exc)
        return result
    if not found:
        return None
    seen.update(e.path for e in found)
    result.entries = len(found)
    by_path = {e.path: e for e in found}
    checked = [_checked(dataset.id, by_path[p]) for p in choose(list(by_path), options.sample,
                                                                    options.seed, f"{dataset.id}:text")]
    result.checked = checked  # type: ignore[assignment]
    ready = [c for c in checked if c.verdict == "ok"]
    lengths: dict[int | None, list[TextChecked]] = defaultdict(list)
    for c in ready:
        lengths[_length(c.cached)].append(c)  # type: ignore[arg-type]
    captions = [c.caption for c in ready]
    for length, group in lengths.items():
        fresh = counter.encode(encoder, [c.caption for c in group], length, options.batch_size)  # type: ignore[misc]
        # another sampled caption at the same length: the scale of "unrelated"
        others = [_another(captions, c.caption) for c in group]  # type: ignore[arg-type]
        other = counter.encode(encoder, others, length, options.batch_size)
        for c, f, o in zip(group, fresh, other, strict=True):
            c.fresh, c.other = f, o
        progress(f"verify: {dataset.id}: {len(group)} captions embedded")
    pairing = _pairing(ready)
    if pairing is None:
        return result
    result.details["pairing"] = {"cached": pairing[0], "output": pairing[1], "features": pairing[2]}
    for c in ready:
        pair = _pair(c, pairing)
        if pair is None:
            c.verdict, c.note = "skipped", f"no tensor {pairing[0]!r} of the dataset's shape"
            continue
        cached, fresh, other = pair
        # the fresh norm where the other caption embeds the same (one caption in all the sample)
        c.unrelated = (float((other.double() - fresh.double()).norm()) if other is not None else 0.0) \
            or float(fresh.double().norm())
        c.close = closeness(cached, fresh, c.unrelated)
    return result


def _checked(dataset: str, entry: TextEntry) -> TextChecked:
    c = TextChecked(dataset, entry.path, entry.caption, entry.source, entry.recorded)
    if entry.caption is None:
        c.verdict, c.note = "skipped", entry.source
        return c
    try:
        c.cached = cached_tensors(entry.path)
    except (Unreadable, OSError) as exc:
        c.verdict, c.note = "skipped", str(exc)
    return c


def _another(captions: list[str | None], caption: str) -> str:
    """The next sampled caption that differs from `caption` (cyclic); the empty caption when
    there is none."""
    text = [c for c in captions if c is not None]
    if caption in text:
        at = text.index(caption)
        text = text[at + 1:] + text[:at]
    return next((c for c in text if c != caption), "")


def cached_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor in a text-embedding file, float32, a leading batch dim of 1 dropped; loaded
    only after the scan's reader accepts the file, and as tensors only."""
    import numpy as np
    import torch

    from cachedoctor.verify.encode import checked_bytes, load_tensors

    data = checked_bytes(path)
    try:
        loaded = load_tensors(data, path)
    except (KeyError, OSError, ValueError, RuntimeError, EOFError) as exc:
        raise Unreadable(f"cannot load it: {exc}") from None
    out = {}
    for name, value in (loaded.items() if isinstance(loaded, dict) else [("", loaded)]):
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            while value.ndim > 1 and value.shape[0] == 1:
                value = value[0]
            out[str(name)] = value.float()
    if not out:
        raise Unreadable("it holds no floating-point tensor")
    return out


def _length(cached: dict[str, torch.Tensor]) -> int | None:
    """The sequence length to tokenize to: that of the largest [seq, features] tensor."""
    matrices = [t for t in cached.values() if t.ndim == 2]
    return max(matrices, key=lambda t: t.numel()).shape[0] if matrices else None


def _options(c: TextChecked) -> list[Pairing]:
    out: list[Pairing] = []
    for key, value in (c.cached or {}).items():
        for name, fresh in (c.fresh or {}).items():
            if value.ndim != fresh.ndim or value.ndim not in (1, 2) or value.shape[:-1] != fresh.shape[:-1]:
                continue
            if value.shape[-1] == fresh.shape[-1]:
                out.append((key, name, None))
            elif value.shape[-1] > fresh.shape[-1]:
                out.append((key, name, fresh.shape[-1]))
    return out


def _pair(c: TextChecked, pairing: Pairing) -> tuple[Any, Any, Any] | None:
    key, name, width = pairing
    if c.cached is None or c.fresh is None or key not in c.cached or name not in c.fresh:
        return None
    if (key, name, width) not in _options(c):
        return None
    cached = c.cached[key] if width is None else c.cached[key][..., :width]
    return cached, c.fresh[name], (c.other or {}).get(name)


def _pairing(ready: list[TextChecked]) -> Pairing | None:
    """The pairing most entries have, of the lowest median normalised error."""
    counts: dict[Pairing, list[float]] = defaultdict(list)
    for c in ready:
        for option in _options(c):
            cached, fresh, _ = _pair(c, option)  # type: ignore[misc]
            norm = float(fresh.double().norm())
            counts[option].append(float((cached.double() - fresh.double()).norm()) / norm if norm else 1e9)
    if not counts:
        return None
    # full tensors before leading slices: a match of the whole is the stronger claim
    return min(counts, key=lambda o: (-len(counts[o]), statistics.median(counts[o]), o[2] is not None))


def _judge(result: DatasetResult, encoder: TextEncoder, options: VerifyOptions,
           counter: Counter) -> list[Finding]:
    checked: list[TextChecked] = result.checked  # type: ignore[assignment]
    ctx = RuleContext(dataset=result.id)
    where = os.path.abspath(result.cache_dir or result.id)
    ready = [c for c in checked if c.cached is not None and c.fresh is not None and c.verdict == "ok"]
    if ready and "pairing" not in result.details:
        cached = sorted({f"{k} {list(v.shape)}" for c in ready for k, v in c.cached.items()})  # type: ignore[union-attr]
        fresh = sorted({f"{k} {list(v.shape)}" for k, v in ready[0].fresh.items()})  # type: ignore[union-attr]
        for c in ready:
            c.verdict = embedded_by_another_text_encoder.RULE.code
        return [embedded_by_another_text_encoder.RULE.finding(
            where, f"no tensor of the {len(ready)} sampled text embeddings has a shape the text "
            f"encoder gives ({', '.join(fresh)}; the cache holds {', '.join(cached[:4])}): embedded "
            f"by another text encoder than {encoder.spec}", ctx, entries=len(ready), compared=0)]
    compared = [c for c in checked if c.close is not None]
    off = [c for c in compared if not c.close.matches]  # type: ignore[union-attr]
    findings: list[Finding] = []
    pairing = result.details.get("pairing", {})
    key = (pairing.get("cached"), pairing.get("output"), pairing.get("features"))
    for c in off:
        explained = _recorded(c, key, encoder, options, counter) or _other_caption(c, compared, key)
        if explained is not None:
            findings.append(explained)
    off = [c for c in off if c.verdict == "ok"]
    far = [c for c in off if c.close.distance >= UNRELATED]  # type: ignore[union-attr]
    if len(compared) >= 2 and len(far) * 2 > len(compared):
        for c in far:
            c.verdict = embedded_by_another_text_encoder.RULE.code
        median = statistics.median(c.close.distance for c in far)  # type: ignore[union-attr]
        findings.append(embedded_by_another_text_encoder.RULE.finding(
            where, f"{len(far)} of {len(compared)} sampled text embeddings are as far from a fresh "
            f"embedding of their caption as unrelated captions' embeddings are (median distance "
            f"{median:.2f}): embedded by another text encoder than {encoder.spec}", ctx,
            entries=len(far), compared=len(compared), median_distance=round(median, 4)))
        off = [c for c in off if c.verdict == "ok"]
    for c in off:
        c.verdict = caption_changed.RULE.code
        findings.append(caption_changed.RULE.finding(
            c.entry, f"differs from an embedding of its caption {_short(c.caption)} ({os.path.basename(c.source)}; "
            f"distance {c.close.distance:.2f}, cosine {c.close.cosine:.3f}): the caption changed "  # type: ignore[union-attr]
            "after this embedding was cached", ctx, caption=c.caption,
            distance=round(c.close.distance, 4), cosine=round(c.close.cosine, 4)))  # type: ignore[union-attr]
    return findings


def _recorded(c: TextChecked, key: Pairing, encoder: TextEncoder, options: VerifyOptions,
              counter: Counter) -> Finding | None:
    """CD607, confirmed: the caption the file records embeds to what it holds."""
    if c.recorded is None or c.recorded == c.caption:
        return None
    [fresh] = counter.encode(encoder, [c.recorded], _length(c.cached), options.batch_size)  # type: ignore[arg-type]
    pair = _pair(TextChecked(c.dataset, c.entry, c.recorded, c.source, cached=c.cached, fresh=fresh,
                             other=c.other), key)
    if pair is None or not closeness(pair[0], pair[1], c.unrelated).matches:
        return None
    c.verdict = caption_changed.RULE.code
    c.details.update(recorded=c.recorded)
    return caption_changed.RULE.finding(
        c.entry, f"embeds {_short(c.recorded)}, the caption it records, but {os.path.basename(c.source)} now says "
        f"{_short(c.caption)} (distance {c.close.distance:.2f}): the caption changed after this "  # type: ignore[union-attr]
        "embedding was cached", RuleContext(dataset=c.dataset), caption=c.caption, recorded=c.recorded)


def _other_caption(c: TextChecked, compared: list[TextChecked], key: Pairing) -> Finding | None:
    """CD607: the embedding is another sampled item's caption's (captions swapped or renamed)."""
    mine = _pair(c, key)
    if mine is None:
        return None
    for o in compared:
        theirs = _pair(o, key) if o is not c and o.caption != c.caption else None
        if theirs is None or theirs[1].shape != mine[0].shape:
            continue
        if closeness(mine[0], theirs[1], c.unrelated).matches:
            c.verdict = caption_changed.RULE.code
            c.details.update(matches=o.entry)
            return caption_changed.RULE.finding(
                c.entry, f"embeds the caption of {os.path.basename(o.entry)} ({_short(o.caption)}), "
                f"not its own {_short(c.caption)} ({os.path.basename(c.source)}): captions were swapped or renamed "
                "after caching", RuleContext(dataset=c.dataset), caption=c.caption, matches=o.entry)
    return None


def _short(text: str | None, limit: int = 60) -> str:
    text = text or ""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
