"""Entries of sharded caches: a diffusion-pipe shard is checked blob by blob.

The walk lists `shard_<n>.bin` as one file; here each blob its `metadata.db` locates becomes
an entry of its own (`shard_<n>.bin@<offset>`, a latent or a text embedding by its folder),
read by the ordinary readers through a window of the shard and judged by every file rule, as
a single cache file would be. metadata.db itself is read as the offsets table it is; a shard
no table locates is what a killed caching run leaves (diffusion-pipe commits a shard's rows
once the shard is closed), an interrupted write.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable, Iterator

from cachedoctor.formats.meta import FileMeta
from cachedoctor.formats.shard_blobs import (
    INDEX_NAME,
    SHARD_FORMAT,
    SHARD_PATTERN,
    blobs,
    index_meta,
    index_of,
)
from cachedoctor.inventory import LATENT, METADATA, OTHER, TEMP, TEXT, Entry

SQLITE_SIDE_FILES = (INDEX_NAME + "-journal", INDEX_NAME + "-wal", INDEX_NAME + "-shm")
# text encoder i's caches (utils/dataset.py): `text_embeddings_<i>/` per size bucket, and
# `uncond_text_embeddings_<i>/` beside the buckets, the embedding of the empty caption that
# replaces a caption when it is dropped out (DirectoryDataset.cache_text_embeddings)
TEXT_FOLDER = re.compile(r"^(uncond_)?text_embeddings_\d+$")


def expand(entries: Iterable[Entry], deep: bool, directory: str
           ) -> Iterator[tuple[Entry, FileMeta | None]]:
    """(entry, its FileMeta) for the parts of a sharded cache, (entry, None) for every other
    file (its reader is the caller's). `entries` are files of `directory`: one without a
    metadata.db (nearly every one) costs one stat, not a look at each name."""
    if index_of(directory) is None:
        return zip(entries, itertools.repeat(None))
    return _expand(entries, deep)


def _expand(entries: Iterable[Entry], deep: bool) -> Iterator[tuple[Entry, FileMeta | None]]:
    for entry in entries:
        if entry.error is not None:
            yield entry, None
            continue
        directory, name = os.path.split(entry.path)
        if name == INDEX_NAME or name in SQLITE_SIDE_FILES or SHARD_PATTERN.match(name):
            index = index_of(directory)
            if index is not None:
                yield from _parts(entry, directory, name, index, deep)
                continue
        yield entry, None


def _parts(entry: Entry, directory: str, name: str, index, deep: bool
           ) -> Iterator[tuple[Entry, FileMeta | None]]:
    if name == INDEX_NAME:
        if index.error is not None and not _has_shards(directory):
            yield entry, None  # some other program's database: judged as any file
            return
        yield entry._replace(role=METADATA), index_meta(entry.path)
        return
    if name in SQLITE_SIDE_FILES:
        # SQLite's own journal: a hot one is rolled back when diffusion-pipe next opens the
        # database; moving it away would leave a half-written database
        yield entry._replace(role=METADATA), _whole(entry.path)
        return
    number = int(SHARD_PATTERN.match(name)[1])
    if index.error is not None:
        yield entry._replace(role=OTHER), _whole(entry.path)  # metadata.db's CD101 says why
        return
    if number not in index.shards:
        yield entry._replace(role=TEMP), _whole(entry.path)
        return
    role = TEXT if TEXT_FOLDER.match(os.path.basename(directory)) else LATENT
    try:
        for meta in blobs(entry.path, index, number, deep=deep):
            yield entry._replace(path=meta.path, role=role), meta
    except OSError:
        yield entry, None  # the shard cannot be opened: its reader reports the I/O error


def _has_shards(directory: str) -> bool:
    try:
        return any(SHARD_PATTERN.match(n) for n in os.listdir(directory))
    except OSError:
        return False


def _whole(path: str) -> FileMeta:
    try:
        st = os.stat(path)
    except OSError:
        return FileMeta(path, 0, SHARD_FORMAT)
    return FileMeta(path, st.st_size, SHARD_FORMAT, mtime=st.st_mtime)
