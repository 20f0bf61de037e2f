"""diffusion-pipe's sharded cache: `torch.save` blobs end to end in `shard_<n>.bin`, located by
a SQLite `metadata.db` beside them.

diffusion-pipe's `utils/cache.py` (`Cache`) keeps, per cache folder (`latents/`,
`text_embeddings_<i>/` under each `cache_<bucket>/` or `ar_frames_<bucket>/`):
- table `fingerprint(value)`: one row, the hash of the dataset the cache was built from; at
  start-up a different fingerprint deletes `metadata.db` and every `*.bin` (the whole folder is
  rebuilt), a missing row is filled in with the new fingerprint and the items are kept;
- table `items(shard, shard_index)`: one row per dataset row, in dataset order: item i is row
  i of the dataset, found at row `shard_index` of table `shard_<shard>`;
- table `shard_<n>(offset, size)`: where each blob of `shard_<n>.bin` lies, in write order.
Rows are committed only once a shard is closed, so a killed caching run leaves a shard file
with no table, which the next run overwrites.

Reading here never loads a blob: each is handed to the ordinary readers as a window of its
shard (`BlobSource`) and reported as `shard_<n>.bin@<offset>`. The database is opened
read-only and immutable: nothing is written, no journal or lock created. Only tables are read
(a view named `shard_1` could compute forever), rows are bounded, and the SQLite VM is
interrupted after a bounded amount of work. A hostile or corrupt `metadata.db` is an error on
that file, never a traceback or a hang.
"""

from __future__ import annotations

import os
import re
import sqlite3
import stat
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field

from cachedoctor.formats.meta import PICKLE_FORMATS, TORCH_ZIP, FileMeta
from cachedoctor.formats.source import WHOLE_FILE_LIMIT, WINDOW, FileSource, Window, windowed_pread

INDEX_NAME = "metadata.db"
INDEX_FORMAT = "diffusion-pipe-index"  # metadata.db, read as the offsets table it is
SHARD_FORMAT = "diffusion-pipe-shard"  # a shard file judged as a whole (its blobs are not)
SHARD_PATTERN = re.compile(r"^shard_(\d{1,9})\.bin$")
BLOB_PATTERN = re.compile(r"^(?P<shard>.*[/\\]shard_\d{1,9}\.bin)@(?P<offset>\d+)$")
SQLITE_MAGIC = b"SQLite format 3\x00"

MAX_ROWS = 2_000_000  # items and offsets rows read in all; a bigger table is a finding
MAX_TABLES = 10_000
MAX_BAD_BLOBS = 100  # misplaced blobs listed per shard; the rest are counted in one line
# A rollback journal or write-ahead log beside metadata.db is part of what SQLite reads when
# diffusion-pipe opens it (a hot journal rolled back, a WAL's commits): read with the database
LOG_SUFFIXES = ("-journal", "-wal")
MAX_COPY = 1 << 30  # bytes of database and log copied to read them so
MAX_VM_STEPS = 200_000_000  # SQLite VM instructions (a few seconds) before the read gives up
_STEP = 100_000


@dataclass(frozen=True)
class ShardIndex:
    """What metadata.db says, or why it cannot be read (`error`)."""

    path: str
    error: str | None = None
    fingerprints: int = 0  # rows of table `fingerprint` (-1: no such table)
    items: int = 0
    shards: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # n -> (offset, size)
    item_shards: dict[int, int] = field(default_factory=dict)  # n -> items that point into it
    dangling: int = 0  # items whose shard_index is past their shard table's rows
    bad_rows: tuple[str, ...] = ()  # rows that are no (offset, size) of ints

    def shard_path(self, n: int) -> str:
        return os.path.join(os.path.dirname(self.path), f"shard_{n}.bin")


def is_shard_cache(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, INDEX_NAME))


def unit_files(path: str) -> list[str] | None:
    """The files diffusion-pipe rebuilds together with `path` (a blob `shard_<n>.bin@<offset>`,
    a shard, or metadata.db of a sharded cache): metadata.db (and its -journal or -wal) and
    every shard of its folder.
    Items are positional, so a shard cannot go alone: the folder is one unit. None when `path`
    is no part of such a cache."""
    blob = BLOB_PATTERN.match(path)
    if blob:
        path = blob["shard"]
    directory, name = os.path.split(path)
    if name != INDEX_NAME and not SHARD_PATTERN.match(name):
        return None
    if not is_shard_cache(directory):
        return None
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    # (metadata.db's logs go with it: left beside a rebuilt database, SQLite would apply them)
    logs = {INDEX_NAME + suffix for suffix in LOG_SUFFIXES}
    return [os.path.join(directory, n) for n in names
            if n == INDEX_NAME or n in logs or SHARD_PATTERN.match(n)]


class _Interrupted(Exception):
    pass


def read_index(path: str) -> ShardIndex:
    """Read metadata.db read-only; never raises for what the file holds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang the scan
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ShardIndex(path, error="not a regular file")
            magic = os.read(fd, len(SQLITE_MAGIC))
        finally:
            os.close(fd)
    except OSError as exc:
        return ShardIndex(path, error=f"cannot read it: {exc.strerror or exc}")
    if magic != SQLITE_MAGIC:
        why = "it is empty" if not magic else f"it starts with {magic[:8].hex(' ')}"
        return ShardIndex(path, error=f"no SQLite database: {why}")
    companions = [path + suffix for suffix in LOG_SUFFIXES if os.path.lexists(path + suffix)]
    if companions:  # what diffusion-pipe's SQLite reads with them: read from a private copy
        with tempfile.TemporaryDirectory(prefix="cachedoctor-db-") as private:
            try:
                copy = _copied(path, companions, private)
            except OSError as exc:
                return ShardIndex(path, error=f"cannot read it with its {_names(companions)}: "
                                              f"{exc.strerror or exc}")
            return _query(path, _uri(copy, ""))
    return _query(path, _uri(path, "?mode=ro&immutable=1"))


def _uri(path: str, query: str) -> str:
    # (bytes: a name that is no UTF-8, kept by surrogateescape, is percent-encoded as it is)
    return "file:" + urllib.parse.quote(os.fsencode(os.path.abspath(path))) + query


def _names(paths: list[str]) -> str:
    return " and ".join(os.path.basename(p) for p in paths)


def _copied(path: str, companions: list[str], folder: str) -> str:
    """metadata.db and its logs copied into `folder` (regular files only, MAX_COPY bytes in
    all): SQLite replays a WAL or rolls back a hot journal there, never in the cache."""
    budget = MAX_COPY
    for source in (path, *companions):
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO must not hang the scan)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{os.path.basename(source)} is not a regular file")
            budget -= st.st_size
            if budget < 0:
                raise OSError(f"more than {MAX_COPY // 2**20} MiB to read")
            left = st.st_size
            with open(os.path.join(folder, os.path.basename(source)), "wb") as out:
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    out.write(chunk)
                    left -= len(chunk)
        finally:
            os.close(fd)
    return os.path.join(folder, os.path.basename(path))


def _query(path: str, uri: str) -> ShardIndex:
    try:
        con = sqlite3.connect(uri, uri=True, timeout=0)
    except (sqlite3.Error, ValueError) as exc:
        return ShardIndex(path, error=f"SQLite cannot open it: {exc}")
    steps = [0]

    def progress() -> int:
        steps[0] += _STEP
        return 1 if steps[0] > MAX_VM_STEPS else 0

    con.set_progress_handler(progress, _STEP)
    try:
        return _read(con, path)
    except _Interrupted as exc:
        return ShardIndex(path, error=str(exc))
    except (sqlite3.Error, ValueError, OverflowError, MemoryError, RecursionError) as exc:
        if steps[0] > MAX_VM_STEPS:
            return ShardIndex(path, error="reading it took more than the work allowed (a hostile "
                                          "or huge database): not read")
        return ShardIndex(path, error=f"SQLite cannot read it: {exc}")
    finally:
        con.close()


def _ints(row: tuple) -> tuple[int, int] | None:
    if len(row) != 2 or not all(type(v) is int for v in row):
        return None
    return row[0], row[1]


def _read(con: sqlite3.Connection, path: str) -> ShardIndex:
    objects = con.execute("SELECT type, name FROM sqlite_master LIMIT ?",
                          (MAX_TABLES + 1,)).fetchall()
    if len(objects) > MAX_TABLES:
        raise _Interrupted(f"more than {MAX_TABLES:,} tables: not read")
    names = {n for t, n in objects if t == "table" and isinstance(n, str)}
    bad: list[str] = [
        f"{t} {n!r:.60} is named like a shard table: diffusion-pipe would query it (never read here)"
        for t, n in objects if t != "table" and isinstance(n, str) and n.startswith("shard_")][:10]
    if "items" not in names:
        raise _Interrupted("no table 'items': not diffusion-pipe's offsets table")
    budget = MAX_ROWS
    fingerprints = -1
    if "fingerprint" in names:
        fingerprints = len(con.execute("SELECT value FROM fingerprint LIMIT 2").fetchall())
    rows = con.execute("SELECT shard, shard_index FROM items LIMIT ?", (budget + 1,)).fetchall()
    if len(rows) > budget:
        raise _Interrupted(f"more than {MAX_ROWS:,} rows: not read")
    budget -= len(rows)
    shards: dict[int, tuple[tuple[int, int], ...]] = {}
    # as diffusion-pipe reads them: in sqlite_master's order, each table's shard number
    # int(name.split('_')[-1]), the rows of every table of one number in one list
    for name in dict.fromkeys(n for t, n in objects if t == "table" and isinstance(n, str)):
        if not name.startswith("shard_"):
            continue
        number = name.split("_")[-1]
        try:
            shard = int(number)
        except ValueError:
            bad.append(f"table {name!r} names no shard number (diffusion-pipe fails on it)")
            continue
        if not 0 <= shard < 10**9:
            bad.append(f"table {name!r} names shard {number!r:.20}, no shard file's number")
            continue
        if name != f"shard_{shard}":
            bad.append(f"table {name!r} is no name diffusion-pipe writes: it reads its rows as "
                       f"more rows of shard {shard}")
        quoted = '"' + name.replace('"', '""') + '"'
        table = con.execute(f"SELECT offset, size FROM {quoted} LIMIT ?", (budget + 1,)).fetchall()
        if len(table) > budget:
            raise _Interrupted(f"more than {MAX_ROWS:,} rows: not read")
        budget -= len(table)
        entries = []
        for i, row in enumerate(table):
            pair = _ints(row)
            if pair is None or pair[0] < 0 or pair[1] <= 0:
                bad.append(f"row {i} of table {name} is no (offset, size) of a blob: {row!r:.80}")
                continue
            entries.append(pair)
        shards[shard] = shards.get(shard, ()) + tuple(entries)
    item_shards: dict[int, int] = {}
    dangling = 0
    for i, row in enumerate(rows):
        pair = _ints(row)
        if pair is None or pair[1] < 0:
            if len(bad) < 100:
                bad.append(f"item {i} is no (shard, shard_index) pair: {row!r:.80}")
            continue
        shard, at = pair
        item_shards[shard] = item_shards.get(shard, 0) + 1
        if shard in shards and at >= len(shards[shard]):
            dangling += 1
    return ShardIndex(path, None, fingerprints, len(rows), shards, item_shards, dangling,
                      tuple(bad[:100]))


# by path and stat (inode and ctime too: a metadata.db replaced within a tick, at its size)
_indexes: dict[tuple, ShardIndex] = {}


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns


def index_of(directory: str) -> ShardIndex | None:
    """The (cached) index of a sharded cache folder, or None when it has no metadata.db."""
    path = os.path.join(directory, INDEX_NAME)
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns,
           *(_stamp(path + suffix) for suffix in LOG_SUFFIXES))  # (a log changes what it holds)
    if key not in _indexes:
        if len(_indexes) >= 8:
            _indexes.clear()
        _indexes[key] = read_index(path)
    return _indexes[key]


def index_meta(path: str) -> FileMeta:
    """metadata.db as a FileMeta: its problems in `errors` (CD101), the facts the layout rules
    need (shards that items point at but are missing, a missing fingerprint) in `metadata`."""
    index = index_of(os.path.dirname(path)) or read_index(path)
    try:
        st = os.stat(path)
        size, mtime = st.st_size, st.st_mtime
    except OSError:
        size, mtime = 0, 0.0
    if index.error:
        return FileMeta(path, size, INDEX_FORMAT, errors=(index.error,), mtime=mtime)
    errors = list(index.bad_rows)
    if index.dangling:
        errors.append(f"{index.dangling:,} items point past the rows of their shard table: "
                      "diffusion-pipe fails with IndexError on them")
    facts = {"items": str(index.items)}
    missing = sorted(n for n in index.item_shards
                     if n not in index.shards or not os.path.isfile(index.shard_path(n)))
    if missing:
        facts["missing_shards"] = ",".join(str(n) for n in missing)
        facts["missing_items"] = str(sum(index.item_shards[n] for n in missing))
    if index.items and index.fingerprints <= 0:
        facts["unfingerprinted"] = "1"
    return FileMeta(path, size, INDEX_FORMAT, errors=tuple(errors), metadata=facts, mtime=mtime)


class BlobSource:
    """A window [start, start + size) of a shard file, as a Source: offsets are the blob's own."""

    def __init__(self, shard: FileSource, start: int, size: int) -> None:
        self._shard = shard
        self._start = start
        self.size = size
        self.buffer: bytes | None = None
        if size <= WHOLE_FILE_LIMIT:
            self.buffer = shard.pread(start, size)
            self.windows: tuple[Window, ...] = ((0, self.buffer),)
        else:
            tail = size - WINDOW
            self.windows = ((0, shard.pread(start, WINDOW)), (tail, shard.pread(start + tail, WINDOW)))

    def pread(self, offset: int, n: int) -> bytes:
        return windowed_pread(self, offset, n, lambda at, count: self._shard.pread(self._start + at, count))


def encoder_slot(path: str) -> str | None:
    """The folder of the cache a blob path is in (`text_embeddings_1`): diffusion-pipe keeps
    one text cache per text encoder, whose embeddings differ by design. None for any other
    path."""
    blob = BLOB_PATTERN.match(path)
    return os.path.basename(os.path.dirname(blob["shard"])) if blob else None


def blob_path(shard: str, offset: int) -> str:
    return f"{shard}@{offset}"


def blobs(shard: str, index: ShardIndex, number: int, *, deep: bool = False) -> Iterator[FileMeta]:
    """A FileMeta per blob of `shard` (the offsets of table `shard_<number>`), read through the
    ordinary readers. A blob past the shard's end, overlapping another, or that is no torch
    file is an error on that blob; one bad blob never stops the others."""
    from cachedoctor.formats import describe_os_error, read_source  # formats/__init__ imports readers

    fd = os.open(shard, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file: {shard}")
        src = FileSource(fd, st.st_size, position=0, spans=())
        end_of_previous, previous = 0, None
        rows = sorted(index.shards.get(number, ()))
        misplaced = 0
        for at, (offset, size) in enumerate(rows):
            path = blob_path(shard, offset)
            problem = None
            if offset + size > st.st_size:
                problem = (f"the offsets table puts this blob at {offset:,}..{offset + size:,}, "
                           f"past the shard's end ({st.st_size:,} bytes): cut short")
            elif previous is not None and offset < end_of_previous:
                problem = (f"overlaps the blob at {previous:,} (which ends at {end_of_previous:,}): "
                           "the offsets table is wrong")
            if offset + size > end_of_previous:
                end_of_previous, previous = offset + size, offset
            if problem:  # (its size: the bytes the shard holds, not what the row promises)
                misplaced += 1
                if misplaced > MAX_BAD_BLOBS:  # a hostile table must not make a finding a row
                    yield FileMeta(path, 0, TORCH_ZIP, mtime=st.st_mtime, errors=(
                        f"this and the {len(rows) - at - 1:,} blobs after it are not checked: "
                        f"the offsets table already misplaces {MAX_BAD_BLOBS} blobs",))
                    return
                held = max(0, min(size, st.st_size - offset))
                yield FileMeta(path, held, TORCH_ZIP, errors=(problem,), mtime=st.st_mtime)
                continue
            try:
                meta = read_source(BlobSource(src, offset, size), path, deep=deep)
            except OSError as exc:
                meta = FileMeta(path, size, TORCH_ZIP, errors=(describe_os_error(exc),))
            if meta.format not in PICKLE_FORMATS and not meta.errors:
                head = src.pread(offset, 8)
                meta = FileMeta(path, size, TORCH_ZIP, errors=(
                    f"no torch.save blob ({meta.format}): it starts with {head.hex(' ')}",))
            meta.mtime = st.st_mtime
            yield meta
    finally:
        os.close(fd)
