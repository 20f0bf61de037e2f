"""Compact per-file summaries for the dataset rules, kept on disk so memory stays flat.

A worker turns each cache file's FileMeta into a FileSummary: the few facts a dataset rule
compares. Those are the primary latent shape, dtypes, text-embedding signature and devices,
and what the trainer's naming says: bucket, expected latent size and model family. In a bare
tree a summary also holds its group, the folder of the file's dataset: rules compare files
of one group only. The main process appends the summaries to a SummaryStore (a temporary
SQLite file that spills to disk). Each dataset rule streams its dataset's summaries back as
often as it needs.

The store also holds one coverage row per image and per latent cache entry. A row's coverage
key says which image the entry belongs to. The images the trainer's metadata lists are rows
too. The coverage rules (CD404-CD407) ask SQLite to join them, so no list of every file is
kept in memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import marshal
import os
import re
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

from cachedoctor.formats.meta import FileMeta, TensorMeta
from cachedoctor.formats.shard_blobs import encoder_slot
from cachedoctor.inventory import LATENT, TEXT, Entry
from cachedoctor.layouts.base import text_family

if TYPE_CHECKING:
    from cachedoctor.layouts.base import CacheFacts

IMAGE_SIDE, CACHE_SIDE, LISTED_SIDE = 0, 1, 2  # coverage rows: an image, a cache entry, a listing

# Keys trainers give the latent inside a dict: SimpleTuner `latents`, ai-toolkit `latent`,
# OneTrainer `latent_image`, kohya `latents` / `latents_<H>x<W>` (multi-resolution).
LATENT_KEYS = ("latents", "latent", "latent_image")
KOHYA_RESO_KEY = re.compile(r"^latents_\d+x\d+$")
# musubi-tuner: `latents_<F>x<H>x<W>_<dtype>` ([C, F, H, W]; FLUX.2 `latents_<H>x<W>_<dtype>`)
MUSUBI_KEY = re.compile(r"^latents_\d+x\d+(x\d+)?_[a-z][a-z0-9_]*$")
# OneTrainer before 474dd2c6 (2024-07-14, mgds 0ab2f97) cached the VAE's output as it came: a
# diffusers DiagonalGaussianDistribution of [1, 2C, h, w] parameters. Its loader trained on
# SampleVAEDistribution(mode="mean"): `distribution.mode().squeeze()`, the mean as [C, h, w].
DISTRIBUTION_MEAN = ("latent_image_distribution", "mean")
# Keys that only text-encoder outputs carry (SimpleTuner, OneTrainer, kohya, ai-toolkit).
TEXT_KEY = re.compile(
    r"(prompt_embeds|pooled|hidden_state|text_embed|t5_out|lg_out|vlm_embed|byt5_embed"
    r"|attention_mask|attn_mask|input_ids|tokens_\d|time_ids)"
)


class FileSummary(NamedTuple):
    path: str
    dataset: str | None
    bucket: str | None
    role: str
    format: str
    size: int
    mtime: float
    shape: tuple[int, ...] | None  # the primary latent's shape
    dtype: str | None  # the primary latent's dtype (or the first tensor's for text files)
    signature: tuple[tuple[str, int | None], ...]  # text embeds: (key, last dim) per tensor
    locations: tuple[str, ...]
    expected: tuple[int, int] | None = None  # (h, w) the trainer's bucket needs
    family: str | None = None  # model family / architecture the naming tells
    group: str | None = None  # the folder of its dataset in a bare tree (see layouts/bare.py)
    lacks: str | None = None  # a key the trainer reads from it that it lacks (CacheFacts.lacks)


FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})


def is_floating(dtype: str | None) -> bool:
    """A dtype a latent or an embedding is stored in (float8 formats included); not an int64
    `original_size`, a bool mask or token ids."""
    return dtype is not None and (dtype in FLOATING or dtype.startswith("float8"))


def primary_latent(meta: FileMeta) -> TensorMeta | None:
    """The tensor that is the latent: a bare tensor, a known key, the mean of OneTrainer's
    cached VAE distribution, or the only 3-D+ tensor."""
    tensors = meta.tensors
    if meta.metadata and meta.metadata.get("architecture") == "hidream_o1_image":
        return None  # musubi's HiDream-O1 caches pixel patch tokens [H, W, D], no latent
    mean = next((t for t in tensors if t.path == DISTRIBUTION_MEAN), None)
    if mean is not None:
        return _squeezed(mean)
    if len(tensors) == 1 and (tensors[0].path == () or len(tensors[0].shape) >= 3):
        return tensors[0]
    by_key = {t.path[-1]: t for t in tensors if len(t.path) == 1 and isinstance(t.path[0], str)}
    for key in LATENT_KEYS:
        if key in by_key:
            return by_key[key]
    reso = [t for k, t in by_key.items() if KOHYA_RESO_KEY.match(k)]
    if len(reso) == 1:
        return reso[0]
    musubi = [t for k, t in by_key.items() if MUSUBI_KEY.match(k)]
    if len(musubi) == 1:
        return musubi[0]
    big = [t for t in tensors if len(t.shape) >= 3]
    return big[0] if len(big) == 1 else None


def _squeezed(tensor: TensorMeta) -> TensorMeta:
    """The tensor as torch's squeeze() views it: its axes of size 1 dropped."""
    kept = [i for i, n in enumerate(tensor.shape) if n != 1]
    return dataclasses.replace(tensor, shape=tuple(tensor.shape[i] for i in kept),
                               stride=tuple(tensor.stride[i] for i in kept))


_TEXT_KEYS: dict[str, bool] = {}  # key -> is a text-encoder key; keys repeat across a cache


def _is_text_key(key: str) -> bool:
    known = _TEXT_KEYS.get(key)
    if known is None:
        known = bool(TEXT_KEY.search(key)) and not key.startswith(LATENT_KEYS)
        if len(_TEXT_KEYS) < 4096:
            _TEXT_KEYS[key] = known
    return known


def content_role(entry_role: str, meta: FileMeta) -> str:
    """Refine a name-based role from what the file holds: dict keys tell embeddings apart."""
    if entry_role != LATENT or meta.root == "tensor" or not meta.tensors:
        return entry_role
    keys = [p for t in meta.tensors for p in t.path[:1] if isinstance(p, str)]
    if keys and any(_is_text_key(k) for k in keys) and not any(
        k.startswith(LATENT_KEYS) for k in keys
    ):
        return TEXT
    return entry_role


class Content(NamedTuple):
    """The facts of a summary that come from the file's bytes alone (files with the same
    facts, zip_templates' twins, share them)."""

    role: str
    shape: tuple[int, ...] | None
    dtype: str | None
    signature: tuple[tuple[str, int | None], ...]
    locations: tuple[str, ...]


def content(entry_role: str, meta: FileMeta) -> Content | None:
    """What a readable tensor file of `entry_role` holds, or None when it gets no summary."""
    if not meta.ok or not meta.is_tensor_file or not meta.tensors:
        return None
    role = content_role(entry_role, meta)
    if role not in (LATENT, TEXT):
        return None
    latent = primary_latent(meta) if role == LATENT else None
    signature: tuple[tuple[str, int | None], ...] = ()
    if role == TEXT:
        # Only a floating tensor's last dim is a feature size. An integer or bool one's is a
        # token count (ids, per-token tags or indexes, masks), which varies with the caption
        # (ai-toolkit's HiDream-O1 `text_embeds` are token ids, MiniMax-H3's
        # `text_token_tags` one per token).
        signature = tuple(sorted(
            ("/".join(map(str, t.path)) or "<root>",
             t.shape[-1] if t.shape and is_floating(t.dtype) else None)
            for t in meta.tensors
        ))
    # Only a latent's own dtype (or an embedding's first floating tensor's) is compared: an
    # int64 `original_size` beside kohya's latents, or a mask, says nothing about precision.
    if role == LATENT:
        dtype = latent.dtype if latent is not None and is_floating(latent.dtype) else None
    else:
        dtype = next((t.dtype for t in meta.tensors if is_floating(t.dtype)), None)
    tensors = meta.tensors
    locations = (tensors[0].location,) if len(tensors) == 1 else meta.locations
    return Content(role, latent.shape if latent else None, dtype, signature, locations)


def summarize(entry: Entry, meta: FileMeta, facts: CacheFacts | None = None,
              known: Content | None = None, group: str | None = None) -> FileSummary | None:
    """The summary of a readable tensor file, or None for anything else. `facts` (from the
    trainer's naming) give a latent's bucket and expected size; without them the walk's
    folder bucket stands. `known`: the file's content(), when the caller has it already.
    `group`: the dataset folder a bare tree's naming puts the file's folder in."""
    held = known if known is not None else content(entry.role, meta)
    if held is None:
        return None
    bucket, expected, family, shape, lacks = entry.bucket, None, None, held.shape, None
    if facts is not None and held.role == LATENT:
        bucket, expected, family, lacks = facts.bucket, facts.expected, facts.family, facts.lacks
        if facts.shape is not None:
            shape = facts.shape or None
    elif held.role == TEXT:
        # a diffusion-pipe blob's text encoder (text_embeddings_<i>/) is its family: each encoder
        # has a sharded cache of its own, whose embeddings differ from the others' by design
        family = text_family(entry.path[entry.path.rfind(os.sep) + 1:]) or encoder_slot(entry.path)
    return FileSummary(entry.path, entry.dataset, bucket, held.role, meta.format, meta.size,
                       meta.mtime, shape, held.dtype, held.signature, held.locations,
                       expected, family, group, lacks)


class SummaryStore:
    """Summaries spilled to a temporary SQLite database (a row per batch of one dataset's
    files, see encode), streamed back per dataset."""

    def __init__(self) -> None:
        # "" = a private temporary database that SQLite keeps on disk once it outgrows its cache
        self._db = sqlite3.connect("")
        self._db.execute("CREATE TABLE s (dataset TEXT, blob BLOB)")
        self._db.execute("CREATE INDEX s_dataset ON s (dataset)")
        # side: IMAGE_SIDE, CACHE_SIDE or LISTED_SIDE; flag: an image the trainer expects a
        # cache entry for; note: a cache entry's naming scheme ("unhashed", "legacy", ...)
        self._db.execute("CREATE TABLE cov (dataset TEXT, side INTEGER, key TEXT, path TEXT, "
                         "mtime REAL, flag INTEGER, note TEXT)")
        self._indexed = False

    def add_blobs(self, rows: list[tuple[str, bytes]]) -> None:
        self._db.executemany("INSERT INTO s VALUES (?, ?)", rows)

    def add_coverage(self, rows: list[CoverageRow]) -> None:
        if rows:
            self._db.executemany("INSERT INTO cov VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def coverage_rows(self, dataset: str | None = None) -> Iterator[CoverageRow]:
        """Every coverage row (of `dataset`, when given), to ship to another process (sharded
        preflight)."""
        if dataset is None:
            rows = self._db.execute("SELECT * FROM cov ORDER BY rowid")
        else:
            rows = self._db.execute("SELECT * FROM cov WHERE dataset = ? ORDER BY rowid", (dataset,))
        for row in rows:
            yield CoverageRow(*row)

    def _index(self) -> None:
        # built once every row is in: cheaper than keeping an index up to date while inserting
        if not self._indexed:
            self._db.execute("CREATE INDEX cov_key ON cov (dataset, side, key)")
            self._db.execute("CREATE INDEX cov_path ON cov (dataset, side, path)")
            self._indexed = True

    def rows(self) -> Iterator[tuple[str, bytes]]:
        """Every (dataset, summary) row, to ship to another process (sharded preflight)."""
        yield from self._db.execute("SELECT dataset, blob FROM s ORDER BY rowid")

    def datasets(self) -> list[str]:
        return [d for (d,) in self._db.execute(
            "SELECT dataset FROM s UNION SELECT dataset FROM cov ORDER BY 1")]

    def view(self, dataset: str) -> DatasetView:
        self._index()
        return DatasetView(self._db, dataset)

    def close(self) -> None:
        self._db.close()


def encode(dataset: str | None, summaries: list[FileSummary]) -> tuple[str, bytes]:
    """What a worker sends back for a batch of one dataset's files: the dataset key and one
    marshal blob (one row per batch, not per file: inserting rows is most of what storing
    costs) of the batch's tally (see DatasetView.tally) and its summaries.

    marshal (plain tuples, strings and numbers) is faster than pickle and runs no code.
    """
    counts = Counter(_group(s) for s in summaries)
    return encode_counted(dataset, counts, [tuple(s) for s in summaries])


def encode_counted(dataset: str | None, counts: Mapping[Group, int],
                   summaries: list[tuple]) -> tuple[str, bytes]:
    """encode()'s blob from a tally the caller made (the index counts a directory by run)."""
    return dataset or "", marshal.dumps((list(counts.items()), summaries))


class Group(NamedTuple):
    """The facts of a summary that dataset rules compare (see DatasetView.tally)."""

    role: str
    family: str | None
    bucket: str | None
    shape: tuple[int, ...] | None
    expected: tuple[int, int] | None
    dtype: str | None
    format: str
    locations: tuple[str, ...]
    signature: tuple[tuple[str, int | None], ...]
    group: str | None
    lacks: str | None = None


_group = attrgetter(*Group._fields)  # a summary's Group, as a plain tuple


def folder_key(folder: str) -> tuple[str, ...]:
    """A folder's components: in this order the first and last folder of a set share exactly
    the components every folder of the set shares (os.path.commonpath compares components)."""
    return tuple(folder.split(os.sep))


def widen(spans: dict, group: tuple, folder: str) -> None:
    """Grow `group`'s (first, last) folder span in `spans` to take in `folder`."""
    span = spans.get(group)
    if span is None:
        spans[group] = (folder, folder)
        return
    low, high = span
    key = folder_key(folder)
    if key < folder_key(low):
        spans[group] = (folder, high)
    elif key > folder_key(high):
        spans[group] = (low, folder)


def common_folder(spans: Iterable[tuple[str, str]]) -> str | None:
    """The common folder of every folder the (first, last) spans cover."""
    ends = [folder for span in spans for folder in span]
    return os.path.commonpath(sorted(set(ends))) if ends else None


class CoverageRow(NamedTuple):
    """One image, cache entry or listed image of a dataset, for the coverage queries (a row of
    the `cov` table, in its column order)."""

    dataset: str
    side: int  # IMAGE_SIDE, CACHE_SIDE or LISTED_SIDE
    key: str | None  # the coverage key an image and its cache entry share
    path: str
    mtime: float
    flag: int  # an image the trainer expects a cache entry for
    note: str | None  # a cache entry's naming scheme ("unhashed", "legacy", ...)


class DatasetView:
    """A dataset's summaries; iterate it as often as needed (each pass streams from disk).
    The coverage queries join images with cache entries by coverage key, in SQLite."""

    def __init__(self, db: sqlite3.Connection, dataset: str) -> None:
        self._db = db
        self.dataset = dataset
        self._tally: Counter[Group] | None = None
        self._spans: dict[Group, tuple[str, str]] | None = None
        self._folders: Counter[tuple[str, Group]] | None = None

    def tally(self) -> Counter[Group]:
        """How many summaries share each Group of facts, shared by every rule: a rule looks
        for trouble here and reads the files one by one only when it found some (memory: one
        entry per distinct group, not per file). The workers counted each batch already."""
        if self._tally is None:
            tally: Counter[tuple] = Counter()
            for counts, _ in self._blobs():
                for group, n in counts:
                    tally[group] += n
            self._tally = Counter({Group(*g): n for g, n in tally.items()})
        return self._tally

    def __iter__(self) -> Iterator[FileSummary]:
        for _, rows in self._blobs():
            for row in rows:
                yield FileSummary(*row)

    def spans(self) -> dict[Group, tuple[str, str]]:
        """Per Group, the first and last folder of its files in component order (folder_key):
        what common_folder needs of a group, whatever its size (a sharded preflight merges
        them, see reduce.py)."""
        if self._spans is None:
            spans: dict[tuple, tuple[str, str]] = {}
            for s in self:
                widen(spans, _group(s), os.path.dirname(s.path))
            self._spans = {Group(*g): span for g, span in spans.items()}
        return self._spans

    def common_folder(self, which: Callable[[Group], bool]) -> str | None:
        """The folder that holds every file whose Group is `which` (None when there is none)."""
        return common_folder(span for g, span in self.spans().items() if which(g))

    def folder_tally(self) -> Counter[tuple[str, Group]]:
        """How many files of each Group each folder holds, for the files whose naming tells
        a family (CD309 compares the families of one folder)."""
        if self._folders is None:
            self._folders = Counter((os.path.dirname(s.path), Group(*_group(s)))
                                    for s in self if s.family is not None)
        return self._folders

    def _blobs(self) -> Iterator[tuple[list, list]]:
        cursor = self._db.execute("SELECT blob FROM s WHERE dataset = ? ORDER BY rowid",
                                  (self.dataset,))
        for (blob,) in cursor:
            yield marshal.loads(blob)

    def has_cache_entries(self) -> bool:
        return self._db.execute("SELECT 1 FROM cov WHERE dataset = ? AND side = ? LIMIT 1",
                                (self.dataset, CACHE_SIDE)).fetchone() is not None

    def missing(self) -> Iterator[tuple[str, str]]:
        """(image path, key) of images the trainer expects an entry for that have none."""
        yield from self._db.execute(
            "SELECT i.path, i.key FROM cov i WHERE i.dataset = ? AND i.side = ? AND i.flag = 1 "
            "AND NOT EXISTS (SELECT 1 FROM cov c WHERE c.dataset = i.dataset AND c.side = ? "
            "AND c.key = i.key) ORDER BY i.path", (self.dataset, IMAGE_SIDE, CACHE_SIDE))

    def orphans(self) -> Iterator[tuple[str, str, str | None]]:
        """(cache path, key, naming note) of cache entries no image maps to."""
        yield from self._db.execute(
            "SELECT c.path, c.key, c.note FROM cov c WHERE c.dataset = ? AND c.side = ? "
            "AND NOT EXISTS (SELECT 1 FROM cov i WHERE i.dataset = c.dataset AND i.side = ? "
            "AND i.key = c.key) ORDER BY c.path", (self.dataset, CACHE_SIDE, IMAGE_SIDE))

    def stale(self, tolerance: float) -> Iterator[tuple[str, float, str, float]]:
        """(cache path, its mtime, image path, its mtime) where the image is newer."""
        yield from self._db.execute(
            "SELECT c.path, c.mtime, i.path, i.mtime FROM cov c JOIN cov i ON i.dataset = "
            "c.dataset AND i.side = ? AND i.key = c.key WHERE c.dataset = ? AND c.side = ? "
            "AND i.mtime > c.mtime + ? ORDER BY c.path, i.path",
            (IMAGE_SIDE, self.dataset, CACHE_SIDE, tolerance))

    def collisions(self) -> Iterator[tuple[str, list[str]]]:
        """(key, image paths) for every key that two or more images map to."""
        rows = self._db.execute(
            "SELECT key, path FROM cov WHERE dataset = ? AND side = ? AND key IN (SELECT key "
            "FROM cov WHERE dataset = ? AND side = ? GROUP BY key HAVING count(*) > 1) "
            "ORDER BY key, path", (self.dataset, IMAGE_SIDE, self.dataset, IMAGE_SIDE))
        for key, group in itertools.groupby(rows, key=lambda row: row[0]):
            yield key, [path for _, path in group]

    def listed_but_gone(self) -> Iterator[str]:
        """Images the trainer's metadata lists that the walk did not find."""
        for (path,) in self._db.execute(
                "SELECT l.path FROM cov l WHERE l.dataset = ? AND l.side = ? AND NOT EXISTS "
                "(SELECT 1 FROM cov i WHERE i.dataset = l.dataset AND i.side = ? AND "
                "i.path = l.path) ORDER BY l.path", (self.dataset, LISTED_SIDE, IMAGE_SIDE)):
            yield path
