"""Sharded preflight as a reduce: each rank sums up its share of the files, the sums merge.

Every rank reads its share of the files (inventory's shard split). Per dataset, it makes a
DatasetAggregate of what the dataset rules judge. That is how many files share each Group of
facts (shape, dtype, device, bucket, ...) and the first and last folder of each Group (their
common folder is every file's). It is also, per folder, the Groups of files whose naming tells
a family (CD309), a coverage sketch (below) and a bitset of the listed images it found. merge()
is associative and commutative, so any rank order gives the same sums. Two rounds of a
size-bounded all-gather (Exchange) make every rank hold the same data:

1. the aggregates, each rank's file findings and counts. Every rank merges them and asks each
   dataset rule what it reads besides (Rule.select over the merged tally): the files of a
   minority, a few examples of each side of a split, at most 1000 listed files;
2. those summaries, and the coverage rows of the sketch's dirty buckets.

The dataset rules then judge a ReducedView: the merged tally, spans and folder tallies, the
selected summaries (in path order) and the dirty coverage rows, and find what they would over
every file. What travels grows with the groups, folders and problems, not the healthy files.

The coverage sketch: each image and cache entry hashes its coverage key into one of BUCKETS
buckets, which sum per side the rows, two independent 31-bit hashes of the keys, and keep the
newest image and the oldest entry. A bucket whose images all expect an entry and pair one to
one with the entries by key (same count, same hash sums) and whose images are no newer than
its entries holds no missing entry, orphan, stale entry or collision: only the rows of the
other buckets (every row of their keys) travel. One case passes for clean: a key two images and
two entries share (a collision where the trainer wrote one image's entry at two sizes, possible
in kohya's and musubi-tuner's naming, not SimpleTuner's: there an entry's name is its key).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import pickle
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from cachedoctor.checks import stale_cache_entry
from cachedoctor.layouts import Dataset
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import (
    IMAGE_SIDE,
    LISTED_SIDE,
    CoverageRow,
    DatasetView,
    FileSummary,
    Group,
    SummaryStore,
    widen,
)

BUCKETS = 1024
_MASK = (1 << 31) - 1
_group = attrgetter(*Group._fields)  # a summary's Group, as a plain tuple
# a bucket's sums: images, images that expect an entry, entries, the two key hashes of the
# images and of the entries, the newest image's mtime, the oldest entry's mtime
IMAGES, EXPECTED, ENTRIES, H1_IMAGES, H1_ENTRIES, H2_IMAGES, H2_ENTRIES, NEWEST, OLDEST = range(9)


def _empty_bucket() -> list:
    return [0, 0, 0, 0, 0, 0, 0, float("-inf"), float("inf")]


def _hashes(key: str) -> tuple[int, int, int]:
    """(bucket, hash 1, hash 2) of a coverage key: the same on every rank (no hash seed)."""
    x = int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"),
                                       digest_size=12).digest(), "little")
    return x % BUCKETS, (x >> 20) & _MASK, (x >> 51) & _MASK


@dataclass
class DatasetAggregate:
    """What a set of files of one dataset adds up to, for the dataset rules (see the module
    doc). Plain tuples and numbers: it pickles small."""

    tally: Counter = field(default_factory=Counter)  # Group tuple -> files
    spans: dict = field(default_factory=dict)  # Group tuple -> (first, last) folder
    folders: Counter = field(default_factory=Counter)  # (folder, Group tuple) -> files
    sketch: dict = field(default_factory=dict)  # bucket -> its sums (_empty_bucket)
    listed: int = 0  # bit i: the i-th of the trainer's listed images (sorted) was found

    @property
    def entries(self) -> int:
        return sum(b[ENTRIES] for b in self.sketch.values())

    def add_row(self, row: CoverageRow) -> None:
        bucket, h1, h2 = _hashes(row.key)
        sums = self.sketch.get(bucket)
        if sums is None:
            sums = self.sketch[bucket] = _empty_bucket()
        if row.side == IMAGE_SIDE:
            sums[IMAGES] += 1
            sums[EXPECTED] += bool(row.flag)
            sums[H1_IMAGES] += h1
            sums[H2_IMAGES] += h2
            sums[NEWEST] = max(sums[NEWEST], row.mtime)
        else:
            sums[ENTRIES] += 1
            sums[H1_ENTRIES] += h1
            sums[H2_ENTRIES] += h2
            sums[OLDEST] = min(sums[OLDEST], row.mtime)

    def dirty(self, tolerance: float) -> frozenset[int]:
        """The buckets whose rows may hold a coverage problem."""
        slack = min(tolerance, 0.0)  # a negative tolerance calls an image stale sooner
        return frozenset(
            b for b, s in self.sketch.items()
            if not (s[IMAGES] == s[EXPECTED] == s[ENTRIES] and s[H1_IMAGES] == s[H1_ENTRIES]
                    and s[H2_IMAGES] == s[H2_ENTRIES] and s[NEWEST] <= s[OLDEST] + slack))


def merge(a: DatasetAggregate, b: DatasetAggregate) -> DatasetAggregate:
    """The aggregate of both sets of files (associative, commutative; `a` and `b` unchanged)."""
    spans = dict(a.spans)
    for group, (low, high) in b.spans.items():
        widen(spans, group, low)
        widen(spans, group, high)
    sketch = {k: list(v) for k, v in a.sketch.items()}
    for bucket, theirs in b.sketch.items():
        mine = sketch.get(bucket)
        if mine is None:
            sketch[bucket] = list(theirs)
            continue
        for i in range(NEWEST):
            mine[i] += theirs[i]
        mine[NEWEST] = max(mine[NEWEST], theirs[NEWEST])
        mine[OLDEST] = min(mine[OLDEST], theirs[OLDEST])
    return DatasetAggregate(a.tally + b.tally, spans, a.folders + b.folders, sketch,
                            a.listed | b.listed)


def merge_all(parts: Iterable[Mapping[str, DatasetAggregate]]) -> dict[str, DatasetAggregate]:
    merged: dict[str, DatasetAggregate] = {}
    for part in parts:
        for dataset, aggregate in part.items():
            known = merged.get(dataset)
            merged[dataset] = aggregate if known is None else merge(known, aggregate)
    return merged


def _listed(datasets: Mapping[str, Dataset]) -> dict[str, list[str]]:
    """Per dataset, its listed images in sorted order: the bit number of an image is its place
    here, the same on every rank."""
    return {key: sorted(d.listed_images) for key, d in datasets.items() if d.listed_images}


def _bit(listed: list[str], path: str) -> int | None:
    i = bisect.bisect_left(listed, path)
    return i if i < len(listed) and listed[i] == path else None


def aggregate(store: SummaryStore, datasets: Mapping[str, Dataset]) -> dict[str, DatasetAggregate]:
    """The aggregates of the files in `store` (one rank's share), per dataset."""
    out: dict[str, DatasetAggregate] = {}
    for dataset in store.datasets():
        view = store.view(dataset)
        found = out[dataset] = DatasetAggregate()
        found.tally = Counter({tuple(g): n for g, n in view.tally().items()})
        for s in view:
            group = _group(s)
            folder = os.path.dirname(s.path)
            widen(found.spans, group, folder)
            if s.family is not None:
                found.folders[(folder, group)] += 1
    listed = _listed(datasets)
    bitsets = {dataset: bytearray((len(names) + 7) // 8) for dataset, names in listed.items()}
    for row in store.coverage_rows():
        if row.side == LISTED_SIDE:
            continue  # every rank knows the listing: the bitset says which were found
        found = out.setdefault(row.dataset, DatasetAggregate())
        names = listed.get(row.dataset)
        if names is not None and row.side == IMAGE_SIDE:
            bit = _bit(names, row.path)
            if bit is not None:
                bitsets[row.dataset][bit >> 3] |= 1 << (bit & 7)
        if row.key is not None:
            found.add_row(row)
    for dataset, bits in bitsets.items():
        if dataset in out:
            out[dataset].listed = int.from_bytes(bits, "little")
    return out


class ReducedView(DatasetView):
    """A dataset as the dataset rules see it after the reduce: every rank's tally, spans and
    folder tallies merged, the summaries the rules selected (in path order), and the coverage
    rows of the dirty buckets (in `db`)."""

    def __init__(self, base: DatasetView, merged: DatasetAggregate,
                 files: Iterable[tuple] = ()) -> None:
        super().__init__(base._db, base.dataset)
        self._tally = Counter({Group(*g): n for g, n in merged.tally.items()})
        self._spans = {Group(*g): span for g, span in merged.spans.items()}
        self._folders = Counter({(folder, Group(*g)): n for (folder, g), n in merged.folders.items()})
        self._files = sorted(files, key=lambda row: row[0])
        self._entries = merged.entries

    def __iter__(self) -> Iterator[FileSummary]:
        for row in self._files:
            yield FileSummary(*row)

    def has_cache_entries(self) -> bool:
        return self._entries > 0


class ReducedStore:
    """What engine.check_datasets reads (datasets(), view(), close()) after the reduce."""

    def __init__(self, merged: Mapping[str, DatasetAggregate], datasets: Mapping[str, Dataset],
                 shipped: Iterable[Mapping[str, tuple[list, list]]]) -> None:
        self._merged = merged
        self._files: dict[str, dict[str, tuple]] = {}
        self._store = SummaryStore()
        for part in shipped:
            for dataset, (files, rows) in part.items():
                self._files.setdefault(dataset, {}).update((row[0], row) for row in files)
                self._store.add_coverage([CoverageRow(*row) for row in rows])
        listed = _listed(datasets)
        for dataset, names in listed.items():
            found = (merged[dataset].listed if dataset in merged else 0).to_bytes(
                (len(names) + 7) // 8, "little")
            self._store.add_coverage([CoverageRow(dataset, LISTED_SIDE, None, path, 0.0, 0, None)
                                      for i, path in enumerate(names)
                                      if not found[i >> 3] >> (i & 7) & 1])
        self._datasets = sorted(set(merged) | set(listed))

    def datasets(self) -> list[str]:
        return self._datasets

    def view(self, dataset: str) -> ReducedView:
        merged = self._merged.get(dataset) or DatasetAggregate()
        return ReducedView(self._store.view(dataset), merged,
                           self._files.get(dataset, {}).values())

    def close(self) -> None:
        self._store.close()


def _context(options: Any, dataset: str, datasets: Mapping[str, Dataset]) -> RuleContext:
    # as engine.check_datasets makes it
    return RuleContext(options.deep, dataset or None, options.settings, None,
                       datasets.get(dataset))


def shipment(store: SummaryStore, merged: Mapping[str, DatasetAggregate], options: Any,
             rules: Iterable[Rule], datasets: Mapping[str, Dataset]
             ) -> dict[str, tuple[list, list]]:
    """Per dataset, what this rank's files add to the merged aggregates for the dataset rules
    to judge: (the summaries the rules select, the coverage rows of dirty buckets)."""
    checks = [r for r in rules if r.check_dataset is not None]
    empty = SummaryStore()
    try:
        out: dict[str, tuple[list, list]] = {}
        local = set(store.datasets())
        for dataset, aggregate_ in merged.items():
            view = ReducedView(empty.view(dataset), aggregate_)
            ctx = _context(options, dataset, datasets)
            selectors = []
            everything = False
            for rule in checks:
                if rule.select is None:
                    everything = True
                    break
                try:
                    selector = rule.select(view, ctx)
                except Exception:  # check_dataset meets the same bug: CD002, over every file
                    everything = True
                    break
                if selector is not None:
                    selectors.append(selector)
            files = _selected(store.view(dataset), selectors, everything) \
                if dataset in local and (everything or selectors) else []
            rows = _dirty_rows(store, dataset, aggregate_, ctx)
            if files or rows:
                out[dataset] = (files, rows)
        return out
    finally:
        empty.close()


def _selected(view: DatasetView, selectors: list, everything: bool) -> list[tuple]:
    """The summaries of `view` the selectors want: all of a key's, or its `limit` smallest."""
    files: dict[str, tuple] = {}
    smallest: dict[tuple, list[tuple[str, tuple]]] = {}
    for s in view:
        if everything:
            files[s.path] = tuple(s)
            continue
        for i, selector in enumerate(selectors):
            try:
                wanted = selector(s)
            except Exception:  # the rule meets the same file again, and reports its error
                wanted = (None, None)
            if wanted is None:
                continue
            key, limit = wanted
            if limit is None:
                files[s.path] = tuple(s)
                continue
            kept = smallest.setdefault((i, key), [])
            if len(kept) < limit or s.path < kept[-1][0]:
                bisect.insort(kept, (s.path, tuple(s)), key=lambda item: item[0])
                del kept[limit:]
    for kept in smallest.values():
        files.update(kept)
    return list(files.values())


def _dirty_rows(store: SummaryStore, dataset: str, merged: DatasetAggregate,
                ctx: RuleContext) -> list[tuple]:
    facts = ctx.facts
    if not merged.sketch or (merged.entries == 0 and not (facts and facts.naming.stem_collisions)):
        return []  # no entry: nothing missing (CD404 waits for a cache), orphaned or stale
    dirty = merged.dirty(float(stale_cache_entry.RULE.setting(ctx, "tolerance-seconds")))
    if not dirty:
        return []
    return [tuple(row) for row in store.coverage_rows(dataset)
            if row.side != LISTED_SIDE and row.key is not None and _hashes(row.key)[0] in dirty]


class Exchange:
    """A size-bounded all-gather of bytes over a torch.distributed group, counting what it
    moves: each call all-gathers every rank's length (8 bytes), then every rank's bytes padded
    to the longest. `exchanged`: the bytes this rank's calls gathered (its own included)."""

    def __init__(self, dist: Any, group: Any = None) -> None:
        import torch

        self._dist, self._group = dist, group
        self.world = dist.get_world_size(group)
        # NCCL moves only CUDA tensors, on this rank's device; gloo, CPU ones
        nccl = str(dist.get_backend(group)).lower() == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl \
            else torch.device("cpu")
        self.exchanged = 0
        self.calls = 0

    def all_gather(self, data: bytes) -> list[bytes]:
        import numpy as np
        import torch

        length = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        lengths = [torch.zeros_like(length) for _ in range(self.world)]
        self._dist.all_gather(lengths, length, group=self._group)
        sizes = [int(n.item()) for n in lengths]
        width = max(max(sizes), 1)
        mine = torch.zeros(width, dtype=torch.uint8, device=self._device)
        if data:
            mine[:len(data)] = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(
                self._device)
        parts = [torch.empty(width, dtype=torch.uint8, device=self._device)
                 for _ in range(self.world)]
        self._dist.all_gather(parts, mine, group=self._group)
        self.exchanged += self.world * (8 + width)
        self.calls += 1
        return [part[:size].cpu().numpy().tobytes() for part, size in zip(parts, sizes, strict=True)]

    def objects(self, obj: Any) -> list[Any]:
        """`obj` of every rank (pickled between ranks of one job, compressed)."""
        blob = zlib.compress(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), 1)
        return [pickle.loads(zlib.decompress(b)) for b in self.all_gather(blob)]
