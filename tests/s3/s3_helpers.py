"""A real S3 API on loopback for the tests: moto's server mode, started once per session on a
free port of 127.0.0.1, with fake credentials; every test gets a bucket of its own, emptied and
removed after it. Nothing leaves the machine."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SECRET = "wJalrXUtnFEMI-never-print-this-K7MDENG"  # the fake secret key every test signs with
KEY_ID = "AKIACACHEDOCTORTEST"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Bucket:
    name: str
    endpoint: str
    client: object

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.name}/{prefix}".rstrip("/")

    def upload(self, tree: Path, prefix: str) -> list[str]:
        """Every file under `tree` as objects under `prefix`; their keys."""
        keys = []
        for path in sorted(p for p in tree.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(tree).as_posix()}".lstrip("/")
            self.client.put_object(Bucket=self.name, Key=key, Body=path.read_bytes())
            keys.append(key)
        return keys

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", ())]

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def etag(self, key: str) -> str:
        return self.client.head_object(Bucket=self.name, Key=key)["ETag"]


@pytest.fixture(scope="session", name="s3_endpoint")
def s3_server() -> Iterator[str]:
    """The moto server of the session, started on first use."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        moto.stop()


@pytest.fixture(name="s3")
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Bucket]:
    """A bucket of the test's own, and the environment pointed at the server with fake keys
    (a test module imports s3_bucket and s3_server to use it)."""
    import boto3

    endpoint = s3_endpoint

    from cachedoctor.remote import client as clients

    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask 169.254.169.254 for keys
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setattr(clients, "_default", clients.Endpoint())
    monkeypatch.setattr(clients, "_buckets", {})
    monkeypatch.setattr(clients, "_clients", {})
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    name = f"cd-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    try:
        yield Bucket(name, endpoint, s3)
    finally:
        for page in s3.get_paginator("list_object_versions").paginate(Bucket=name):
            for item in [*page.get("Versions", ()), *page.get("DeleteMarkers", ())]:
                s3.delete_object(Bucket=name, Key=item["Key"], VersionId=item["VersionId"])
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            for item in page.get("Contents", ()):
                s3.delete_object(Bucket=name, Key=item["Key"])
        s3.delete_bucket(Bucket=name)


def relative(findings, prefix: str) -> set[tuple[str, str, str]]:
    """(code, path under `prefix`, message with `prefix` taken out) of each finding."""
    prefix = prefix.rstrip("/") + "/"
    return {(f.code, f.path.replace(prefix, ""), f.message.replace(prefix, "")) for f in findings}

