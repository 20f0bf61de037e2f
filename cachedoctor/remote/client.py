"""boto3 clients for S3-compatible storage, one per endpoint and process, made on first use.

Where a client gets its settings, first found wins:
- the endpoint: `--endpoint-url`, a SimpleTuner backend's `aws_endpoint_url`, else botocore's
  own (`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, the profile's `endpoint_url`, then AWS);
- credentials: a backend's `aws_access_key_id`/`aws_secret_access_key`, else botocore's chain
  (environment, `AWS_PROFILE` and ~/.aws, container and instance roles);
- the region: a backend's `aws_region_name`, else botocore's (`AWS_REGION`, the profile).

Retries are botocore's "standard" mode (exponential backoff with jitter on throttling, 5xx
and connection errors). The connection pool is sized for the readers' thread pool. A secret
is held only in the Endpoint (which never shows it in its repr) and the client; every message
made from a failure is the service's error code and text, which carry no credentials.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from cachedoctor.layouts.base import TargetError

INSTALL_HINT = "reading S3 needs boto3: pip install 'cachedoctor[s3]'"
THREADS = 48  # requests in flight per process: enough to hide ~5-50 ms of latency per request
MAX_ATTEMPTS = 5


class MissingClient(TargetError):
    """boto3 is not installed: exit 2 with how to install it."""


@dataclass(frozen=True)
class Endpoint:
    """Where a bucket lives and how to sign for it; None leaves a setting to botocore."""

    url: str | None = None
    region: str | None = None
    key_id: str | None = field(default=None, repr=False)
    secret: str | None = field(default=None, repr=False)


_default = Endpoint()
_buckets: dict[str, Endpoint] = {}  # bucket -> its backend's settings (a SimpleTuner config)
_clients: dict[tuple[int, Endpoint], Any] = {}
_lock = threading.Lock()


def set_endpoint_url(url: str | None) -> None:
    """The `--endpoint-url` flag: the endpoint of every bucket a backend does not place."""
    global _default
    _default = Endpoint(url=url or None)


def configure(bucket: str, endpoint: Endpoint) -> None:
    """Settings a trainer config gives for `bucket` (its endpoint, region, keys). The flag's
    endpoint wins over the config's, as a command line does over a config file."""
    _buckets[bucket] = endpoint


def endpoint_for(bucket: str) -> Endpoint:
    own = _buckets.get(bucket, Endpoint())
    url = _default.url or own.url
    return Endpoint(url, own.region, own.key_id, own.secret)


def require_boto3() -> None:
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise MissingClient(INSTALL_HINT) from None


def client(bucket: str) -> Any:
    """The S3 client for `bucket` in this process (a forked worker makes its own: a client's
    connection pool must not cross a fork)."""
    endpoint = endpoint_for(bucket)
    key = (os.getpid(), endpoint)
    found = _clients.get(key)
    if found is not None:
        return found
    require_boto3()
    import boto3
    from botocore.config import Config

    with _lock:
        found = _clients.get(key)
        if found is None:
            config = Config(retries={"mode": "standard", "max_attempts": MAX_ATTEMPTS},
                            max_pool_connections=THREADS + 16, connect_timeout=10, read_timeout=60)
            session = boto3.session.Session()
            found = session.client(
                "s3", endpoint_url=endpoint.url, region_name=endpoint.region,
                aws_access_key_id=endpoint.key_id, aws_secret_access_key=endpoint.secret,
                config=config)
            _clients[key] = found
    return found


def describe(exc: BaseException) -> str:
    """A failure of a request as one line: the service's code and message, or the kind of
    connection failure. Never the request itself (its signature) nor any credential."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        code = str(error.get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        message = str(error.get("Message") or "").strip()
        known = {"NoSuchBucket": "no such bucket", "NoSuchKey": "no such object",
                 "404": "no such object", "AccessDenied": "access denied",
                 "403": "access denied", "PreconditionFailed": "changed since it was listed",
                 "412": "changed since it was listed", "InvalidAccessKeyId": "the access key is not known",
                 "SignatureDoesNotMatch": "the secret key does not match the access key"}
        said = known.get(code)
        if said:
            return f"cannot read: {said} ({code})"
        return f"cannot read: {code}: {message}" if message else f"cannot read: {code}"
    name = type(exc).__name__
    if name in ("IncompleteReadError", "ResponseStreamingError"):
        return "cannot read: the server sent fewer bytes than it promised (a connection cut short?)"
    if name == "FlexibleChecksumError":
        return ("cannot read: the bytes received do not match the object's checksum (cut short "
                "or changed on the way)")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return ("cannot read: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the backend's aws_access_key_id)")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ConnectionClosedError"):
        where = getattr(exc, "kwargs", {}).get("endpoint_url")
        return f"cannot read: cannot reach the endpoint{f' {where}' if where else ''} ({name})"
    return f"cannot read: {name}"


def read_object(url: str, limit: int) -> bytes | None:
    """The whole object at `url` (a trainer's small metadata file), None when there is none;
    an OSError with describe()'s text when it cannot be read or is larger than `limit`."""
    from cachedoctor.remote import split

    bucket, key = split(url)
    try:
        reply = client(bucket).get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
        body = reply["Body"]
        try:
            data = body.read(limit + 1)  # a server that ignores the range sends it all
        finally:
            body.close()
    except MissingClient:
        raise
    except Exception as exc:
        code = str((getattr(exc, "response", None) or {}).get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404"):
            return None
        raise OSError(describe(exc)) from None
    if len(data) > limit:
        raise OSError(f"larger than {limit // 2**20} MiB")
    return data
