"""Compact per-file summaries for the dataset rules, kept on disk so memory stays flat.

A worker turns each cache file's FileMeta into a FileSummary (the few facts a dataset rule
compares: primary latent shape, dtypes, text-embedding signature, devices). The main process
appends them to a SummaryStore (a temporary SQLite file that spills to disk) and each dataset
rule streams its dataset's summaries back as often as it needs.
"""

from __future__ import annotations

import marshal
import re
import sqlite3
from collections.abc import Iterator
from typing import NamedTuple

from cachedoctor.formats.meta import FileMeta, TensorMeta
from cachedoctor.inventory import LATENT, TEXT, Entry

# Keys trainers give the latent inside a dict: SimpleTuner `latents`, ai-toolkit `latent`,
# OneTrainer `latent_image`, kohya `latents` / `latents_<H>x<W>` (multi-resolution).
LATENT_KEYS = ("latents", "latent", "latent_image")
KOHYA_RESO_KEY = re.compile(r"^latents_\d+x\d+$")
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


def primary_latent(meta: FileMeta) -> TensorMeta | None:
    """The tensor that is the latent: a bare tensor, a known key, or the only 3-D+ tensor."""
    tensors = meta.tensors
    if len(tensors) == 1 and (tensors[0].path == () or len(tensors[0].shape) >= 3):
        return tensors[0]
    by_key = {t.path[-1]: t for t in tensors if len(t.path) == 1 and isinstance(t.path[0], str)}
    for key in LATENT_KEYS:
        if key in by_key:
            return by_key[key]
    reso = [t for k, t in by_key.items() if KOHYA_RESO_KEY.match(k)]
    if len(reso) == 1:
        return reso[0]
    big = [t for t in tensors if len(t.shape) >= 3]
    return big[0] if len(big) == 1 else None


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


def summarize(entry: Entry, meta: FileMeta) -> FileSummary | None:
    """The summary of a readable tensor file, or None for anything else."""
    if not meta.ok or not meta.is_tensor_file or not meta.tensors:
        return None
    role = content_role(entry.role, meta)
    if role not in (LATENT, TEXT):
        return None
    latent = primary_latent(meta) if role == LATENT else None
    signature: tuple[tuple[str, int | None], ...] = ()
    if role == TEXT:
        signature = tuple(sorted(
            ("/".join(map(str, t.path)) or "<root>", t.shape[-1] if t.shape else None)
            for t in meta.tensors
        ))
    first = latent or meta.tensors[0]
    tensors = meta.tensors
    locations = (tensors[0].location,) if len(tensors) == 1 else meta.locations
    return FileSummary(entry.path, entry.dataset, entry.bucket, role, meta.format, meta.size,
                       meta.mtime, latent.shape if latent else None, first.dtype, signature,
                       locations)


class SummaryStore:
    """Summaries spilled to a temporary SQLite database, streamed back per dataset."""

    def __init__(self) -> None:
        # "" = a private temporary database that SQLite keeps on disk once it outgrows its cache
        self._db = sqlite3.connect("")
        self._db.execute("CREATE TABLE s (dataset TEXT, blob BLOB)")
        self._db.execute("CREATE INDEX s_dataset ON s (dataset)")

    def add_blobs(self, rows: list[tuple[str, bytes]]) -> None:
        self._db.executemany("INSERT INTO s VALUES (?, ?)", rows)

    def rows(self) -> Iterator[tuple[str, bytes]]:
        """Every (dataset, summary) row, to ship to another process (sharded preflight)."""
        yield from self._db.execute("SELECT dataset, blob FROM s ORDER BY rowid")

    def datasets(self) -> list[str]:
        return [d for (d,) in self._db.execute("SELECT DISTINCT dataset FROM s ORDER BY dataset")]

    def view(self, dataset: str) -> DatasetView:
        return DatasetView(self._db, dataset)

    def close(self) -> None:
        self._db.close()


def encode(summary: FileSummary) -> tuple[str, bytes]:
    """What a worker sends back: the dataset key and the summary as marshal bytes.

    marshal (plain tuples, strings and numbers) is faster than pickle and runs no code.
    """
    return summary.dataset or "", marshal.dumps(tuple(summary))


class DatasetView:
    """A dataset's summaries; iterate it as often as needed (each pass streams from disk)."""

    def __init__(self, db: sqlite3.Connection, dataset: str) -> None:
        self._db = db
        self.dataset = dataset

    def __iter__(self) -> Iterator[FileSummary]:
        cursor = self._db.execute("SELECT blob FROM s WHERE dataset = ? ORDER BY rowid",
                                  (self.dataset,))
        for (blob,) in cursor:
            yield FileSummary(*marshal.loads(blob))
