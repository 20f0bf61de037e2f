"""Caches on S3-compatible object storage: `s3://bucket/prefix` targets and SimpleTuner `aws`
data backends.

Nothing here imports boto3 at import time: a scan of local paths never needs it. Paths of
objects are URLs (`s3://bucket/key`) everywhere a local scan has an absolute path, so readers,
rules, findings and reporters treat them alike.
"""

from __future__ import annotations

SCHEME = "s3://"


def is_remote(path: str) -> bool:
    """Whether `path` names an object-store location rather than a local file."""
    return isinstance(path, str) and path.startswith(SCHEME)


def split(url: str) -> tuple[str, str]:
    """("bucket", "key/without/leading/slash") of an s3:// URL; the key may be ""."""
    rest = url[len(SCHEME):]
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


def join(bucket: str, key: str) -> str:
    key = key.strip("/")
    return f"{SCHEME}{bucket}/{key}" if key else f"{SCHEME}{bucket}"
