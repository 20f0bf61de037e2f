"""`scan s3://…`: the same findings as the same tree on disk, SimpleTuner `aws` backends with
coverage from the bucket, credentials never shown, and one line when boto3 is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from s3_helpers import KEY_ID, SECRET, Bucket, relative, s3_bucket, s3_server  # noqa: F401 (fixtures)

from cachedoctor.fixtures import BUILDERS
from cachedoctor.fixtures.clean import build as clean

from conftest import by_code, invoke, scan_paths


def defective_tree(root: Path, marker: Path) -> Path:
    """A cache dir with healthy latents and planted defects, as the fixtures make them."""
    tree = root / "latents"
    clean(tree / "clean", n=4)
    clean(tree / "gz", n=2, container="gzip")
    clean(tree / "big", n=1, shape=(16, 160, 160))  # > 256 KiB: read as head and tail ranges
    BUILDERS["CD101"](tree / "torn")
    BUILDERS["CD101"](tree / "torn_gz", how="gzip")  # streamed through ranged GETs
    BUILDERS["CD101"](tree / "torn_st", how="safetensors")
    BUILDERS["CD101"](tree / "torn_big", shape=(16, 160, 160))  # cut, and read by head and tail
    BUILDERS["CD201"](tree / "batch", batch_size=4)
    BUILDERS["CD105"](tree / "hostile", marker=marker)
    (tree / "notes.txt").write_text("not a cache\n")
    return tree


def test_an_s3_prefix_gets_the_findings_of_the_same_tree_on_disk(s3: Bucket, tmp_path: Path) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    tree = defective_tree(tmp_path, marker)
    s3.upload(tree, "runs/latents")
    on_disk = scan_paths(tree)
    remote = scan_paths(s3.url("runs/latents"))
    assert {"CD101", "CD201", "CD105"} <= {f.code for f in on_disk.findings}
    assert len([f for f in on_disk.findings if f.code == "CD101"]) == 4
    assert relative(remote.findings, s3.url("runs/latents")) == relative(on_disk.findings, str(tree))
    assert remote.files == on_disk.files
    pooled = scan_paths(s3.url("runs/latents"), jobs=2)  # worker processes, a client each
    assert relative(pooled.findings, s3.url("runs/latents")) == relative(on_disk.findings, str(tree))
    assert all(f.path.startswith(s3.url("runs/latents/")) for f in remote.findings)
    assert not marker.exists()  # the hostile pickle was read, never run


def test_a_clean_prefix_has_no_findings_and_one_object_is_a_target(s3: Bucket, tmp_path: Path) -> None:
    tree = tmp_path / "ok"
    clean(tree, n=3)
    clean(tree / "gz", n=2, container="gzip")
    keys = s3.upload(tree, "ok")
    assert not scan_paths(s3.url("ok")).findings
    one = scan_paths(s3.url(keys[0]))
    assert one.files == 1 and not one.findings


def test_a_missing_prefix_or_bucket_is_one_line_exit_2(s3: Bucket) -> None:
    result = invoke("scan", s3.url("nothing/here"))
    assert result.exit_code == 2
    assert "no object at or under this prefix" in result.output
    result = invoke("scan", "s3://no-such-bucket-cachedoctor/x")
    assert result.exit_code == 2 and "no such bucket" in result.output.lower()
    assert "Traceback" not in result.output


def _aws_project(root: Path, s3: Bucket, defects: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """A SimpleTuner project whose images and caches live in `s3`'s bucket (data_backend/aws.py:
    instance_data_dir = aws_data_prefix; cache_dir_vae and the text cache_dir are keys there;
    the bucket files list keys), with the backend's own endpoint and keys."""
    from cachedoctor.fixtures.projects import simpletuner

    local = simpletuner.build(root / "local", defects)
    photos = local.root / "datasets" / "photos"
    for name in ("aspect_ratio_bucket_indices_photos.json", "aspect_ratio_bucket_metadata_photos.json"):
        path = photos / name
        path.write_text(path.read_text().replace(f"{local.root}/", ""))  # absolute paths -> keys
    s3.upload(photos, "datasets/photos")
    s3.upload(local.root / "output/models/cache/vae/sdxl/photos", "cache/vae/sdxl/photos")
    s3.upload(local.root / "cache/text/sdxl", "cache/text/sdxl")
    project = root / "remote"
    (project / "config").mkdir(parents=True)
    keys = {"aws_bucket_name": s3.name, "aws_endpoint_url": s3.endpoint,
            "aws_region_name": "us-east-1", "aws_access_key_id": KEY_ID,
            "aws_secret_access_key": SECRET}
    backends = [
        {"id": "photos", "type": "aws", "dataset_type": "image", "aws_data_prefix": "datasets/photos",
         "caption_strategy": "textfile", "resolution": 128, "resolution_type": "pixel_area",
         "cache_dir_vae": "cache/vae/{model_family}/{id}", **keys},
        {"id": "text-embeds", "type": "aws", "dataset_type": "text_embeds", "default": True,
         "aws_data_prefix": "", "cache_dir": "cache/text/{model_family}", **keys},
    ]
    (project / "config" / "multidatabackend.json").write_text(json.dumps(backends, indent=2))
    (project / "config" / "config.json").write_text(json.dumps({
        "--model_family": "sdxl", "--output_dir": "output/models",
        "--data_backend_config": "config/multidatabackend.json"}))
    return project / "config" / "config.json", keys


def test_simpletuner_aws_backends_are_scanned_from_the_bucket(s3: Bucket, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config, _ = _aws_project(tmp_path, s3)
    # the backend's keys and endpoint sign the requests, not the environment's
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    report = scan_paths(config)
    assert report.files > 20
    assert not report.findings, report.findings
    latent = next(k for k in s3.keys("cache/vae/sdxl/photos/") if k.endswith(".pt"))
    s3.client.delete_object(Bucket=s3.name, Key=latent)  # an image without its latent
    missing = by_code(scan_paths(config), "CD404")
    assert len(missing) == 1
    assert missing[0].path.startswith(f"s3://{s3.name}/datasets/photos/img_")
    assert latent.rpartition("/")[2] in missing[0].message


def test_credentials_are_never_printed(s3: Bucket, tmp_path: Path) -> None:
    config, _ = _aws_project(tmp_path, s3)
    s3.client.put_object(Bucket=s3.name, Key="cache/vae/sdxl/photos/" + "0" * 64 + ".pt", Body=b"PK\x03\x04torn")
    for fmt in ("text", "json", "sarif", "junit", "github"):
        result = invoke("scan", str(config), "--format", fmt, "--fail-on", "never")
        assert result.exit_code == 0, result.output
        assert SECRET not in result.output and KEY_ID not in result.output
        assert "0" * 64 in result.output  # the report did show the object it judged
    bad = json.loads(config.with_name("multidatabackend.json").read_text())
    for backend in bad:
        backend["aws_bucket_name"] = "no-such-bucket-cachedoctor"
    config.with_name("multidatabackend.json").write_text(json.dumps(bad))
    result = invoke("scan", str(config), "--format", "json", "--fail-on", "never")
    assert SECRET not in result.output and KEY_ID not in result.output
    assert "no such bucket" in result.output.lower()


def test_no_credentials_is_one_line_exit_2(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = invoke("scan", s3.url("anything"))
    assert result.exit_code == 2 and "no AWS credentials found" in result.output
    assert "Traceback" not in result.output


def test_the_endpoint_flag_reaches_the_server(s3: Bucket, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    clean(tmp_path / "c", n=2)
    s3.upload(tmp_path / "c", "c")
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # botocore would now ask AWS itself
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # a closed port, overridden
    result = invoke("scan", s3.url("c"), "--endpoint-url", s3.endpoint)
    assert result.exit_code == 0, result.output


def test_without_boto3_an_s3_target_is_one_line_exit_2() -> None:
    code = ("import sys; sys.modules['boto3'] = None\n"
            "from cachedoctor.cli import main\n"
            "sys.argv = ['cachedoctor', 'scan', 's3://some-bucket/prefix']\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'cachedoctor[s3]'" in lines[0], done.stderr


def test_a_local_scan_never_imports_boto3(tmp_path: Path) -> None:
    clean(tmp_path / "c", n=2)
    code = ("import sys\nfrom cachedoctor.engine import scan\n"
            f"scan([{str(tmp_path / 'c')!r}])\n"
            "print('boto3' in sys.modules, 'botocore' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_a_diffusion_pipe_cache_is_said_to_be_unchecked_not_misjudged(s3: Bucket, tmp_path: Path) -> None:
    from cachedoctor.fixtures.projects import diffusion_pipe

    cache = diffusion_pipe.cache_of(diffusion_pipe.build(tmp_path / "p"))
    assert not scan_paths(cache).findings
    s3.upload(cache, "dp")
    findings = scan_paths(s3.url("dp")).findings
    assert findings and {f.code for f in findings} == {"CD001"}
    assert all("not checked on S3" in f.message for f in findings)
    names = {f.path.rpartition("/")[2] for f in findings}
    assert "metadata.db" in names and all(n == "metadata.db" or n.startswith("shard_") for n in names)


def test_throttled_requests_are_retried_with_backoff(s3: Bucket, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request's first try is answered 503 SlowDown (S3's throttling) by a proxy of the
    moto app: botocore's standard retry mode tries again, and the scan sees every object."""
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from s3_helpers import free_port
    from werkzeug.serving import make_server

    clean(tmp_path / "c", n=3)
    BUILDERS["CD101"](tmp_path / "c" / "torn")
    s3.upload(tmp_path / "c", "c")
    app = DomainDispatcherApplication(create_backend_app)  # a second app: share the bucket's data
    seen: set[str] = set()
    throttled = []

    def flaky(environ, start_response):
        request = f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO')}?{environ.get('QUERY_STRING')}"
        if request not in seen:
            seen.add(request)
            throttled.append(request)
            start_response("503 Slow Down", [("Content-Type", "application/xml")])
            return [b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"]
        return app(environ, start_response)

    port = free_port()
    server = make_server("127.0.0.1", port, flaky, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        report = scan_paths(s3.url("c"))
    finally:
        server.shutdown()
        thread.join()
    assert report.files == 4 and [f.code for f in report.findings] == ["CD101"]
    assert any(r.startswith("GET") for r in throttled) and len(throttled) >= 5
