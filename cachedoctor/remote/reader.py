"""Read S3 objects through the readers' byte Source: ranged GETs of only the bytes they need.

While a batch of objects is read, a thread pool fetches the windows of the objects after the
one being parsed (THREADS requests in flight, at most AHEAD objects ahead: memory stays
bounded). An object up to WHOLE_OBJECT bytes takes one GET. A bigger one takes two ranged GETs,
its head and its tail (where torch keeps data.pkl and the zip central directory, and
safetensors its header). Any other range a reader asks for is one more ranged GET (--deep reads every
tensor's bytes that way). A gzip-compressed cache (SimpleTuner `compress_cache`) has its
central directory inside the compressed stream: it is streamed, 1 MiB per GET, and inflated
under the scan's 64 MiB cap. Every GET carries `If-Match: <ETag from the listing>`, so an
object rewritten during the scan is reported as changed, never read half old, half new.
Images are never fetched: the listing's size and LastModified are all coverage needs.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from cachedoctor.formats import UNREADABLE, read_source
from cachedoctor.formats.meta import EMPTY, IMAGE, UNKNOWN, FileMeta
from cachedoctor.formats.shard_blobs import INDEX_NAME, SHARD_PATTERN
from cachedoctor.formats.source import Window, windowed_pread
from cachedoctor.inventory import IMAGE as IMAGE_ROLE
from cachedoctor.inventory import LATENT, TEXT, Batch, Entry
from cachedoctor.remote import client as clients
from cachedoctor.remote import split
from cachedoctor.remote.listing import posix_time

WHOLE_OBJECT = 256 * 1024  # one request either way; below this, the bytes cost less than a second request
WINDOW = 64 * 1024  # head and tail of a bigger object
# diffusion-pipe's offsets table is SQLite, which reads a file: said, never misjudged as blobs
SHARDED = ("cannot read: a diffusion-pipe sharded cache (metadata.db and shard_<n>.bin) is not "
           "checked on S3 in this version: copy the folder to disk and scan it there")


class RemoteError(OSError):
    """A request failed (after botocore's retries); its text is clients.describe()'s."""


class Fetched(NamedTuple):
    size: int
    mtime: float
    etag: str
    windows: tuple[Window, ...] = ()
    error: str | None = None


class S3Source:
    """An object's bytes: the windows fetched with its batch, any other range on request."""

    def __init__(self, url: str, fetched: Fetched) -> None:
        self.url = url
        self.size = fetched.size
        self.mtime = fetched.mtime
        self.etag = fetched.etag
        self.windows = fetched.windows
        whole = len(self.windows) == 1 and self.windows[0][0] == 0 and \
            len(self.windows[0][1]) == self.size
        self.buffer: bytes | None = self.windows[0][1] if whole else None

    def pread(self, offset: int, n: int) -> bytes:
        return windowed_pread(self, offset, n, self._get)

    def _get(self, offset: int, n: int) -> bytes:
        return get_range(self.url, self.etag, offset, n)


def get_range(url: str, etag: str, offset: int, n: int) -> bytes:
    """`n` bytes at `offset` of the object, as it was when listed (If-Match)."""
    bucket, key = split(url)
    extra = {"IfMatch": etag} if etag else {}
    try:
        reply = clients.client(bucket).get_object(
            Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + n - 1}", **extra)
        body = reply["Body"]
        try:
            data = body.read(n)  # never more: a server may send the whole object instead
            body.read(1)  # the end of a body that kept to the range: botocore checks its length and checksum
        finally:
            body.close()
    except clients.MissingClient:
        raise
    except Exception as exc:
        raise RemoteError(clients.describe(exc)) from None
    if offset and not str(reply.get("ContentRange") or "").startswith(f"bytes {offset}-"):
        # a 200 with the whole object: its first bytes are no window at `offset`
        raise RemoteError("cannot read: the server ignores ranged requests (it sent the object "
                          "from its start): not checked")
    span = re.match(r"bytes (\d+)-(\d+)/", str(reply.get("ContentRange") or ""))
    promised = min(n, int(span[2]) - int(span[1]) + 1) if span else None
    if promised is not None and len(data) < promised:  # a body cut short, but ended cleanly
        raise RemoteError(f"cannot read: the server sent {len(data):,} of the {promised:,} bytes "
                          "it promised: not checked")
    return data


def wanted(size: int) -> tuple[tuple[int, int], ...]:
    """The (offset, length) windows fetched up front for an object of `size` bytes."""
    if size <= 0:
        return ()
    if size <= WHOLE_OBJECT:
        return ((0, size),)
    return ((0, WINDOW), (size - WINDOW, WINDOW))


def needs_bytes(entry: Entry) -> bool:
    """Whether the readers look into this object (images and the trainer's other files in an
    image prefix are judged by the listing alone, as they are by a stat on disk)."""
    return entry.role != IMAGE_ROLE and (entry.area != "images" or entry.role in (LATENT, TEXT))


# The batch being checked in this thread (engine.check_batch opens it before reading and
# closes it after): its objects' listing facts, and their windows fetched ahead of the reader.
_local = threading.local()
_pools: dict[int, ThreadPoolExecutor] = {}  # one per process (a forked worker makes its own)
AHEAD = 2 * clients.THREADS  # objects fetched ahead of the one being read: bounds memory too


def _pool() -> ThreadPoolExecutor:
    pool = _pools.get(os.getpid())
    if pool is None:
        pool = _pools[os.getpid()] = ThreadPoolExecutor(clients.THREADS, "s3-read")
    return pool


class _Ahead:
    """The objects of one batch in the order they will be read, each fetched (THREADS at a
    time) while the ones before it are parsed, at most AHEAD objects ahead of the reader."""

    def __init__(self, found: dict[str, Fetched], order: list[str]) -> None:
        self.found, self.order = found, order
        self.position = {url: i for i, url in enumerate(order)}
        self.futures: dict[str, Future] = {}
        self.submitted = 0

    def take(self, url: str) -> Fetched | None:
        at = self.position.get(url)
        if at is not None and url in self.found:
            while self.submitted < min(len(self.order), at + AHEAD):
                ahead = self.order[self.submitted]
                if ahead in self.found:  # (not taken already, out of order)
                    try:
                        self.futures[ahead] = _pool().submit(_windows, ahead, self.found[ahead])
                    except RuntimeError:  # no thread to be had: this object is fetched in line
                        break
                self.submitted += 1
        fetched = self.found.pop(url, None)  # read once: its bytes go with its FileMeta
        if fetched is None or at is None:
            return fetched
        future = self.futures.pop(url, None)
        return future.result() if future is not None else _windows(url, fetched)

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()


def _windows(url: str, fetched: Fetched) -> Fetched:
    try:
        return fetched._replace(windows=tuple(
            (at, get_range(url, fetched.etag, at, n)) for at, n in wanted(fetched.size)))
    except RemoteError as exc:
        return fetched._replace(error=str(exc))


def prefetch(batch: Batch, entries: Iterable[Entry]) -> None:
    """Start reading `batch`: the objects the readers will look into are fetched ahead of
    read_entry, in `entries`' order, until forget()."""
    stats = batch.stats or {}
    found: dict[str, Fetched] = {}
    order: list[str] = []
    sharded = INDEX_NAME in stats and any(SHARD_PATTERN.match(n) for n in stats)
    for entry in entries:
        name = entry.path.rpartition("/")[2]
        size, mtime, etag = stats.get(name, (0, 0.0, ""))
        found[entry.path] = Fetched(size, mtime, etag)
        if sharded and (SHARD_PATTERN.match(name) or name.startswith(INDEX_NAME)):
            found[entry.path] = Fetched(size, mtime, etag, (), SHARDED)
        elif entry.error is None and needs_bytes(entry) and size > 0:
            order.append(entry.path)
    _local.batch = _Ahead(found, order)


def forget() -> None:
    batch = getattr(_local, "batch", None)
    if batch is not None:
        batch.close()
    _local.batch = None


def read_entry(entry: Entry, deep: bool) -> FileMeta:
    """The FileMeta of one object, from what prefetch() fetched (and more ranges on request)."""
    batch = getattr(_local, "batch", None)
    fetched = batch.take(entry.path) if batch is not None else None
    if fetched is None:  # not in the batch being read (a caller outside one): fetch it now
        fetched = _fetch_one(entry)
    if fetched.error:
        return FileMeta(entry.path, fetched.size, UNREADABLE, errors=(fetched.error,),
                        mtime=fetched.mtime)
    if not needs_bytes(entry):
        fmt = IMAGE if entry.role == IMAGE_ROLE else (EMPTY if fetched.size == 0 else UNKNOWN)
        return FileMeta(entry.path, fetched.size, fmt, mtime=fetched.mtime)
    src = S3Source(entry.path, fetched)
    if not src.windows:
        src.windows = ((0, b""),)
    try:
        meta = read_source(src, entry.path, deep=deep)
    except OSError as exc:
        meta = FileMeta(entry.path, src.size, UNREADABLE, errors=(str(exc),))
    meta.mtime = fetched.mtime
    return meta


def _fetch_one(entry: Entry) -> Fetched:
    bucket, key = split(entry.path)
    try:
        head = clients.client(bucket).head_object(Bucket=bucket, Key=key)
    except clients.MissingClient:
        raise
    except Exception as exc:
        return Fetched(0, 0.0, "", (), clients.describe(exc))
    fetched = Fetched(int(head.get("ContentLength", 0)), posix_time(head.get("LastModified")),
                      str(head.get("ETag", "")))
    if not needs_bytes(entry):
        return fetched
    try:
        windows = tuple((at, get_range(entry.path, fetched.etag, at, n)) for at, n in wanted(fetched.size))
    except RemoteError as exc:
        return fetched._replace(error=str(exc))
    return fetched._replace(windows=windows)
