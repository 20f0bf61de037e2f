"""List a bucket prefix as the local walk lists a directory tree: Batches of names per
"directory" (the key up to its last slash), each name with its size, LastModified and ETag in
place of a stat.

ListObjectsV2 pages of 1,000 keys, in key order; a directory's batch leaves as soon as it holds
`size` names, so a prefix of a million objects is never held whole. Keys under `.cachedoctor/`
(our own journal and quarantine), folder markers (keys ending in `/`) and keys under a prefix
walked as a root of its own are skipped. A failure to list is a Batch error row, as an
unreadable directory is on disk.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator

from cachedoctor.inventory import STATE_DIR, Batch
from cachedoctor.remote import client as clients
from cachedoctor.remote import join, split

ObjectStat = tuple[int, float, str]  # (size, mtime as a POSIX time, ETag with its quotes)


def check_target(url: str) -> str | None:
    """Why `url` cannot be scanned (no such bucket, nothing under the prefix, no credentials),
    or None: one small listing request."""
    bucket, key = split(url)
    if not bucket:
        return f"{url}: expected s3://bucket/prefix"
    try:
        s3 = clients.client(bucket)
        page = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    except clients.MissingClient:
        raise
    except Exception as exc:
        return f"{url}: {clients.describe(exc).removeprefix('cannot read: ')}"
    if not page.get("KeyCount") and key:
        return f"{url}: no object at or under this prefix"
    return None


def batches(url: str, *, dataset: str | None = None, area: str = "cache", size: int = 256,
            shard: tuple[int, int] | None = None, recursive: bool = True,
            prune: tuple[str, ...] = ()) -> Iterator[Batch]:
    """The objects under `url` (or the object `url` names) in batches of at most `size` names
    per directory; `prune`: URLs of other roots, whose objects are left to their own walk."""
    bucket, prefix = split(url)
    root = join(bucket, prefix)
    pending: dict[str, tuple[list[str], dict[str, ObjectStat]]] = {}
    try:
        s3 = clients.client(bucket)
        pages = _pages(s3, bucket, f"{prefix}/" if prefix else "", recursive)
        skip = tuple(os.path.join(p, "") for p in prune if p != root and p.startswith(root + "/"))
        listed = 0
        for page in pages:
            for item in page.get("Contents", ()):
                key = item["Key"]
                if key.endswith("/") or f"/{STATE_DIR}/" in f"/{key}":
                    continue
                if key.startswith("/"):  # s3://bucket//x.pt: URLs (and split()) name `x.pt`
                    if shard is None or shard[0] == 0:
                        yield Batch(root, (), dataset, None, area, ((
                            f"s3://{bucket}/{key}", "cannot read: its key starts with '/', which "
                            "s3:// URLs read as the key without it: not checked"),))
                    continue
                path = join(bucket, key)
                if skip and path.startswith(skip):
                    continue
                listed += 1
                directory, _, name = path.rpartition("/")
                if shard is not None and not _mine(shard, directory, root)(name):
                    continue
                names, stats = pending.setdefault(directory, ([], {}))
                names.append(name)
                stats[name] = (int(item.get("Size", 0)), posix_time(item.get("LastModified")),
                               str(item.get("ETag", "")))
                if len(names) >= size:
                    del pending[directory]
                    yield _batch(directory, root, names, stats, dataset, area)
        if listed == 0 and prefix:
            yield from _single(s3, bucket, prefix, dataset, area, shard)
    except clients.MissingClient:
        raise
    except Exception as exc:  # the listing failed part-way: what it listed is still checked
        if shard is None or shard[0] == 0:  # sharded: rank 0 reports it, once
            why = str(exc) if isinstance(exc, RepeatedPage) else clients.describe(exc)
            yield Batch(root, (), dataset, None, area, ((root, why),))
    for directory, (names, stats) in pending.items():
        yield _batch(directory, root, names, stats, dataset, area)


class RepeatedPage(Exception):
    """The server sent a continuation token it sent before: its listing would never end."""

    def __str__(self) -> str:
        return ("cannot read: the listing repeats a page (a continuation token came back twice): "
                "listed up to there")


def _pages(s3, bucket: str, prefix: str, recursive: bool) -> Iterator[dict]:
    """ListObjectsV2 pages. botocore's paginator stops a token repeated at once, not a circle
    of them (A, B, A, ...): a server that hands one out again is stopped here, at its second
    time round."""
    seen: set[str] = set()
    token = None
    while True:
        page = s3.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1000,
                                  **({} if recursive else {"Delimiter": "/"}),
                                  **({"ContinuationToken": token} if token else {}))
        yield page
        token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        if not token:
            return
        if token in seen:
            raise RepeatedPage
        seen.add(token)


def _single(s3, bucket: str, key: str, dataset: str | None, area: str,
            shard: tuple[int, int] | None) -> Iterator[Batch]:
    """The object `key` itself, when the URL names one object rather than a prefix."""
    url = join(bucket, key)
    directory, _, name = url.rpartition("/")
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        yield Batch(directory, (), dataset, None, area, ((url, clients.describe(exc)),))
        return
    if shard is None or shard[0] == 0:
        stats = {name: (int(head.get("ContentLength", 0)), posix_time(head.get("LastModified")),
                        str(head.get("ETag", "")))}
        yield Batch(directory, (name,), dataset, None, area, (), stats)


def _batch(directory: str, root: str, names: list[str], stats: dict[str, ObjectStat],
           dataset: str | None, area: str) -> Batch:
    bucket = None if directory == root else directory[len(root) + 1:]
    return Batch(directory, tuple(names), dataset, bucket, area, (), stats)


def _mine(shard: tuple[int, int], directory: str, root: str) -> Callable[[str], bool]:
    """The local walk's split (inventory._mine): a CRC-32 of the path under the root."""
    rank, world = shard
    under = directory[len(root) + 1:] if directory != root else ""
    start = zlib.crc32(os.fsencode(under) + b"/" if under else b"")
    return lambda name: zlib.crc32(os.fsencode(name), start) % world == rank


def posix_time(value) -> float:
    try:
        return float(value.timestamp())
    except (AttributeError, TypeError, ValueError, OverflowError):
        return 0.0
