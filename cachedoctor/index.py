"""The incremental index: each file's verdict kept between scans, so a rescan reads only the
files that are new or changed.

A row per file, keyed by its path as walked (absolute), holds the file's stat (size, mtime_ns,
inode, device, ctime_ns), a scope stamp and what the file phase made of the file: its size,
its summary and coverage row for the dataset rules, and its file findings. A rescan stats
every file the walk lists and reuses a row only when every stat field and the scope stamp are
the same; anything else is read again. The scope stamp hashes the package version and the
source of every module (a change of a reader or a rule re-judges everything), the options that
shape a verdict (--deep, the rules selected, their settings) and what the trainer config says
about the file's dataset, bucket and area. The dataset rules always run over every summary,
stored or fresh. A whole batch of the walk (a small directory, or a chunk of a big one cut
where its names say: inventory.batches) of clean recorded files is one `dirs` row instead: a
fingerprint of its names and stats, its summaries by run and each file's stat and size; a
rescan stats its files and compares one digest, and goes file by file only when it differs.

Rows are plain columns, JSON and int64 arrays (never pickle): an index runs no code, and a row
that does not decode is read again. Verdicts are taken on trust, so an index another user can
write is not used (the user's own place is). Only latents, text embeddings and images in image dirs
are recorded (the files a scan reads, and images, which the coverage rules need); everything
else is cheap to judge and is judged every time. A file modified less than RACY_NS before the
scan began is not recorded (a write in the same clock tick after our stat would leave its
mtime unchanged), nor is one its reader could not read (an I/O error may pass).

Where: `<cache root>/.cachedoctor/index.sqlite` (the first directory the scan walks), else,
where that cannot be written, `$CACHEDOCTOR_STATE_DIR/index/`, `$XDG_CACHE_HOME/cachedoctor/
index/` or `~/.cache/cachedoctor/index/`, one file per real root path; with no writable place
the scan runs without an index. WAL and a busy timeout let concurrent scans share it; a
corrupt index is rebuilt and a locked or unwritable one skipped, with a one-line notice: the
index only ever saves reading, it never decides a result.

The parent process does every lookup and every write (Session): the workers only encode each
file's record (`record`), so SQLite is never written from many processes of one scan.
"""

from __future__ import annotations

import array
import contextlib
import functools
import hashlib
import itertools
import json
import operator
import os
import secrets
import sqlite3
import stat
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime
from enum import Enum
from typing import Any, NamedTuple

from cachedoctor import __version__
from cachedoctor.clock import fs_now
from cachedoctor.config import ConfigError
from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.shard_blobs import INDEX_NAME, SHARD_PATTERN
from cachedoctor.inventory import IMAGE, LATENT, STATE_DIR, TEXT, Batch, excluded
from cachedoctor.summary import CoverageRow, FileSummary, Group, encode, encode_counted

NAME = "index.sqlite"
SCHEMA = "7"
BUSY_MS = 5000  # how long a scan waits for another scan's write before it skips its own
RACY_NS = 2_000_000_000
COMMIT_EVERY = 16384  # rows per write transaction
LOOKUP_CHUNK = 500  # names per SELECT (SQLite allows 999 parameters in old builds)
WHOLE_DIR = 1024  # a directory with fewer names than this is looked up at once (engine.BATCH)
DIGEST = 16  # hex digits of a stamp

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS files (
    dir INTEGER, name BLOB, size INTEGER, mtime_ns INTEGER, ino INTEGER, dev INTEGER,
    ctime_ns INTEGER, scope INTEGER, bytes INTEGER, summary INTEGER, findings INTEGER,
    side INTEGER, key TEXT, flag INTEGER, note TEXT, PRIMARY KEY (dir, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS texts (id INTEGER PRIMARY KEY, text TEXT);
CREATE TABLE IF NOT EXISTS dirs (
    key INTEGER PRIMARY KEY, dir INTEGER, scope INTEGER, fp BLOB, files INTEGER, bytes INTEGER,
    summaries TEXT, coverage TEXT, detail BLOB,
    shard TEXT  -- "<rank>/<world>" for a rank of a sharded scan, else NULL
);
CREATE TABLE IF NOT EXISTS scans (
    id TEXT PRIMARY KEY, started_ns INTEGER, finished_ns INTEGER, files INTEGER, reused INTEGER
);
"""


class SinceError(ConfigError):
    """A --changed-since value that is no time, and no scan or repair run on record (a usage
    error, as a bad option is)."""


# -- what a worker sends back per file ---------------------------------------------------------

def text_id(text: str | bytes) -> int:
    """A text's id in the `texts` table: a 64-bit hash of it, so that a worker can name a text
    without asking the index (and a row's scope or directory is compared without a query). A
    directory is named by its path's bytes (a name need not be UTF-8)."""
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


class Records(NamedTuple):
    """What a worker sends back for the index: a row per file read (the `files` table's
    columns) and the texts those rows name that it has not sent before; or, for a whole
    batch of the walk (Batch.part) of clean recorded files, its `dirs` row instead of the
    rows (one insert, not a thousand; the parent turns it back into rows when it cannot keep
    it: a batch it cut, a file modified too recently)."""

    rows: list[tuple]
    texts: list[tuple[int, str]]
    folder: tuple | None = None  # (newest mtime_ns, the `dirs` row)
    key: int | None = None  # the batch's chunk (chunk_key), if it is a whole one


def chunk_key(directory: bytes, part: str, shard: tuple[int, int] | None) -> int:
    """The `dirs` key of a whole batch (Batch.part) of `directory`: its last name, or "" for
    the directory's last batch (or only one); a rank of a sharded scan keeps its own."""
    return text_id(b"\0".join((directory, part.encode(FS, "surrogateescape"),
                                b"" if shard is None else b"%d/%d" % shard)))


_STAT_FIELDS = operator.attrgetter("st_size", "st_mtime_ns", "st_ino", "st_dev", "st_ctime_ns")
_MTIME = operator.attrgetter("st_mtime")
_GROUP = operator.attrgetter(*Group._fields)  # a summary's Group, as summary.encode counts it


_STAT_BYTES = struct.Struct("=5q")  # a stat tuple as array("q") lays it out (native order)


def _listing(names: Any, stats: Iterable[tuple]) -> bytes:
    """A directory's names ("\\0"-joined, after their length) and stats (int64s), as bytes;
    OverflowError for an inode or a time beyond 63 bits."""
    listed = "\0".join(names).encode("utf-8", "surrogatepass")
    try:  # (a C loop: array("q", chain(...)) converts each of the five ints in Python)
        packed = b"".join(itertools.starmap(_STAT_BYTES.pack, stats))
    except struct.error as exc:
        raise OverflowError(str(exc)) from None
    return b"".join((len(listed).to_bytes(8, "little"), listed, packed))


def fingerprint(names: Any, stats: Iterable[tuple]) -> bytes:
    """One digest of a directory's names (in walk order) and their stats: a rescan of an
    unchanged directory compares it, not each file's row (C loops, no Python per file)."""
    stats = list(stats)
    try:
        listing = _listing(names, stats)
    except OverflowError:  # never a `dirs` row's: the directory goes file by file
        listing = repr((list(names), stats)).encode("utf-8", "surrogatepass")
    return _digest(listing)


def _digest(listing: bytes) -> bytes:
    return hashlib.blake2b(listing, digest_size=16).digest()


class Recorder:
    """A worker's side of the index (one per ScanState). Per file the worker only appends a
    tuple to `files`; `take` makes the batch's records at once: one `dirs` row for a whole
    clean batch (its lists built by C loops, a summary text per run of equal summaries), else
    a row per file. The JSON texts many files share (a summary but for its path and mtime)
    are made once."""

    def __init__(self) -> None:
        self.memo: dict[tuple, int] = {}  # a summary's facts -> its text's id
        self.ids: dict[str | bytes, int] = {}  # a scope stamp or a directory -> its text's id
        self.sent: set[int] = set()
        # per file recorded, in the batch's order, appended by the worker: (name, stat, size,
        # summary, coverage row, first, end, path), its findings being the batch's [first:end]
        self.files: list[tuple] = []
        self.texts: list[tuple[int, str | bytes]] = []

    def _text(self, text: str | bytes) -> int:
        found = text_id(text)
        if found not in self.sent:
            if len(self.sent) >= MEMO:
                self.sent.clear()
            self.sent.add(found)
            self.texts.append((found, text))
        return found

    def _id(self, text: str | bytes) -> int:
        found = self.ids.get(text)
        if found is None:
            if len(self.ids) >= MEMO:
                self.ids.clear()
            found = self.ids[text] = self._text(text)
        return found

    def _summary(self, facts: tuple | None) -> int | None:
        if facts is None:
            return None
        found = self.memo.get(facts)
        if found is None:
            if len(self.memo) >= MEMO:
                self.memo.clear()
            found = self.memo[facts] = self._text(_dumps(facts))
        return found

    def take(self, directory: bytes, names: tuple[str, ...], files: int, scope: str,
             findings: list[Finding], key: int | None) -> Records:
        """The batch's records: its `dirs` row when it is a whole chunk of its directory
        (`key`), every one of its files was recorded and the batch found nothing."""
        done, self.files = self.files, []
        names_done = list(map(_DONE_NAME, done))
        if not _SIDE_NAMES.isdisjoint(names_done) or any(map(_SHARD, names_done)):
            done = [d for d in done if _recordable_name(d[0])]  # (rare: C loops decide)
        if not done:
            return Records([], [], None, key)
        dir_id, scope_id = self._id(directory), self._id(scope)
        folder = None
        if key is not None and not findings and len(done) == len(names) == files:
            folder = self._folder(key, dir_id, scope_id, done, names)
        rows = [] if folder is not None else \
            [r for r in (self._row(dir_id, scope_id, f, findings) for f in done) if r is not None]
        texts, self.texts = self.texts, []
        return Records(rows, texts, folder, key)

    def _folder(self, key: int, dir_id: int, scope_id: int, done: list[tuple], names: Any
                ) -> tuple | None:
        summaries = list(map(_DONE_SUMMARY, done))
        facts = map(_FACTS, summaries) if None not in summaries else \
            [None if s is None else _FACTS(s) for s in summaries]
        covers = list(map(_DONE_COVER, done))
        if None not in covers:  # (every file an entry: a C loop)
            covers = list(map(_COVER, covers))
        elif covers.count(None) != len(covers):
            covers = [None if c is None else _COVER(c) for c in covers]
        try:
            runs = [[self._summary(same), len(list(run))] for same, run in itertools.groupby(facts)]
        except (TypeError, ValueError, RecursionError):
            return None  # (file by file: the file whose summary has no JSON form is left out)
        return _dir_row(key, dir_id, scope_id, names, list(map(_DONE_STAT, done)),
                        list(map(_DONE_SIZE, done)), runs, covers)

    def _row(self, dir_id: int, scope_id: int, done: tuple, findings: list[Finding]
             ) -> tuple | None:
        """One file's `files` row; None when some value has no exact JSON form (the file is
        then read again next time)."""
        name, stat, size, summary, coverage, first, end, path = done
        try:
            summary_id = self._summary(None if summary is None else _FACTS(summary))
            findings_id = self._text(_dumps([_finding_row(f, path) for f in findings[first:end]])) \
                if end > first else None
            cover = _COVER(coverage) if coverage is not None else (None, None, None, None)
            return (dir_id, name.encode(FS, "surrogateescape"), *stat, scope_id, size,
                    summary_id, findings_id, *cover)
        except (TypeError, ValueError, RecursionError):
            return None


_DONE_NAME, _DONE_STAT, _DONE_SIZE, _DONE_SUMMARY, _DONE_COVER = map(operator.itemgetter, range(5))
# a summary but for its path and mtime (what files share); a coverage row as a `files` row's
_FACTS = operator.itemgetter(*(i for i, f in enumerate(FileSummary._fields) if f not in ("path", "mtime")))
_COVER = operator.itemgetter(*(CoverageRow._fields.index(f) for f in ("side", "key", "flag", "note")))
_SUMMARY, _FINDINGS, _SCOPE, _SIZE = (operator.itemgetter(i) for i in (9, 10, 7, 8))
_ROW_STAT = operator.itemgetter(2, 3, 4, 5, 6)


def folder_row(key: int, rows: list[tuple], names: Any) -> tuple | None:
    """The `dirs` row of a chunk whose files are `rows` (`files` rows, in the order of
    `names`, none with a finding), with the newest mtime_ns: None when it has none."""
    if set(map(_FINDINGS, rows)) != {None} or len(set(map(_SCOPE, rows))) != 1:
        return None
    runs = [[sid, len(list(run))] for sid, run in itertools.groupby(map(_SUMMARY, rows))]
    covers = [None if r[11] is None else r[11:15] for r in rows]
    return _dir_row(key, rows[0][0], rows[0][7], names, list(map(_ROW_STAT, rows)),
                    list(map(_SIZE, rows)), runs, covers)


def _dir_row(key: int, dir_id: int, scope_id: int, names: Any, stats: list[tuple],
             sizes: list[int], runs: list[list], covers: list) -> tuple | None:
    """(newest mtime_ns, the `dirs` row): its detail is the fingerprinted listing and each
    file's size, as bytes (C loops only), deflated (a seventh of the size: names and stats
    of one batch differ little; an index of a million files writes 20 MB, not 75); None when
    a value does not fit."""
    try:
        listing = _listing(names, stats)
        detail = zlib.compress(listing + array.array("q", sizes).tobytes(), 1)
        coverage = None if covers.count(None) == len(covers) else _dumps(covers)
        summaries = _dumps(runs)
    except (OverflowError, TypeError, ValueError):
        return None
    return (max(map(operator.itemgetter(1), stats)),
            (key, dir_id, scope_id, _digest(listing), len(stats), sum(sizes), summaries,
             coverage, detail))


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


_PLAIN = (str, int, float, bool, type(None))
FS = "utf-8"  # os.fsencode's encoding on Linux and macOS; names are stored as its bytes


def _tagged(value: Any) -> Any:
    """Details as JSON that keeps what JSON alone loses: a tuple is {"t": [...]}, a mapping
    {"m": [[key, value], ...]}; a list stays a list. Anything else (an enum, an object) raises."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list:
        return [_tagged(v) for v in value]
    if kind is tuple:
        return {"t": [_tagged(v) for v in value]}
    if isinstance(value, Mapping):
        return {"m": [[_tagged(k), _tagged(v)] for k, v in value.items()]}
    raise TypeError(f"{kind.__name__} in finding details")


def _untagged(value: Any) -> Any:
    if type(value) is list:
        return [_untagged(v) for v in value]
    if type(value) is dict:
        if "t" in value:
            return tuple(_untagged(v) for v in value["t"])
        return {_untagged(k): _untagged(v) for k, v in value["m"]}
    if type(value) not in _PLAIN:
        raise ValueError("not a value")
    return value


def _finding_row(finding: Finding, path: str) -> list:
    if type(finding.severity) is not Severity or (finding.fix is not None
                                                  and type(finding.fix) is not FixKind):
        raise TypeError("finding of an unknown kind")
    return [finding.code, finding.name, int(finding.severity),
            None if finding.path == path else finding.path, finding.message, finding.dataset,
            _tagged(finding.details), None if finding.fix is None else str(finding.fix)]


def _finding(row: list, path: str) -> Finding:
    code, name, severity, where, message, dataset, details, fix = row
    if not all(isinstance(v, str) for v in (code, name, message)) or \
            not all(v is None or isinstance(v, str) for v in (where, dataset)):
        raise ValueError("not a finding")
    found = _untagged(details)
    if type(found) is not dict:
        raise ValueError("not a finding")
    return Finding(code, name, Severity(severity), path if where is None else where, message,
                   dataset, found, None if fix is None else FixKind(fix))


def _tuple(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


def _template(text: str) -> tuple[tuple, tuple]:
    """A stored summary as the fields before and after its mtime (its path goes first)."""
    (dataset, bucket, role, fmt, size, shape, dtype, signature, locations, expected, family,
     group, lacks) = json.loads(text)
    if not all(isinstance(v, str) for v in (role, fmt)) or type(size) is not int or not all(
            v is None or isinstance(v, str) for v in (dataset, bucket, dtype, family, group, lacks)):
        raise ValueError("not a summary")
    return ((dataset, bucket, role, fmt, size),
            (_tuple(shape), dtype, tuple(map(tuple, signature)), tuple(locations),
             _tuple(expected), family, group, lacks))


# -- stamps ------------------------------------------------------------------------------------

@functools.cache
def code_stamp() -> str:
    """The package version and a hash of the source of every module of the package and its
    rule catalogue: any change to a reader or a rule, a new rule included, re-judges every file."""
    import cachedoctor
    import cachedoctor.checks

    return source_digest(__version__, (os.path.dirname(cachedoctor.__file__),
                                       *cachedoctor.checks.__path__))


def source_digest(version: str, tops: Iterable[str]) -> str:
    """A hash of `version` and every .py file under `tops` (names and bytes)."""
    digest = hashlib.sha256(version.encode())
    for top in tops:
        for folder, dirs, names in sorted(os.walk(top)):
            dirs.sort()
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, top).encode())
                try:
                    with open(path, "rb") as source:
                        digest.update(source.read())
                except OSError:
                    digest.update(b"?")
    return digest.hexdigest()[:DIGEST]


# Dataset facts that no file's verdict depends on (the dataset rules read them afresh), and
# that can be big: the images a trainer's metadata lists.
_UNSTAMPED = frozenset({"listed_images", "listing"})


def _canon(value: Any, depth: int = 0) -> str:
    """A text of `value` that is the same in every process (sets and mappings sorted, no
    object addresses)."""
    if depth > 30:
        return "..."
    deeper = depth + 1
    if isinstance(value, Enum) or type(value) in _PLAIN or isinstance(value, bytes):
        return repr(value)
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_canon(v, deeper) for v in value)) + "}"
    if isinstance(value, Mapping):
        return "{" + ",".join(sorted(f"{_canon(k, deeper)}:{_canon(v, deeper)}"
                                     for k, v in value.items())) + "}"
    if isinstance(value, (tuple, list)):
        return type(value).__name__ + "(" + ",".join(_canon(v, deeper) for v in value) + ")"
    name = type(value).__qualname__
    if is_dataclass(value):
        return name + _canon({f.name: getattr(value, f.name) for f in fields(value)
                              if f.name not in _UNSTAMPED}, deeper)
    state = getattr(value, "__dict__", None)
    return name + (_canon(state, deeper) if state is not None else "")


def scope_stamps(options: Any, rules: Iterable[Any], datasets: Mapping[str, Any]
                 ) -> Callable[[Batch], str]:
    """A function giving each batch its scope stamp: the code, the options that shape a
    verdict and the facts of the batch's dataset, bucket and area."""
    base = _canon((code_stamp(), bool(options.deep), sorted(r.code for r in rules),
                   dict(options.settings)))
    facts: dict[str | None, str] = {}
    stamps: dict[tuple, str] = {}

    def stamp(batch: Batch) -> str:
        key = (batch.dataset, batch.bucket, batch.area)
        found = stamps.get(key)
        if found is None:
            if batch.dataset not in facts:
                facts[batch.dataset] = _canon(datasets.get(batch.dataset)) \
                    if batch.dataset is not None else ""
            found = stamps[key] = hashlib.sha256(
                "\0".join((base, facts[batch.dataset], _canon(key))).encode()).hexdigest()[:DIGEST]
        return found

    return stamp


# -- where ------------------------------------------------------------------------------------

def user_dir() -> str:
    """Where indexes of caches that cannot be written go."""
    explicit = os.environ.get("CACHEDOCTOR_STATE_DIR")
    if explicit:
        return os.path.join(explicit, "index")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cachedoctor", "index")


def places(root: str) -> list[str]:
    """The index files a cache root may use, in order of preference."""
    real = os.path.realpath(root)
    key = hashlib.sha256(os.fsencode(real)).hexdigest()[:24]
    return [os.path.join(root, STATE_DIR, NAME), os.path.join(user_dir(), f"{key}.sqlite")]


def _refuse_links(path: str, in_cache: bool) -> None:
    """SQLite follows links, and a rebuild deletes: a cache someone else made could point its
    index, or its .cachedoctor/, at any file."""
    names = (path, path + "-wal", path + "-shm", path + "-journal")
    for link in ((os.path.dirname(path),) if in_cache else ()) + names:
        if os.path.islink(link):
            raise PermissionError(f"{link} is a symlink")


def _refuse_strangers(path: str, in_cache: bool) -> None:
    """An index is a list of verdicts that a rescan takes on trust: one that another user can
    write (theirs, its WAL or shm file or its folder theirs, a file writable by its group or
    a file or folder writable by anyone) could call a hostile file clean. Such an index is
    not used; the user's own place is. (A folder its group can write is fine: a member could
    only replace our files with theirs, which are refused.)"""
    me = os.geteuid()
    folder = (os.path.dirname(path),) if in_cache else ()
    for name in (*folder, path, path + "-wal", path + "-shm"):
        try:
            st = os.stat(name)
        except FileNotFoundError:
            continue
        others = stat.S_IWOTH if name in folder else stat.S_IWOTH | stat.S_IWGRP
        if st.st_uid != me or st.st_mode & others:
            whose = (f"owned by user {st.st_uid}" if st.st_uid != me else
                     "writable by anyone" if st.st_mode & stat.S_IWOTH else "writable by its group")
            raise PermissionError(f"{name} is {whose}: its verdicts are not trusted")


def _create_private(path: str) -> None:
    """The index file, made readable and writable by its owner alone (SQLite gives its WAL and
    shm files the same mode): under a umask of 002, as on many shared machines, SQLite would
    make it writable by the group, whose members could then forge verdicts."""
    # (FileExistsError: another scan made it first; _refuse_strangers judged it, or will)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))


def _connect(path: str, in_cache: bool) -> sqlite3.Connection:
    folder = os.path.dirname(path)
    _refuse_links(path, in_cache)
    _refuse_strangers(path, in_cache)
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o755, exist_ok=True)
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise PermissionError(f"{path}: not writable")
    if not os.access(folder, os.W_OK):  # WAL needs its -wal and -shm files beside it
        raise PermissionError(f"{folder}: not writable")
    _create_private(path)
    db = sqlite3.connect(path, timeout=BUSY_MS / 1000, isolation_level=None,
                         check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {int(BUSY_MS)}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA cache_size = -32768")  # 32 MiB: a rescan's reads and a scan's inserts
        db.executescript(_TABLES)
        found = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if found is None:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (SCHEMA,))
        elif found[0] != SCHEMA:
            raise sqlite3.DatabaseError(f"schema {found[0]!r}, not {SCHEMA!r}")
    except BaseException:
        db.close()
        raise
    return db


def _patient_connect(path: str, in_cache: bool) -> sqlite3.Connection:
    """_connect, retried while another scan holds the lock for up to BUSY_MS: the switch to WAL
    and the first CREATE TABLE of two scans starting at once can report "locked" at once,
    without SQLite's busy handler ever waiting."""
    deadline = time.monotonic() + BUSY_MS / 1000
    while True:
        try:
            return _connect(path, in_cache)
        except sqlite3.Error as exc:
            if not _locked(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def _locked(exc: sqlite3.Error) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


def _remove(path: str) -> None:
    for name in (path, path + "-wal", path + "-shm", path + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def open_db(root: str, rebuild: bool, notices: list[str],
            make: bool = True) -> tuple[sqlite3.Connection | None, str | None]:
    """The index of `root`, at the first of its places that works: a corrupt one is rebuilt,
    a locked one skipped (with a notice each); (None, None) when none can be used. `make`
    False: only a place that holds an index already is used (fix's scan makes none)."""
    problems = []
    for n, path in enumerate(places(root)):
        if not make and not os.path.isfile(path):
            continue
        try:
            if rebuild:
                _refuse_links(path, n == 0)
                _remove(path)
            return _patient_connect(path, n == 0), path
        except sqlite3.Error as exc:
            if _locked(exc):
                notices.append(f"index {path} is locked by another process ({exc}): "
                               "scanning without it")
                return None, None
            try:  # not a database, or not ours: start it afresh
                _remove(path)
                db = _connect(path, n == 0)
            except (sqlite3.Error, OSError) as again:
                problems.append(f"{path}: {again}")
                continue
            notices.append(f"index {path} was unreadable ({exc}): rebuilt")
            return db, path
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
    notices.append("no writable place for the index (" + "; ".join(problems) +
                   "): scanning without it")
    return None, None


# -- --changed-since ---------------------------------------------------------------------------

def since_ns(text: str, db: sqlite3.Connection | None, roots: Iterable[str]) -> int:
    """--changed-since's time in ns: epoch seconds, an ISO time (local time unless it says),
    or the start of a scan this index recorded, or of a repair run of one of `roots` or of the
    folder holding it (a OneTrainer cache keeps its repair state in its cache_dir, above the
    image/ and text/ folders a scan of its config walks, which OneTrainer deletes)."""
    text = text.strip()
    try:
        return int(float(text) * 1e9)
    except (ValueError, OverflowError):  # OverflowError: inf, 1e400, 10**400 seconds
        pass
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        return int(moment.astimezone().timestamp() * 1e9)
    except (ValueError, OverflowError):  # also a time before year 1 once in local time
        pass
    if db is not None:
        try:
            found = db.execute("SELECT started_ns FROM scans WHERE id = ?", (text,)).fetchone()
        except sqlite3.Error:
            found = None
        if found is not None:
            return int(found[0])
    roots = list(roots)
    for root in dict.fromkeys(roots + [os.path.dirname(os.path.abspath(r)) for r in roots]):
        journal = os.path.join(root, STATE_DIR, "journal.sqlite")
        if not os.path.isfile(journal):
            continue
        try:
            con = sqlite3.connect(f"file:{journal}?mode=ro", uri=True, timeout=1)
            try:
                found = con.execute("SELECT started FROM runs WHERE run_id = ?", (text,)).fetchone()
            finally:
                con.close()
        except sqlite3.Error:
            continue
        if found is not None and isinstance(found[0], (int, float)):
            return int(found[0] * 1e9) - 1_000  # (float seconds: a stamp may round up)
    raise SinceError(f"--changed-since {text!r}: not an ISO time or epoch seconds, nor a scan or "
                     "repair run recorded for this cache")


# -- one scan's use of the index ----------------------------------------------------------------

@dataclass
class Reused:
    """A batch's files whose verdicts came from the index (the fields of engine.ChunkResult)."""

    files: int = 0
    bytes: int = 0
    findings: list[Finding] = field(default_factory=list)
    summaries: list[tuple[str, bytes]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    coverage: list[CoverageRow] = field(default_factory=list)
    records: tuple = ()


_SIDE_NAMES = frozenset({INDEX_NAME, INDEX_NAME + "-journal", INDEX_NAME + "-wal",
                         INDEX_NAME + "-shm"})


def recorded_roles(area: str) -> frozenset[str]:
    """The roles of the files recorded in an area: latents, text embeddings, images of an
    image dir (the worker's test per file; Recorder.take then leaves out a diffusion-pipe
    shard or its offsets table, whose verdicts depend on each other)."""
    return _IMAGE_AREA_ROLES if area == "images" else _ROLES


_ROLES = frozenset({LATENT, TEXT})
_IMAGE_AREA_ROLES = _ROLES | {IMAGE}
_SHARD = operator.methodcaller("startswith", "shard_")


def _recordable_name(name: str) -> bool:
    return name not in _SIDE_NAMES and not (name.startswith("shard_") and SHARD_PATTERN.match(name))


_STAT = tuple[int, int, int, int, int]
_KEY = operator.itemgetter(0, 1)
MEMO = 65_536  # decoded texts kept per scan (a cache's files share a few summaries)


def _folder_rows(folder: tuple) -> list[tuple]:
    """A `dirs` row as the `files` rows of its files (raises when it does not decode)."""
    _, dir_id, scope, _, files, _, summaries, coverage, packed = folder
    if type(files) is not int or not 0 < files <= 1 << 20:
        raise ValueError("not a directory record")
    # bounded: a name is at most 255 bytes (NAME_MAX), 3 each when stored as surrogates
    inflate = zlib.decompressobj()
    detail = inflate.decompress(packed, 8 + files * (48 + 3 * 255 + 1))
    if not inflate.eof:
        raise ValueError("not a directory record")
    head = int.from_bytes(detail[:8], "little")
    if len(detail) != 8 + head + 48 * files:
        raise ValueError("not a directory record")
    names = detail[8:8 + head].decode("utf-8", "surrogatepass").split("\0")
    numbers = array.array("q")
    numbers.frombytes(detail[8 + head:])
    stats = [tuple(numbers[5 * i:5 * i + 5]) for i in range(files)]
    sizes = numbers[5 * files:]
    ids: list = []
    for sid, n in json.loads(summaries):
        if (sid is not None and type(sid) is not int) or type(n) is not int or \
                not 0 < n <= files - len(ids):
            raise ValueError("not a run")
        ids.extend([sid] * n)
    cover = json.loads(coverage) if coverage is not None else [None] * len(names)
    if not len(names) == len(stats) == len(sizes) == len(ids) == len(cover) == files:
        raise ValueError("not a directory record")
    rows = []
    for name, st, size, sid, cov in zip(names, stats, sizes, ids, cover, strict=True):
        if type(name) is not str or type(size) is not int or len(st) != 5:
            raise ValueError("not a directory record")
        rows.append((dir_id, name.encode(FS, "surrogateescape"), *st, scope, size, sid, None,
                     *(cov if cov is not None else (None, None, None, None))))
    return rows


class Session:
    """One scan's use of an index (`db`, or none: then only --changed-since applies): splits
    each batch into the files it can reuse and those to read, and records what was read.

    A whole batch of clean recorded files has one `dirs` row: a fingerprint of its names and
    stats and its summaries by run. A rescan stats its files and compares one digest; only a
    batch that changed is looked at file by file (its row's detail, and `files` rows). Only
    files that have a row are stat'ed here (a first scan stats nothing more than a scan
    without the index: a file is recorded with the stat its reader took of it)."""

    def __init__(self, db: sqlite3.Connection | None, where: str | None,
                 stamp: Callable[[Batch], str], exclude: tuple[str, ...], keep_paths: bool,
                 since: int | None, notices: list[str],
                 shard: tuple[int, int] | None = None) -> None:
        self.db, self.where, self.stamp, self.shard = db, where, stamp, shard
        self.shard_text = None if shard is None else f"{shard[0]}/{shard[1]}"
        self.exclude, self.keep_paths, self.since = exclude, keep_paths, since
        self.notices = notices
        self.started = fs_now(where if db is not None else None)
        self.scan_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)
        self.reused = 0
        self.unjudged = 0  # files unchanged since --changed-since: their file findings left out
        self.old: set[str] = set()  # files being read that did not change since --changed-since
        self.rows: list[tuple] = []
        self.folders: list[tuple] = []  # `dirs` rows to write
        self.stale: list[int] = []  # chunks read whole whose `dirs` row is out of date
        self.whole: set[int] = set()  # chunks whose every file went to the readers
        self.listed: dict[int, list[bytes]] = {}  # chunk read whole -> its `files` rows' names
        self.seen: set[int] = set()  # the chunks of this scan
        self.dropped: list[tuple[int, bytes]] = []  # `files` rows a `dirs` row replaces
        self.walked: set[int] = set()  # the directories of this scan
        self.new_texts: list[tuple[int, str | bytes]] = []
        self.dirs: dict[int, str] = {}  # directory ids met (for --changed-since)
        self.texts: dict[int, str] = {}  # id -> text, read back
        self.templates: dict[int, tuple] = {}  # summary id -> decoded (None: undecodable)
        self.found: dict[int, list] = {}  # findings id -> decoded rows
        self.directory: str | None = None  # the directory of the last batch
        self.empty = False  # no row at all (a first scan): nothing to look up
        if db is not None:
            try:
                self.empty = db.execute("SELECT 1 FROM files UNION ALL SELECT 1 FROM dirs "
                                        "LIMIT 1").fetchone() is None
            except sqlite3.Error as exc:
                self._drop(f"cannot read the index {where} ({exc}): reading every file")

    def split(self, batches: Iterable[Batch], on_reused: Callable[[Reused], None]) -> Iterator[Batch]:
        """The files of `batches` to read; `on_reused` gets the verdicts of the others."""
        for batch in batches:
            keep, reused = self._split(batch)
            if reused.files:
                self.reused += reused.files
                on_reused(reused)
            if keep or batch.errors:  # (a batch left whole is still a whole chunk)
                yield batch._replace(names=tuple(keep), part=batch.part
                                     if len(keep) == len(batch.names) else None)

    def _split(self, batch: Batch) -> tuple[list[str], Reused]:
        reused = Reused()
        head = os.path.join(batch.directory, "")
        exclude = self.exclude
        names = [n for n in batch.names if not excluded(head + n, exclude)] if exclude \
            else batch.names
        first = batch.directory != self.directory
        self.directory = batch.directory
        encoded = os.fsencode(batch.directory)
        folder_id = text_id(encoded)
        key = None if batch.part is None else chunk_key(encoded, batch.part, self.shard)
        if key is not None:
            self.seen.add(key)
            self.walked.add(folder_id)
        whole = key is not None and len(names) == len(batch.names)  # (nothing excluded)
        folder = self._folder(key) if whole and names else None
        if folder is not None and self.since is None and self._bulk(folder, batch, names, reused):
            return [], reused
        # (only recordable files; the whole directory's rows at once when it is one batch)
        rows, from_files = self._lookup(batch.directory, names, first and batch.part == "", folder)
        if not rows and self.since is None:  # nothing on record (a first scan): read them all
            if whole:
                self.whole.add(key)
            return list(names), reused
        scope = text_id(self.stamp(batch)) if rows else None
        keep: list[str] = []
        summaries: list[FileSummary] = []
        since, dataset, templates = self.since, batch.dataset or "", self.templates
        stat = os.stat
        for name in names:
            path = head + name
            row = rows.get(name)
            if row is None and since is None:
                keep.append(name)
                continue
            try:
                st = stat(path)
            except OSError:
                keep.append(name)
                continue
            old = False
            if since is not None:
                old = max(st.st_mtime_ns, st.st_ctime_ns) < since
                self.unjudged += old
            if row is not None and row[6] == scope and row[1:6] == (
                    st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns) and \
                    type(row[7]) is int:
                template = templates.get(row[8])
                if template is not None and row[9] is None and row[10] is None:
                    # the common case, inline: a clean file whose summary text is decoded
                    summaries.append(FileSummary(path, *template[0], st.st_mtime, *template[1]))
                    reused.files += 1
                    reused.bytes += row[7]
                    if self.keep_paths:
                        reused.paths.append(path)
                    continue
                verdict = self._verdict(row, path, dataset, st.st_mtime)
                if verdict is not None:
                    found, summary, coverage = verdict
                    reused.files += 1
                    reused.bytes += row[7]
                    if not old:
                        reused.findings.extend(found)
                    if summary is not None:
                        summaries.append(summary)
                    if coverage is not None:
                        reused.coverage.append(coverage)
                    if self.keep_paths:
                        reused.paths.append(path)
                    continue
            keep.append(name)
            if old:
                self.old.add(path)
        if summaries:
            reused.summaries.append(encode(batch.dataset, summaries))
        if whole and len(keep) == len(names):
            self.whole.add(key)
            if from_files:  # (replaced by its `dirs` row, if the chunk is clean)
                self.listed[key] = from_files
        elif whole and not keep and since is None and self.db is not None:
            self._refresh(key, folder_id, names, rows, from_files)
        return keep, reused

    def _refresh(self, key: int, folder_id: int, names: Any, rows: dict[str, tuple],
                 from_files: list[bytes]) -> None:
        """A new `dirs` row for a chunk whose every file was reused one by one (its row was
        out of date, or missing): the next rescan takes the fast path again."""
        ordered = [(folder_id, n.encode(FS, "surrogateescape"), *rows[n][1:]) for n in names]
        if all(r[10] is None and r[3] < self.started - RACY_NS for r in ordered):
            made = folder_row(key, ordered, names)
            if made is not None:
                self._keep(made[1], from_files)

    def _keep(self, folder: tuple, replaced: Iterable[bytes]) -> None:
        """Write a chunk's `dirs` row, and drop the `files` rows of `replaced` names in its
        directory (folder[1]) that it stands for."""
        self.folders.append((*folder, self.shard_text))
        self.dropped.extend((folder[1], n) for n in replaced)

    def _folder(self, key: int) -> tuple | None:
        """The chunk's `dirs` row, if any."""
        if self.db is None or self.empty:
            return None
        try:
            return self.db.execute("SELECT key, dir, scope, fp, files, bytes, summaries, "
                                   "coverage, detail FROM dirs WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error as exc:
            self._drop(f"cannot read the index {self.where} ({exc}): reading every file")
            return None

    def _bulk(self, folder: tuple, batch: Batch, names: Any, reused: Reused) -> bool:
        """Every file of an unchanged batch from its `dirs` row: its stats, one digest
        compared, its summaries made by run. False when anything differs or does not decode."""
        _, _, scope, fp, files, nbytes, runs_text, coverage, _ = folder
        if files != len(names) or type(nbytes) is not int or \
                scope != text_id(self.stamp(batch)):
            return False
        head = os.path.join(batch.directory, "")
        paths = [head + n for n in names]
        try:
            stats = list(map(os.stat, paths))
        except OSError:
            return False
        if fingerprint(names, map(_STAT_FIELDS, stats)) != fp:
            return False
        mtimes = list(map(_MTIME, stats))
        summaries: list[tuple] = []
        rows: list[CoverageRow] = []
        counts: dict[tuple, int] = {}
        try:
            at = 0
            for sid, n in json.loads(runs_text):
                if type(n) is not int or n < 1:
                    raise ValueError("not a run")
                if sid is not None:
                    before, after = self._template(sid)
                    group = _GROUP(FileSummary("", *before, 0.0, *after))
                    counts[group] = counts.get(group, 0) + n
                    summaries.extend([(p, *before, m, *after) for p, m in
                                      zip(paths[at:at + n], mtimes[at:at + n], strict=True)])
                at += n
            if at != files:
                raise ValueError("runs do not cover the directory")
            if coverage is not None:
                cover = json.loads(coverage)
                if len(cover) != files:
                    raise ValueError("not a coverage list")
                dataset = batch.dataset or ""
                for row, path, mtime in zip(cover, paths, mtimes, strict=True):
                    if row is not None:
                        side, key, flag, note = row
                        if type(side) is not int or type(flag) is not int or \
                                not all(v is None or type(v) is str for v in (key, note)):
                            raise ValueError("not a coverage row")
                        rows.append(CoverageRow(dataset, side, key, path, mtime, flag, note))
            if summaries:  # its tally made by run
                reused.summaries.append(encode_counted(batch.dataset, counts, summaries))
        except Exception:  # written by something else: file by file
            return False
        reused.files, reused.bytes, reused.coverage = files, nbytes, rows
        if self.keep_paths:
            reused.paths = paths
        return True

    def _template(self, sid: int) -> tuple:
        template = self.templates.get(sid)
        if template is None:
            if sid not in self.texts:
                self._fetch([sid])
            template = self.templates[sid] = _template(self.texts[sid])
        return template

    def _fetch(self, ids: list[int]) -> None:
        """The texts of `ids` into self.texts."""
        assert self.db is not None
        if len(self.texts) > MEMO:
            self.texts.clear()
            self.templates.clear()
            self.found.clear()
        ids = sorted(ids)
        for start in range(0, len(ids), LOOKUP_CHUNK):
            chunk = ids[start:start + LOOKUP_CHUNK]
            self.texts.update(self.db.execute(
                f"SELECT id, text FROM texts WHERE id IN ({','.join('?' * len(chunk))})", chunk))

    def _verdict(self, row: tuple, path: str, dataset: str, mtime: float
                 ) -> tuple[list[Finding], FileSummary | None, CoverageRow | None] | None:
        """A row's findings, summary and coverage row, or None when it does not decode (written
        by something else: the file is read again)."""
        try:
            summary = coverage = None
            if row[8] is not None:
                template = self.templates.get(row[8])
                if template is None:
                    template = self.templates[row[8]] = _template(self.texts[row[8]])
                summary = FileSummary(path, *template[0], mtime, *template[1])
            found: list[Finding] = []
            if row[9] is not None:
                rows = self.found.get(row[9])
                if rows is None:
                    rows = self.found[row[9]] = json.loads(self.texts[row[9]])
                found = [_finding(f, path) for f in rows]
            if row[10] is not None:
                side, key, flag, note = row[10:14]
                if type(side) is not int or type(flag) is not int:
                    raise ValueError("not a coverage row")
                coverage = CoverageRow(dataset, side, key, path, mtime, flag, note)
        except Exception:
            return None
        return found, summary, coverage

    def _lookup(self, directory: str, names: Any, at_once: bool, folder: tuple | None
                ) -> tuple[dict[str, tuple], list[bytes]]:
        """The rows of `names` in `directory` (and the texts they name, into self.texts): the
        `dirs` row's files, then the `files` rows (newer), the whole directory's at once when
        it is one batch (a big directory comes in several batches: those ask for their
        names); and the names of the `files` rows found."""
        listed: list[bytes] = []
        if self.db is None or not names or self.empty:
            return {}, listed
        found = {}
        if folder is not None:
            with contextlib.suppress(Exception):  # written by something else: files rows only
                found = {row[1].decode(FS, "surrogateescape"): row[1:]
                         for row in _folder_rows(folder)}
        folder_id = text_id(os.fsencode(directory))
        columns = ("SELECT name, size, mtime_ns, ino, dev, ctime_ns, scope, bytes, summary, "
                   "findings, side, key, flag, note FROM files WHERE dir = ?")
        try:
            if at_once:
                wanted = set(names)
                for row in self.db.execute(columns, (folder_id,)):
                    name = row[0].decode(FS, "surrogateescape")
                    if name in wanted:
                        found[name] = row
                        listed.append(row[0])
            else:
                for start in range(0, len(names), LOOKUP_CHUNK):
                    chunk = [n.encode(FS, "surrogateescape")
                             for n in names[start:start + LOOKUP_CHUNK]]
                    marks = ",".join("?" * len(chunk))
                    for row in self.db.execute(f"{columns} AND name IN ({marks})",
                                               (folder_id, *chunk)):
                        found[row[0].decode(FS, "surrogateescape")] = row
                        listed.append(row[0])
            wanted = {i for row in found.values() for i in (row[8], row[9])
                      if i is not None and i not in self.texts}
            if wanted:
                self._fetch(list(wanted))
        except (sqlite3.Error, TypeError, ValueError) as exc:
            self._drop(f"cannot read the index {self.where} ({exc}): reading every file")
            return {}, []
        return found, listed

    def judged(self, findings: list[Finding]) -> list[Finding]:
        """The file findings of a batch just read, without those of files that did not change
        since --changed-since (call it before `store`, which forgets them)."""
        if not self.old:
            return findings
        return [f for f in findings if f.path not in self.old]

    def store(self, records: Records | None) -> None:
        """Record the verdicts of files just read (written in batches of COMMIT_EVERY). A file
        modified less than RACY_NS before the scan began is not recorded."""
        if records is None:
            return
        racy = self.started - RACY_NS
        rows = records.rows
        key = records.key
        whole = key in self.whole
        self.whole.discard(key)
        listed = self.listed.pop(key, None)
        if records.folder is not None:
            newest, folder = records.folder
            if self.db is not None and whole and newest < racy and not self.old:
                self._keep(folder, listed or ())
                self.new_texts.extend(records.texts)
                self._maybe_flush()
                return
            rows = _folder_rows(folder)  # made by our worker: it decodes
        if self.old:
            dirs = {i: os.fsdecode(t) for i, t in records.texts if isinstance(t, bytes)}
            dirs.update(self.dirs)
            self.dirs = dirs
            for row in rows:
                if row[0] in dirs:
                    self.old.discard(os.path.join(dirs[row[0]], os.fsdecode(row[1])))
        if self.db is None:
            return
        if whole:  # read whole, but not clean (or too new): no `dirs` row
            self.stale.append(key)
        self.rows.extend(row for row in rows if row[3] < racy)
        self.new_texts.extend(records.texts)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self.rows) + WHOLE_DIR * len(self.folders) >= COMMIT_EVERY:
            self._flush()

    def _flush(self) -> None:
        rows, self.rows = self.rows, []
        folders, self.folders = self.folders, []
        stale, self.stale = self.stale, []
        dropped, self.dropped = self.dropped, []
        texts, self.new_texts = self.new_texts, []
        if not (rows or folders or stale or dropped) or self.db is None:
            return
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.executemany("INSERT OR IGNORE INTO texts VALUES (?, ?)", texts)
                # a chunk's `dirs` row replaces its files' `files` rows
                self.db.executemany("DELETE FROM files WHERE dir = ? AND name = ?", dropped)
                self.db.executemany("INSERT OR REPLACE INTO dirs VALUES (?,?,?,?,?,?,?,?,?,?)",
                                    folders)
                self.db.executemany("DELETE FROM dirs WHERE key = ?", [(k,) for k in stale])
                rows.sort(key=_KEY)  # in key order: half the b-tree work of the walk's order
                self.db.executemany("INSERT OR REPLACE INTO files VALUES "
                                    "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        except (sqlite3.Error, ValueError, TypeError) as exc:
            self._drop(f"cannot write the index {self.where} ({exc}): this scan's results are "
                       "not recorded")

    def _drop(self, notice: str) -> None:
        self.notices.append(notice)
        if self.db is not None:
            self.db.close()
        self.db = None

    def close(self, files: int, full: bool) -> dict[str, Any]:
        """Write what is left, record the scan (prune rows of files gone after a `full` scan
        when they are many) and say what the index did."""
        self._flush()
        if self.db is not None:
            try:
                self.db.execute("INSERT OR REPLACE INTO scans VALUES (?, ?, ?, ?, ?)",
                                (self.scan_id, self.started, time.time_ns(), files, self.reused))
                if full:
                    self._prune(files)
            except sqlite3.Error as exc:
                self.notices.append(f"cannot write the index {self.where} ({exc})")
            self.db.close()
            self.db = None
        stats: dict[str, Any] = {"read": files - self.reused, "reused": self.reused}
        if self.since is not None:
            stats["judged"] = files - self.unjudged
        if self.where is not None:
            stats["scan"] = self.scan_id
            stats["location"] = self.where
        return stats

    def _prune(self, files: int) -> None:
        """The rows of chunks a directory of this scan no longer has; rows of files and
        directories that are gone, once they outnumber the files a scan saw (an index shared
        by scans of other targets keeps theirs: they still exist), and texts no row names."""
        assert self.db is not None
        if self.walked:
            # (rows of a sharded scan's ranks are theirs: an unsharded scan sees none of them)
            old = [(k,) for k, d in self.db.execute("SELECT key, dir FROM dirs WHERE shard IS NULL")
                   if d in self.walked and k not in self.seen]
            if old:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.executemany("DELETE FROM dirs WHERE key = ?", old)
                self.db.execute("COMMIT")
        (rows,) = self.db.execute("SELECT (SELECT count(*) FROM files) + "
                                  "(SELECT coalesce(sum(files), 0) FROM dirs)").fetchone()
        if rows <= 2 * files + 10_000:
            return
        gone = [(d, n) for d, n, path in self.db.execute(
                    "SELECT f.dir, f.name, t.text FROM files f LEFT JOIN texts t ON t.id = f.dir")
                if not isinstance(path, bytes)
                or not os.path.lexists(os.path.join(os.fsdecode(path), os.fsdecode(n)))]
        folders = list(self.db.execute("SELECT d.key, d.dir, t.text, d.scope, d.summaries "
                                       "FROM dirs d LEFT JOIN texts t ON t.id = d.dir"))
        named: set[int] = set()
        gone_dirs = []
        for key, folder_id, path, scope, runs in folders:
            if not isinstance(path, bytes) or not os.path.isdir(os.fsdecode(path)):
                gone_dirs.append((key,))
                continue
            named.update((folder_id, scope))
            with contextlib.suppress(Exception):
                named.update(sid for sid, _ in json.loads(runs) if type(sid) is int)
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("DELETE FROM files WHERE dir = ? AND name = ?", gone)
        self.db.executemany("DELETE FROM dirs WHERE key = ?", gone_dirs)
        self.db.execute("CREATE TEMP TABLE IF NOT EXISTS named (id INTEGER PRIMARY KEY)")
        self.db.execute("DELETE FROM named")
        self.db.executemany("INSERT OR IGNORE INTO named VALUES (?)", [(i,) for i in named])
        self.db.execute("DELETE FROM texts WHERE id NOT IN (SELECT scope FROM files UNION "
                        "SELECT summary FROM files UNION SELECT findings FROM files UNION "
                        "SELECT dir FROM files UNION SELECT id FROM named)")
        self.db.execute("COMMIT")


def open_session(roots: list[str], options: Any, rules: list[Any], datasets: Mapping[str, Any],
                 notices: list[str]) -> Session | None:
    """This scan's session, or None when it uses no index and no --changed-since. `roots`:
    the directories the scan walks (the index lives in the first one's .cachedoctor/)."""
    use = options.index and roots
    if not use and options.changed_since is None:
        return None
    db, where = open_db(roots[0], options.rebuild_index, notices, options.make_index) \
        if use else (None, None)
    since = None
    if options.changed_since is not None:
        try:
            since = since_ns(options.changed_since, db, roots)
        except SinceError:
            if db is not None:
                db.close()
            raise
    return Session(db, where, scope_stamps(options, rules, datasets), options.exclude,
                   options.keep_paths, since, notices, options.shard)
