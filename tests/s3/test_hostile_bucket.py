"""A bucket is written by others: a journal mirror forged to steer `undo` out of the prefix or
the quarantine, keys made to resolve elsewhere, a server whose listing never ends. Each attack
is built by its real mechanism against moto's S3 server (or a proxy in front of it)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from s3_helpers import Bucket, free_port, s3_bucket, s3_server  # noqa: F401 (fixtures)

from cachedoctor.engine import scan
from cachedoctor.fixtures import BUILDERS
from cachedoctor.fixtures.clean import build as clean
from cachedoctor.options import ScanOptions
from cachedoctor.repair import remote
from cachedoctor.repair.journal import CONFLICT, DONE

from conftest import invoke, scan_paths

PREFIX = "cache/vae"


def _victims(s3: Bucket) -> dict[str, bytes]:
    """Objects a forged mirror must never touch: outside the prefix, and beside it."""
    victims = {"precious/model.safetensors": b"weights of someone else",
               "cache/vae-old/keep.pt": b"a sibling prefix's entry",
               f"{PREFIX}/kept/entry.pt": b"an entry of the cache itself"}
    for key, body in victims.items():
        s3.client.put_object(Bucket=s3.name, Key=key, Body=body)
    return victims


def _forge(s3: Bucket, run_id: str, body: object | bytes) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    s3.client.put_object(Bucket=s3.name, Key=f"{PREFIX}/.cachedoctor/journal/{run_id}.json", Body=raw)


def _row(s3: Bucket, obj: str, quarantine: str, n: int = 0) -> dict:
    return {"seq": n, "action": "quarantine", "object": obj, "quarantine": quarantine,
            "codes": ["CD101"], "size": 1, "etag": "\"x\"", "state": DONE, "error": None}


def _undo(s3: Bucket, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(tmp_path / "a-machine-without-the-journal"))
    return invoke("undo", run_id, "--cache", s3.url(PREFIX))


def _objects(s3: Bucket) -> dict[str, bytes]:
    return {k: s3.get(k) for k in s3.keys("") if not k.startswith(f"{PREFIX}/.cachedoctor/journal/")}


def test_a_forged_mirror_never_moves_an_object_from_outside_the_quarantine(
        s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror's `quarantine` naming any object: undo would copy it into the cache, then
    delete it where it was (the copy back removes the quarantine copy)."""
    victims = _victims(s3)
    base = s3.url(PREFIX)
    _forge(s3, "20250101T000000Z-dead", {"run_id": "x", "actions": [
        _row(s3, f"{base}/stolen.safetensors", s3.url("precious/model.safetensors"), 0),
        _row(s3, f"{base}/sibling.pt", s3.url("cache/vae-old/keep.pt"), 1),
        _row(s3, f"{base}/own.pt", s3.url(f"{PREFIX}/kept/entry.pt"), 2)]})

    result = _undo(s3, "20250101T000000Z-dead", tmp_path, monkeypatch)

    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "0 object(s) restored, 3 left alone" in result.output
    assert "names a quarantine copy other than" in result.output
    assert _objects(s3) == victims


@pytest.mark.parametrize("obj", [
    "s3://{bucket}/precious/new.pt",  # outside the prefix
    "s3://{bucket}/cache/vae-old/new.pt",  # a sibling prefix that starts like it
    "s3://another-bucket/cache/vae/x.pt",  # another bucket
    "s3://{bucket}/cache/vae/a/../../../precious/new.pt",  # resolved by some servers
    "s3://{bucket}/cache/vae/./x.pt",
    "s3://{bucket}/cache/vae/.cachedoctor/journal/other.json",  # our own state
    "s3://{bucket}/cache/vae/" + "k" * 1100,  # longer than any S3 key
])
def test_a_forged_mirror_never_restores_to_a_key_outside_the_cache(
        s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, obj: str) -> None:
    victims = _victims(s3)
    obj = obj.format(bucket=s3.name)
    run_id = "20250101T000000Z-beef"
    rel = obj.split("/", 3)[3][len(PREFIX) + 1:] if obj.startswith(s3.url(PREFIX) + "/") else "x"
    planted = f"{PREFIX}/.cachedoctor/quarantine/{run_id}/{rel}"
    if len(planted) <= 1024:  # the copy the mirror says it made, where a real run would have
        s3.client.put_object(Bucket=s3.name, Key=planted, Body=b"planted by the forger")
        victims[planted] = b"planted by the forger"
    _forge(s3, run_id, {"actions": [_row(s3, obj, s3.url(planted))]})

    result = _undo(s3, run_id, tmp_path, monkeypatch)

    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "0 object(s) restored, 1 left alone" in result.output
    assert _objects(s3) == victims


@pytest.mark.parametrize("body", [
    b"[]", b"null", b"{\"actions\": 7}", b"not json at all",
    b"[" * 100_000 + b"]" * 100_000,  # nested past Python's recursion limit
    b"\xff\xfe\x00garbage",
])
def test_a_mirror_that_is_no_journal_is_one_line_and_changes_nothing(
        s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: bytes) -> None:
    victims = _victims(s3)
    _forge(s3, "20250101T000000Z-f00d", body)

    result = _undo(s3, "20250101T000000Z-f00d", tmp_path, monkeypatch)

    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"cachedoctor: error: {s3.url(PREFIX)}/.cachedoctor/journal/20250101T000000Z-f00d.json is "
        "no journal mirror cachedoctor writes: nothing undone"]
    assert _objects(s3) == victims


def test_rows_of_the_wrong_types_are_left_alone_and_the_good_ones_undone(
        s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run's mirror with rows someone garbled: the rows that still hold are undone."""
    tree = tmp_path / "tree"
    clean(tree / "ok", n=2)
    BUILDERS["CD101"](tree / "torn")
    BUILDERS["CD101"](tree / "torn2", how="safetensors")
    s3.upload(tree, PREFIX)
    before = {k: s3.get(k) for k in s3.keys(PREFIX)}
    url = s3.url(PREFIX)
    done = remote.apply(remote.build_remote_plan(scan([url], ScanOptions(jobs=1)), (url,)))
    assert [state for _, state, _ in done.outcomes] == [DONE, DONE]
    key = f"{PREFIX}/.cachedoctor/journal/{done.run_id}.json"
    mirror = json.loads(s3.get(key))
    good = mirror["actions"][0]
    mirror["actions"][1:] = [
        {**mirror["actions"][1], "size": "huge"}, {**good, "seq": None}, {**good, "object": 7},
        {**good, "size": True}, {**good, "size": -1}, "a string", None, [1, 2]]
    s3.client.put_object(Bucket=s3.name, Key=key, Body=json.dumps(mirror).encode())

    result = _undo(s3, done.run_id, tmp_path, monkeypatch)

    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "1 object(s) restored, 5 left alone" in result.output
    assert s3.get(good["object"].split("/", 3)[3]) == before[good["object"].split("/", 3)[3]]


@pytest.mark.parametrize("run_id", ["../x", "../../precious/model", "a/b", "", ".hidden", "x\ny",
                                    "r" * 300])
def test_undo_of_a_run_id_that_is_no_name_of_ours_is_one_line(
        s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_id: str) -> None:
    victims = _victims(s3)
    s3.client.put_object(Bucket=s3.name, Key="cache/x.json",  # what `vae/.cachedoctor/journal/../../../x` names
                         Body=json.dumps({"actions": [_row(s3, s3.url(f"{PREFIX}/new.pt"),
                                                           s3.url("precious/model.safetensors"))]}))
    victims["cache/x.json"] = s3.get("cache/x.json")

    result = _undo(s3, run_id, tmp_path, monkeypatch)

    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "is no run id cachedoctor writes" in lines[0], result.output
    assert _objects(s3) == victims


def test_fix_leaves_a_key_with_dot_parts_alone(s3: Bucket, tmp_path: Path) -> None:
    """`cache/vae/a/../../../precious/x.pt` is one literal key to S3, but a proxy or server that
    resolves dot segments would copy and delete `precious/x.pt`: the plan leaves it out."""
    tree = tmp_path / "tree"
    BUILDERS["CD101"](tree / "torn")
    [torn] = [p for p in tree.rglob("*") if p.is_file()]
    key = f"{PREFIX}/a/../../../precious/{torn.name}"
    s3.client.put_object(Bucket=s3.name, Key=key, Body=torn.read_bytes())
    s3.client.put_object(Bucket=s3.name, Key=f"precious/{torn.name}", Body=b"someone's file")

    result = invoke("fix", s3.url(PREFIX), "--yes")

    assert "Traceback" not in result.output and "which some servers resolve" in result.output
    assert s3.get(key) == torn.read_bytes() and s3.get(f"precious/{torn.name}") == b"someone's file"


def test_plan_and_run_lines_cannot_be_forged_by_a_key_with_a_newline(tmp_path: Path) -> None:
    """A key holding a newline and a fake line: printed as one inert line."""
    import io

    from cachedoctor.repair.plan import Note

    forged = "s3://b/cache/vae/x.pt\nRun 1: 0 object(s) quarantined"
    plan = remote.RemotePlan((remote.RemoteAction(forged, "s3://b/cache/vae", ("CD101",), 1, "e"),),
                             (Note("CD101", forged, "gone\nsince", skipped=True),))
    run = remote.RemoteRun("r", [(plan.actions[0], CONFLICT, "left\nalone")])
    out = io.StringIO()
    remote.render_plan(plan, out)
    remote.render_run(run, out, undoing=True)
    assert not any(line.startswith("Run 1") for line in out.getvalue().splitlines())
    assert len(out.getvalue().splitlines()) == 6  # plan, action, skipped, note, undo, outcome


# -- a server that misbehaves ---------------------------------------------------------------------


@contextmanager
def _proxy(s3: Bucket, monkeypatch: pytest.MonkeyPatch,
           rewrite: Callable[[dict, Callable], object]) -> Iterator[None]:
    """A proxy of the moto app on loopback, `rewrite(environ, app_call)` answering each
    request; the environment points at it."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)

    def handler(environ, start_response):
        return rewrite(environ, start_response, app)

    port = free_port()
    server = make_server("127.0.0.1", port, handler, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    try:
        yield
    finally:
        server.shutdown()
        thread.join()


def _listing(bucket: str, keys: list[str], token: str | None) -> bytes:
    contents = "".join(f"<Contents><Key>{k}</Key><Size>10</Size><ETag>&quot;e{i}&quot;</ETag>"
                       f"<LastModified>2025-01-01T00:00:00.000Z</LastModified></Contents>"
                       for i, k in enumerate(keys))
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>" \
        if token else "<IsTruncated>false</IsTruncated>"
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>{bucket}</Name>'
            f"<Prefix>c/</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>{more}"
            f"{contents}</ListBucketResult>").encode()


def test_a_listing_whose_tokens_go_round_in_a_circle_ends(s3: Bucket, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Page A says "next: B", page B says "next: A", forever (botocore stops only on the same
    token twice in a row): the scan ends, saying the listing repeats itself."""
    clean(tmp_path / "c", n=2)
    s3.upload(tmp_path / "c", "c")
    pages = []

    def circle(environ, start_response, app):
        query = environ.get("QUERY_STRING", "")
        if "list-type=2" in query and "max-keys=1&" not in query + "&":
            token = re.search(r"continuation-token=([^&]*)", query)
            pages.append(token[1] if token else None)
            if len(pages) > 50:  # the scan would hang here: fail the test instead
                start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
                return [b"<Error><Code>InternalError</Code><Message>looped</Message></Error>"]
            nxt = "B" if (token is None or token[1] == "A") else "A"
            start_response("200 OK", [("Content-Type", "application/xml")])
            return [_listing(s3.name, [f"c/page{len(pages)}.txt"], nxt)]
        return app(environ, start_response)

    with _proxy(s3, monkeypatch, circle):
        report = scan_paths(s3.url("c"))
    assert len(pages) <= 4, pages
    assert any("repeats a page" in f.message for f in report.findings), \
        [(f.code, f.message) for f in report.findings]


def test_a_server_that_ignores_ranges_is_said_not_misjudged(s3: Bucket, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers a ranged GET with the whole object (200, no Content-Range): the
    tail window would be the object's first bytes, and a big object read whole into memory."""
    clean(tmp_path / "c", n=1, shape=(16, 160, 160))  # > 256 KiB: read by head and tail ranges
    clean(tmp_path / "c" / "small", n=1)  # one GET of the whole object either way
    s3.upload(tmp_path / "c", "c")
    sent = []

    def no_ranges(environ, start_response, app):
        if environ.pop("HTTP_RANGE", None):
            environ.pop("HTTP_IF_MATCH", None)
            sent.append(environ.get("PATH_INFO"))
        return app(environ, start_response)

    with _proxy(s3, monkeypatch, no_ranges):
        report = scan_paths(s3.url("c"))
    assert sent
    wrong = [(f.code, f.path, f.message) for f in report.findings]
    assert all("ignores ranged requests" in m for _, _, m in wrong), wrong
    assert len(wrong) == 1 and "/small/" not in wrong[0][1], wrong


def test_a_body_cut_short_is_said_not_judged_torn(s3: Bucket, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy that passes on the first KiB of each object's bytes and ends the body cleanly
    (chunked, no Content-Length): a short read is the server's fault, not a torn cache file."""
    clean(tmp_path / "c", n=2)
    s3.upload(tmp_path / "c", "c")

    def cut(environ, start_response, app):
        if not environ.get("HTTP_RANGE"):
            return app(environ, start_response)
        reply = {}

        def keep(status, headers, exc_info=None):
            reply["status"], reply["headers"] = status, [h for h in headers if h[0].lower() != "content-length"]

        body = b"".join(app(environ, keep))
        start_response(reply["status"], reply["headers"])
        return [body[:1024]]

    with _proxy(s3, monkeypatch, cut):
        report = scan_paths(s3.url("c"))
    said = [(f.code, f.message) for f in report.findings]
    assert said and all("promised" in m or "checksum" in m for _, m in said), said


def test_a_key_with_a_leading_slash_is_said_not_judged_as_its_twin(s3: Bucket, tmp_path: Path) -> None:
    """`/x.pt` and `x.pt` are two objects, but s3://bucket//x.pt reads as the second: a hostile
    `/x.pt` beside a clean `x.pt` was never judged itself."""
    clean(tmp_path / "c", n=1)
    [good] = [p for p in (tmp_path / "c").rglob("*.pt")]
    marker = tmp_path / "PAYLOAD_RAN"
    [bad] = BUILDERS["CD105"](tmp_path / "bad", marker=marker)
    s3.client.put_object(Bucket=s3.name, Key="x.pt", Body=good.read_bytes())
    s3.client.put_object(Bucket=s3.name, Key="/x.pt", Body=Path(bad).read_bytes())

    report = scan_paths(s3.url())

    said = [(f.code, f.path, f.message) for f in report.findings]
    assert any(p == f"s3://{s3.name}//x.pt" and "starts with '/'" in m for _, p, m in said), said
    assert not marker.exists()
