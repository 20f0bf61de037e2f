"""The verify run: layouts -> datasets -> sampled entries -> encodes -> comparisons -> findings."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachedoctor.findings import Finding, Severity
from cachedoctor.images import ImageError
from cachedoctor.layouts.base import Dataset, Layout
from cachedoctor.layouts.entries import NO_CHANGES, Entries, EntrySpec, Geometry, NoSpec
from cachedoctor.repair.errors import RepairError
from cachedoctor.verify.compare import closeness, unrelated_level
from cachedoctor.verify.diagnose import Checked, judge
from cachedoctor.verify.encode import Fresh, Unreadable, cached_latent, pixels_of
from cachedoctor.verify.results import DatasetResult
from cachedoctor.verify.sample import SampleSize, choose, latent_entries
from cachedoctor.verify.text import Counter, run_text

if TYPE_CHECKING:
    from cachedoctor.repair.encoders import Encoder
    from cachedoctor.verify.text_encoders import TextEncoder


DEFAULT_SAMPLE = SampleSize(count=64)  # entries per dataset
NEARBY = 2  # images each side of a mismatched entry's own tried as its pair (CD605)
# what any of the four trainers reads as an image
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".avif", ".jxl", ".tif", ".tiff")


@dataclass(frozen=True)
class VerifyOptions:
    sample: SampleSize = DEFAULT_SAMPLE
    seed: int = 0
    device: str = "cpu"
    batch_size: int = 8


@dataclass
class VerifyReport:
    encoder: str | None
    options: VerifyOptions
    datasets: list[DatasetResult]
    findings: list[Finding]
    images: int  # images encoded, the alternatives tried included
    seconds: float  # spent encoding
    text_encoder: str | None = None
    captions: int = 0  # captions embedded, the other captions each is scaled by included
    text_seconds: float = 0.0

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0

    def exit_code(self, fail_on: str = "error") -> int:
        if fail_on == "never":
            return 0
        threshold = Severity.parse(fail_on)
        return int(any(f.severity >= threshold for f in self.findings))


def run(layouts: Sequence[Layout], encoder: Encoder | None, options: VerifyOptions,
        progress: Callable[[str], None] = lambda line: None,
        text_encoder: TextEncoder | None = None) -> VerifyReport:
    """Verify a sample of every dataset's latents (with `encoder`) and caption embeddings (with
    `text_encoder`); reads caches, images and captions, writes nothing."""
    spent = [0.0, 0]
    results: list[DatasetResult] = []
    findings: list[Finding] = []
    if encoder is not None:
        _latents(layouts, encoder, options, progress, spent, results, findings)
    counter = Counter()
    if text_encoder is not None:
        text_encoder.prepare(options.device)
        text_results, text_findings = run_text(layouts, text_encoder, options, progress, counter)
        results.extend(text_results)
        findings.extend(text_findings)
    findings.sort(key=lambda f: f.sort_key)
    return VerifyReport(encoder.spec if encoder else None, options, results, findings, spent[1], spent[0],
                        text_encoder.spec if text_encoder else None, counter.captions, counter.seconds)


def _latents(layouts: Sequence[Layout], encoder: Encoder, options: VerifyOptions,
             progress: Callable[[str], None], spent: list, results: list[DatasetResult],
             findings: list[Finding]) -> None:
    def counted(n: int) -> None:
        spent[1] += n

    fresh = Fresh(encoder, options.device, options.batch_size, counted)
    fresh.prepare()
    for layout in layouts:
        for dataset in layout.datasets:
            where = dataset.latent_cache_dir or (dataset.cache_dirs[0] if layout.trainer == "bare"
                                                 and dataset.cache_dirs else None)
            if where is None:
                continue  # a text-embed dataset
            result, entries = _dataset(layout.trainer, dataset, where, fresh, options, spent, progress)
            results.append(result)
            findings.extend(_judge(result, entries, fresh, spent))


def _timed(spent: list, call: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    try:
        return call(*args)
    finally:
        spent[0] += time.perf_counter() - start


def _dataset(trainer: str, dataset: Dataset, where: str, fresh: Fresh, options: VerifyOptions,
             spent: list, progress: Callable[[str], None]) -> tuple[DatasetResult, Entries | None]:
    result = DatasetResult(dataset.id, trainer, where)
    entries = dataset.naming.entries(dataset, NO_CHANGES)
    if entries is None:
        result.note = ("its layout does not say which image each entry is of (a bare cache: give "
                       "the trainer's config)")
        return result, None
    found = latent_entries(where)
    result.entries = len(found)
    # grouped by the pixel size encoded, so that a batch is one bucket; pixels are read a batch
    # at a time (10,000 sampled 1024px images would be 30 GB at once)
    buckets: dict[tuple, list[Checked]] = defaultdict(list)
    for path in choose(found, options.sample, options.seed, dataset.id):
        checked = Checked(dataset.id, path, factor=dataset.vae_factor)
        result.checked.append(checked)
        try:
            checked.image = entries.source(path)
            checked.spec = entries.spec(checked.image, path)
        except (NoSpec, RepairError, ImageError, OSError, ValueError) as exc:
            _skip(checked, exc)
            continue
        geometry = checked.spec.geometry
        size = geometry.crop[2:] if geometry is not None else checked.image  # as it is: one each
        buckets[(size, checked.spec.format)].append(checked)
    done = 0
    for (_, fmt), group in buckets.items():
        for start in range(0, len(group), options.batch_size):
            ready, images = [], []
            for checked in group[start:start + options.batch_size]:
                try:
                    checked.cached = cached_latent(checked.entry, fmt)
                    images.append(pixels_of(checked.spec))  # type: ignore[arg-type]
                    ready.append(checked)
                except (Unreadable, RepairError, ImageError, OSError, ValueError) as exc:
                    checked.cached = None
                    _skip(checked, exc)
            by_size: dict[tuple, list[int]] = defaultdict(list)  # images of one size per call
            for i, image in enumerate(images):
                by_size[tuple(image.shape)].append(i)
            for indices in by_size.values():
                latents = _timed(spent, fresh.encode, [images[i] for i in indices], fmt)
                for i, latent in zip(indices, latents, strict=True):
                    ready[i].fresh = latent
            done += len(group[start:start + options.batch_size])
            progress(f"verify: {dataset.id}: {done}/{len(result.checked)} entries encoded")
    by_shape: dict[tuple, list[Checked]] = defaultdict(list)
    for checked in result.checked:
        if checked.fresh is None or checked.cached is None:
            continue
        if checked.fresh.shape != checked.cached.shape:
            checked.verdict = "skipped"
            checked.note = (f"cached {list(checked.cached.shape)}, a fresh encode "
                            f"{list(checked.fresh.shape)}: the scan's size rules (CD301, CD302) judge it")
            continue
        by_shape[tuple(checked.fresh.shape)].append(checked)
    for group in by_shape.values():
        level = unrelated_level([c.fresh for c in group])  # type: ignore[misc]
        for checked in group:
            checked.unrelated = level
            checked.close = closeness(checked.cached, checked.fresh, level)  # type: ignore[arg-type]
            if checked.close.matches:  # kept only as another image's candidate (CD605)
                checked.cached, checked.fresh = None, checked.fresh.half()  # type: ignore[union-attr]
    return result, entries


def _skip(checked: Checked, exc: Exception) -> None:
    checked.verdict, checked.note = "skipped", str(exc) or type(exc).__name__


def _judge(result: DatasetResult, entries: Entries | None, fresh: Fresh, spent: list) -> list[Finding]:
    def encode(specs: Sequence[EntrySpec], geometries: Sequence[Geometry | None], flip: bool) -> list:
        images = [pixels_of(s, g, flip) for s, g in zip(specs, geometries, strict=True)]
        return _timed(spent, fresh.encode, images, specs[0].format)

    sampled = {c.image for c in result.checked}
    known: dict[str, Checked | None] = {}

    def nearby(c: Checked) -> list[Checked]:
        """The images NEARBY places before and after c's in its folder, not sampled, encoded
        with their own geometry where it gives c's pixel size."""
        if entries is None or c.image is None or c.spec is None:
            return []
        folder, name = os.path.split(c.image)
        try:
            names = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_EXTENSIONS))
        except OSError:
            return []
        at = names.index(name) if name in names else -1
        out = []
        for i in range(max(0, at - NEARBY), at + NEARBY + 1) if at >= 0 else ():
            path = os.path.join(folder, names[i]) if i < len(names) else None
            if path is None or path in sampled:
                continue
            if path not in known:
                known[path] = _candidate(c, path, entries, encode)
            if known[path] is not None:
                out.append(known[path])
        return out

    where = result.cache_dir or result.id
    return list(judge(result.id, os.path.abspath(where), result.checked, encode, nearby))


def _candidate(c: Checked, image: str, entries: Entries, encode: Callable[..., list]) -> Checked | None:
    try:
        spec = entries.spec(image)
        geometry, own = spec.geometry, c.spec.geometry  # type: ignore[union-attr]
        if (geometry.crop[2:] if geometry else None) != (own.crop[2:] if own else None):
            return None  # another bucket
        [latent] = encode([spec], [None], False)
    except (NoSpec, RepairError, ImageError, OSError, ValueError):
        return None
    return Checked(c.dataset, spec.path, image, spec, fresh=latent)
